//! SentencePiece-style tokenization as llama.cpp's `llm_tokenizer_spm_session`: start from single
//! characters, repeatedly merge the adjacent pair whose concatenation is the highest-scoring token
//! (leftmost on ties), then fall back to `<0xXX>` byte tokens for what formed no token.

use std::cmp::Ordering;
use std::collections::BinaryHeap;

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
    score: f32,
    size: usize,
}

impl Ord for Bigram {
    fn cmp(&self, other: &Self) -> Ordering {
        // Max-heap: higher score first, then the leftmost pair.
        self.score
            .partial_cmp(&other.score)
            .unwrap_or(Ordering::Equal)
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

/// Tokenizes `text` (spaces already escaped to `▁`), appending to `out`.
pub(crate) fn tokenize(vocab: &Vocab, text: &str, out: &mut Vec<u32>) {
    let mut symbols: Vec<Symbol> = Vec::with_capacity(text.len());
    let n_chars = text.chars().count();
    for (i, (start, c)) in text.char_indices().enumerate() {
        symbols.push(Symbol {
            prev: i.checked_sub(1),
            next: (i + 1 < n_chars).then_some(i + 1),
            start,
            len: c.len_utf8(),
        });
    }

    let mut queue = BinaryHeap::new();
    let try_add = |symbols: &[Symbol],
                   queue: &mut BinaryHeap<Bigram>,
                   left: Option<usize>,
                   right: Option<usize>| {
        let (Some(left), Some(right)) = (left, right) else {
            return;
        };
        let (l, r) = (symbols[left], symbols[right]);
        let piece = &text[l.start..r.start + r.len];
        if let Some(id) = vocab.id(piece) {
            queue.push(Bigram {
                left,
                right,
                score: vocab.scores[id as usize],
                size: piece.len(),
            });
        }
    };
    for i in 1..symbols.len() {
        try_add(&symbols, &mut queue, Some(i - 1), Some(i));
    }

    while let Some(b) = queue.pop() {
        let (l, r) = (symbols[b.left], symbols[b.right]);
        // Stale: one side was merged since this pair was queued.
        if l.len == 0 || r.len == 0 || l.len + r.len != b.size {
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
        try_add(&symbols, &mut queue, prev, Some(b.left));
        try_add(&symbols, &mut queue, Some(b.left), next);
    }

    let mut at = if symbols.is_empty() { None } else { Some(0) };
    while let Some(i) = at {
        let s = symbols[i];
        resegment(vocab, &text[s.start..s.start + s.len], out);
        at = s.next;
    }
}

/// A merged symbol is always a token; a single character may not be, and goes out as bytes.
/// (llama.cpp's `resegment` also walks a reverse-merge map, which only ever applies to texts
/// that merges produced, and those are tokens.)
fn resegment(vocab: &Vocab, piece: &str, out: &mut Vec<u32>) {
    if let Some(id) = vocab.id(piece) {
        out.push(id);
        return;
    }
    for b in piece.bytes() {
        if let Some(id) = byte_token(vocab, b) {
            out.push(id);
        }
    }
}

/// `<0xXX>`, else the byte itself as a one-character token (llama.cpp's `byte_to_token`), else
/// the unknown token. llama.cpp throws where this falls back to `<unk>`: a vocabulary without its
/// byte tokens is broken, and an `<unk>` is the better failure inside a server.
fn byte_token(vocab: &Vocab, b: u8) -> Option<u32> {
    vocab
        .id(&format!("<0x{b:02X}>"))
        .or_else(|| {
            b.is_ascii()
                .then(|| vocab.id(&(b as char).to_string()))
                .flatten()
        })
        .or(vocab.unk)
}
