//! JSON mode (OpenAI's `response_format: {"type": "json_object"}`): a byte-level pushdown
//! automaton that says whether a text is a prefix of one JSON object (RFC 8259, UTF-8), so
//! the sampler can leave only the tokens that keep it one, and end tokens only once the
//! object is closed.
//!
//! The state is a few bytes and `Copy` (the stack of open containers is a bit set), so
//! checking a token is running its bytes through a copy: the sampler does that for every
//! token of the vocabulary at each step. Two limits keep a model from wandering: at most
//! `WS_MAX` whitespace bytes in a row, and at most `DEPTH_MAX` nested containers.

/// Whitespace bytes allowed in a row between tokens of the object (a model in JSON mode can
/// otherwise fall into printing newlines until max_tokens: OpenAI's documentation warns of
/// it). Enough for pretty-printed output 28 levels deep.
pub const WS_MAX: u8 = 64;
/// Containers open at once at most.
pub const DEPTH_MAX: u8 = 64;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    /// Before the object: whitespace or `{`.
    Start,
    /// After `{`: a key or `}`.
    ObjectFirst,
    /// After `,` in an object: a key.
    Key,
    /// After a key: `:`.
    Colon,
    /// After `[`: a value or `]`.
    ArrayFirst,
    /// After `:` or `,` in an array: a value.
    Value,
    /// After a value in a container: `,` or the container's close.
    After,
    /// In a string (a key when `key`); `esc`: after a backslash; `hex`: \u digits left;
    /// `cont`: UTF-8 continuation bytes left, `lo`/`hi` the range of the next one.
    Str {
        key: bool,
        esc: bool,
        hex: u8,
        cont: u8,
        lo: u8,
        hi: u8,
    },
    /// In a number, at the given part of `-?(0|[1-9]\d*)(\.\d+)?([eE][+-]?\d+)?`.
    Num(Num),
    /// In `true`, `false` or `null`: the literal and the bytes matched.
    Lit(&'static [u8], u8),
    /// The object is closed: only the end may follow.
    Done,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Num {
    Minus,
    Zero,
    Int,
    Dot,
    Frac,
    E,
    ESign,
    Exp,
}

impl Num {
    /// The number may end here.
    fn complete(self) -> bool {
        matches!(self, Num::Zero | Num::Int | Num::Frac | Num::Exp)
    }

    fn next(self, b: u8) -> Option<Num> {
        let digit = b.is_ascii_digit();
        Some(match (self, b) {
            (Num::Minus, b'0') => Num::Zero,
            (Num::Minus, _) if digit => Num::Int,
            (Num::Int, _) if digit => Num::Int,
            (Num::Zero | Num::Int, b'.') => Num::Dot,
            (Num::Zero | Num::Int | Num::Frac, b'e' | b'E') => Num::E,
            (Num::Dot | Num::Frac, _) if digit => Num::Frac,
            (Num::E, b'+' | b'-') => Num::ESign,
            (Num::E | Num::ESign | Num::Exp, _) if digit => Num::Exp,
            _ => return None,
        })
    }
}

/// Where a text stands in a JSON object.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct JsonState {
    mode: Mode,
    /// Open containers, innermost in bit `depth - 1`: 1 an object, 0 an array.
    stack: u64,
    depth: u8,
    /// Whitespace bytes in a row so far.
    ws: u8,
}

impl Default for JsonState {
    fn default() -> Self {
        JsonState::new()
    }
}

impl JsonState {
    pub const fn new() -> JsonState {
        JsonState {
            mode: Mode::Start,
            stack: 0,
            depth: 0,
            ws: 0,
        }
    }

    /// The object is closed: the text is one JSON object.
    pub fn is_done(&self) -> bool {
        self.mode == Mode::Done
    }

    /// Inside a string, where any printable ASCII byte but `"` and `\` keeps it one (the
    /// sampler's shortcut for most tokens there).
    pub fn in_plain_string(&self) -> bool {
        matches!(
            self.mode,
            Mode::Str {
                esc: false,
                hex: 0,
                cont: 0,
                ..
            }
        )
    }

    /// The state after `bytes`, or None where they leave the text no prefix of an object.
    pub fn feed(mut self, bytes: &[u8]) -> Option<JsonState> {
        for &b in bytes {
            self = self.step(b)?;
        }
        Some(self)
    }

