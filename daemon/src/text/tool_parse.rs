//! Reading calls back out of generated text, piece by piece, by the layout their format's
//! grammar gave them (`tools.rs`): content before a call, each call's id and function as
//! soon as its name is read, then its arguments as they come (how OpenAI streams calls).

use super::answer::{call_id, held_back, Parse, ToolEvent};
use super::harmony::HarmonyParser;
use super::tools::{Layout, ToolFormat};

#[derive(Clone, Debug, PartialEq)]
enum State {
    /// Free text (auto): watching for the start of a call.
    Content,
    /// Expecting these bytes, then `next`.
    Lit(String, Box<State>),
    /// A function's name, up to its closing quote.
    Name,
    /// Arguments: a JSON value, scanned to its end.
    Args,
    /// After a call: another (`sep`), the close, or the end.
    Between,
    /// Past what the layout explains (a text not written under the grammar): the rest is
    /// content.
    Raw,
}

/// Reads an answer back, piece by piece, as its syntax says: calls in a format's layout,
/// or harmony's messages.
pub struct ToolParser(Box<dyn Parse>);

impl ToolParser {
    pub fn new(syntax: Syntax) -> ToolParser {
        ToolParser(match syntax.format {
            ToolFormat::Harmony => Box::new(HarmonyParser::new(syntax.tools)),
            f => Box::new(LayoutParser::new(f, syntax.parallel, syntax.forced)),
        })
    }

    /// Calls begun so far.
    pub fn calls(&self) -> usize {
        self.0.calls()
    }

    /// The events `text` (the next piece) completes; some bytes may wait for the next.
    pub fn feed(&mut self, text: &str) -> Vec<ToolEvent> {
        self.0.feed(text)
    }

    /// The events of what is left at the end of the text.
    pub fn finish(&mut self) -> Vec<ToolEvent> {
        self.0.finish()
    }
}

/// How a chat answer is read: the format calls come in (harmony's answers are read even
/// without tools, for their channels), whether several calls may come, whether a call is
/// forced, whether the request offered tools.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Syntax {
    pub format: ToolFormat,
    pub parallel: bool,
    pub forced: bool,
    pub tools: bool,
}

/// Reads calls back out of a text written in a format's layout, piece by piece.
pub struct LayoutParser {
    layout: Layout,
    format: ToolFormat,
    parallel: bool,
    state: State,
    buf: String,
    /// Calls begun so far.
    calls: usize,
    scan: JsonScan,
}

impl Parse for LayoutParser {
    fn buf(&mut self) -> &mut String {
        &mut self.buf
    }

    /// One step over the buffer; false when it needs more text.
    fn step(&mut self, out: &mut Vec<ToolEvent>) -> bool {
        match std::mem::replace(&mut self.state, State::Raw) {
            State::Content => self.content(out),
            State::Raw => {
                if !self.buf.is_empty() {
                    out.push(ToolEvent::Text(std::mem::take(&mut self.buf)));
                }
                false
            }
            State::Lit(want, next) => {
                let n = want.len().min(self.buf.len());
                if self.buf.as_bytes()[..n] != want.as_bytes()[..n] {
                    // Not the layout: the rest is content (or, inside a call, dropped).
                    self.state = State::Raw;
                    return true;
                }
                if n < want.len() {
                    // Kept until the whole literal is there: should it fail further on,
                    // these bytes are content as they would be in a text read whole.
                    self.state = State::Lit(want, next);
                    return false;
                }
                self.buf.drain(..n);
                self.state = *next;
                true
            }
            State::Name => match self.buf.find('"') {
                Some(end) => {
                    let name: String = self.buf.drain(..end).collect();
                    out.push(ToolEvent::Call {
                        index: self.calls,
                        id: call_id(self.format == ToolFormat::Mistral),
                        name,
                    });
                    self.calls += 1;
                    self.scan = JsonScan::default();
                    self.state = State::Lit(self.layout.mid.to_string(), Box::new(State::Args));
                    true
                }
                None => {
                    self.state = State::Name;
                    false
                }
            },
            State::Args => {
                let (n, done) = self.scan.feed(self.buf.as_bytes());
                let text: String = self.buf.drain(..n).collect();
                if !text.is_empty() {
                    out.push(ToolEvent::Args {
                        index: self.calls - 1,
                        text,
                    });
                }
                if done {
                    self.state = State::Lit(self.layout.tail.to_string(), Box::new(State::Between));
                    true
                } else {
                    self.state = State::Args;
                    false
                }
            }
            State::Between => self.between(),
        }
    }

