//! A small byte-pair-encoding trainer, and the seeded fill that grows its merges to a real
//! vocabulary's size.
//!
//! Invariants the tokenizers of llama.cpp and Spillway rely on, and which [`Bpe`] keeps: every
//! merge's two operands and its result are pieces; every piece past the base symbols is the result
//! of exactly one merge; no two pieces are equal.

use std::collections::HashMap;

use super::super::rng::Xoshiro256;

/// Base symbols, then one piece per merge in merge (priority) order.
#[derive(Debug, Clone)]
pub struct Bpe {
    pub pieces: Vec<String>,
    pub n_base: usize,
    /// `merges[k]` joins two pieces into `pieces[n_base + k]`.
    pub merges: Vec<(u32, u32)>,
    index: HashMap<String, u32>,
}

impl Bpe {
    pub fn new(base: Vec<String>) -> Self {
        let index = base
            .iter()
            .enumerate()
            .map(|(i, s)| (s.clone(), i as u32))
            .collect::<HashMap<_, _>>();
        assert_eq!(index.len(), base.len(), "base symbols must be distinct");
        Bpe {
            n_base: base.len(),
            pieces: base,
            merges: Vec::new(),
            index,
        }
    }

    pub fn id(&self, piece: &str) -> Option<u32> {
        self.index.get(piece).copied()
    }

    fn push_merge(&mut self, a: u32, b: u32) -> u32 {
        let joined = format!("{}{}", self.pieces[a as usize], self.pieces[b as usize]);
        let id = self.pieces.len() as u32;
        self.index.insert(joined.clone(), id);
        self.pieces.push(joined);
        self.merges.push((a, b));
        id
    }

    /// Learns up to `max_merges` merges from `words` (symbol sequences with counts): the most
    /// frequent adjacent pair first, ties broken by the pair's text so the result never depends
    /// on hash order. Stops when no pair occurs twice. A pair whose join already exists as a
    /// piece (reached by another split) is left unmerged, keeping pieces unique.
    pub fn train(&mut self, words: &[(Vec<String>, u64)], max_merges: usize) {
        let mut words: Vec<(Vec<u32>, u64)> = words
            .iter()
            .map(|(syms, n)| {
                let ids = syms
                    .iter()
                    .map(|s| self.id(s).expect("word symbols are base symbols"))
                    .collect();
                (ids, *n)
            })
            .collect();
        let mut banned = std::collections::HashSet::new();
        while self.merges.len() < max_merges {
            let mut counts: HashMap<(u32, u32), u64> = HashMap::new();
            for (w, n) in &words {
                for p in w.windows(2) {
                    *counts.entry((p[0], p[1])).or_default() += n;
                }
            }
            let best = counts
                .into_iter()
                .filter(|(pair, _)| !banned.contains(pair))
                .max_by(|(pa, ca), (pb, cb)| {
                    let text =
                        |p: &(u32, u32)| (&self.pieces[p.0 as usize], &self.pieces[p.1 as usize]);
                    ca.cmp(cb).then_with(|| text(pb).cmp(&text(pa)))
                });
            let Some(((a, b), count)) = best else { break };
            if count < 2 {
                break;
            }
            let joined = format!("{}{}", self.pieces[a as usize], self.pieces[b as usize]);
            if self.index.contains_key(&joined) {
                banned.insert((a, b));
                continue;
            }
            let id = self.push_merge(a, b);
            for (w, _) in &mut words {
                let mut i = 0;
                while i + 1 < w.len() {
                    if w[i] == a && w[i + 1] == b {
                        w[i] = id;
                        w.remove(i + 1);
                    }
                    i += 1;
                }
            }
        }
    }

