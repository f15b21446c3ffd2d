//! The text side's fuzz targets (cargo-fuzz in `fuzz/`, built with the `fuzz` feature; the
//! committed corpora also run as a plain test, `fuzzing::tests`): chat templates and
//! tokenizers, over the models `fuzzing` loads. Any input may be refused; none may panic,
//! hang or allocate without bound.

use crate::text::{ChatMessage, ChatTemplate, Tokenizer};

/// Messages (split at 0 bytes, roles in turn) rendered by real templates, and by the
/// input's first line taken as a template of its own.
pub fn template(data: &[u8], templates: &[ChatTemplate]) {
    let text = String::from_utf8_lossy(data);
    let mut parts = text.split('\0');
    let source = parts.next().unwrap_or_default();
    let roles = ["system", "user", "assistant", "user", "tool"];
    let messages: Vec<ChatMessage> = parts
        .take(64)
        .enumerate()
        .map(|(i, c)| ChatMessage::new(roles[i % roles.len()].to_string(), c.to_string()))
        .collect();
    for t in templates {
        let _ = t.render(&messages, true);
    }
    if let Ok(t) = ChatTemplate::new(source, "<s>".into(), "</s>".into()) {
        let _ = t.render(&messages, true);
    }
}

/// Text through the tokenizers of the committed tiny models (byte-level BPE and
/// SentencePiece), and back.
pub fn tokenizer(data: &[u8], tokenizers: &[Tokenizer]) {
    let text = String::from_utf8_lossy(data);
    for t in tokenizers {
        if let Ok(ids) = t.encode(&text, true) {
            let _ = t.decode(&ids);
        }
    }
}
