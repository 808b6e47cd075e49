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

/// Levenshtein distance between two short words.
fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut previous: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut current = vec![i + 1; b.len() + 1];
        for (j, cb) in b.iter().enumerate() {
            let substitution = previous[j] + usize::from(ca != *cb);
            current[j + 1] = substitution.min(previous[j + 1] + 1).min(current[j] + 1);
        }
        previous = current;
    }
    previous[b.len()]
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
    }

    #[test]
    fn unrelated_words_get_nothing() {
        assert_eq!(closest("timeout_seconds", ARGS), None);
        assert_eq!(closest("banana", ARGS), None);
    }
}
