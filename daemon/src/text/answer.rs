//! What reading an answer back yields, whatever its format: content, reasoning, calls
//! and their arguments as events (`ToolEvent`), from parsers fed the text piece by piece
//! (`Parse`: `tool_parse::LayoutParser` for calls in a grammar's layout,
//! `harmony::HarmonyParser` for gpt-oss's channels).

/// What a generated text holds, in order.
#[derive(Clone, Debug, PartialEq)]
pub enum ToolEvent {
    /// Text for the answer's content.
    Text(String),
    /// The model's reasoning (harmony's analysis channel: `reasoning_content`).
    Reasoning(String),
    /// Call `index` begins: its id and function.
    Call {
        index: usize,
        id: String,
        name: String,
    },
    /// More of call `index`'s arguments (JSON text).
    Args { index: usize, text: String },
}

/// A parser of an answer's text, piece by piece: a state machine over the bytes not yet
/// read.
pub trait Parse: Send {
    /// The text not yet read.
    fn buf(&mut self) -> &mut String;
    /// One step over the buffer; false when it needs more text.
    fn step(&mut self, out: &mut Vec<ToolEvent>) -> bool;
    /// The events of `rest`, what no step could read by the end of the text.
    fn rest(&mut self, rest: String, out: &mut Vec<ToolEvent>);
    /// Calls begun so far.
    fn calls(&self) -> usize;

    /// The events `text` (the next piece) completes; some bytes may wait for the next.
    fn feed(&mut self, text: &str) -> Vec<ToolEvent> {
        self.buf().push_str(text);
        let mut out = Vec::new();
        while self.step(&mut out) {}
        merge(out)
    }

    /// The events of what is left at the end of the text.
    fn finish(&mut self) -> Vec<ToolEvent> {
        let mut out = self.feed("");
        let rest = std::mem::take(self.buf());
        if !rest.is_empty() {
            self.rest(rest, &mut out);
        }
        merge(out)
    }
}

/// The bytes at the end of `buf` that may be the start of `marker` (kept back until the
/// next piece tells).
pub(crate) fn held_back(buf: &str, marker: &str) -> usize {
    (1..marker.len().min(buf.len() + 1))
        .rev()
        .find(|&k| {
            let at = buf.len() - k;
            buf.is_char_boundary(at) && marker.starts_with(&buf[at..])
        })
        .unwrap_or(0)
}

/// Adjacent text events, and adjacent argument pieces of one call, as one.
pub(crate) fn merge(events: Vec<ToolEvent>) -> Vec<ToolEvent> {
    let mut out: Vec<ToolEvent> = Vec::with_capacity(events.len());
    for e in events {
        match (out.last_mut(), e) {
            (Some(ToolEvent::Text(a)), ToolEvent::Text(b)) => a.push_str(&b),
            (Some(ToolEvent::Reasoning(a)), ToolEvent::Reasoning(b)) => a.push_str(&b),
            (
                Some(ToolEvent::Args { index: i, text: a }),
                ToolEvent::Args { index: j, text: b },
            ) if *i == j => a.push_str(&b),
            (_, e) => out.push(e),
        }
    }
    out
}

/// A call id, unique in this process and not guessable: `call_` and 24 letters or digits,
/// or with `short` 9 of them (Mistral's template refuses any other id).
pub fn call_id(short: bool) -> String {
    use std::hash::{BuildHasher, Hasher};
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let state = std::collections::hash_map::RandomState::new();
    let mut id = String::from(if short { "" } else { "call_" });
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    const ALPHABET: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789";
    let parts = if short { 2 } else { 4 };
    for part in 0..parts {
        let mut h = state.build_hasher();
        h.write_u64(n);
        h.write_u64(part);
        let mut x = h.finish();
        for _ in 0..6 {
            id.push(ALPHABET[(x % 62) as usize] as char);
            x /= 62;
        }
    }
    if short {
        id.truncate(9);
    }
    id
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A text fed at once and split at every character gives the same events, merged, call
    /// ids left out; returns them.
    pub(crate) fn agree<P: Parse>(make: impl Fn() -> P, text: &str) -> Vec<ToolEvent> {
        let strip = |v: Vec<ToolEvent>| -> Vec<ToolEvent> {
            merge(
                v.into_iter()
                    .map(|e| match e {
                        ToolEvent::Call { index, name, .. } => ToolEvent::Call {
                            index,
                            id: String::new(),
                            name,
                        },
                        e => e,
                    })
                    .collect(),
            )
        };
        let mut p = make();
        let mut whole = p.feed(text);
        whole.extend(p.finish());
        let mut p = make();
        let mut split = Vec::new();
        for (i, c) in text.char_indices() {
            split.extend(p.feed(&text[i..i + c.len_utf8()]));
        }
        split.extend(p.finish());
        let whole = strip(whole);
        assert_eq!(strip(split), whole, "{text:?}");
        whole
    }

    /// `count` texts of 1 to 24 of `parts` drawn at random (seeded).
    pub(crate) fn random_texts(parts: &[&str], seed: u64, count: usize) -> Vec<String> {
        let mut rng = crate::util::rng::Rng::new(seed);
        (0..count)
            .map(|_| {
                let n = 1 + rng.below(24) as usize;
                (0..n)
                    .map(|_| parts[rng.below(parts.len() as u64) as usize])
                    .collect()
            })
            .collect()
    }
}
