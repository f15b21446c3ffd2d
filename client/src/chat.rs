//! `sluice chat`: an interactive chat that behaves like a REPL. A line editor (rustyline)
//! with history kept across sessions; Ctrl-C stops the reply (the request is dropped, so
//! the daemon evicts the sequence) and keeps the conversation; slash commands that never
//! reach the model; multi-line input; and a conversation trimmed from its oldest turns to
//! fit the context, saying so.

use crate::{finish_name, generate_until, Sampling, Until};
use anyhow::{bail, Context as _, Result};
use rustyline::completion::Completer;
use rustyline::error::ReadlineError;
use rustyline::highlight::Highlighter;
use rustyline::hint::Hinter;
use rustyline::history::FileHistory;
use rustyline::validate::{ValidationContext, ValidationResult, Validator};
use rustyline::{Config, Editor, Helper};
use sluice_client::{pb, Client};
use std::io::Write;
use std::path::{Path, PathBuf};
use tokio::signal::unix::{signal, Signal, SignalKind};

const HELP: &str = "\
Commands (they never reach the model):
  /help                this list
  /clear               forget the conversation (the system message stays)
  /system TEXT         set the system message; /system alone shows it, /system - removes it
  /set NAME VALUE      set a sampling parameter: temperature, top_p, top_k, min_p, seed,
                       max_tokens, repetition_penalty, presence_penalty, frequency_penalty
                       (VALUE model: back to the model default)
  /set                 show the parameters
  /show                the model, its context and what the conversation holds
  /history [json]      the conversation's messages, as the next request sends them
  /tool RESULT         answer the model's next unanswered tool call (--tools); once all
                       are answered, the results go to the model
  /exit, /quit, /bye   leave (so does Ctrl-D on an empty line)
Input:
  Ctrl-C               stop the reply (the conversation keeps what was said); on the
                       prompt, clear the line
  \"\"\" ... \"\"\"          a message of several lines; so does a line ending in \\
  Up, Down, Ctrl-R     previous lines, also from earlier sessions
A line that begins with // is sent with one / removed.";

/// Multi-line input: a line ending in `\`, or a `"""` block not yet closed, continues.
struct Lines;

impl Completer for Lines {
    type Candidate = String;
}
impl Hinter for Lines {
    type Hint = String;
}
impl Highlighter for Lines {}
impl Helper for Lines {}

impl Validator for Lines {
    fn validate(&self, ctx: &mut ValidationContext) -> rustyline::Result<ValidationResult> {
        Ok(if continues(ctx.input()) {
            ValidationResult::Incomplete
        } else {
            ValidationResult::Valid(None)
        })
    }
}

/// Whether the input so far is an unfinished multi-line message.
fn continues(input: &str) -> bool {
    let t = input.trim_start();
    if let Some(rest) = t.strip_prefix("\"\"\"") {
        return !rest.trim_end().ends_with("\"\"\"");
    }
    input.ends_with('\\')
}

/// The message a (possibly multi-line) input stands for.
fn message_of(input: &str) -> String {
    let t = input.trim();
    if let Some(rest) = t.strip_prefix("\"\"\"") {
        let rest = rest.strip_suffix("\"\"\"").unwrap_or(rest);
        return rest.trim_matches('\n').to_string();
    }
    input.replace("\\\n", "\n")
}

/// Where the line history lives: `--history`, else $XDG_STATE_HOME/sluice/chat_history,
/// else ~/.local/state/sluice/chat_history. None: no history file.
fn history_path(flag: Option<PathBuf>) -> Option<PathBuf> {
    if flag.is_some() {
        return flag;
    }
    let state = std::env::var_os("XDG_STATE_HOME")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".local/state")))?;
    Some(state.join("sluice").join("chat_history"))
}

pub struct ChatArgs {
    pub model: String,
    pub system: Option<String>,
    pub sampling: Sampling,
    pub history: Option<PathBuf>,
    pub no_history: bool,
    /// --tools: functions the model may call, and --tool-choice.
    pub tools: Vec<pb::Tool>,
    pub tool_choice: String,
}

