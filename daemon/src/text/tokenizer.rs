//! The tokenizer: the `tokenizers` crate, from a tokenizer.json or rebuilt from a GGUF
//! byte-level BPE vocabulary with the pre-tokenizer its `tokenizer.ggml.pre` names (the
//! regexes are llama.cpp's, llama-vocab.cpp); a GGUF SentencePiece vocabulary through
//! `spm` (llama.cpp's algorithm).

use super::grammar::{Grammars, TokenKind, TokenTexts};
use super::harmony::Harmony;
use crate::store::format::{GgufVocab, Manifest, SpecialTokens, TokenizerSpec};
use serde::Serialize;
use serde_json::{json, Value};

#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    #[error("tokenizer: {0}")]
    Build(String),
    #[error("tokenize: {0}")]
    Encode(String),
}

enum Inner {
    Hf(Box<tokenizers::Tokenizer>),
    Spm(Box<super::spm::Spm>),
}

pub struct Tokenizer {
    inner: Inner,
    special: SpecialTokens,
    /// GGUF vocabularies carry add_bos outside the tokenizer; tokenizer.json files say it in
    /// their post-processor.
    prepend_bos: bool,
    vocab: u32,
    /// The most bytes one token stands for (`longest_token_bytes`), found on first use.
    longest: std::sync::OnceLock<usize>,
    /// The vocabulary as constraints see it, built on first use (`grammars`).
    grammars: std::sync::OnceLock<Result<Grammars, String>>,
    /// Harmony's tokens, when the vocabulary has them (gpt-oss).
    harmony: Option<Harmony>,
}

/// GPT-2's pre-tokenizer regex.
const GPT2_REGEX: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)";

