//! SentencePiece vocabularies of GGUF files (`tokenizer.ggml.model = "llama"`: Llama 2,
//! Mistral, Gemma and their fine-tunes), tokenized as llama.cpp does (llama-vocab.cpp,
//! `llm_tokenizer_spm`): user-defined tokens, and control tokens when specials are parsed,
//! are matched whole in the text (leftmost, longest at a position); each stretch of text
//! between them gets a leading space when the vocabulary says so (`add_space_prefix`),
//! spaces become U+2581, and adjacent pieces merge greedily by the score of the token they
//! would form (highest first, leftmost on a tie); a character no token covers falls back
//! to its UTF-8 bytes as `<0xNN>` tokens.

use crate::store::format::GgufVocab;
use aho_corasick::{AhoCorasick, MatchKind};
use std::collections::{BinaryHeap, HashMap};

/// GGUF token types (llama.cpp `llama_token_type`).
const NORMAL: i32 = 1;
const UNKNOWN: i32 = 2;
const CONTROL: i32 = 3;
const USER_DEFINED: i32 = 4;
const BYTE: i32 = 6;

pub struct Spm {
    tokens: Vec<String>,
    types: Vec<i32>,
    scores: Vec<f32>,
    by_text: HashMap<String, u32>,
    /// `<0xNN>` for each byte.
    bytes: Vec<u32>,
    /// The tokens matched whole in text, leftmost first and longest at a position: with
    /// control and unknown tokens (specials parsed) and without (user-defined only), each
    /// with the ids of its patterns.
    all_specials: (AhoCorasick, Vec<u32>),
    user_defined: (AhoCorasick, Vec<u32>),
    add_space_prefix: bool,
}

/// A merge candidate: the pieces at `left` and `right` would form a token of `score`.
#[derive(PartialEq)]
struct Bigram {
    score: f32,
    left: usize,
    right: usize,
    len: usize,
}

impl Eq for Bigram {}

impl Ord for Bigram {
    /// Highest score first; on a tie, the leftmost.
    fn cmp(&self, o: &Self) -> std::cmp::Ordering {
        self.score
            .total_cmp(&o.score)
            .then_with(|| o.left.cmp(&self.left))
    }
}

impl PartialOrd for Bigram {
    fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(o))
    }
}

/// One piece of text during merging: a byte range and its neighbours.
#[derive(Clone, Copy)]
struct Piece {
    start: usize,
    len: usize,
    prev: Option<usize>,
    next: Option<usize>,
}

impl Spm {
    pub fn new(v: &GgufVocab) -> Result<Spm, String> {
        let n = v.tokens.len();
        if v.scores.len() != n {
            return Err(format!(
                "SentencePiece vocabulary: {} scores for {n} tokens (tokenizer.ggml.scores)",
                v.scores.len()
            ));
        }
        let types = if v.token_types.is_empty() {
            vec![NORMAL; n]
        } else {
            v.token_types.clone()
        };
        let mut by_text = HashMap::with_capacity(n);
        for (i, t) in v.tokens.iter().enumerate() {
            // The first of duplicate texts wins, as in llama.cpp's token_to_id map.
            by_text.entry(t.clone()).or_insert(i as u32);
        }
        let mut bytes = vec![0u32; 256];
        for (b, slot) in bytes.iter_mut().enumerate() {
            let name = format!("<0x{b:02X}>");
            *slot = *by_text.get(&name).ok_or_else(|| {
                format!(
                    "SentencePiece vocabulary has no byte-fallback token {name} (of <0x00>..<0xFF>): text it cannot cover could not be tokenized; this GGUF was converted without byte fallback"
                )
            })?;
        }
        let matcher = |keep: &dyn Fn(i32) -> bool| -> Result<(AhoCorasick, Vec<u32>), String> {
            let ids: Vec<u32> = (0..n)
                .filter(|&i| keep(types[i]) && !v.tokens[i].is_empty())
                .map(|i| i as u32)
                .collect();
            let ac = AhoCorasick::builder()
                .match_kind(MatchKind::LeftmostLongest)
                .build(ids.iter().map(|&i| &v.tokens[i as usize]))
                .map_err(|e| format!("SentencePiece special tokens: {e}"))?;
            Ok((ac, ids))
        };
        let all_specials = matcher(&|t| matches!(t, CONTROL | USER_DEFINED | UNKNOWN))?;
        let user_defined = matcher(&|t| t == USER_DEFINED)?;
        Ok(Spm {
            tokens: v.tokens.clone(),
            types,
            scores: v.scores.clone(),
            by_text,
            bytes,
            all_specials,
            user_defined,
            add_space_prefix: v.add_space_prefix,
        })
    }