/// `--tools FILE`: OpenAI's tools (a JSON list of `{"type": "function", "function":
/// {...}}`) as the proto's.
pub fn read_tools(path: &Path) -> Result<Vec<pb::Tool>> {
    let text = std::fs::read_to_string(path).with_context(|| format!("read {}", path.display()))?;
    let list: Vec<serde_json::Value> = serde_json::from_str(&text)
        .with_context(|| format!("{} is not a JSON list of tools", path.display()))?;
    list.iter()
        .enumerate()
        .map(|(i, t)| {
            let f = t.get("function").unwrap_or(t);
            let name = f
                .get("name")
                .and_then(|n| n.as_str())
                .with_context(|| format!("{}: tools[{i}] has no function.name", path.display()))?;
            Ok(pb::Tool {
                name: name.to_string(),
                description: f
                    .get("description")
                    .and_then(|d| d.as_str())
                    .unwrap_or_default()
                    .to_string(),
                parameters: f
                    .get("parameters")
                    .map(|p| p.to_string())
                    .unwrap_or_default(),
            })
        })
        .collect()
}

struct Chat {
    client: Client,
    model: String,
    /// The served model's name and context (positions per sequence).
    name: String,
    context: usize,
    system: Option<String>,
    s: Sampling,
    /// The conversation without the system message: user and assistant turns.
    turns: Vec<pb::ChatMessage>,
    tools: Vec<pb::Tool>,
    tool_choice: String,
}

/// A user message.
pub(crate) fn user(content: String) -> pb::ChatMessage {
    msg("user", content)
}

fn msg(role: &str, content: String) -> pb::ChatMessage {
    pb::ChatMessage {
        role: role.into(),
        content,
        ..Default::default()
    }
}

fn grpc(st: tonic::Status) -> anyhow::Error {
    anyhow::anyhow!("{:?}: {}", st.code(), st.message())
}

impl Chat {
    fn new(client: Client, info: pb::ModelInfo, args: ChatArgs) -> Chat {
        Chat {
            client,
            model: info.name.clone(),
            name: info.name,
            context: info.context_length as usize,
            system: args.system,
            s: args.sampling,
            turns: Vec::new(),
            tools: args.tools,
            tool_choice: args.tool_choice,
        }
    }

    fn messages(&self) -> Vec<pb::ChatMessage> {
        let mut m = Vec::with_capacity(self.turns.len() + 1);
        if let Some(sys) = &self.system {
            m.push(msg("system", sys.clone()));
        }
        m.extend(self.turns.iter().cloned());
        m
    }

    /// Tokens the reply is kept room for: --max-tokens (at most half the context), else a
    /// quarter of the context (at most 512).
    fn reserve(&self) -> usize {
        match self.s.max_tokens {
            0 => (self.context / 4).min(512),
            n => (n as usize).min(self.context / 2),
        }
    }

    /// Prompt tokens of the conversation as the next request sends it.
    async fn prompt_tokens(&mut self) -> Result<usize> {
        let r = self
            .client
            .tokenize(pb::TokenizeRequest {
                model: self.model.clone(),
                messages: self.messages(),
                ..Default::default()
            })
            .await
            .map_err(grpc)?;
        Ok(r.into_inner().token_ids.len())
    }

    /// Drops the oldest turns (a user message with the reply after it) until the
    /// conversation leaves room for the reply in the context; the newest message stays.
    /// Returns the prompt tokens.
    async fn fit(&mut self) -> Result<usize> {
        let limit = self.context.saturating_sub(self.reserve());
        let mut dropped = 0;
        loop {
            let n = self.prompt_tokens().await?;
            if n <= limit {
                if dropped > 0 {
                    eprintln!(
                        "[dropped the {dropped} oldest messages to fit the context of {} tokens ({} kept for the reply)]",
                        self.context,
                        self.reserve()
                    );
                }
                return Ok(n);
            }
            if self.turns.len() <= 1 {
                let e = format!(
                    "the message has {n} prompt tokens; the context holds {} with {} kept for the reply: shorten it{}",
                    self.context,
                    self.reserve(),
                    if dropped > 0 { " (the earlier turns were dropped already)" } else { "" }
                );
                if dropped > 0 {
                    eprintln!("[dropped the {dropped} oldest messages]");
                }
                bail!(e);
            }
            // A user message and the assistant's reply to it, or the one message left
            // before the newest.
            let k = if self.turns.len() > 2 && self.turns[1].role == "assistant" {
                2
            } else {
                1
            };
            self.turns.drain(..k);
            dropped += k;
        }
    }