    fn in_object(&self) -> bool {
        self.depth > 0 && self.stack >> (self.depth - 1) & 1 == 1
    }

    fn open(mut self, object: bool) -> Option<JsonState> {
        if self.depth >= DEPTH_MAX {
            return None;
        }
        self.stack = self.stack & !(1 << self.depth) | u64::from(object) << self.depth;
        self.depth += 1;
        self.mode = if object {
            Mode::ObjectFirst
        } else {
            Mode::ArrayFirst
        };
        Some(self)
    }

    /// A value just ended.
    fn value_done(mut self) -> JsonState {
        self.mode = if self.depth == 0 {
            Mode::Done
        } else {
            Mode::After
        };
        self
    }

    fn close(mut self, object: bool) -> Option<JsonState> {
        if self.depth == 0 || self.in_object() != object {
            return None;
        }
        self.depth -= 1;
        Some(self.value_done())
    }

    fn string(key: bool) -> Mode {
        Mode::Str {
            key,
            esc: false,
            hex: 0,
            cont: 0,
            lo: 0,
            hi: 0,
        }
    }

    /// The start of a value (after `:`, `[` or `,` in an array).
    fn value(mut self, b: u8) -> Option<JsonState> {
        self.mode = match b {
            b'{' => return self.open(true),
            b'[' => return self.open(false),
            b'"' => JsonState::string(false),
            b'-' => Mode::Num(Num::Minus),
            b'0' => Mode::Num(Num::Zero),
            b'1'..=b'9' => Mode::Num(Num::Int),
            b't' => Mode::Lit(b"true", 1),
            b'f' => Mode::Lit(b"false", 1),
            b'n' => Mode::Lit(b"null", 1),
            _ => return None,
        };
        Some(self)
    }

