//! The text side of the `gpt` workload: the built-in text, characters as tokens, and the unigram
//! entropy of a text.

use std::collections::HashMap;

/// The built-in training text: Shakespeare's sonnets (public domain; see `examples/data/README.md`).
pub const DEFAULT_TEXT: &str = include_str!("../../data/sonnets.txt");

/// The vocabulary of a text: its distinct characters, sorted, each token the index of its character.
#[derive(Debug, Clone)]
pub struct CharVocab {
    chars: Vec<char>,
    ids: HashMap<char, u32>,
}

impl CharVocab {
    /// The sorted distinct characters of `text`.
    pub fn from_text(text: &str) -> Self {
        let mut chars: Vec<char> = text.chars().collect();
        chars.sort_unstable();
        chars.dedup();
        let ids = chars
            .iter()
            .enumerate()
            .map(|(i, &c)| (c, i as u32))
            .collect();
        Self { chars, ids }
    }

    /// Number of tokens (distinct characters).
    pub fn len(&self) -> usize {
        self.chars.len()
    }

    /// Whether the vocabulary is empty (built from an empty text).
    pub fn is_empty(&self) -> bool {
        self.chars.is_empty()
    }

    /// The tokens of `text`; `None` if it holds a character outside the vocabulary.
    pub fn encode(&self, text: &str) -> Option<Vec<u32>> {
        text.chars().map(|c| self.ids.get(&c).copied()).collect()
    }

    /// The text of `tokens`; `None` if one is out of range.
    pub fn decode(&self, tokens: &[u32]) -> Option<String> {
        tokens
            .iter()
            .map(|&t| self.chars.get(t as usize).copied())
            .collect()
    }
}

/// The entropy in nats of the tokens' empirical distribution, `-Σ p ln p`: the cross-entropy per
/// token of the best model that ignores context. A language model that learns beats it.
pub fn unigram_entropy(tokens: &[u32]) -> f64 {
    let mut counts: HashMap<u32, usize> = HashMap::new();
    for &t in tokens {
        *counts.entry(t).or_default() += 1;
    }
    let n = tokens.len() as f64;
    counts
        .values()
        .map(|&c| {
            let p = c as f64 / n;
            -p * p.ln()
        })
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_vocabulary_is_the_sorted_distinct_characters_and_round_trips() {
        let v = CharVocab::from_text("hello, world");
        assert_eq!(v.len(), 9); // ' ' ',' d e h l o r w
        assert_eq!(v.encode(" ,dehlorw").unwrap(), (0..9).collect::<Vec<u32>>());
        let t = v.encode("hello, world").unwrap();
        assert_eq!(v.decode(&t).unwrap(), "hello, world");
        assert!(v.encode("x").is_none());
        assert!(v.decode(&[9]).is_none());
        let u = CharVocab::from_text("été ü");
        assert_eq!(u.len(), 4); // é t space ü: characters, not bytes
    }

    #[test]
    fn unigram_entropy_matches_closed_forms() {
        // Uniform over 4 symbols: ln 4. One symbol: 0. Probabilities 1/2, 1/4, 1/4: 1.5 ln 2.
        assert!((unigram_entropy(&[0, 1, 2, 3, 3, 2, 1, 0]) - 4f64.ln()).abs() < 1e-12);
        assert_eq!(unigram_entropy(&[5, 5, 5]), 0.0);
        assert!((unigram_entropy(&[0, 0, 1, 2]) - 1.5 * 2f64.ln()).abs() < 1e-12);
    }

    #[test]
    fn the_built_in_text_is_long_enough_for_the_defaults() {
        assert!(DEFAULT_TEXT.chars().count() > 30_000);
        let v = CharVocab::from_text(DEFAULT_TEXT);
        assert!(v.len() > 40 && v.len() < 100, "{}", v.len());
    }
}