    /// Token ids of `text`; `parse_special` matches control tokens in it too.
    pub fn encode(&self, text: &str, parse_special: bool) -> Vec<u32> {
        let (ac, ids) = if parse_special {
            &self.all_specials
        } else {
            &self.user_defined
        };
        // Every stretch of text starts the text or follows a special token, so each gets
        // the space prefix (when the vocabulary has one), as in llama.cpp.
        let mut out = Vec::new();
        let mut at = 0;
        for m in ac.find_iter(text) {
            if m.start() > at {
                self.encode_raw(&text[at..m.start()], &mut out);
            }
            out.push(ids[m.pattern().as_usize()]);
            at = m.end();
        }
        if at < text.len() {
            self.encode_raw(&text[at..], &mut out);
        }
        out
    }

    fn encode_raw(&self, raw: &str, out: &mut Vec<u32>) {
        let mut text = String::with_capacity(raw.len() + 3);
        if self.add_space_prefix {
            text.push(' ');
        }
        text.push_str(raw);
        let text = text.replace(' ', "\u{2581}");
        let mut pieces: Vec<Piece> = text
            .char_indices()
            .map(|(i, c)| Piece {
                start: i,
                len: c.len_utf8(),
                prev: None,
                next: None,
            })
            .collect();
        let n = pieces.len();
        for (i, p) in pieces.iter_mut().enumerate() {
            p.prev = i.checked_sub(1);
            p.next = (i + 1 < n).then_some(i + 1);
        }
        let mut heap = BinaryHeap::new();
        let bigram = |pieces: &[Piece], l: usize, r: usize| -> Option<Bigram> {
            let (a, b) = (pieces[l], pieces[r]);
            let s = &text[a.start..b.start + b.len];
            let id = *self.by_text.get(s)?;
            Some(Bigram {
                score: self.scores[id as usize],
                left: l,
                right: r,
                len: s.len(),
            })
        };
        for i in 1..n {
            heap.extend(bigram(&pieces, i - 1, i));
        }
        while let Some(bg) = heap.pop() {
            let (l, r) = (pieces[bg.left], pieces[bg.right]);
            // Stale: one side has merged since this candidate was made.
            if l.len == 0 || r.len == 0 || l.len + r.len != bg.len || l.next != Some(bg.right) {
                continue;
            }
            pieces[bg.left].len += r.len;
            pieces[bg.left].next = r.next;
            pieces[bg.right].len = 0;
            if let Some(nx) = r.next {
                pieces[nx].prev = Some(bg.left);
            }
            if let Some(pv) = l.prev {
                heap.extend(bigram(&pieces, pv, bg.left));
            }
            if let Some(nx) = r.next {
                heap.extend(bigram(&pieces, bg.left, nx));
            }
        }
        let mut at = (n > 0).then_some(0);
        while let Some(i) = at {
            let p = pieces[i];
            let s = &text[p.start..p.start + p.len];
            match self.by_text.get(s) {
                Some(&id) => out.push(id),
                None => out.extend(s.bytes().map(|b| self.bytes[b as usize])),
            }
            at = p.next;
        }
    }

    /// The bytes a token stands for in text: spaces for U+2581, its byte for `<0xNN>`,
    /// nothing for control tokens unless `special`.
    pub fn piece_bytes(&self, id: u32, special: bool, out: &mut Vec<u8>) {
        let Some(t) = self.tokens.get(id as usize) else {
            return;
        };
        match self.types.get(id as usize).copied().unwrap_or(NORMAL) {
            BYTE => {
                if let Some(b) = t
                    .strip_prefix("<0x")
                    .and_then(|h| h.strip_suffix('>'))
                    .and_then(|h| u8::from_str_radix(h, 16).ok())
                {
                    out.push(b);
                }
            }
            CONTROL | UNKNOWN if !special => {}
            USER_DEFINED | CONTROL | UNKNOWN => out.extend_from_slice(t.as_bytes()),
            _ => out.extend_from_slice(t.replace('\u{2581}', " ").as_bytes()),
        }
    }

    /// Text of `ids`; a leading space the prefix rule added is dropped.
    pub fn decode(&self, ids: &[u32], special: bool) -> String {
        let mut bytes = Vec::new();
        for &id in ids {
            self.piece_bytes(id, special, &mut bytes);
        }
        let text = String::from_utf8_lossy(&bytes).into_owned();
        match (self.add_space_prefix, text.strip_prefix(' ')) {
            (true, Some(rest)) => rest.to_string(),
            _ => text,
        }
    }

    /// A control or unknown token: text leaves it out.
    pub fn is_control(&self, id: u32) -> bool {
        matches!(self.types.get(id as usize), Some(&(CONTROL | UNKNOWN)))
    }

    pub fn token(&self, id: u32) -> Option<&str> {
        self.tokens.get(id as usize).map(String::as_str)
    }

    pub fn token_id(&self, s: &str) -> Option<u32> {
        self.by_text.get(s).copied()
    }
}
