//! Markdown tables and SVG bar charts (plotters) of the results.

use std::fmt::Write as _;
use std::path::Path;

use plotters::prelude::*;

use crate::harness::Cell;

/// One group of bars (e.g. "c=8, 20 % dup"), one bar per series.
pub struct Group {
    pub label: String,
    pub cells: Vec<Option<Cell>>,
}

pub fn rate(cell: &Option<Cell>) -> f64 {
    cell.as_ref().map_or(f64::NAN, Cell::rate)
}

pub fn fmt_rate(r: f64) -> String {
    if r.is_nan() {
        "–".into()
    } else if r >= 100_000.0 {
        format!("{:.0}k", r / 1000.0)
    } else {
        format!("{r:.0}")
    }
}

pub fn fmt_ms(us: f64) -> String {
    if us.is_nan() {
        "–".into()
    } else if us < 100.0 {
        format!("{:.3}", us / 1000.0)
    } else {
        format!("{:.2}", us / 1000.0)
    }
}

pub fn fmt_ratio(num: f64, den: f64) -> String {
    if num.is_nan() || den.is_nan() || den == 0.0 {
        "–".into()
    } else {
        format!("{:.2}", num / den)
    }
}

/// A section's tables: the rates with their `ratios` (see [`rate_table`]),
/// then the latencies under `latency_heading`, then the CPU per delivery
/// under `cpu_heading` when the section measures it.
pub fn tables(
    series: &[&str],
    groups: &[Group],
    ratios: &[(usize, usize)],
    reps: usize,
    latency_heading: &str,
    cpu_heading: Option<&str>,
) -> String {
    let mut s = rate_table(series, groups, ratios, reps);
    if reps > 1 && !ratios.is_empty() {
        s.push_str(
            "\nThe same ratios run by run: each repetition's rates divided (the rows of one repetition ran \
             back to back), median [min–max] of the repetitions:\n\n",
        );
        s.push_str(&paired_table(series, groups, ratios));
    }
    s.push_str(latency_heading);
    s.push_str(&latency_table(series, groups));
    if let Some(heading) = cpu_heading {
        s.push_str(heading);
        s.push_str(&cpu_table(series, groups));
    }
    s
}

/// Rates (median [min–max]) per group and series, plus ratio columns.
pub fn rate_table(series: &[&str], groups: &[Group], ratios: &[(usize, usize)], reps: usize) -> String {
    let names = series.iter().map(|name| name.to_string());
    let mut s = header(names.chain(ratio_names(series, ratios)));
    for g in groups {
        let _ = write!(s, "| {} | ", g.label);
        for cell in &g.cells {
            match cell {
                Some(c) if reps > 1 => {
                    let (min, max) = c.min_max();
                    let _ = write!(
                        s,
                        "{} <sub>{}–{}</sub> | ",
                        fmt_rate(c.rate()),
                        fmt_rate(min),
                        fmt_rate(max)
                    );
                }
                Some(c) => {
                    let _ = write!(s, "{} | ", fmt_rate(c.rate()));
                }
                None => s.push_str("– | "),
            }
        }
        for (a, b) in ratios {
            let _ = write!(s, "{} | ", fmt_ratio(rate(&g.cells[*a]), rate(&g.cells[*b])));
        }
        s.push('\n');
    }
    s
}

/// Per group, each ratio `a/b` run by run (`a`'s k-th rate over `b`'s):
/// median [min–max].
pub fn paired_table(series: &[&str], groups: &[Group], ratios: &[(usize, usize)]) -> String {
    let mut s = header(ratio_names(series, ratios));
    for g in groups {
        let _ = write!(s, "| {} | ", g.label);
        for (a, b) in ratios {
            let mut paired: Vec<f64> = match (&g.cells[*a], &g.cells[*b]) {
                (Some(a), Some(b)) => a
                    .rates
                    .iter()
                    .zip(&b.rates)
                    .filter(|(_, b)| **b > 0.0)
                    .map(|(a, b)| a / b)
                    .collect(),
                _ => Vec::new(),
            };
            paired.sort_by(f64::total_cmp);
            match (paired.first(), paired.last()) {
                (Some(min), Some(max)) => {
                    let _ = write!(
                        s,
                        "{:.2} <sub>{min:.2}–{max:.2}</sub> | ",
                        crate::harness::median(&paired)
                    );
                }
                _ => s.push_str("– | "),
            }
        }
        s.push('\n');
    }
    s
}

