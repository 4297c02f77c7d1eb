//! The GPT-2 byte-level BPE pre-tokenizers of Llama 3 (`llama-bpe`) and Qwen2 (`qwen2`), as a
//! hand-written scanner over code points, and GPT-2's byte-to-unicode table.
//!
//! The two regexes are
//!
//! ```text
//! llama-bpe: (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+
//! qwen2:     (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|      ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+
//! ```
//!
//! The `regex` crate has no look-ahead, so this is a scanner that tries the alternatives in order,
//! as llama.cpp's `unicode_regex_split_custom_llama3` does; Qwen2 differs only in taking digits one
//! at a time. llama.cpp runs the Qwen2 regex through `std::regex` over a category-collapsed copy of
//! the text instead, which matches the same words (the fixtures recorded from llama.cpp check it).
//!
//! Character classes, as llama.cpp's generated tables define them:
//! - `\p{L}`: General_Category L* (Lu, Ll, Lt, Lm, Lo), from `unicode-general-category`.
//!   Not `char::is_alphabetic`, which also takes Other_Alphabetic marks (e.g. U+0345) and Nl.
//! - `\p{N}`: General_Category N* (Nd, Nl, No), from the same table.
//! - `\s`: the White_Space property, which is exactly `char::is_whitespace` (Python's
//!   `str.isspace` is not: it adds U+001C..U+001F; llama.cpp's table comes from the `regex`
//!   module's `\s`, which is White_Space).
//! - The contractions compare ASCII-lowercased: no non-ASCII code point lowercases to one of
//!   `s t m d r e v l`, so this equals llama.cpp's full `unicode_tolower`.

use unicode_general_category::{get_general_category, GeneralCategory as Gc};

/// Which pre-tokenizer regex a byte-level BPE vocabulary uses (`tokenizer.ggml.pre`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PreTokenizer {
    /// Llama 3 (`llama-bpe`, `llama3`, `llama-v3`, `falcon3`, ...): digits in runs of up to three.
    Llama3,
    /// Qwen2 and Qwen3 (`qwen2`, `deepseek-r1-qwen`, `megrez`): one digit per word.
    Qwen2,
}

impl PreTokenizer {
    fn max_digits(self) -> usize {
        match self {
            PreTokenizer::Llama3 => 3,
            PreTokenizer::Qwen2 => 1,
        }
    }
}

#[derive(Debug, Clone, Copy, Default)]
struct Flags {
    /// Inside the text (llama.cpp's `as_uint() != 0`); positions past the end have no flags.
    defined: bool,
    letter: bool,
    number: bool,
    whitespace: bool,
}

fn flags(c: char) -> Flags {
    let (letter, number) = match get_general_category(c) {
        Gc::UppercaseLetter
        | Gc::LowercaseLetter
        | Gc::TitlecaseLetter
        | Gc::ModifierLetter
        | Gc::OtherLetter => (true, false),
        Gc::DecimalNumber | Gc::LetterNumber | Gc::OtherNumber => (false, true),
        _ => (false, false),
    };
    Flags {
        defined: true,
        letter,
        number,
        whitespace: c.is_whitespace(),
    }
}

/// Splits `text` into words by the pre-tokenizer's regex. The words, concatenated, are `text`.
pub fn split(pre: PreTokenizer, text: &str) -> Vec<&str> {
    let chars: Vec<(usize, char)> = text.char_indices().collect();
    let lengths = scan(&chars, pre.max_digits());
    let mut words = Vec::with_capacity(lengths.len());
    let mut at = 0;
    for len in lengths {
        let start = chars[at].0;
        at += len;
        let end = chars.get(at).map_or(text.len(), |&(b, _)| b);
        words.push(&text[start..end]);
    }
    words
}

/// Word lengths in code points.
fn scan(chars: &[(usize, char)], max_digits: usize) -> Vec<usize> {
    let n = chars.len();
    let cpt = |pos: usize| chars.get(pos).map(|&(_, c)| c);
    let fl = |pos: usize| chars.get(pos).map_or(Flags::default(), |&(_, c)| flags(c));
    let is_cr_lf = |c: Option<char>| matches!(c, Some('\r' | '\n'));

    let mut out = Vec::new();
    let mut prev_end = 0;
    let mut emit = |end: usize, out: &mut Vec<usize>| {
        if end > prev_end {
            out.push(end - prev_end);
        }
        prev_end = end;
    };

    let mut pos = 0;
    while pos < n {
        let c = chars[pos].1;
        let f = fl(pos);

        // (?i:'s|'t|'re|'ve|'m|'ll|'d)
        if c == '\'' && pos + 1 < n {
            let c1 = chars[pos + 1].1.to_ascii_lowercase();
            if matches!(c1, 's' | 't' | 'm' | 'd') {
                pos += 2;
                emit(pos, &mut out);
                continue;
            }
            if pos + 2 < n {
                let c2 = chars[pos + 2].1.to_ascii_lowercase();
                if matches!((c1, c2), ('r', 'e') | ('v', 'e') | ('l', 'l')) {
                    pos += 3;
                    emit(pos, &mut out);
                    continue;
                }
            }
        }

        // [^\r\n\p{L}\p{N}]?\p{L}+
        if !(c == '\r' || c == '\n' || f.number) && (f.letter || fl(pos + 1).letter) {
            pos += 1;
            while fl(pos).letter {
                pos += 1;
            }
            emit(pos, &mut out);
            continue;
        }

        // \p{N}{1,3} (Llama 3) or \p{N} (Qwen2)
        if f.number {
            let mut ini = pos;
            while fl(pos).number {
                pos += 1;
                if pos - ini >= max_digits {
                    emit(pos, &mut out);
                    ini = pos;
                }
            }
            emit(pos, &mut out);
            continue;
        }

        //  ?[^\s\p{L}\p{N}]+[\r\n]*
        let mut f2 = if c == ' ' { fl(pos + 1) } else { f };
        if !(f2.whitespace || f2.letter || f2.number) && f.defined {
            if c == ' ' {
                pos += 1;
            }
            while !(f2.whitespace || f2.letter || f2.number) && f2.defined {
                pos += 1;
                f2 = fl(pos);
            }
            while is_cr_lf(cpt(pos)) {
                pos += 1;
            }
            emit(pos, &mut out);
            continue;
        }

        let mut num_ws = 0;
        let mut last_end_r_or_n = 0;
        while fl(pos + num_ws).whitespace {
            if is_cr_lf(cpt(pos + num_ws)) {
                last_end_r_or_n = pos + num_ws + 1;
            }
            num_ws += 1;
        }

        if last_end_r_or_n > 0 {
            // \s*[\r\n]+
            pos = last_end_r_or_n;
        } else if num_ws > 1 && pos + num_ws < n {
            // \s+(?!\S): leave the last space to the word that follows
            pos += num_ws - 1;
        } else if num_ws > 0 {
            // \s+
            pos += num_ws;
        } else {
            pos += 1;
        }
        emit(pos, &mut out);
    }
    out
}