    /// Adds seeded merges until there are `target` merges. Each joins a piece that may begin a
    /// word (`is_start`) with a short lowercase-letter piece (`is_suffix`), so the new pieces
    /// look like words and never put a word-boundary marker in the middle of a piece.
    pub fn fill(
        &mut self,
        target: usize,
        rng: &mut Xoshiro256,
        is_start: impl Fn(&str) -> bool,
        is_suffix: impl Fn(&str) -> bool,
    ) {
        let mut starts: Vec<u32> = (0..self.pieces.len() as u32)
            .filter(|&i| is_start(&self.pieces[i as usize]))
            .collect();
        let mut suffixes: Vec<u32> = (0..self.pieces.len() as u32)
            .filter(|&i| is_suffix(&self.pieces[i as usize]))
            .collect();
        assert!(!starts.is_empty() && !suffixes.is_empty());
        let mut max_chars = 16;
        let mut rejected = 0u32;
        while self.merges.len() < target {
            let a = starts[rng.below(starts.len() as u64) as usize];
            let b = suffixes[rng.below(suffixes.len() as u64) as usize];
            let joined = format!("{}{}", self.pieces[a as usize], self.pieces[b as usize]);
            if joined.chars().count() > max_chars || self.index.contains_key(&joined) {
                rejected += 1;
                // Only a tiny base could run out of short joins; then allow longer pieces.
                if rejected > 10_000 {
                    max_chars += 4;
                    rejected = 0;
                }
                continue;
            }
            rejected = 0;
            let id = self.push_merge(a, b);
            if is_start(&joined) {
                starts.push(id);
            }
            if is_suffix(&joined) {
                suffixes.push(id);
            }
        }
    }
}

/// Splits text the way GPT-2-style pre-tokenizers roughly do: a run of letters, digits or other
/// symbols with at most one leading space, or a run of whitespace.
pub fn pre_tokenize(text: &str) -> Vec<&str> {
    #[derive(PartialEq, Clone, Copy)]
    enum Class {
        Letter,
        Digit,
        Space,
        Other,
    }
    let class = |c: char| {
        if c.is_alphabetic() {
            Class::Letter
        } else if c.is_numeric() {
            Class::Digit
        } else if c.is_whitespace() {
            Class::Space
        } else {
            Class::Other
        }
    };
    let chars: Vec<(usize, char)> = text.char_indices().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < chars.len() {
        let start = chars[i].0;
        let mut j = i;
        // A single space joins the word after it, as in " the".
        if chars[j].1 == ' ' && j + 1 < chars.len() && class(chars[j + 1].1) != Class::Space {
            j += 1;
        }
        let c = class(chars[j].1);
        while j < chars.len() && class(chars[j].1) == c {
            j += 1;
        }
        let end = chars.get(j).map_or(text.len(), |&(o, _)| o);
        out.push(&text[start..end]);
        i = j;
    }
    out
}

/// Counts equal words, in first-seen order.
pub fn count_words(words: impl IntoIterator<Item = Vec<String>>) -> Vec<(Vec<String>, u64)> {
    let mut seen: HashMap<Vec<String>, usize> = HashMap::new();
    let mut out: Vec<(Vec<String>, u64)> = Vec::new();
    for w in words {
        match seen.get(&w) {
            Some(&i) => out[i].1 += 1,
            None => {
                seen.insert(w.clone(), out.len());
                out.push((w, 1));
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chars(s: &str) -> Vec<String> {
        s.chars().map(String::from).collect()
    }

    #[test]
    fn pre_tokenize_keeps_one_leading_space() {
        assert_eq!(
            pre_tokenize("The dam, at 10:45.\n\nIt held"),
            ["The", " dam", ",", " at", " 10", ":", "45", ".", "\n\n", "It", " held"]
        );
    }

    #[test]
    fn training_merges_the_most_frequent_pair_first() {
        let base = chars("abcd");
        let mut bpe = Bpe::new(base);
        let words = count_words([chars("abab"), chars("abc"), chars("abc"), chars("d")]);
        bpe.train(&words, 10);
        assert_eq!(bpe.pieces[4], "ab");
        assert_eq!(bpe.merges[0], (0, 1));
        assert!(bpe.pieces.contains(&"abc".to_string()));
    }

    #[test]
    fn fill_adds_unique_pieces_each_from_one_merge() {
        let mut bpe = Bpe::new(chars("abcdefgh_"));
        let mut rng = Xoshiro256::seed_from(5);
        bpe.fill(
            500,
            &mut rng,
            |s| s.starts_with('_'),
            |s| s.len() <= 3 && !s.contains('_'),
        );
        assert_eq!(bpe.merges.len(), 500);
        let unique: std::collections::HashSet<_> = bpe.pieces.iter().collect();
        assert_eq!(unique.len(), bpe.pieces.len());
        for (k, &(a, b)) in bpe.merges.iter().enumerate() {
            let joined = format!("{}{}", bpe.pieces[a as usize], bpe.pieces[b as usize]);
            assert_eq!(bpe.pieces[bpe.n_base + k], joined);
        }
    }
}