/// p50 / p99 latency per delivery (ms) per group and series.
pub fn latency_table(series: &[&str], groups: &[Group]) -> String {
    let mut s = header(series.iter().map(|name| name.to_string()));
    for g in groups {
        let _ = write!(s, "| {} | ", g.label);
        for cell in &g.cells {
            match cell {
                Some(c) => {
                    let _ = write!(s, "{} / {} | ", fmt_ms(c.p(50.0)), fmt_ms(c.p(99.0)));
                }
                None => s.push_str("– | "),
            }
        }
        s.push('\n');
    }
    s
}

/// CPU time per delivery: this process + the database server (µs).
pub fn cpu_table(series: &[&str], groups: &[Group]) -> String {
    let mut s = header(series.iter().map(|name| name.to_string()));
    for g in groups {
        let _ = write!(s, "| {} | ", g.label);
        for cell in &g.cells {
            match cell {
                Some(c) => {
                    let (client, server) = c.cpu_us();
                    let _ = write!(s, "{client:.0} + {server:.0} = {:.0} | ", client + server);
                }
                None => s.push_str("– | "),
            }
        }
        s.push('\n');
    }
    s
}

/// A table's two header lines: an empty corner, then `columns`.
fn header(columns: impl IntoIterator<Item = String>) -> String {
    let mut s = String::from("| | ");
    let mut count = 0;
    for column in columns {
        let _ = write!(s, "{column} | ");
        count += 1;
    }
    s.push('\n');
    s.push_str(&"| --- ".repeat(1 + count));
    s.push_str("|\n");
    s
}

/// The ratio columns' names, `a/b` by short names.
fn ratio_names<'a>(series: &'a [&str], ratios: &'a [(usize, usize)]) -> impl Iterator<Item = String> + 'a {
    ratios
        .iter()
        .map(|(a, b)| format!("{}/{}", short(series[*a]), short(series[*b])))
}

/// The letter of a series name like "(d) macro + PgStore".
fn short(name: &str) -> String {
    name.strip_prefix('(')
        .and_then(|r| r.split_once(')'))
        .map_or_else(|| name.to_owned(), |(k, _)| k.to_owned())
}

const COLORS: [RGBColor; 7] = [
    RGBColor(0x9e, 0x9e, 0x9e),
    RGBColor(0xe4, 0x57, 0x2e),
    RGBColor(0x29, 0x80, 0xb9),
    RGBColor(0x27, 0xae, 0x60),
    RGBColor(0x8e, 0x44, 0xad),
    RGBColor(0xf3, 0x9c, 0x12),
    RGBColor(0x34, 0x49, 0x5e),
];

/// A grouped bar chart of the median rates with min–max whiskers.
pub fn bar_chart(
    path: &Path,
    title: &str,
    series: &[&str],
    groups: &[Group],
) -> Result<(), Box<dyn std::error::Error>> {
    let width = 1100u32;
    let root = SVGBackend::new(path, (width, 560)).into_drawing_area();
    root.fill(&WHITE)?;
    let max = groups
        .iter()
        .flat_map(|g| g.cells.iter().flatten())
        .map(|c| c.min_max().1)
        .filter(|v| v.is_finite())
        .fold(1.0, f64::max);
    let n = groups.len() as f64;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(70)
        .build_cartesian_2d(-0.5..n - 0.5, 0.0..max * 1.12)?;
    let names: Vec<String> = groups.iter().map(|g| g.label.clone()).collect();
    let x_label = |v: &f64| {
        let i = v.round();
        if (v - i).abs() < 1e-6 && i >= 0.0 && (i as usize) < names.len() {
            names[i as usize].clone()
        } else {
            String::new()
        }
    };
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(groups.len() + 1)
        .x_label_formatter(&x_label)
        .y_desc("deliveries / s")
        .y_label_formatter(&|v| fmt_rate(*v))
        .draw()?;
    let k = series.len() as f64;
    let bar = 0.8 / k;
    for (si, name) in series.iter().enumerate() {
        let color = COLORS[si % COLORS.len()];
        let rects = groups.iter().enumerate().filter_map(|(gi, g)| {
            let c = g.cells.get(si)?.as_ref()?;
            let x0 = gi as f64 - 0.4 + si as f64 * bar;
            Some(Rectangle::new([(x0, 0.0), (x0 + bar * 0.9, c.rate())], color.filled()))
        });
        chart
            .draw_series(rects)?
            .label(*name)
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 10, y + 5)], color.filled()));
        let whiskers = groups.iter().enumerate().filter_map(|(gi, g)| {
            let c = g.cells.get(si)?.as_ref()?;
            if c.rates.len() < 2 {
                return None;
            }
            let (min, max) = c.min_max();
            let x = gi as f64 - 0.4 + si as f64 * bar + bar * 0.45;
            Some(PathElement::new(vec![(x, min), (x, max)], BLACK.stroke_width(1)))
        });
        chart.draw_series(whiskers)?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()?;
    root.present()?;
    Ok(())
}
