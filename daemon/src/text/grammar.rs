//! Constraints on the generated text, on llguidance (guidance-ai's engine, the one
//! llama.cpp, vLLM and SGLang use): JSON mode, JSON schemas, regular expressions and Lark
//! grammars, each compiled against the model's vocabulary into a matcher that gives the
//! tokens able to continue the text at each step.
//!
//! - `Grammar` is what a request asks for, as it came (HTTP, gRPC or a flag).
//! - `Grammars` is one model's vocabulary as llguidance sees it (its token trie and the
//!   lexer slices), built once on first use and shared by every request
//!   (`Tokenizer::grammars`).
//! - `Constraint` is a grammar compiled for that vocabulary: a request's sequences each
//!   start from a clone of it (`Sampler::constrained`).
//!
//! End tokens are not llguidance's business here: a model may have several (eos, end of
//! turn), and each is allowed exactly when the text so far is whole (the matcher
//! accepts). Special tokens that are not end tokens are never generated under a
//! constraint.

use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{ApproximateTokEnv, SimpleVob, TokEnv, TokRxInfo, TokTrie};
use llguidance::{Matcher, ParserFactory};
use serde_json::{json, Value};
use std::sync::Arc;

/// Whitespace between a JSON text's tokens: spaces and tabs with at most one newline, as
/// llama.cpp's JSON grammar allows (`"\n" [ \t]{0,20}`). Unbounded whitespace lets a
/// sampled model print blank lines until max_tokens (OpenAI's documentation warns of it;
/// seen here with SmolLM2 at temperature 1).
pub const JSON_WHITESPACE: &str = r"[ \t]{0,20}(\n[ \t]{0,20})?";

/// What the generated text must be, as the request gave it.
#[derive(Clone, Debug, PartialEq)]
pub enum Grammar {
    /// One JSON object (OpenAI's `response_format: {"type": "json_object"}`).
    JsonObject,
    /// One instance of a JSON schema (`json_schema`, vLLM's `guided_json`).
    JsonSchema(Value),
    /// A text the regular expression matches whole (vLLM's `guided_regex`; Rust's regex
    /// syntax, without look-around or backreferences).
    Regex(String),
    /// A text of a Lark grammar (vLLM's `guided_grammar`, llama.cpp's `grammar`;
    /// llguidance's variant of Lark, which also takes JSON schemas and regexes inline).
    Lark(String),
    /// One of these strings exactly (vLLM's `guided_choice`).
    Choice(Vec<String>),
}

impl Grammar {
    /// The kind, as requests name it.
    pub fn kind(&self) -> &'static str {
        match self {
            Grammar::JsonObject => "json_object",
            Grammar::JsonSchema(_) => "json_schema",
            Grammar::Regex(_) => "regex",
            Grammar::Lark(_) => "grammar",
            Grammar::Choice(_) => "choice",
        }
    }

    fn top(&self) -> TopLevelGrammar {
        match self {
            Grammar::JsonObject => {
                TopLevelGrammar::from_json_schema(with_whitespace(&json!({"type": "object"})))
            }
            Grammar::JsonSchema(s) => TopLevelGrammar::from_json_schema(with_whitespace(s)),
            Grammar::Regex(r) => TopLevelGrammar::from_regex(r),
            Grammar::Lark(g) => TopLevelGrammar::from_lark(g.clone()),
            Grammar::Choice(c) => {
                let alts: Vec<String> = c.iter().map(|s| lark_string(s)).collect();
                TopLevelGrammar::from_lark(format!("start: {}", alts.join(" | ")))
            }
        }
    }
}

/// A schema with sluice's whitespace rule, unless it sets its own (`x-guidance`, as
/// llguidance reads it).
fn with_whitespace(schema: &Value) -> Value {
    let mut s = schema.clone();
    if let Value::Object(m) = &mut s {
        if !m.contains_key("x-guidance") {
            m.insert(
                "x-guidance".into(),
                json!({"whitespace_pattern": JSON_WHITESPACE}),
            );
        }
    } else if let Value::Bool(b) = schema {
        // `true` is any JSON value, `false` none: as objects, so the rule applies.
        s = if *b {
            json!({"x-guidance": {"whitespace_pattern": JSON_WHITESPACE}})
        } else {
            json!({"not": {}})
        };
    }
    s
}

