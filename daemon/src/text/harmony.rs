//! OpenAI's harmony format (gpt-oss): an answer is a run of messages, each a header and a
//! body, `<|channel|>analysis<|message|>...<|end|><|start|>assistant<|channel|>final
//! <|message|>...<|return|>`. The channel says whose the body is: `analysis` is the model's
//! reasoning, `final` the answer, `commentary` either a preamble for the user or, with a
//! recipient (`to=functions.NAME`, before or after the channel), a call whose body is its
//! arguments, ended by `<|call|>`.
//!
//! `<|return|>` and `<|call|>` end generation; `<|end|>` ends a message, not the turn
//! (llama.cpp takes it out of a harmony vocabulary's end tokens the same way). A chat
//! request on such a model has the structural tokens written into its text (`markers`), so
//! this parser can read the messages back: reasoning for `reasoning_content`, the final
//! channel for `content`, calls for `tool_calls`.

use super::answer::{call_id, held_back, Parse, ToolEvent};

pub const START: &str = "<|start|>";
pub const CHANNEL: &str = "<|channel|>";
pub const MESSAGE: &str = "<|message|>";
pub const CONSTRAIN: &str = "<|constrain|>";
pub const END: &str = "<|end|>";
pub const RETURN: &str = "<|return|>";
pub const CALL: &str = "<|call|>";
/// What opens the answer's final message (with or without a content type, as gpt-oss
/// writes a structured answer): a response format holds the text after it.
pub const FINAL: &[&str] = &[
    "<|channel|>final<|message|>",
    "<|channel|>final <|constrain|>json<|message|>",
];

/// A vocabulary's harmony tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Harmony {
    pub start: u32,
    pub channel: u32,
    pub message: u32,
    pub constrain: u32,
    pub end: u32,
    pub ret: u32,
    pub call: u32,
}

impl Harmony {
    /// The harmony tokens of a vocabulary (`id` looks a token up by its text); None unless
    /// it has every one.
    pub fn of(id: impl Fn(&str) -> Option<u32>) -> Option<Harmony> {
        Some(Harmony {
            start: id(START)?,
            channel: id(CHANNEL)?,
            message: id(MESSAGE)?,
            constrain: id(CONSTRAIN)?,
            end: id(END)?,
            ret: id(RETURN)?,
            call: id(CALL)?,
        })
    }

    /// The text a structural token is written as in a chat answer (None: not one; the end
    /// tokens `<|return|>` and `<|call|>` never reach the text).
    pub fn marker(&self, t: u32) -> Option<&'static str> {
        [
            (self.start, START),
            (self.channel, CHANNEL),
            (self.message, MESSAGE),
            (self.constrain, CONSTRAIN),
            (self.end, END),
        ]
        .into_iter()
        .find_map(|(id, s)| (id == t).then_some(s))
    }
}

impl Parse for HarmonyParser {
    fn buf(&mut self) -> &mut String {
        &mut self.buf
    }

    /// One step over the buffer; false when it needs more text.
    fn step(&mut self, out: &mut Vec<ToolEvent>) -> bool {
        match self.state.clone() {
            State::Raw => {
                let t = std::mem::take(&mut self.buf);
                self.emit(Body::Content, t, out);
                false
            }
            State::Header => {
                // A header is judged by itself, whether the text came whole or in pieces:
                // the bytes up to `<|message|>`, or all there are so far.
                let at = self.buf.find(MESSAGE);
                if !could_be_header(&self.buf[..at.unwrap_or(self.buf.len())], at.is_some()) {
                    self.state = State::Raw;
                    return true;
                }
                let Some(at) = at else { return false };
                let header: String = self.buf.drain(..at + MESSAGE.len()).collect();
                let body = self.body_of(&header[..at]);
                if let Body::Call(index) = body {
                    let name = recipient(&header[..at])
                        .map(|r| r.strip_prefix("functions.").unwrap_or(r).to_string())
                        .unwrap_or_default();
                    out.push(ToolEvent::Call {
                        index,
                        id: call_id(false),
                        name,
                    });
                }
                self.state = State::Body(body);
                true
            }
            State::Body(b) => {
                if let Some(at) = self.buf.find(END) {
                    let text: String = self.buf.drain(..at).collect();
                    self.buf.drain(..END.len());
                    self.emit(b, text, out);
                    self.state = State::Header;
                    return true;
                }
                // Keep back what may be the start of `<|end|>`.
                let keep = held_back(&self.buf, END);
                let text: String = self.buf.drain(..self.buf.len() - keep).collect();
                self.emit(b, text, out);
                false
            }
        }
    }

    /// A body's last bytes (a header cut short is dropped).
    fn rest(&mut self, rest: String, out: &mut Vec<ToolEvent>) {
        match &self.state {
            State::Body(b) => self.emit(b.clone(), rest, out),
            State::Raw => self.emit(Body::Content, rest, out),
            State::Header => {}
        }
    }

    fn calls(&self) -> usize {
        self.calls
    }
}

/// Whose a message's body is.
#[derive(Clone, Debug, PartialEq)]
enum Body {
    Reasoning,
    Content,
    /// Call `index`'s arguments.
    Call(usize),
}

#[derive(Clone, Debug, PartialEq)]
enum State {
    /// A header, up to `<|message|>`.
    Header,
    Body(Body),
    /// A text that is not harmony (a model that wrote no header): all content.
    Raw,
}

/// The longest header read before the text is taken as not harmony.
const HEADER_MAX: usize = 512;