    /// Sends the conversation and streams the reply; Ctrl-C stops it.
    async fn reply(&mut self, sigint: &mut Signal) -> Result<()> {
        let prompt_tokens = match self.fit().await {
            Ok(n) => n,
            Err(e) => {
                self.turns.pop();
                return Err(e);
            }
        };
        let mut req = self.s.request();
        // A reply as long as --max-tokens where the context has room, else to its end.
        if req.max_tokens > 0 {
            req.max_tokens = req
                .max_tokens
                .min(self.context.saturating_sub(prompt_tokens) as u32);
        }
        req.model = self.model.clone();
        req.messages = self.messages();
        if !self.tools.is_empty() {
            req.tools = self.tools.clone();
            // Results just came back: the model answers with them rather than being made
            // to call again (a forced choice would loop).
            let answering = self.turns.last().is_some_and(|m| m.role == "tool");
            req.tool_choice = match self.tool_choice.as_str() {
                "auto" | "none" | "" => self.tool_choice.clone(),
                _ if answering => "none".into(),
                forced => forced.into(),
            };
        }
        let out = generate_until(
            &mut self.client,
            req,
            |t| {
                let mut o = std::io::stdout().lock();
                let _ = o.write_all(t.as_bytes());
                let _ = o.flush();
            },
            sigint,
        )
        .await;
        println!();
        match out {
            Ok(Until::Done(o)) => {
                let f = finish_name(o.done.finish_reason);
                if !matches!(f, "stop" | "stop_string" | "tool_calls") {
                    eprintln!("[{f}: the reply was cut off]");
                }
                for c in &o.done.tool_calls {
                    println!("-> {}({})  [{}]", c.name, c.arguments, c.id);
                }
                if !o.done.tool_calls.is_empty() {
                    eprintln!("[answer each call with /tool RESULT]");
                }
                let mut m = msg("assistant", o.text);
                m.tool_calls = o.done.tool_calls;
                // What led to the calls, which templates render before them (gpt-oss's).
                m.reasoning = o.reasoning;
                self.turns.push(m);
                Ok(())
            }
            Ok(Until::Stopped(text)) => {
                eprintln!("[stopped]");
                // What was said stays in the conversation; a reply stopped before its first
                // word takes its question with it.
                if text.is_empty() {
                    self.turns.pop();
                } else {
                    self.turns.push(msg("assistant", text));
                }
                Ok(())
            }
            Err(st) => {
                self.turns.pop();
                Err(grpc(st))
            }
        }
    }

    /// The first call of the last assistant message no tool message answers yet.
    fn pending_call(&self) -> Option<String> {
        let at = self.turns.iter().rposition(|m| m.role == "assistant")?;
        let answered: Vec<&str> = self.turns[at + 1..]
            .iter()
            .filter(|m| m.role == "tool")
            .map(|m| m.tool_call_id.as_str())
            .collect();
        self.turns[at]
            .tool_calls
            .iter()
            .find(|c| !answered.contains(&c.id.as_str()))
            .map(|c| c.id.clone())
    }

    /// `/tool RESULT`: the result goes into the conversation, and once every call has one,
    /// to the model.
    async fn tool_result(&mut self, result: &str, sigint: &mut Signal) {
        match self.answer(result) {
            Ok(true) => {
                if let Err(e) = self.reply(sigint).await {
                    eprintln!("error: {e:#}");
                }
            }
            Ok(false) => eprintln!("[more calls wait for a result]"),
            Err(e) => eprintln!("error: {e:#}"),
        }
    }

