//! Incremental detokenization and stop strings.
//!
//! A token can end inside a multi-byte character, and byte-level BPE decoders then yield
//! U+FFFD; text is emitted only once it no longer ends that way, so a stream never carries
//! a broken character. Text that could be the start of a stop string is held back until it
//! is known not to be one.

use super::tokenizer::Tokenizer;

#[derive(Default)]
pub struct Detokenizer {
    ids: Vec<u32>,
    prefix: usize,
    read: usize,
}

impl Detokenizer {
    /// Adds a token; returns the new text it completes, if any.
    pub fn push(&mut self, tok: &Tokenizer, id: u32) -> String {
        self.ids.push(id);
        let before = tok.decode(&self.ids[self.prefix..self.read]);
        let now = tok.decode(&self.ids[self.prefix..]);
        if now.len() > before.len() && !now.ends_with('\u{FFFD}') {
            if let Some(delta) = now.get(before.len()..) {
                let delta = delta.to_string();
                self.prefix = self.read;
                self.read = self.ids.len();
                return delta;
            }
        }
        String::new()
    }

    /// Whatever text is still held (at the end of generation).
    pub fn flush(&mut self, tok: &Tokenizer) -> String {
        let before = tok.decode(&self.ids[self.prefix..self.read]);
        let now = tok.decode(&self.ids[self.prefix..]);
        self.prefix = self.ids.len();
        self.read = self.ids.len();
        now.get(before.len()..).unwrap_or("").to_string()
    }
}

/// Matches stop strings across pieces of streamed text.
pub struct StopMatcher {
    stops: Vec<String>,
    held: String,
}

impl StopMatcher {
    pub fn new(stops: Vec<String>) -> StopMatcher {
        StopMatcher {
            stops: stops.into_iter().filter(|s| !s.is_empty()).collect(),
            held: String::new(),
        }
    }

    /// Feeds new text; returns (text safe to emit, whether a stop string matched). On a
    /// match the text before the stop string is emitted and the rest dropped.
    pub fn push(&mut self, text: &str) -> (String, bool) {
        self.held.push_str(text);
        if let Some(at) = self
            .stops
            .iter()
            .filter_map(|s| self.held.find(s.as_str()))
            .min()
        {
            let out = self.held[..at].to_string();
            self.held.clear();
            return (out, true);
        }
        // Hold back the longest tail that is a proper prefix of some stop string.
        let mut keep = 0;
        for s in &self.stops {
            for (k, _) in s.char_indices().skip(1) {
                if self.held.ends_with(&s[..k]) {
                    keep = keep.max(k);
                }
            }
        }
        let cut = self.held.len() - keep;
        let out = self.held[..cut].to_string();
        self.held.drain(..cut);
        (out, false)
    }

    /// Held text, released when generation ends for another reason.
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.held)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stop_strings_match_across_pieces_and_hold_back_only_prefixes() {
        let mut m = StopMatcher::new(vec!["\nUser:".into(), "###".into()]);
        let mut out = String::new();
        let mut stopped = false;
        for piece in ["Hello", " world", "\n", "Us", "er: more"] {
            let (t, s) = m.push(piece);
            out.push_str(&t);
            if s {
                stopped = true;
                break;
            }
        }
        assert!(stopped);
        assert_eq!(out, "Hello world");
        let mut m = StopMatcher::new(vec!["###".into()]);
        assert_eq!(m.push("a#"), ("a".to_string(), false));
        assert_eq!(m.push("b"), ("#b".to_string(), false));
        assert_eq!(m.finish(), "");
    }
}