    fn step(mut self, b: u8) -> Option<JsonState> {
        let ws = matches!(b, b' ' | b'\t' | b'\n' | b'\r');
        let structural = !matches!(self.mode, Mode::Str { .. } | Mode::Num(_) | Mode::Lit(..));
        if structural {
            if ws {
                self.ws += 1;
                return (self.ws <= WS_MAX && self.mode != Mode::Done).then_some(self);
            }
            self.ws = 0;
        }
        match self.mode {
            Mode::Start => (b == b'{').then(|| self.open(true))?,
            Mode::ObjectFirst | Mode::Key => {
                if b == b'}' && self.mode == Mode::ObjectFirst {
                    return self.close(true);
                }
                (b == b'"').then(|| {
                    self.mode = JsonState::string(true);
                    self
                })
            }
            Mode::Colon => (b == b':').then(|| {
                self.mode = Mode::Value;
                self
            }),
            Mode::ArrayFirst if b == b']' => self.close(false),
            Mode::ArrayFirst | Mode::Value => self.value(b),
            Mode::After => match b {
                b',' => {
                    self.mode = if self.in_object() {
                        Mode::Key
                    } else {
                        Mode::Value
                    };
                    Some(self)
                }
                b'}' => self.close(true),
                b']' => self.close(false),
                _ => None,
            },
            Mode::Str {
                key,
                esc,
                hex,
                cont,
                lo,
                hi,
            } => {
                let mut s = (esc, hex, cont, lo, hi);
                if cont > 0 {
                    if !(lo..=hi).contains(&b) {
                        return None;
                    }
                    s = (false, 0, cont - 1, 0x80, 0xBF);
                } else if hex > 0 {
                    if !b.is_ascii_hexdigit() {
                        return None;
                    }
                    s.1 = hex - 1;
                } else if esc {
                    s = match b {
                        b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't' => {
                            (false, 0, 0, 0, 0)
                        }
                        b'u' => (false, 4, 0, 0, 0),
                        _ => return None,
                    };
                } else {
                    match b {
                        b'"' => {
                            if key {
                                self.mode = Mode::Colon;
                                return Some(self);
                            }
                            return Some(self.value_done());
                        }
                        b'\\' => s.0 = true,
                        0x00..=0x1F => return None,
                        0x20..=0x7F => {}
                        // UTF-8 lead bytes and the range of the byte after them (no
                        // overlong forms, no surrogates, nothing past U+10FFFF).
                        0xC2..=0xDF => s = (false, 0, 1, 0x80, 0xBF),
                        0xE0 => s = (false, 0, 2, 0xA0, 0xBF),
                        0xE1..=0xEC | 0xEE..=0xEF => s = (false, 0, 2, 0x80, 0xBF),
                        0xED => s = (false, 0, 2, 0x80, 0x9F),
                        0xF0 => s = (false, 0, 3, 0x90, 0xBF),
                        0xF1..=0xF3 => s = (false, 0, 3, 0x80, 0xBF),
                        0xF4 => s = (false, 0, 3, 0x80, 0x8F),
                        _ => return None,
                    }
                }
                self.mode = Mode::Str {
                    key,
                    esc: s.0,
                    hex: s.1,
                    cont: s.2,
                    lo: s.3,
                    hi: s.4,
                };
                Some(self)
            }
            Mode::Num(n) => match n.next(b) {
                Some(n) => {
                    self.mode = Mode::Num(n);
                    Some(self)
                }
                // The number ended; the byte belongs to what follows it.
                None if n.complete() => self.value_done().step(b),
                None => None,
            },
            Mode::Lit(word, at) => {
                if word.get(at as usize) != Some(&b) {
                    return None;
                }
                if at as usize + 1 == word.len() {
                    return Some(self.value_done());
                }
                self.mode = Mode::Lit(word, at + 1);
                Some(self)
            }
            Mode::Done => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What serde_json (the reference) says of a whole text: one JSON object.
    fn serde_says_object(text: &[u8]) -> bool {
        serde_json::from_slice::<serde_json::Map<String, serde_json::Value>>(text).is_ok()
    }

    fn ours(text: &[u8]) -> Option<JsonState> {
        JsonState::new().feed(text)
    }

    #[test]
    fn objects_are_done_and_every_prefix_of_one_is_a_prefix() {
        let docs: [&[u8]; 9] = [
            br#"{}"#,
            br#" { "a" : 1 } "#.trim_ascii_end(),
            br#"{"a":[1,-2.5e+3,0,0.0,1E9,true,false,null,"x",{},[]],"b":{"c":"\u00e9\n\\\"/"}}"#,
            "{\"k\": \"é → 😀 ✓\"}".as_bytes(),
            b"{\n  \"name\": \"cat\",\n  \"legs\": 4,\n  \"tags\": [\n    \"pet\"\n  ]\n}",
            br#"{"":""}"#,
            br#"{"a":-0}"#,
            br#"{"a":[[[[[]]]]]}"#,
            br#"{"a":1.5e-7}"#,
        ];
        for d in docs {
            assert!(serde_says_object(d), "{:?}", String::from_utf8_lossy(d));
            for cut in 0..d.len() {
                let s = ours(&d[..cut]);
                assert!(
                    s.is_some_and(|s| !s.is_done()),
                    "prefix {:?} of {:?}",
                    String::from_utf8_lossy(&d[..cut]),
                    String::from_utf8_lossy(d)
                );
            }
            assert!(
                ours(d).is_some_and(|s| s.is_done()),
                "{:?}",
                String::from_utf8_lossy(d)
            );
            // Nothing may follow a closed object (the end token alone).
            assert_eq!(ours(d).and_then(|s| s.feed(b" ")), None);
        }
    }

    #[test]
    fn what_is_no_object_is_refused_where_it_stops_being_one() {
        for (bad, ok_len) in [
            (&br#"[1]"#[..], 0),
            (br#""a""#, 0),
            (br#"{"a" 1}"#, 5),
            (br#"{"a":01}"#, 6),
            (br#"{"a":1.}"#, 7),
            (br#"{"a":-}"#, 6),
            (br#"{"a":1,}"#, 7),
            (br#"{"a":[1,]}"#, 8),
            (br#"{"a":tru}"#, 8),
            (br#"{"a":nul1}"#, 8),
            (br#"{"a":"\x"}"#, 7),
            (br#"{"a":"\u12g4"}"#, 10),
            (b"{\"a\":\"\x01\"}", 6),
            (br#"{a:1}"#, 1),
            (br#"{"a":1]"#, 6),
            (br#"{"a":[1}"#, 7),
            (br#"{'a':1}"#, 1),
            (b"{\"a\":\"\xC0\x80\"}", 6),
            (b"{\"a\":\"\xED\xA0\x80\"}", 7),
            (b"{\"a\":\"\xF4\x90\x80\x80\"}", 7),
            (b"{\"a\":\"\xE2\x82\"}", 8),
        ] {
            assert!(
                !serde_says_object(bad),
                "{:?}",
                String::from_utf8_lossy(bad)
            );
            assert!(
                ours(&bad[..ok_len]).is_some(),
                "{:?}",
                String::from_utf8_lossy(bad)
            );
            assert_eq!(
                ours(&bad[..ok_len + 1]),
                None,
                "{:?} at {ok_len}",
                String::from_utf8_lossy(bad)
            );
        }
    }

    #[test]
    fn the_limits_hold() {
        let deep = |n: usize| {
            let mut d = String::from("{\"a\":");
            d += &"[".repeat(n - 1);
            d += &"]".repeat(n - 1);
            d += "}";
            d
        };
        assert!(ours(deep(DEPTH_MAX as usize).as_bytes()).is_some_and(|s| s.is_done()));
        assert_eq!(ours(deep(DEPTH_MAX as usize + 1).as_bytes()), None);
        let ws = |n: usize| format!("{{{}}}", " ".repeat(n));
        assert!(ours(ws(WS_MAX as usize).as_bytes()).is_some_and(|s| s.is_done()));
        assert_eq!(ours(ws(WS_MAX as usize + 1).as_bytes()), None);
        // Whitespace inside strings is text, not counted.
        let long = format!("{{\"a\":\"{}\"}}", " ".repeat(500));
        assert!(ours(long.as_bytes()).is_some_and(|s| s.is_done()));
    }

    /// Random texts from JSON's own alphabet, judged by serde_json and by the automaton:
    /// they agree on every one (within the limits, which these texts stay under).
    #[test]
    fn agrees_with_serde_json_on_random_texts() {
        const PARTS: [&str; 30] = [
            "{",
            "}",
            "[",
            "]",
            ",",
            ":",
            "\"",
            "\"a\"",
            "\"b\":",
            "1",
            "0",
            "-",
            ".",
            "e",
            "+",
            "5",
            "true",
            "false",
            "null",
            "nul",
            " ",
            "\n",
            "\\",
            "\\n",
            "\\u00",
            "4f",
            "é",
            "\u{1F600}",
            "x",
            "{\"k\":",
        ];
        let mut state = 0x2545F4914F6CDD1Du64;
        let mut next = |n: usize| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state % n as u64) as usize
        };
        let (mut objects, mut refused) = (0, 0);
        for _ in 0..200_000 {
            let mut text = String::new();
            for _ in 0..1 + next(14) {
                text += PARTS[next(PARTS.len())];
            }
            // Texts of the form `{"k": ... }` are objects more often.
            if next(2) == 0 {
                text = format!("{{\"k\":{text}}}");
            }
            let want =
                match serde_json::from_str::<serde_json::Map<String, serde_json::Value>>(&text) {
                    Ok(_) => true,
                    // RFC 8259 sets no range on numbers; serde_json's f64 has one.
                    Err(e) if e.to_string().contains("number out of range") => continue,
                    Err(_) => false,
                };
            // The automaton takes no whitespace after the object (the end token comes next).
            let body = text.trim_end_matches([' ', '\n', '\t', '\r']);
            let got = ours(body.as_bytes()).is_some_and(|s| s.is_done());
            assert_eq!(got, want, "{text:?}");
            if want {
                objects += 1;
            } else {
                refused += 1;
            }
        }
        assert!(
            objects > 1000 && refused > 1000,
            "{objects} objects, {refused} not"
        );
    }

    /// Bytes that cannot be UTF-8 anywhere are refused in strings; all of Unicode's
    /// scalar values are taken.
    #[test]
    fn strings_take_every_scalar_value_and_only_those() {
        for c in [
            '\u{80}',
            '\u{7FF}',
            '\u{800}',
            '\u{D7FF}',
            '\u{E000}',
            '\u{FFFF}',
            '\u{10000}',
            '\u{10FFFF}',
        ] {
            let d = format!("{{\"a\":\"{c}\"}}");
            assert!(ours(d.as_bytes()).is_some_and(|s| s.is_done()), "{c:?}");
        }
        for b in [0x80u8, 0xBF, 0xC0, 0xC1, 0xF5, 0xFF] {
            assert_eq!(ours(&[b'{', b'"', b]), None, "{b:#x}");
        }
    }
}
