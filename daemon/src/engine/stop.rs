//! Stop strings over streamed text: text is released only once no stop string can still begin
//! in it, so a client never sees part of a stop string.

/// Generated text, released to the caller only once no stop string can still begin in it.
pub struct StopScanner {
    stops: Vec<String>,
    text: String,
    released: usize,
}

impl StopScanner {
    pub fn new(stops: &[String]) -> Self {
        StopScanner {
            stops: stops.to_vec(),
            text: String::new(),
            released: 0,
        }
    }

    /// Adds `piece`; returns true when a stop string has appeared (the text is cut before it).
    pub fn push(&mut self, piece: &str, on_text: &mut impl FnMut(&str)) -> bool {
        let search_from = self.released;
        self.text.push_str(piece);
        let hit = self
            .stops
            .iter()
            .filter_map(|s| {
                self.text[search_from..]
                    .find(s.as_str())
                    .map(|i| search_from + i)
            })
            .min();
        if let Some(at) = hit {
            self.text.truncate(at);
            self.release(at, on_text);
            return true;
        }
        // Hold back the longest tail that could still grow into a stop string.
        let hold = self
            .stops
            .iter()
            .flat_map(|s| {
                s.char_indices()
                    .map(|(i, _)| i)
                    .filter(|&i| i > 0 && self.text.ends_with(&s[..i]))
            })
            .max()
            .unwrap_or(0);
        let mut safe = self.text.len() - hold;
        while !self.text.is_char_boundary(safe) {
            safe -= 1;
        }
        self.release(safe, on_text);
        false
    }

    fn release(&mut self, upto: usize, on_text: &mut impl FnMut(&str)) {
        if upto > self.released {
            on_text(&self.text[self.released..upto]);
            self.released = upto;
        }
    }

    /// Releases what is left and returns the whole text.
    pub fn finish(mut self, on_text: &mut impl FnMut(&str)) -> String {
        let end = self.text.len();
        self.release(end, on_text);
        self.text
    }
}

#[cfg(test)]
mod tests {
    use super::StopScanner;

    fn scan(stops: &[&str], pieces: &[&str]) -> (bool, String, Vec<String>) {
        let stops: Vec<String> = stops.iter().map(|s| s.to_string()).collect();
        let mut scanner = StopScanner::new(&stops);
        let mut released = Vec::new();
        let mut stopped = false;
        for p in pieces {
            if scanner.push(p, &mut |t: &str| released.push(t.to_string())) {
                stopped = true;
                break;
            }
        }
        let text = scanner.finish(&mut |t: &str| released.push(t.to_string()));
        (stopped, text, released)
    }

    #[test]
    fn a_stop_string_split_across_pieces_is_found_and_never_released() {
        let (stopped, text, released) = scan(&["\n\n"], &["Hello", " world\n", "\nmore"]);
        assert!(stopped);
        assert_eq!(text, "Hello world");
        assert_eq!(released.concat(), "Hello world");
    }

    #[test]
    fn text_that_cannot_start_a_stop_string_is_released_at_once() {
        let (stopped, text, released) = scan(&["END"], &["abc", "dE", "x"]);
        assert!(!stopped);
        assert_eq!(text, "abcdEx");
        assert_eq!(released, ["abc", "d", "Ex"]);
    }

    #[test]
    fn multibyte_stop_strings_are_held_back_on_char_boundaries() {
        let (stopped, text, _) = scan(&["日本"], &["a日", "本b"]);
        assert!(stopped);
        assert_eq!(text, "a");
        let (stopped, text, _) = scan(&["é!"], &["café", "?"]);
        assert!(!stopped);
        assert_eq!(text, "café?");
    }
}