/// `s` as a Lark string literal.
fn lark_string(s: &str) -> String {
    // JSON's escapes are Lark's.
    serde_json::to_string(s).unwrap_or_default()
}

/// What each token of the vocabulary adds to generated text: its bytes, or that it ends
/// generation, or that it adds nothing (a special token the text leaves out).
pub struct TokenTexts {
    bytes: Vec<u8>,
    /// Token `i`'s bytes are `bytes[starts[i]..starts[i + 1]]`.
    starts: Vec<u32>,
    kinds: Vec<TokenKind>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TokenKind {
    Text,
    /// Ends generation (eos, end of turn).
    End,
    /// A special token the text leaves out, or one of no bytes.
    Silent,
}

impl TokenTexts {
    pub fn with_capacity(n: usize) -> TokenTexts {
        let mut starts = Vec::with_capacity(n + 1);
        starts.push(0);
        TokenTexts {
            bytes: Vec::new(),
            starts,
            kinds: Vec::with_capacity(n),
        }
    }

    /// The next token's bytes and kind.
    pub fn push(&mut self, bytes: &[u8], kind: TokenKind) {
        self.bytes.extend_from_slice(bytes);
        self.starts.push(self.bytes.len() as u32);
        self.kinds.push(kind);
    }

    /// A table of the given tokens, id by id (a vocabulary made up for tests).
    pub fn of(tokens: &[(&[u8], TokenKind)]) -> TokenTexts {
        let mut t = TokenTexts::with_capacity(tokens.len());
        for &(b, k) in tokens {
            t.push(b, k);
        }
        t
    }

    pub fn len(&self) -> usize {
        self.kinds.len()
    }

    pub fn is_empty(&self) -> bool {
        self.kinds.is_empty()
    }

    pub fn kind(&self, id: u32) -> TokenKind {
        self.kinds
            .get(id as usize)
            .copied()
            .unwrap_or(TokenKind::Silent)
    }

    pub fn bytes(&self, id: u32) -> &[u8] {
        let i = id as usize;
        match (self.starts.get(i), self.starts.get(i + 1)) {
            (Some(&a), Some(&b)) => &self.bytes[a as usize..b as usize],
            _ => &[],
        }
    }
}

/// One model's vocabulary as llguidance sees it: every token's bytes (special tokens under
/// llguidance's marker byte, so no text matches them), the end tokens, and the parser
/// factory with its lexer slices. Built on the first constrained request: about 1 s and
/// 115 MB for Gemma 3's 262k tokens.
pub struct Grammars {
    factory: ParserFactory,
    /// Tokens that end generation: allowed when the text is whole.
    ends: Vec<u32>,
    vocab: usize,
}

impl Grammars {
    /// `name(id)` names a special token (its text in the vocabulary), for grammars that
    /// refer to one.
    pub fn new(texts: &TokenTexts, name: impl Fn(u32) -> String) -> Result<Grammars, String> {
        let n = texts.len();
        let mut words = Vec::with_capacity(n);
        let mut ends = Vec::new();
        for id in 0..n as u32 {
            match texts.kind(id) {
                TokenKind::Text => words.push(texts.bytes(id).to_vec()),
                kind => {
                    if kind == TokenKind::End {
                        ends.push(id);
                    }
                    let mut w = vec![TokTrie::SPECIAL_TOKEN_MARKER];
                    let nm = name(id);
                    if nm.is_empty() {
                        w.extend_from_slice(format!("<[{id}]>").as_bytes());
                    } else {
                        w.extend_from_slice(nm.as_bytes());
                    }
                    words.push(w);
                }
            }
        }
        let info = TokRxInfo {
            vocab_size: n as u32,
            tok_eos: ends.first().copied().unwrap_or(0),
            tok_bos: None,
            tok_pad: None,
            tok_unk: None,
            tok_end_of_turn: ends.get(1).copied(),
        };
        let env: TokEnv = Arc::new(ApproximateTokEnv::new(TokTrie::from(&info, &words)));
        // With llguidance's lexer slices (sub-tries for the insides of JSON strings): they
        // cost 60 MB and 0.45 s to build on Gemma 3's 262k tokens, but without them a
        // JSON schema cost SmolLM2 4.5 % of its decode speed (198.4 against 207.8 tokens/s
        // sampled, 5 rounds alternating), with them none (211.8).
        let mut factory = ParserFactory::new_simple(&env).map_err(|e| e.to_string())?;
        // Errors come back as values; nothing is printed.
        factory.quiet();
        Ok(Grammars {
            factory,
            ends,
            vocab: n,
        })
    }

