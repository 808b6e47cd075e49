//! Compile-time parsing of `ttl = ".."` and `lease = ".."` literals.

/// Milliseconds in `text`, a whole number followed by a unit: `ms`, `s`,
/// `m`, `h` or `d` (for example `"30s"`, `"15m"`, `"12h"`, `"7d"`).
pub fn parse_millis(text: &str) -> Result<u64, String> {
    let text = text.trim();
    let digits = text.chars().take_while(char::is_ascii_digit).count();
    let (number, unit) = text.split_at(digits);
    let expected = "expected a whole number and a unit (ms, s, m, h, d), like \"30s\", \"15m\", \"12h\" or \"7d\"";
    if number.is_empty() {
        return Err(expected.to_owned());
    }
    let number: u64 = number
        .parse()
        .map_err(|_| format!("the number in {text:?} is too large"))?;
    let unit_millis: u64 = match unit.trim() {
        "ms" => 1,
        "s" => 1_000,
        "m" => 60_000,
        "h" => 3_600_000,
        "d" => 86_400_000,
        "" => return Err(format!("{text:?} has no unit: {expected}")),
        other => return Err(format!("unknown unit {other:?}: {expected}")),
    };
    let millis = number
        .checked_mul(unit_millis)
        .ok_or_else(|| format!("{text:?} is too long"))?;
    if millis == 0 {
        return Err("a duration of zero would expire at once: use at least \"1ms\"".to_owned());
    }
    // Stores compute expiry in signed 64-bit milliseconds; keep far from it.
    if millis > 100 * 365 * 86_400_000 {
        return Err(format!("{text:?} is longer than 100 years"));
    }
    Ok(millis)
}

#[cfg(test)]
mod tests {
    use super::parse_millis;

    #[test]
    fn each_unit_is_understood() {
        assert_eq!(parse_millis("250ms"), Ok(250));
        assert_eq!(parse_millis("30s"), Ok(30_000));
        assert_eq!(parse_millis("15m"), Ok(900_000));
        assert_eq!(parse_millis("12h"), Ok(43_200_000));
        assert_eq!(parse_millis("7d"), Ok(604_800_000));
    }

    #[test]
    fn malformed_durations_are_explained() {
        for bad in [
            "",
            "7",
            "d",
            "7 days",
            "-1s",
            "1.5h",
            "0s",
            "99999999999999999999d",
            "200000d",
        ] {
            assert!(parse_millis(bad).is_err(), "{bad:?} should be refused");
        }
        assert!(parse_millis("7w").unwrap_err().contains("unknown unit"));
    }
}