    /// The result of the next unanswered call; true once none is left.
    fn answer(&mut self, result: &str) -> Result<bool> {
        let id = self
            .pending_call()
            .context("/tool: no call of the model is waiting for a result")?;
        let mut m = msg("tool", result.to_string());
        m.tool_call_id = id;
        self.turns.push(m);
        Ok(self.pending_call().is_none())
    }

    fn show(&self) {
        let words: usize = self
            .turns
            .iter()
            .map(|m| m.content.split_whitespace().count())
            .sum();
        println!(
            "model {} (context {} tokens, {} kept for the reply); {} messages, {} words{}",
            self.name,
            self.context,
            self.reserve(),
            self.turns.len(),
            words,
            match &self.system {
                Some(s) => format!("; system: {s:?}"),
                None => String::new(),
            }
        );
    }

    /// A slash command; false: leave.
    fn command(&mut self, line: &str) -> Result<bool> {
        let (cmd, arg) = match line.split_once(char::is_whitespace) {
            Some((c, a)) => (c, a.trim()),
            None => (line, ""),
        };
        match cmd {
            "/exit" | "/quit" | "/bye" => return Ok(false),
            "/help" | "/?" => println!("{HELP}"),
            "/clear" => {
                let n = self.turns.len();
                self.turns.clear();
                println!("[forgot {n} messages]");
            }
            "/system" => match arg {
                "" => match &self.system {
                    Some(s) => println!("{s}"),
                    None => println!("[no system message]"),
                },
                "-" => {
                    self.system = None;
                    println!("[system message removed]");
                }
                text => {
                    self.system = Some(text.to_string());
                    println!("[system message set]");
                }
            },
            "/set" => {
                if arg.is_empty() {
                    println!("{}", self.s.describe());
                } else {
                    let (name, value) = arg
                        .split_once(char::is_whitespace)
                        .map(|(n, v)| (n, v.trim()))
                        .with_context(|| format!("/set {arg}: give a value (/set {arg} VALUE)"))?;
                    self.s.set(name, value)?;
                    println!("[{name} = {value}]");
                }
            }
            "/show" => self.show(),
            "/history" => {
                let msgs = self.messages();
                if arg == "json" {
                    let v: Vec<_> = msgs.iter().map(sluice_proto::openai_message).collect();
                    println!("{}", serde_json::Value::Array(v));
                } else {
                    for m in msgs {
                        println!("{}: {}", m.role, m.content);
                    }
                }
            }
            other => bail!(
                "unknown command {other}; /help lists them (start a message with // to send a /)"
            ),
        }
        Ok(true)
    }
}