    /// `g` compiled for this vocabulary, or what is wrong with it (for a schema, the
    /// keywords llguidance does not enforce and where they are).
    pub fn compile(&self, g: &Grammar) -> Result<Constraint, String> {
        let parser = self
            .factory
            .create_parser(g.top())
            .map_err(|e| explain(g, &e.to_string()))?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(explain(g, &e));
        }
        Ok(Constraint {
            matcher,
            ends: self.ends.clone().into(),
            vocab: self.vocab,
            kind: g.kind(),
            lazy: None,
            env: self.factory.tok_env().clone(),
        })
    }

    /// `g` compiled to hold the text only from its trigger on (llama.cpp's lazy
    /// grammar): until then any token may come; `g` is then the text after it.
    pub fn compile_lazy(&self, g: &Grammar, trigger: Trigger) -> Result<Constraint, String> {
        let mut c = self.compile(g)?;
        c.lazy = Some(Lazy {
            trigger,
            tail: Vec::new(),
            must: false,
        });
        Ok(c)
    }

    /// `compile_lazy` for a text that must come to the trigger: no end token before it
    /// (a harmony answer's final channel, which a response format holds).
    pub fn compile_after(&self, g: &Grammar, trigger: Trigger) -> Result<Constraint, String> {
        let mut c = self.compile_lazy(g, trigger)?;
        if let Some(l) = &mut c.lazy {
            l.must = true;
        }
        Ok(c)
    }
}

/// What arms a lazy constraint.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Trigger {
    /// The text comes to end with one of these (special tokens count as their names:
    /// `<|channel|>final<|message|>`).
    Text(&'static [&'static str]),
    /// This token is generated (a special token, such as Mistral's `[TOOL_CALLS]`).
    Token(u32),
}

/// A lazy constraint's watch for its trigger: the last bytes of the text.
#[derive(Clone, Debug)]
struct Lazy {
    trigger: Trigger,
    tail: Vec<u8>,
    /// The text may not end before the trigger.
    must: bool,
}

/// An llguidance error as a request's: a schema's unimplemented keywords with the place of
/// the first of each.
fn explain(g: &Grammar, e: &str) -> String {
    let e = e.trim();
    if let (Grammar::JsonSchema(s), Some(list)) = (g, e.strip_prefix("Unimplemented keys: ")) {
        let keys: Vec<String> = serde_json::from_str(list).unwrap_or_default();
        let placed: Vec<String> = keys
            .iter()
            .map(|k| match find_key(s, k, &mut String::new()) {
                Some(at) => format!("{k:?} at {}", if at.is_empty() { "/" } else { &at }),
                None => format!("{k:?}"),
            })
            .collect();
        if !placed.is_empty() {
            return format!(
                "the schema uses keywords sluice cannot enforce: {} (remove them, or move them into \"description\")",
                placed.join(", ")
            );
        }
    }
    // llguidance's messages can carry the whole grammar after the first line.
    let first = e.lines().next().unwrap_or(e);
    format!("{} is not valid: {first}", g.kind())
}

/// The JSON pointer of the first object in `v` (depth first) that has key `k`.
fn find_key(v: &Value, k: &str, at: &mut String) -> Option<String> {
    match v {
        Value::Object(m) => {
            if m.contains_key(k) {
                return Some(at.clone());
            }
            for (name, child) in m {
                let len = at.len();
                at.push('/');
                at.push_str(&name.replace('~', "~0").replace('/', "~1"));
                let r = find_key(child, k, at);
                at.truncate(len);
                if r.is_some() {
                    return r;
                }
            }
            None
        }
        Value::Array(a) => a.iter().enumerate().find_map(|(i, child)| {
            let len = at.len();
            at.push_str(&format!("/{i}"));
            let r = find_key(child, k, at);
            at.truncate(len);
            r
        }),
        _ => None,
    }
}

/// A grammar compiled for one vocabulary, at the start of a text or partway through.
#[derive(Clone)]
pub struct Constraint {
    matcher: Matcher,
    ends: Arc<[u32]>,
    vocab: usize,
    kind: &'static str,
    /// Not yet holding the text: waiting for its trigger.
    lazy: Option<Lazy>,
    /// The vocabulary (a token's bytes, for the trigger).
    env: TokEnv,
}

