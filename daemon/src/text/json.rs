//! JSON mode (OpenAI's `response_format: {"type": "json_object"}`): a byte-level pushdown
//! automaton that says whether a text is a prefix of one JSON object (RFC 8259, UTF-8), so
//! the sampler can leave only the tokens that keep it one, and end tokens only once the
//! object is closed.
//!
//! The state is a few bytes and `Copy` (the stack of open containers is a bit set), so
//! checking a token is running its bytes through a copy: the sampler does that for every
//! token of the vocabulary at each step. Two limits keep a model from wandering: whitespace
//! between tokens is at most one newline and `WS_MAX` bytes in a row (`Ws`), and at most
//! `DEPTH_MAX` containers are nested.

/// Whitespace bytes allowed in a row between tokens of the object: enough for a newline
/// and the indent of pretty-printed output 19 levels deep.
pub const WS_MAX: u8 = 40;

/// A run of whitespace between tokens: spaces and tabs, and at most one newline, as
/// llama.cpp's JSON grammar allows (`"\n" [ \t]{0,20}`). A model sampled in JSON mode
/// otherwise falls into printing blank lines until max_tokens (OpenAI's documentation
/// warns of it; measured here with SmolLM2 at temperature 1).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Ws {
    n: u8,
    newline: bool,
}

impl Ws {
    pub const NONE: Ws = Ws {
        n: 0,
        newline: false,
    };

    pub fn is_ws(b: u8) -> bool {
        matches!(b, b' ' | b'\t' | b'\n' | b'\r')
    }

    /// The run after whitespace byte `b`, or None past the limits (a carriage return is
    /// never needed, so it is refused too).
    pub fn push(self, b: u8) -> Option<Ws> {
        let newline = b == b'\n';
        if b == b'\r' || (newline && self.newline) || self.n >= WS_MAX {
            return None;
        }
        Some(Ws {
            n: self.n + 1,
            newline: self.newline || newline,
        })
    }
}
/// Containers open at once at most.
pub const DEPTH_MAX: u8 = 64;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    /// Before the object: only `{` (no leading whitespace).
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
    /// In a string (a key when `key`).
    Str { key: bool, lex: StrLex },
    /// In a number, at the given part of `-?(0|[1-9]\d*)(\.\d+)?([eE][+-]?\d+)?`.
    Num(Num),
    /// In `true`, `false` or `null`: the literal and the bytes matched.
    Lit(&'static [u8], u8),
    /// The object is closed: only the end may follow.
    Done,
}

/// A number's part, of `-?(0|[1-9]\d*)(\.\d+)?([eE][+-]?\d+)?`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Num {
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
    /// A number's first byte.
    pub fn start(b: u8) -> Option<Num> {
        match b {
            b'-' => Some(Num::Minus),
            b'0' => Some(Num::Zero),
            b'1'..=b'9' => Some(Num::Int),
            _ => None,
        }
    }

    /// The number may end here.
    pub fn complete(self) -> bool {
        matches!(self, Num::Zero | Num::Int | Num::Frac | Num::Exp)
    }

    /// The part after `b`; an `integer` takes no fraction and no exponent.
    pub fn next(self, b: u8, integer: bool) -> Option<Num> {
        let digit = b.is_ascii_digit();
        Some(match (self, b) {
            (Num::Minus, b'0') => Num::Zero,
            (Num::Minus, _) if digit => Num::Int,
            (Num::Int, _) if digit => Num::Int,
            (Num::Zero | Num::Int, b'.') if !integer => Num::Dot,
            (Num::Zero | Num::Int | Num::Frac, b'e' | b'E') if !integer => Num::E,
            (Num::Dot | Num::Frac, _) if digit => Num::Frac,
            (Num::E, b'+' | b'-') => Num::ESign,
            (Num::E | Num::ESign | Num::Exp, _) if digit => Num::Exp,
            _ => return None,
        })
    }
}

/// Inside a string: after a backslash (`esc`), \u digits left (`hex`), UTF-8
/// continuation bytes left (`cont`) and the range of the next one (`lo..=hi`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StrLex {
    esc: bool,
    hex: u8,
    cont: u8,
    lo: u8,
    hi: u8,
}

/// What a byte does in a string.
pub enum InStr {
    Goes(StrLex),
    /// The closing quote.
    Ends,
}

impl StrLex {
    /// Any printable ASCII byte but `"` and `\` keeps the string one.
    pub fn is_plain(&self) -> bool {
        !self.esc && self.hex == 0 && self.cont == 0
    }