    /// Bytes of arguments cut short are the call's; text before any call is content.
    fn rest(&mut self, rest: String, out: &mut Vec<ToolEvent>) {
        match self.state {
            State::Args => out.push(ToolEvent::Args {
                index: self.calls - 1,
                text: rest,
            }),
            _ if self.calls == 0 => out.push(ToolEvent::Text(rest)),
            _ => {}
        }
    }

    fn calls(&self) -> usize {
        self.calls
    }
}

impl LayoutParser {
    /// A parser for texts planned with `forced` (the calls from the first byte) or not.
    pub fn new(format: ToolFormat, parallel: bool, forced: bool) -> LayoutParser {
        let layout = format.layout();
        let state = if forced {
            State::Lit(
                format!("{}{}", layout.open, layout.head),
                Box::new(State::Name),
            )
        } else {
            State::Content
        };
        LayoutParser {
            layout,
            format,
            parallel,
            state,
            buf: String::new(),
            calls: 0,
            scan: JsonScan::default(),
        }
    }

    fn content(&mut self, out: &mut Vec<ToolEvent>) -> bool {
        if self.format == ToolFormat::Llama3 {
            // Llama 3.1: a call is the whole answer, from its first byte.
            let Some(first) = self.buf.chars().next() else {
                self.state = State::Content;
                return false;
            };
            self.state = if first == '{' {
                State::Lit(self.layout.head.to_string(), Box::new(State::Name))
            } else {
                State::Raw
            };
            return true;
        }
        // A call's opening and head together (Mistral's special token is not in the text,
        // so its `[` alone would be any bracket).
        let open = format!("{}{}", self.layout.open, self.layout.head);
        if let Some(at) = self.buf.find(&open) {
            if at > 0 {
                out.push(ToolEvent::Text(self.buf[..at].to_string()));
            }
            self.buf.drain(..at + open.len());
            self.state = State::Name;
            return true;
        }
        // Keep back what may be the start of the opening.
        let cut = self.buf.len() - held_back(&self.buf, &open);
        if cut > 0 {
            out.push(ToolEvent::Text(self.buf[..cut].to_string()));
            self.buf.drain(..cut);
        }
        self.state = State::Content;
        false
    }

    fn between(&mut self) -> bool {
        let l = &self.layout;
        if self.parallel && !l.sep.is_empty() {
            let n = l.sep.len().min(self.buf.len());
            if n > 0 && self.buf.as_bytes()[..n] == l.sep.as_bytes()[..n] {
                if n < l.sep.len() {
                    self.state = State::Between;
                    return false;
                }
                self.buf.drain(..n);
                self.state = State::Lit(l.head.to_string(), Box::new(State::Name));
                return true;
            }
        }
        if self.buf.is_empty() {
            self.state = State::Between;
            return false;
        }
        // The close (or anything after the calls) ends them; it is not content.
        self.buf.clear();
        self.state = State::Between;
        false
    }
}

/// Where a JSON value's text stands: how deep, inside a string, after a backslash.
#[derive(Clone, Debug, Default, PartialEq)]
struct JsonScan {
    depth: usize,
    in_string: bool,
    escaped: bool,
    begun: bool,
}

