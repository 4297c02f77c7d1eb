//! Splitting text around special tokens before the model's tokenizer sees it, as llama.cpp's
//! `tokenizer_st_partition`: for each special token, longest text first, every occurrence in the
//! remaining raw-text fragments becomes that token. CONTROL and UNKNOWN tokens are matched only
//! with `parse_special`; USER_DEFINED tokens always.

use super::vocab::Vocab;
use super::TokenAttr;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Fragment {
    /// A byte range of the input text.
    Text(usize, usize),
    Token(u32),
}

/// Special-token ids in matching order: longest text first, then by id (llama.cpp's
/// `std::sort` leaves equal lengths in no defined order; ties only matter for overlapping
/// special tokens of the same length, which real vocabularies do not have).
pub(crate) fn matching_order(vocab: &Vocab) -> Vec<u32> {
    let mut ids: Vec<u32> = (0..vocab.tokens.len() as u32)
        .filter(|&id| vocab.attrs[id as usize].is_special_cache())
        .collect();
    ids.sort_by(|&a, &b| {
        vocab.tokens[b as usize]
            .len()
            .cmp(&vocab.tokens[a as usize].len())
            .then(a.cmp(&b))
    });
    ids
}

/// C's `isspace` in the "C" locale, which llama.cpp's LSTRIP/RSTRIP use.
fn c_isspace(b: u8) -> bool {
    matches!(b, b' ' | b'\t' | b'\n' | 0x0B | 0x0C | b'\r')
}

pub(crate) fn partition(
    vocab: &Vocab,
    order: &[u32],
    text: &str,
    parse_special: bool,
) -> Vec<Fragment> {
    let bytes = text.as_bytes();
    let mut fragments = if text.is_empty() {
        Vec::new()
    } else {
        vec![Fragment::Text(0, text.len())]
    };
    for &id in order {
        let attr = vocab.attrs[id as usize];
        if !parse_special && attr.intersects(TokenAttr::CONTROL | TokenAttr::UNKNOWN) {
            continue;
        }
        let needle = vocab.tokens[id as usize].as_str();
        if !fragments
            .iter()
            .any(|f| matches!(*f, Fragment::Text(s, e) if text[s..e].contains(needle)))
        {
            continue;
        }
        let mut next = Vec::with_capacity(fragments.len() + 2);
        for f in fragments {
            let Fragment::Text(mut start, end) = f else {
                next.push(f);
                continue;
            };
            while let Some(found) = text[start..end].find(needle) {
                let m = start + found;
                let mut left_end = m;
                if attr.contains(TokenAttr::LSTRIP) {
                    while left_end > start && c_isspace(bytes[left_end - 1]) {
                        left_end -= 1;
                    }
                }
                if left_end > start {
                    next.push(Fragment::Text(start, left_end));
                }
                next.push(Fragment::Token(id));
                start = m + needle.len();
                if attr.contains(TokenAttr::RSTRIP) {
                    while start < end && c_isspace(bytes[start]) {
                        start += 1;
                    }
                }
            }
            if start < end {
                next.push(Fragment::Text(start, end));
            }
        }
        fragments = next;
    }
    fragments
}