    /// The string after `b`, its end, or None where `b` cannot come here.
    pub fn step(self, b: u8) -> Option<InStr> {
        let lex = |esc, hex, cont, lo, hi| {
            Some(InStr::Goes(StrLex {
                esc,
                hex,
                cont,
                lo,
                hi,
            }))
        };
        if self.cont > 0 {
            return if (self.lo..=self.hi).contains(&b) {
                lex(false, 0, self.cont - 1, 0x80, 0xBF)
            } else {
                None
            };
        }
        if self.hex > 0 {
            return b.is_ascii_hexdigit().then_some(InStr::Goes(StrLex {
                hex: self.hex - 1,
                ..self
            }));
        }
        if self.esc {
            return match b {
                b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't' => lex(false, 0, 0, 0, 0),
                b'u' => lex(false, 4, 0, 0, 0),
                _ => None,
            };
        }
        match b {
            b'"' => Some(InStr::Ends),
            b'\\' => lex(true, 0, 0, 0, 0),
            0x00..=0x1F => None,
            0x20..=0x7F => lex(false, 0, 0, 0, 0),
            // UTF-8 lead bytes and the range of the byte after them (no overlong forms, no
            // surrogates, nothing past U+10FFFF).
            0xC2..=0xDF => lex(false, 0, 1, 0x80, 0xBF),
            0xE0 => lex(false, 0, 2, 0xA0, 0xBF),
            0xE1..=0xEC | 0xEE..=0xEF => lex(false, 0, 2, 0x80, 0xBF),
            0xED => lex(false, 0, 2, 0x80, 0x9F),
            0xF0 => lex(false, 0, 3, 0x90, 0xBF),
            0xF1..=0xF3 => lex(false, 0, 3, 0x80, 0xBF),
            0xF4 => lex(false, 0, 3, 0x80, 0x8F),
            _ => None,
        }
    }
}

/// Where a text stands in a JSON object.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct JsonState {
    mode: Mode,
    /// Open containers, innermost in bit `depth - 1`: 1 an object, 0 an array.
    stack: u64,
    depth: u8,
    /// Whitespace in a row so far.
    ws: Ws,
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
            ws: Ws::NONE,
        }
    }

    /// The object is closed: the text is one JSON object.
    pub fn is_done(&self) -> bool {
        self.mode == Mode::Done
    }

    /// Inside a string, where any printable ASCII byte but `"` and `\` keeps it one (the
    /// sampler's shortcut for most tokens there).
    pub fn in_plain_string(&self) -> bool {
        matches!(self.mode, Mode::Str { lex, .. } if lex.is_plain())
    }

    /// In `true`, `false` or `null`.
    pub fn in_literal(&self) -> bool {
        matches!(self.mode, Mode::Lit(..))
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
            lex: StrLex::default(),
        }
    }

    /// The start of a value (after `:`, `[` or `,` in an array).
    fn value(mut self, b: u8) -> Option<JsonState> {
        self.mode = match b {
            b'{' => return self.open(true),
            b'[' => return self.open(false),
            b'"' => JsonState::string(false),
            b'-' | b'0'..=b'9' => Mode::Num(Num::start(b)?),
            b't' => Mode::Lit(b"true", 1),
            b'f' => Mode::Lit(b"false", 1),
            b'n' => Mode::Lit(b"null", 1),
            _ => return None,
        };
        Some(self)
    }

    fn step(mut self, b: u8) -> Option<JsonState> {
        let structural = !matches!(self.mode, Mode::Str { .. } | Mode::Num(_) | Mode::Lit(..));
        if structural {
            if Ws::is_ws(b) {
                // The object starts at its brace: a reply that opens with blank lines or
                // spaces is not what JSON mode asks for. After the close the text ends.
                if matches!(self.mode, Mode::Done | Mode::Start) {
                    return None;
                }
                self.ws = self.ws.push(b)?;
                return Some(self);
            }
            self.ws = Ws::default();
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
            Mode::Str { key, lex } => match lex.step(b)? {
                InStr::Goes(lex) => {
                    self.mode = Mode::Str { key, lex };
                    Some(self)
                }
                InStr::Ends if key => {
                    self.mode = Mode::Colon;
                    Some(self)
                }
                InStr::Ends => Some(self.value_done()),
            },
            Mode::Num(n) => match n.next(b, false) {
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
            br#"{ "a" : 1 } "#.trim_ascii_end(),
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
        // One newline a run, then an indent; no carriage return.
        assert!(ours(b"{\n  \"a\": 1,\n\t\"b\":\n 2\n}").is_some_and(|s| s.is_done()));
        assert_eq!(ours(b"{\n\n"), None);
        assert_eq!(ours(b"{ \n \n"), None);
        assert_eq!(ours(b"{\r\n"), None);
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
        let mut rng = crate::util::rng::Rng::new(0x2545F4914F6CDD1D);
        let mut next = |n: usize| rng.below(n as u64) as usize;
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
            // The automaton takes no whitespace before the object (it starts at its brace)
            // or after it (the end token comes next), and no run of it with two newlines.
            let body = text.trim_end_matches([' ', '\n', '\t', '\r']);
            if body.starts_with(|c: char| c.is_ascii_whitespace()) {
                assert!(ours(body.as_bytes()).is_none(), "{text:?}");
                continue;
            }
            let two_newlines = body
                .split(|c: char| !c.is_ascii_whitespace())
                .any(|run| run.matches('\n').count() > 1);
            if two_newlines {
                continue;
            }
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

    /// What the tokenizer calls plain (`TokenKind::Text { plain }`: whole characters, no
    /// quote, backslash or control character) keeps a string one, from any character.
    #[test]
    fn plain_text_keeps_a_string_one() {
        let mut rng = crate::util::rng::Rng::new(7);
        for _ in 0..20_000 {
            let c = char::from_u32(rng.below(0x11_0000) as u32).unwrap_or('x');
            let plain = c >= ' ' && c != '"' && c != '\\';
            let text = format!("{{\"a\":\"{c}{c}");
            assert_eq!(
                ours(text.as_bytes()).is_some_and(|s| s.in_plain_string()),
                plain,
                "{c:?}"
            );
        }
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
