//! GPT-2 byte-level BPE as llama.cpp's `llm_tokenizer_bpe_session`: pre-tokenize, map each word's
//! bytes to their stand-in characters, then repeatedly merge the adjacent pair with the lowest
//! merge rank (leftmost on ties).

use std::cmp::Ordering;
use std::collections::BinaryHeap;

use super::pretokenize::{byte_encode, split, PreTokenizer};
use super::vocab::Vocab;

#[derive(Debug, Clone, Copy)]
struct Symbol {
    prev: Option<usize>,
    next: Option<usize>,
    start: usize,
    len: usize,
}

#[derive(Debug)]
struct Bigram {
    left: usize,
    right: usize,
    rank: u32,
    /// Byte range of left+right in the word when queued, to detect stale pairs.
    start: usize,
    end: usize,
}

impl Ord for Bigram {
    fn cmp(&self, other: &Self) -> Ordering {
        // Max-heap: lowest rank first, then the leftmost pair.
        other
            .rank
            .cmp(&self.rank)
            .then_with(|| other.left.cmp(&self.left))
    }
}
impl PartialOrd for Bigram {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl PartialEq for Bigram {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}
impl Eq for Bigram {}

/// Tokenizes raw `text` (one fragment between special tokens), appending to `out`.
pub(crate) fn tokenize(
    vocab: &Vocab,
    pre: PreTokenizer,
    table: &[char; 256],
    text: &str,
    out: &mut Vec<u32>,
) {
    for word in split(pre, text) {
        let word = byte_encode(table, word);
        if vocab.ignore_merges {
            if let Some(id) = vocab.id(&word) {
                out.push(id);
                continue;
            }
        }
        tokenize_word(vocab, &word, out);
    }
}

fn tokenize_word(vocab: &Vocab, word: &str, out: &mut Vec<u32>) {
    let n_chars = word.chars().count();
    let mut symbols: Vec<Symbol> = word
        .char_indices()
        .enumerate()
        .map(|(i, (start, c))| Symbol {
            prev: i.checked_sub(1),
            next: (i + 1 < n_chars).then_some(i + 1),
            start,
            len: c.len_utf8(),
        })
        .collect();

    let mut queue = BinaryHeap::new();
    let add = |symbols: &[Symbol],
               queue: &mut BinaryHeap<Bigram>,
               left: Option<usize>,
               right: Option<usize>| {
        let (Some(left), Some(right)) = (left, right) else {
            return;
        };
        let (l, r) = (symbols[left], symbols[right]);
        let (Some(a), Some(b)) = (
            vocab.id(&word[l.start..l.start + l.len]),
            vocab.id(&word[r.start..r.start + r.len]),
        ) else {
            return;
        };
        if let Some(&rank) = vocab.bpe_ranks.get(&(a, b)) {
            queue.push(Bigram {
                left,
                right,
                rank,
                start: l.start,
                end: r.start + r.len,
            });
        }
    };
    for i in 1..symbols.len() {
        add(&symbols, &mut queue, Some(i - 1), Some(i));
    }

    while let Some(b) = queue.pop() {
        let (l, r) = (symbols[b.left], symbols[b.right]);
        // Stale unless the two symbols still spell exactly the queued pair. Symbols are
        // contiguous byte ranges of the word, so comparing ranges compares the texts.
        if l.len == 0
            || r.len == 0
            || l.start != b.start
            || r.start + r.len != b.end
            || l.start + l.len != r.start
        {
            continue;
        }
        symbols[b.left].len += r.len;
        symbols[b.right].len = 0;
        symbols[b.left].next = r.next;
        if let Some(next) = r.next {
            symbols[next].prev = Some(b.left);
        }
        let prev = symbols[b.left].prev;
        let next = symbols[b.left].next;
        add(&symbols, &mut queue, prev, Some(b.left));
        add(&symbols, &mut queue, Some(b.left), next);
    }

    for s in symbols.iter().filter(|s| s.len > 0) {
        let piece = &word[s.start..s.start + s.len];
        match vocab.id(piece) {
            Some(id) => out.push(id),
            None => {
                // llama.cpp looks each byte up as a one-byte token; only ASCII can match.
                for b in piece.bytes().filter(u8::is_ascii) {
                    if let Some(id) = vocab.id(&(b as char).to_string()) {
                        out.push(id);
                    }
                }
            }
        }
    }
}