/// The split regexes of a GGUF pre-tokenizer type, applied in order.
fn pre_regexes(pre: Option<&str>) -> Result<Vec<&'static str>, TokenizerError> {
    Ok(match pre.unwrap_or("default") {
        "default" | "gpt2" | "gpt-2" => vec![GPT2_REGEX],
        // SmolLM2 and StarCoder split every digit on its own, then apply GPT-2's regex.
        "smollm" | "starcoder" | "refact" | "codeshell" | "command-r" | "minerva" | "exaone" => vec![r"\p{N}", GPT2_REGEX],
        "llama-bpe" | "llama3" | "dbrx" | "smaug-bpe" => vec![r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"],
        "qwen2" | "deepseek-r1-qwen" => vec![r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"],
        other => {
            return Err(TokenizerError::Build(format!(
                "GGUF pre-tokenizer {other:?} is not supported (supported: default, gpt2, smollm, starcoder, llama-bpe, qwen2); pack the Hugging Face directory instead"
            )))
        }
    })
}

/// A tokenizer.json equivalent of a GGUF byte-level BPE vocabulary, written straight from
/// the vocabulary: a `serde_json::Value` of 49k tokens and merges would cost ten times the
/// text's bytes at start, a transient the host budget must otherwise cover.
fn gguf_tokenizer_json(v: &GgufVocab) -> Result<String, TokenizerError> {
    if v.model != "gpt2" {
        return Err(TokenizerError::Build(format!(
            "GGUF tokenizer model {:?} is not supported yet (only byte-level BPE, \"gpt2\"); pack the Hugging Face directory (tokenizer.json) instead",
            v.model
        )));
    }
    // CONTROL (3) and USER_DEFINED (4) tokens are matched whole in text, as llama.cpp does.
    let added: Vec<Value> = v
        .token_types
        .iter()
        .enumerate()
        .filter(|(_, &t)| t == 3 || t == 4)
        .map(|(id, &t)| json!({"id": id, "content": v.tokens[id], "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": t == 3}))
        .collect();
    let mut splits: Vec<Value> = pre_regexes(v.pre.as_deref())?
        .into_iter()
        .map(|r| json!({"type": "Split", "pattern": {"Regex": r}, "behavior": "Isolated", "invert": false}))
        .collect();
    splits.push(json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false}));

    /// The vocabulary as a JSON object, token -> id.
    struct Vocab<'a>(&'a [String]);
    impl Serialize for Vocab<'_> {
        fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
            s.collect_map(self.0.iter().enumerate().map(|(id, t)| (t, id)))
        }
    }
    #[derive(Serialize)]
    struct Bpe<'a> {
        #[serde(rename = "type")]
        kind: &'static str,
        dropout: Option<f32>,
        unk_token: Option<&'a str>,
        continuing_subword_prefix: Option<&'a str>,
        end_of_word_suffix: Option<&'a str>,
        fuse_unk: bool,
        byte_fallback: bool,
        ignore_merges: bool,
        vocab: Vocab<'a>,
        merges: &'a [String],
    }
    #[derive(Serialize)]
    struct TokenizerJson<'a> {
        version: &'static str,
        truncation: Option<()>,
        padding: Option<()>,
        added_tokens: Vec<Value>,
        normalizer: Option<()>,
        pre_tokenizer: Value,
        post_processor: Option<()>,
        decoder: Value,
        model: Bpe<'a>,
    }
    serde_json::to_string(&TokenizerJson {
        version: "1.0",
        truncation: None,
        padding: None,
        added_tokens: added,
        normalizer: None,
        pre_tokenizer: json!({"type": "Sequence", "pretokenizers": splits}),
        post_processor: None,
        decoder: json!({"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true}),
        model: Bpe {
            kind: "BPE",
            dropout: None,
            unk_token: None,
            continuing_subword_prefix: None,
            end_of_word_suffix: None,
            fuse_unk: false,
            byte_fallback: false,
            ignore_merges: false,
            vocab: Vocab(&v.tokens),
            merges: &v.merges,
        },
    })
    .map_err(|e| TokenizerError::Build(format!("GGUF vocabulary as tokenizer.json: {e}")))
}

fn parse_json(json: &str) -> Result<tokenizers::Tokenizer, TokenizerError> {
    json.parse()
        .map_err(|e| TokenizerError::Build(format!("{e}")))
}

impl Tokenizer {
    pub fn from_manifest(m: &Manifest) -> Result<Tokenizer, TokenizerError> {
        Tokenizer::new(&m.tokenizer, &m.special, m.arch.vocab)
    }

    /// The tokenizer a model's spec describes (what an importer read), with its special
    /// tokens and vocabulary size.
    pub fn new(
        spec: &TokenizerSpec,
        special: &crate::store::format::SpecialTokens,
        vocab: u32,
    ) -> Result<Tokenizer, TokenizerError> {
        let (inner, prepend_bos) = match spec {
            TokenizerSpec::Gguf(v) if v.model == "llama" => (
                Inner::Spm(Box::new(
                    super::spm::Spm::new(v).map_err(TokenizerError::Build)?,
                )),
                special.add_bos,
            ),
            TokenizerSpec::HfJson(s) => (Inner::Hf(Box::new(parse_json(s)?)), false),
            TokenizerSpec::Gguf(v) => (
                Inner::Hf(Box::new(parse_json(&gguf_tokenizer_json(v)?)?)),
                special.add_bos,
            ),
        };
        let mut t = Tokenizer {
            inner,
            special: special.clone(),
            prepend_bos: prepend_bos && special.bos.is_some(),
            vocab,
            longest: std::sync::OnceLock::new(),
            grammars: std::sync::OnceLock::new(),
            harmony: None,
        };
        t.harmony = Harmony::of(|s| t.token_id(s).filter(|&id| id < vocab));
        if let Some(h) = t.harmony {
            // `<|end|>` ends a message, not the turn; `<|return|>` and `<|call|>` end it
            // (stores packed before sluice knew harmony have `<|end|>` among their ends).
            let ends = &mut t.special.end_tokens;
            ends.retain(|&id| id != h.end);
            for id in [h.ret, h.call] {
                if !ends.contains(&id) {
                    ends.push(id);
                }
            }
        }
        Ok(t)
    }

    /// The vocabulary's harmony tokens (gpt-oss), if it has them.
    pub fn harmony(&self) -> Option<Harmony> {
        self.harmony
    }

    /// Token ids of `text`. With `add_special`, BOS is added when the model asks for it
    /// (prompts); without, text is tokenized as is (chat templates carry their own).
    pub fn encode(&self, text: &str, add_special: bool) -> Result<Vec<u32>, TokenizerError> {
        let mut ids = match &self.inner {
            Inner::Hf(t) => t
                .encode(text, add_special)
                .map_err(|e| TokenizerError::Encode(e.to_string()))?
                .get_ids()
                .to_vec(),
            // Special tokens in the text are parsed, as tokenizer.json's added tokens are.
            Inner::Spm(t) => t.encode(text, true),
        };
        if add_special && self.prepend_bos {
            let bos = self.special.bos.expect("checked at build");
            if ids.first() != Some(&bos) {
                ids.insert(0, bos);
            }
        }
        Ok(ids)
    }

    /// Text of `ids`, special tokens left out.
    pub fn decode(&self, ids: &[u32]) -> String {
        match &self.inner {
            Inner::Hf(t) => t.decode(ids, true).unwrap_or_default(),
            Inner::Spm(t) => t.decode(ids, false),
        }
    }

    /// The token's own string (e.g. "Ġthe", "▁the"), for Tokenize responses.
    pub fn piece(&self, id: u32) -> String {
        match &self.inner {
            Inner::Hf(t) => t.id_to_token(id).unwrap_or_default(),
            Inner::Spm(t) => t.token(id).unwrap_or_default().to_string(),
        }
    }

    /// The bytes token `id` stands for in text (special tokens: their string), whole even
    /// where they end inside a UTF-8 character, as OpenAI's logprobs `bytes` are.
    pub fn token_bytes(&self, id: u32) -> Vec<u8> {
        match &self.inner {
            Inner::Hf(t) => {
                let byte_level = matches!(
                    t.get_decoder(),
                    Some(tokenizers::DecoderWrapper::ByteLevel(_))
                );
                if let Some(added) = t.get_added_vocabulary().simple_id_to_token(id) {
                    return added.into_bytes();
                }
                match t.id_to_token(id) {
                    Some(p) if byte_level => {
                        let mut out = Vec::with_capacity(p.len());
                        for c in p.chars() {
                            push_byte_of_char(c, &mut out);
                        }
                        out
                    }
                    // A byte-fallback piece alone is its byte, not U+FFFD.
                    Some(p) if is_byte_piece(&p) => {
                        vec![u8::from_str_radix(&p[3..5], 16).unwrap_or(b'?')]
                    }
                    _ => t.decode(&[id], false).unwrap_or_default().into_bytes(),
                }
            }
            Inner::Spm(t) => {
                let mut out = Vec::new();
                t.piece_bytes(id, true, &mut out);
                out
            }
        }
    }

    /// The vocabulary as constraints (JSON mode, schemas, regexes, grammars) see it,
    /// built on the first constrained request and shared by all.
    pub fn grammars(&self) -> Result<&Grammars, String> {
        self.grammars
            .get_or_init(|| Grammars::new(&self.texts(), |id| self.piece(id)))
            .as_ref()
            .map_err(|e| format!("the vocabulary cannot take constraints: {e}"))
    }

    /// Every token's text and kind: some 4 MB and 0.1 s for a vocabulary of 262k tokens.
    fn texts(&self) -> TokenTexts {
        let special: std::collections::HashSet<u32> = match &self.inner {
            Inner::Hf(t) => t
                .get_added_tokens_decoder()
                .into_iter()
                .filter(|(_, a)| a.special)
                .map(|(id, _)| id)
                .collect(),
            Inner::Spm(t) => (0..self.vocab).filter(|&id| t.is_control(id)).collect(),
        };
        let mut out = TokenTexts::with_capacity(self.vocab as usize);
        for id in 0..self.vocab {
            if self.is_end(id) {
                out.push(&[], TokenKind::End);
            } else if special.contains(&id) {
                out.push(&[], TokenKind::Silent);
            } else {
                let b = match &self.inner {
                    Inner::Spm(t) => {
                        let mut b = Vec::new();
                        t.piece_bytes(id, false, &mut b);
                        b
                    }
                    Inner::Hf(_) => self.token_bytes(id),
                };
                let kind = if b.is_empty() {
                    TokenKind::Silent
                } else {
                    TokenKind::Text
                };
                out.push(&b, kind);
            }
        }
        out
    }

    pub fn token_id(&self, s: &str) -> Option<u32> {
        match &self.inner {
            Inner::Hf(t) => t.token_to_id(s),
            Inner::Spm(t) => t.token_id(s),
        }
    }

    pub fn special(&self) -> &SpecialTokens {
        &self.special
    }

    /// The most bytes of text one token stands for (special tokens: their string; at least
    /// 1). A text of B bytes is then at least B / this many tokens, give or take what
    /// normalization shrinks (a composed accent: 3 bytes to 2), so a prompt far longer than
    /// the context is refused by its length before it is tokenized, which for megabytes of
    /// text takes hundreds of MB and seconds.
    pub fn longest_token_bytes(&self) -> usize {
        *self.longest.get_or_init(|| {
            (0..self.vocab)
                .map(|id| self.token_bytes(id).len())
                .max()
                .unwrap_or(1)
                .max(1)
        })
    }

    pub fn is_end(&self, id: u32) -> bool {
        self.special.end_tokens.contains(&id)
    }

    /// Generation also ends at the end-of-turn tokens `template` uses (a chat template given
    /// at run time, `--chat-template`: a base model's store knows none of them); returns
    /// those it added.
    pub fn end_turns_of(&mut self, template: &str) -> Vec<u32> {
        let ids = crate::store::end_of_turn_tokens(Some(template), |s| self.token_id(s));
        let added: Vec<u32> = ids
            .into_iter()
            .filter(|id| !self.special.end_tokens.contains(id))
            .collect();
        self.special.end_tokens.extend(&added);
        added
    }

    pub fn vocab(&self) -> u32 {
        self.vocab
    }
}

/// `<0xNN>`: a byte-fallback piece.
fn is_byte_piece(p: &str) -> bool {
    let b = p.as_bytes();
    b.len() == 6
        && p.starts_with("<0x")
        && b[5] == b'>'
        && b[3..5].iter().all(u8::is_ascii_hexdigit)
}

/// The byte a character of GPT-2's byte-level alphabet stands for: printable Latin-1
/// characters are themselves, the other 68 bytes were moved to U+0100.. in order. A
/// character outside the alphabet stands for its own UTF-8.
fn push_byte_of_char(c: char, out: &mut Vec<u8>) {
    let printable = |b: u32| {
        (0x21..=0x7e).contains(&b) || (0xa1..=0xac).contains(&b) || (0xae..=0xff).contains(&b)
    };
    let u = c as u32;
    if u < 256 && printable(u) {
        out.push(u as u8);
        return;
    }
    match (0u32..256)
        .filter(|&b| !printable(b))
        .nth(u.wrapping_sub(256) as usize)
    {
        Some(b) => out.push(b as u8),
        None => out.extend_from_slice(c.encode_utf8(&mut [0; 4]).as_bytes()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A store packed before sluice knew harmony has `<|end|>` among its end tokens: the
    /// tokenizer takes it out and ends the turn at `<|return|>` and `<|call|>`; a chat
    /// template of harmony's gives those two as its end-of-turn tokens.
    #[test]
    fn the_turn_ends_at_return_and_call_not_at_end() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../tests/fixtures/tiny-gptoss-harmony");
        let json = std::fs::read_to_string(dir.join("tokenizer.json")).unwrap();
        let tok = Tokenizer::new(
            &crate::store::format::TokenizerSpec::HfJson(json),
            &crate::store::format::SpecialTokens {
                eos: Some(288),
                end_tokens: vec![288, 292],
                ..Default::default()
            },
            295,
        )
        .unwrap();
        let h = tok.harmony().expect("harmony's tokens");
        assert_eq!((h.end, h.ret, h.call), (292, 288, 294));
        assert!(!tok.is_end(h.end) && tok.is_end(h.ret) && tok.is_end(h.call));
        let template = std::fs::read_to_string(dir.join("../templates/gpt-oss.jinja")).unwrap();
        let ends = crate::store::end_of_turn_tokens(Some(&template), |s| tok.token_id(s));
        assert_eq!(ends, [288, 294]);
    }
}