/// GPT-2's `bytes_to_unicode`: printable bytes stand for themselves, the others are shifted to
/// U+0100.. so every byte is a visible character.
pub fn byte_to_char_table() -> [char; 256] {
    let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
    let mut table = ['\0'; 256];
    let mut n = 0u32;
    for b in 0..=255u8 {
        table[b as usize] = if printable(b) {
            char::from(b)
        } else {
            n += 1;
            char::from_u32(255 + n).expect("U+0100..U+0143 are chars")
        };
    }
    table
}

/// The byte a GPT-2 stand-in character stands for.
pub fn char_to_byte(c: char) -> Option<u8> {
    // Stand-ins are U+0000..U+0143: a table indexed by code point.
    static REVERSE: std::sync::OnceLock<[Option<u8>; 0x144]> = std::sync::OnceLock::new();
    let reverse = REVERSE.get_or_init(|| {
        let mut r = [None; 0x144];
        for (b, &c) in byte_to_char_table().iter().enumerate() {
            r[c as usize] = Some(b as u8);
        }
        r
    });
    reverse.get(c as usize).copied().flatten()
}

/// The byte-level form of a word: each UTF-8 byte as its stand-in character.
pub fn byte_encode(table: &[char; 256], word: &str) -> String {
    word.bytes().map(|b| table[b as usize]).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn words(pre: PreTokenizer, s: &str) -> Vec<&str> {
        let w = split(pre, s);
        assert_eq!(w.concat(), s);
        w
    }

    #[test]
    fn llama3_splits_like_its_regex() {
        use PreTokenizer::Llama3;
        assert_eq!(
            words(Llama3, "Hello world, don't I'LL"),
            ["Hello", " world", ",", " don", "'t", " I", "'LL"]
        );
        assert_eq!(words(Llama3, "1234567"), ["123", "456", "7"]);
        assert_eq!(
            words(Llama3, "  lead\t\ttabs"),
            [" ", " lead", "\t", "\ttabs"]
        );
        assert_eq!(words(Llama3, "a\n\n b  "), ["a", "\n\n", " b", "  "]);
        assert_eq!(words(Llama3, "x  \n  y"), ["x", "  \n", " ", " y"]);
        assert_eq!(words(Llama3, "?!\n\nok"), ["?!\n\n", "ok"]);
        assert_eq!(words(Llama3, " ..."), [" ..."]);
        assert_eq!(words(Llama3, "日本語 🦀"), ["日本語", " 🦀"]);
        assert_eq!(words(Llama3, ""), Vec::<&str>::new());
    }

    #[test]
    fn qwen2_takes_digits_one_by_one() {
        assert_eq!(
            words(PreTokenizer::Qwen2, "x 123"),
            ["x", " ", "1", "2", "3"]
        );
    }

    #[test]
    fn combining_marks_are_not_letters() {
        // U+0301 is Mn: not part of the letter run, but the optional prefix of the next one.
        assert_eq!(
            words(PreTokenizer::Llama3, "cafe\u{301}s"),
            ["cafe", "\u{301}s"]
        );
        assert_eq!(
            words(PreTokenizer::Llama3, "e\u{301}1"),
            ["e", "\u{301}", "1"]
        );
        // U+0345 is Other_Alphabetic, so char::is_alphabetic would wrongly call it a letter.
        assert!('\u{345}'.is_alphabetic());
        assert!(!flags('\u{345}').letter);
    }

    #[test]
    fn byte_table_matches_gpt2() {
        let t = byte_to_char_table();
        assert_eq!(t[b' ' as usize], 'Ġ');
        assert_eq!(t[b'\n' as usize], 'Ċ');
        assert_eq!(t[b'a' as usize], 'a');
        assert_eq!(t[0xAD], '\u{143}');
        let mut seen = std::collections::HashSet::new();
        assert!(t.iter().all(|c| seen.insert(*c)));
    }
}