impl JsonScan {
    /// Bytes of `b` up to the value's end (all of them if it goes on), and whether it
    /// ended there. Arguments are objects, so the value ends where its braces close.
    fn feed(&mut self, b: &[u8]) -> (usize, bool) {
        for (i, &c) in b.iter().enumerate() {
            if self.in_string {
                match (self.escaped, c) {
                    (true, _) => self.escaped = false,
                    (false, b'\\') => self.escaped = true,
                    (false, b'"') => self.in_string = false,
                    _ => {}
                }
                continue;
            }
            match c {
                b'"' => self.in_string = true,
                b'{' | b'[' => {
                    self.depth += 1;
                    self.begun = true;
                }
                b'}' | b']' => {
                    self.depth = self.depth.saturating_sub(1);
                    if self.begun && self.depth == 0 {
                        return (i + 1, true);
                    }
                }
                _ => {}
            }
        }
        (b.len(), false)
    }
}

/// A whole answer read back (`ToolParser` over it at once).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Answer {
    /// None when there is none.
    pub reasoning: Option<String>,
    pub content: Option<String>,
    /// Each call's id, function and arguments.
    pub calls: Vec<(String, String, String)>,
}

/// A whole text's reasoning, content and calls.
pub fn parse_all(syntax: Syntax, text: &str) -> Answer {
    let mut p = ToolParser::new(syntax);
    let mut events = p.feed(text);
    events.extend(p.finish());
    let (mut reasoning, mut content) = (String::new(), String::new());
    let mut calls: Vec<(String, String, String)> = Vec::new();
    for e in events {
        match e {
            ToolEvent::Text(t) => content.push_str(&t),
            ToolEvent::Reasoning(t) => reasoning.push_str(&t),
            ToolEvent::Call { id, name, .. } => calls.push((id, name, String::new())),
            ToolEvent::Args { index, text } => {
                if let Some(c) = calls.get_mut(index) {
                    c.2.push_str(&text);
                }
            }
        }
    }
    Answer {
        reasoning: (!reasoning.is_empty()).then_some(reasoning),
        content: (!content.is_empty()).then_some(content),
        calls,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::text::answer::tests::{agree, random_texts};
    use crate::text::tools::tests::tools;
    use serde_json::{json, Value};

    fn syntax(format: ToolFormat, parallel: bool, forced: bool) -> Syntax {
        Syntax {
            format,
            parallel,
            forced,
            tools: true,
        }
    }

    /// A text split at every byte gives the same events, merged, as the whole (call ids
    /// left out).
    fn pieces_agree(
        format: ToolFormat,
        parallel: bool,
        forced: bool,
        text: &str,
    ) -> Vec<ToolEvent> {
        agree(|| LayoutParser::new(format, parallel, forced), text)
    }

    /// Random texts of the formats' pieces, fed whole and a character at a time: no
    /// panic, the same events, in every format, forced or not.
    #[test]
    fn any_text_reads_the_same_in_any_pieces() {
        let parts = [
            "<tool_call>",
            "\n",
            "</tool_call>",
            "<tool",
            "{\"name\": \"",
            "add",
            "\", \"",
            "arguments\": ",
            "parameters\": ",
            "{",
            "}",
            "[",
            "]",
            ", ",
            "\"",
            "\\",
            "é",
            "{\"tool_calls\": [",
            "x",
            " ",
        ];
        for text in random_texts(&parts, 12, 300) {
            for format in [
                ToolFormat::Hermes,
                ToolFormat::Llama3,
                ToolFormat::Mistral,
                ToolFormat::Generic,
            ] {
                for (parallel, forced) in [(true, false), (true, true), (false, true)] {
                    pieces_agree(format, parallel, forced, &text);
                }
            }
        }
    }

    #[test]
    fn hermes_text_and_calls_come_apart_in_any_pieces() {
        let text = "Let me look.<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"a}\\\"b\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\": 1, \"b\": [2]}}\n</tool_call>";
        let e = pieces_agree(ToolFormat::Hermes, true, false, text);
        assert_eq!(
            e,
            [
                ToolEvent::Text("Let me look.".into()),
                ToolEvent::Call {
                    index: 0,
                    id: String::new(),
                    name: "get_weather".into()
                },
                ToolEvent::Args {
                    index: 0,
                    text: "{\"city\": \"a}\\\"b\"}".into()
                },
                ToolEvent::Call {
                    index: 1,
                    id: String::new(),
                    name: "add".into()
                },
                ToolEvent::Args {
                    index: 1,
                    text: "{\"a\": 1, \"b\": [2]}".into()
                },
            ]
        );
        // Text with a tag's beginning that is no tag stays text.
        let e = pieces_agree(ToolFormat::Hermes, true, false, "a < b and <tool tip>");
        assert_eq!(e, [ToolEvent::Text("a < b and <tool tip>".into())]);
    }

    #[test]
    fn llama_and_generic_calls_parse() {
        let e = pieces_agree(
            ToolFormat::Llama3,
            false,
            false,
            "{\"name\": \"add\", \"parameters\": {\"a\": 1, \"b\": 2}}",
        );
        assert!(
            matches!(&e[..], [ToolEvent::Call { name, .. }, ToolEvent::Args { text, .. }] if name == "add" && text == "{\"a\": 1, \"b\": 2}"),
            "{e:?}"
        );
        let e = pieces_agree(ToolFormat::Llama3, false, false, "It is 3.");
        assert_eq!(e, [ToolEvent::Text("It is 3.".into())]);
        let e = pieces_agree(ToolFormat::Generic, true, true, "{\"tool_calls\": [{\"name\": \"add\", \"arguments\": {\"a\": 1}}, {\"name\": \"get_weather\", \"arguments\": {}}]}");
        let names: Vec<&str> = e
            .iter()
            .filter_map(|e| match e {
                ToolEvent::Call { name, .. } => Some(name.as_str()),
                _ => None,
            })
            .collect();
        assert_eq!(names, ["add", "get_weather"]);
        let Answer { content, calls, .. } = parse_all(
            syntax(ToolFormat::Generic, true, true),
            "{\"tool_calls\": [{\"name\": \"add\", \"arguments\": {\"a\": 1}}]}",
        );
        assert_eq!(content, None);
        assert_eq!(
            (calls[0].1.as_str(), calls[0].2.as_str()),
            ("add", "{\"a\": 1}")
        );
        assert!(calls[0].0.starts_with("call_") && calls[0].0.len() == 29);
        // Mistral: the text after its special token; ids of 9 letters or digits, as its
        // template requires of the calls it is given back.
        let text = "Sure. [{\"name\": \"add\", \"arguments\": {\"a\": [1]}}, {\"name\": \"add\", \"arguments\": {}}]";
        pieces_agree(ToolFormat::Mistral, true, false, text);
        let Answer { content, calls, .. } =
            parse_all(syntax(ToolFormat::Mistral, true, false), text);
        assert_eq!(content.as_deref(), Some("Sure. "));
        assert_eq!(calls.len(), 2);
        assert_eq!(calls[0].2, "{\"a\": [1]}");
        assert!(calls
            .iter()
            .all(|c| c.0.len() == 9 && c.0.bytes().all(|b| b.is_ascii_alphanumeric())));
    }

    /// Sampled from random logits over a byte vocabulary, every forced call (Hermes and the
    /// generic format, one or several, any function or a named one) and every lazy Hermes
    /// text that ends is read back into calls of offered functions whose arguments parse
    /// and hold their schema's required fields.
    #[test]
    fn sampled_calls_parse_and_match_their_schemas() {
        use crate::text::grammar::{Grammars, TokenKind, TokenTexts};
        use crate::text::sampler::{OutputFormat, Sampler, SamplingParams};
        use crate::util::rng::Rng;
        let mut tokens: Vec<Vec<u8>> = (0x20u8..0x7f).map(|b| vec![b]).collect();
        tokens.extend([
            b"\n".to_vec(),
            b"<tool_call>".to_vec(),
            b"{\"".to_vec(),
            b"\": ".to_vec(),
        ]);
        let mut v: Vec<(&[u8], TokenKind)> =
            tokens.iter().map(|t| (&t[..], TokenKind::Text)).collect();
        // Mistral's special token (the text leaves it out), then the end.
        let tc = v.len() as u32;
        v.push((b"", TokenKind::Silent));
        v.push((b"", TokenKind::End));
        let vocab = TokenTexts::of(&v);
        let end = (v.len() - 1) as u32;
        let grammars = Grammars::new(&vocab, |id| format!("<s{id}>")).unwrap();
        let hermes = "{% if tools %}<tool_call>{% endif %}";
        let mistral = "{% if tools %}[AVAILABLE_TOOLS]{% endif %}[TOOL_CALLS]";
        let mut rng = Rng::new(9);
        let (mut calls_read, mut lazy_calls) = (0, 0);
        for (choice, parallel, template, lazy) in [
            (json!("required"), true, hermes, false),
            (
                json!({"type": "function", "function": {"name": "add"}}),
                false,
                hermes,
                false,
            ),
            (json!("required"), true, "no template tools", false),
            (json!("auto"), true, hermes, true),
            (json!("required"), true, mistral, false),
            (json!("auto"), true, mistral, true),
        ] {
            let t = tools(choice, Some(parallel));
            let special = |n: &str| (n == "[TOOL_CALLS]").then_some(tc);
            let p = crate::text::tools::plan(&t, template, &special, &mut Vec::new())
                .unwrap()
                .unwrap();
            let g = p.grammar.as_ref().unwrap();
            let c = match p.trigger {
                Some(tr) => grammars.compile_lazy(g, tr),
                None => grammars.compile(g),
            }
            .unwrap_or_else(|e| panic!("{e}\n{g:?}"));
            let format = OutputFormat::Constrained(Box::new(c));
            for seed in 0..40u64 {
                let mut s = Sampler::new(SamplingParams {
                    temperature: 1.0,
                    seed,
                    ..Default::default()
                })
                .constrained(&[], &format);
                let mut text = Vec::new();
                let mut ended = false;
                for step in 0..400 {
                    let mut logits: Vec<f32> = (0..v.len())
                        .map(|_| rng.below(300) as f32 / 100.0)
                        .collect();
                    // Lazy: nudge towards starting a call after a few tokens.
                    if lazy && step == 3 {
                        let start = if template == mistral {
                            tc
                        } else {
                            tokens.len() as u32 - 3
                        };
                        logits[start as usize] = 100.0;
                    }
                    let tok = s.sample(&logits);
                    if tok == tc {
                        continue;
                    }
                    if tok == end {
                        ended = true;
                        break;
                    }
                    text.extend_from_slice(&tokens[tok as usize]);
                }
                if !ended {
                    continue;
                }
                let text = String::from_utf8(text).unwrap();
                let calls = parse_all(syntax(p.format, p.parallel, t.forced()), &text).calls;
                // Auto: a text may end before it calls anything.
                assert!(
                    !calls.is_empty()
                        || (lazy && !text.contains("<tool_call>") && !text.contains("[{\"name")),
                    "{text}"
                );
                assert!(parallel || calls.len() == 1, "{text}");
                for (_, name, args) in calls {
                    let a: Value = serde_json::from_str(&args)
                        .unwrap_or_else(|e| panic!("{e}: {args} in {text}"));
                    let tool = t
                        .list
                        .iter()
                        .find(|x| x.name == name)
                        .expect("an offered function");
                    for r in tool.parameters["required"].as_array().unwrap() {
                        assert!(a.get(r.as_str().unwrap()).is_some(), "{name} {args}");
                    }
                    calls_read += 1;
                    lazy_calls += usize::from(lazy);
                }
            }
        }
        assert!(
            calls_read > 40 && lazy_calls > 5,
            "{calls_read} calls read, {lazy_calls} lazily"
        );
    }
}
