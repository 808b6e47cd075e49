//! "Did you mean" suggestions for misspelled argument names.

/// The candidate closest to `word`, if it is close enough to be a typo.
pub fn closest<'a>(word: &str, candidates: &[&'a str]) -> Option<&'a str> {
    candidates
        .iter()
        .map(|candidate| (edit_distance(word, candidate), *candidate))
        .filter(|(distance, candidate)| *distance <= (candidate.len() / 3).max(1) + usize::from(word.len() > 4))
        .min_by_key(|(distance, _)| *distance)
        .map(|(_, candidate)| candidate)
}

/// Edit distance between two short words, counting a swap of two adjacent
/// letters as one edit (`kye` is one typo away from `key`).
fn edit_distance(a: &str, b: &str) -> usize {
    let a: Vec<char> = a.chars().collect();
    let b: Vec<char> = b.chars().collect();
    // d[i][j]: distance between the first i letters of a and the first j of b.
    let mut d = vec![vec![0usize; b.len() + 1]; a.len() + 1];
    for (i, row) in d.iter_mut().enumerate() {
        row[0] = i;
    }
    for (j, cell) in d[0].iter_mut().enumerate() {
        *cell = j;
    }
    for i in 1..=a.len() {
        for j in 1..=b.len() {
            let substitution = d[i - 1][j - 1] + usize::from(a[i - 1] != b[j - 1]);
            let mut best = substitution.min(d[i - 1][j] + 1).min(d[i][j - 1] + 1);
            if i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1] {
                best = best.min(d[i - 2][j - 2] + 1);
            }
            d[i][j] = best;
        }
    }
    d[a.len()][b.len()]
}

#[cfg(test)]
mod tests {
    use super::*;

    const ARGS: &[&str] = &["key", "store", "scope", "ttl", "fingerprint", "lease", "tx", "crate"];

    #[test]
    fn typos_get_the_intended_name() {
        assert_eq!(closest("kye", ARGS), Some("key"));
        assert_eq!(closest("stor", ARGS), Some("store"));
        assert_eq!(closest("ttl_", ARGS), Some("ttl"));
        assert_eq!(closest("finger_print", ARGS), Some("fingerprint"));
        assert_eq!(closest("scpoe", ARGS), Some("scope"));
        assert_eq!(closest("stroe", ARGS), Some("store"));
        assert_eq!(closest("tll", ARGS), Some("ttl"));
    }

    #[test]
    fn unrelated_words_get_nothing() {
        assert_eq!(closest("timeout_seconds", ARGS), None);
        assert_eq!(closest("banana", ARGS), None);
    }
}
