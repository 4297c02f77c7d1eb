//! The training text: the King James Bible as `bible -l10000 gen1:1-rev22:21` (Debian's
//! `bible-kjv`) prints it, one heading line per chapter ("Genesis 1") and one line per verse
//! ("  1 In the beginning God created ..."), cleaned into chapters of plain verses.

use anyhow::bail;

/// One chapter: its heading and its verses without their numbers.
#[derive(Debug, Clone, PartialEq)]
pub struct Chapter {
    pub title: String,
    pub verses: Vec<String>,
}

impl Chapter {
    /// The text the model learns from: one verse per line, and a blank line after the chapter.
    pub fn text(&self) -> String {
        let mut s = self.verses.join("\n");
        s.push_str("\n\n");
        s
    }
}

/// Parses `bible`'s output. Verse lines must follow a heading; anything else is an error, so a
/// changed output format is noticed rather than learnt.
pub fn parse(raw: &str) -> anyhow::Result<Vec<Chapter>> {
    let mut chapters: Vec<Chapter> = Vec::new();
    for (n, line) in raw.lines().enumerate() {
        let trimmed = line.trim();
        if trimmed.is_empty() {
            continue;
        }
        if line.starts_with(' ') {
            let Some((number, verse)) = trimmed.split_once(' ') else {
                bail!("line {}: a verse number without text: {line:?}", n + 1);
            };
            if number.parse::<u32>().is_err() {
                bail!("line {}: expected a verse number: {line:?}", n + 1);
            }
            let Some(chapter) = chapters.last_mut() else {
                bail!("line {}: a verse before any chapter heading", n + 1);
            };
            chapter.verses.push(verse.trim().to_string());
        } else {
            chapters.push(Chapter {
                title: trimmed.to_string(),
                verses: Vec::new(),
            });
        }
    }
    if let Some(empty) = chapters.iter().find(|c| c.verses.is_empty()) {
        bail!("chapter {:?} has no verses", empty.title);
    }
    Ok(chapters)
}

/// Whether chapter `index` is held out of training (one in twenty, spread over every book).
pub fn is_held_out(index: usize) -> bool {
    index % 20 == 7
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chapters_and_verses_are_parsed_without_numbers() {
        let raw = "\nGenesis 1\n\n  1 In the beginning God created the heaven and the earth.\n  \
                   2 And the earth was without form.\n\nGenesis 2\n\n  1 Thus the heavens.\n";
        let c = parse(raw).unwrap();
        assert_eq!(c.len(), 2);
        assert_eq!(c[0].title, "Genesis 1");
        assert_eq!(
            c[0].text(),
            "In the beginning God created the heaven and the earth.\n\
             And the earth was without form.\n\n"
        );
        assert_eq!(c[1].verses, vec!["Thus the heavens."]);
    }

    #[test]
    fn malformed_input_is_refused() {
        assert!(parse("  1 a verse before a heading\n").is_err());
        assert!(parse("Genesis 1\n  x not a number\n").is_err());
        assert!(parse("Genesis 1\nGenesis 2\n  1 v\n").is_err());
    }
}