impl std::fmt::Debug for Constraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Constraint({})", self.kind)
    }
}

impl Constraint {
    pub fn kind(&self) -> &'static str {
        self.kind
    }

    /// The text so far is whole: an end token may come now.
    pub fn is_done(&mut self) -> bool {
        if let Some(l) = &self.lazy {
            return !l.must;
        }
        self.matcher.is_stopped() || self.matcher.is_accepting().unwrap_or(false)
    }

    /// Nothing but the end may follow (the grammar cannot go on, or it failed).
    fn must_end(&self) -> bool {
        self.matcher.is_stopped()
    }

    /// The model's first end token, if it has one.
    pub fn first_end(&self) -> Option<u32> {
        self.ends.first().copied()
    }

    fn is_end(&self, t: u32) -> bool {
        self.ends.contains(&t)
    }

    /// Whether token `t` may come next (without computing the whole mask).
    pub fn allows(&mut self, t: u32) -> bool {
        if self.lazy.is_some() {
            return !self.is_end(t) || self.is_done();
        }
        if self.is_end(t) {
            return self.is_done();
        }
        if (t as usize) >= self.vocab || self.must_end() {
            return false;
        }
        matches!(self.matcher.validate_tokens(&[t]), Ok(1))
    }

    /// Sets every token of `row` (a logits row) that may not come next to -inf; returns
    /// whether any token with a finite logit is left.
    pub fn mask(&mut self, row: &mut [f32]) -> bool {
        if self.lazy.is_some() {
            if !self.is_done() {
                for &t in self.ends.iter() {
                    if let Some(l) = row.get_mut(t as usize) {
                        *l = f32::NEG_INFINITY;
                    }
                }
            }
            return row.iter().any(|&l| l > f32::NEG_INFINITY);
        }
        let done = self.is_done();
        let ends: Vec<(usize, f32)> = self
            .ends
            .iter()
            .filter_map(|&t| row.get(t as usize).map(|&l| (t as usize, l)))
            .collect();
        let allowed: Option<SimpleVob> = if self.must_end() {
            None
        } else {
            self.matcher.compute_mask().ok()
        };
        let n = self.vocab.min(row.len());
        match &allowed {
            Some(m) => {
                let covered = n.min(m.len());
                m.iter_unset_entries(|t| {
                    if t < covered {
                        row[t] = f32::NEG_INFINITY;
                    }
                });
                row[covered..n].fill(f32::NEG_INFINITY);
            }
            None => row[..n].fill(f32::NEG_INFINITY),
        }
        row[n..].fill(f32::NEG_INFINITY);
        // End tokens: as they were when the text is whole, else out.
        for (t, l) in ends {
            row[t] = if done { l } else { f32::NEG_INFINITY };
        }
        row.iter().any(|&l| l > f32::NEG_INFINITY)
    }

    /// Moves past token `t` (an end token or one the constraint refused leaves it as it
    /// was).
    pub fn consume(&mut self, t: u32) {
        if let Some(l) = &mut self.lazy {
            let armed = match l.trigger {
                Trigger::Token(id) => t == id,
                Trigger::Text(texts) => {
                    // A row may be longer than the vocabulary: its extra ids have no text.
                    if (t as usize) < self.vocab {
                        let bytes = self.env.tok_trie().token(t);
                        // A special token counts as its name.
                        l.tail.extend_from_slice(
                            bytes
                                .strip_prefix(&[TokTrie::SPECIAL_TOKEN_MARKER])
                                .unwrap_or(bytes),
                        );
                    }
                    let longest = texts.iter().map(|t| t.len()).max().unwrap_or(0);
                    let keep = l.tail.len().saturating_sub(longest);
                    let hit = texts.iter().any(|t| l.tail.ends_with(t.as_bytes()));
                    l.tail.drain(..keep);
                    hit
                }
            };
            if armed {
                // The grammar holds what follows the trigger.
                self.lazy = None;
            }
            return;
        }
        if self.is_end(t) || (t as usize) >= self.vocab || self.must_end() {
            return;
        }
        if matches!(self.matcher.validate_tokens(&[t]), Ok(1)) {
            let _ = self.matcher.consume_token(t);
        }
    }
}