/// Reads a harmony answer's messages back, piece by piece.
pub struct HarmonyParser {
    /// The request offered tools: a message with a recipient is a call (else reasoning).
    tools: bool,
    state: State,
    buf: String,
    calls: usize,
}

impl HarmonyParser {
    pub fn new(tools: bool) -> HarmonyParser {
        HarmonyParser {
            tools,
            state: State::Header,
            buf: String::new(),
            calls: 0,
        }
    }

    fn emit(&self, b: Body, text: String, out: &mut Vec<ToolEvent>) {
        if text.is_empty() {
            return;
        }
        out.push(match b {
            Body::Reasoning => ToolEvent::Reasoning(text),
            Body::Content => ToolEvent::Text(text),
            Body::Call(index) => ToolEvent::Args { index, text },
        });
    }

    /// Whose the body after `header` is (a call is counted here).
    fn body_of(&mut self, header: &str) -> Body {
        let channel = header
            .rfind(CHANNEL)
            .map(|at| &header[at + CHANNEL.len()..])
            .and_then(|c| c.split(|ch: char| ch.is_whitespace() || ch == '<').next())
            .unwrap_or("");
        match (channel, recipient(header)) {
            (_, Some(_)) if self.tools => {
                self.calls += 1;
                Body::Call(self.calls - 1)
            }
            (_, Some(_)) | ("analysis", None) => Body::Reasoning,
            _ => Body::Content,
        }
    }
}

/// A header's recipient (`to=functions.get_weather`), wherever it stands.
fn recipient(header: &str) -> Option<&str> {
    let at = header.find("to=")?;
    let r = header[at + 3..]
        .split(|ch: char| ch.is_whitespace() || ch == '<')
        .next()
        .unwrap_or("");
    (!r.is_empty()).then_some(r)
}

/// Whether `head` is a header (`whole`: it ends at `<|message|>`) or can still become one:
/// it begins with a marker or a recipient and is not too long. Text that begins otherwise
/// is not harmony.
fn could_be_header(head: &str, whole: bool) -> bool {
    if head.len() > HEADER_MAX {
        return false;
    }
    let starts = [START, CHANNEL, " to=", "to=", END];
    starts
        .iter()
        .any(|s| head.starts_with(s) || (!whole && s.starts_with(head)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::text::answer::tests::{agree, random_texts};

    fn agree_on(tools: bool, text: &str) -> Vec<ToolEvent> {
        agree(|| HarmonyParser::new(tools), text)
    }

    #[test]
    fn channels_become_reasoning_content_and_calls() {
        let t = "<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant<|channel|>final<|message|>It is <sunny>.";
        assert_eq!(
            agree_on(false, t),
            vec![
                ToolEvent::Reasoning("Need weather.".into()),
                ToolEvent::Text("It is <sunny>.".into())
            ]
        );
        // A call, the recipient after the channel (as gpt-oss writes it) or before it (as
        // the template renders earlier calls).
        for t in [
            "<|channel|>analysis<|message|>Call it.<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{\"city\": \"Oslo\"}",
            "<|channel|>analysis<|message|>Call it.<|end|><|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{\"city\": \"Oslo\"}",
        ] {
            let e = agree_on(true, t);
            assert_eq!(
                e,
                vec![
                    ToolEvent::Reasoning("Call it.".into()),
                    ToolEvent::Call {
                        index: 0,
                        id: String::new(),
                        name: "get_weather".into()
                    },
                    ToolEvent::Args {
                        index: 0,
                        text: "{\"city\": \"Oslo\"}".into()
                    },
                ],
                "{t}"
            );
            // Without tools offered, a recipient's message is the model's own business.
            assert!(agree_on(false, t)
                .iter()
                .all(|e| matches!(e, ToolEvent::Reasoning(_))));
        }
        // A commentary preamble is for the user; text that is not harmony is content.
        assert_eq!(
            agree_on(true, "<|channel|>commentary<|message|>Looking it up."),
            vec![ToolEvent::Text("Looking it up.".into())]
        );
        assert_eq!(
            agree_on(true, "plain <|end|> text"),
            vec![ToolEvent::Text("plain <|end|> text".into())]
        );
        // A header cut off by max_tokens leaves nothing.
        assert_eq!(agree_on(true, "<|channel|>anal"), vec![]);
    }

    #[test]
    fn markers_are_the_structural_tokens_only() {
        let h = Harmony::of(|s| {
            [START, CHANNEL, MESSAGE, CONSTRAIN, END, RETURN, CALL]
                .iter()
                .position(|m| *m == s)
                .map(|i| i as u32 + 10)
        })
        .expect("all seven");
        assert_eq!(h.marker(11), Some(CHANNEL));
        assert_eq!(h.marker(h.ret), None);
        assert_eq!(h.marker(h.call), None);
        assert!(Harmony::of(|s| (s != CALL).then_some(1)).is_none());
    }

    /// Random texts of markers, parts of markers, recipients, words and multi-byte
    /// characters, fed whole and a character at a time: no panic, the same events.
    #[test]
    fn any_text_reads_the_same_in_any_pieces() {
        let parts = [
            START,
            CHANNEL,
            MESSAGE,
            CONSTRAIN,
            END,
            "<|",
            "<|en",
            "<|end",
            "|>",
            "analysis",
            "final",
            "commentary",
            " to=functions.f",
            " to=",
            "to=",
            "assistant",
            " json",
            "{\"a\": 1}",
            "é",
            "日本",
            " ",
            "\n",
            "x",
        ];
        for text in random_texts(&parts, 11, 400) {
            for tools in [false, true] {
                agree_on(tools, &text);
            }
        }
    }
}