pub async fn run(client: Client, args: ChatArgs) -> Result<()> {
    let mut client = client;
    let models = client
        .list_models(pb::ListModelsRequest::default())
        .await
        .map_err(grpc)?
        .into_inner()
        .models;
    let info = if args.model.is_empty() {
        // The daemon's default: the loaded one where one is, else the only one.
        let loaded: Vec<_> = models.iter().filter(|m| m.loaded).collect();
        match (loaded.as_slice(), models.as_slice()) {
            ([m], _) => (*m).clone(),
            (_, [m]) => m.clone(),
            _ => bail!(
                "this daemon serves {} models: name one with --model ({})",
                models.len(),
                models
                    .iter()
                    .map(|m| m.name.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        }
    } else {
        models
            .iter()
            .find(|m| m.name == args.model)
            .cloned()
            .with_context(|| {
                format!(
                    "the daemon has no model {:?} (`sluice models` lists them)",
                    args.model
                )
            })?
    };
    let (history, no_history) = (args.history.clone(), args.no_history);
    let mut chat = Chat::new(client, info, args);
    let config = Config::builder()
        .auto_add_history(false)
        .max_history_size(2000)
        .map_err(|e| anyhow::anyhow!("line editor: {e}"))?
        .history_ignore_dups(true)
        .map_err(|e| anyhow::anyhow!("line editor: {e}"))?
        .build();
    let mut ed: Editor<Lines, FileHistory> =
        Editor::with_config(config).map_err(|e| anyhow::anyhow!("line editor: {e}"))?;
    ed.set_helper(Some(Lines));
    let hist = if no_history {
        None
    } else {
        history_path(history)
    };
    if let Some(p) = &hist {
        load_history(&mut ed, p);
    }
    // From here on SIGINT is ours: Ctrl-C stops a reply instead of ending the session.
    let mut sigint = signal(SignalKind::interrupt()).context("install the Ctrl-C handler")?;
    eprintln!(
        "Chatting with {} (context {} tokens). /help for commands; Ctrl-C stops a reply, Ctrl-D or /exit leaves.",
        chat.name, chat.context
    );
    loop {
        let line = tokio::task::block_in_place(|| ed.readline(">>> "));
        // A Ctrl-C that reached the process outside the editor (between turns) must not
        // stop the next reply.
        drain(&mut sigint).await;
        let line = match line {
            Ok(l) => l,
            Err(ReadlineError::Interrupted) => continue,
            Err(ReadlineError::Eof) => {
                // Leave the terminal on a fresh line.
                eprintln!();
                break;
            }
            Err(e) => bail!("read a line: {e}"),
        };
        if line.trim().is_empty() {
            continue;
        }
        let _ = ed.add_history_entry(line.as_str());
        if let Some(p) = &hist {
            if let Err(e) = ed.append_history(p) {
                eprintln!("[history not saved to {}: {e}]", p.display());
            }
        }
        let text = line.trim_start();
        if let Some(result) = text.strip_prefix("/tool ") {
            chat.tool_result(result.trim(), &mut sigint).await;
            continue;
        }
        if text.starts_with('/') && !text.starts_with("//") {
            match chat.command(text.trim_end()) {
                Ok(true) => continue,
                Ok(false) => break,
                Err(e) => {
                    eprintln!("error: {e:#}");
                    continue;
                }
            }
        }
        let content = match text.strip_prefix("//") {
            Some(rest) => format!("/{rest}"),
            None => message_of(&line),
        };
        chat.turns.push(msg("user", content));
        if let Err(e) = chat.reply(&mut sigint).await {
            eprintln!("error: {e:#}");
        }
    }
    Ok(())
}

/// Reads the history file; a missing one is a first session, an unreadable one is said.
fn load_history(ed: &mut Editor<Lines, FileHistory>, p: &Path) {
    if let Some(dir) = p.parent() {
        let _ = std::fs::create_dir_all(dir);
    }
    match ed.load_history(p) {
        Ok(()) => {}
        Err(ReadlineError::Io(e)) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => eprintln!("[history {} not read: {e}]", p.display()),
    }
}

/// Takes a SIGINT that is already pending, if any, without waiting.
async fn drain(sigint: &mut Signal) {
    tokio::select! {
        biased;
        _ = sigint.recv() => {}
        () = std::future::ready(()) => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `/help` names every setting `/set` takes (the list is `SamplingArgs::NAMES`).
    #[test]
    fn help_names_every_sampling_setting() {
        let names = sluice_proto::sampling::SamplingArgs::NAMES;
        for name in names.iter().chain(&["max_tokens"]) {
            assert!(HELP.contains(name), "/help does not name {name}");
        }
    }

    #[test]
    fn multi_line_input() {
        assert!(continues("\"\"\"first"));
        assert!(continues("\"\"\"first\nsecond"));
        assert!(!continues("\"\"\"first\nsecond\"\"\""));
        assert!(continues("one\\"));
        assert!(!continues("one"));
        assert_eq!(message_of("\"\"\"\nfirst\nsecond\n\"\"\""), "first\nsecond");
        assert_eq!(message_of("\"\"\"one line\"\"\""), "one line");
        assert_eq!(message_of("one\\\ntwo"), "one\ntwo");
    }
}
