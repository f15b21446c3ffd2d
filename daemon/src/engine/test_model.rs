//! A tiny synthetic model packed into a temporary store, for the engine's unit tests:
//! 2 layers, hidden 64, a 300-token byte-level vocabulary whose token 299 ends a turn.

use super::sequence::GenerateParams;
use crate::dtype::DType;
use crate::import::synth::{self, SynthSpec};
use crate::store::format::{GgufVocab, TokenizerSpec};
use crate::store::writer::{pack, PackOptions};
use crate::store::Store;
use std::sync::Arc;

pub const END_TOKEN: u32 = 299;
pub const VOCAB: u32 = 300;

pub fn store(dir: &std::path::Path) -> Arc<Store> {
    let mut spec = SynthSpec::llama_like(64, 2, DType::F32);
    spec.vocab = VOCAB;
    let mut model = synth::model(&spec);
    model.special.end_tokens = vec![END_TOKEN];
    model.tokenizer = TokenizerSpec::Gguf(byte_level_vocab());
    packed(&model, &dir.join("tiny"), "lz4", 1 << 16)
}

/// `model` packed at `out` with `codec` in frames of `frame_size`, opened.
fn packed(
    model: &crate::import::ImportedModel,
    out: &std::path::Path,
    codec: &str,
    frame_size: u32,
) -> Arc<Store> {
    let units = model.units().expect("units");
    let opts = PackOptions {
        auto: None,
        codec: codec.parse().expect("codec"),
        frame_size,
        threads: 1,
        force: true,
        link: false,
    };
    pack(model, &units, out, &opts, |_| {}).expect("pack the test model");
    Arc::new(Store::open(out).expect("open the test model"))
}

/// A 4-layer synthetic model of `hidden` with a tied embedding of `vocab` rows, packed raw
/// in frames of 1 MiB (for the planner: no tokenizer to speak of).
pub fn tied_store(dir: &std::path::Path, hidden: u32, vocab: u32) -> Arc<Store> {
    let mut spec = SynthSpec::llama_like(hidden, 4, DType::F32);
    spec.vocab = vocab;
    let mut model = synth::model(&spec);
    model.arch.tied_embeddings = true;
    model.tensors.remove("lm_head.weight");
    packed(&model, &dir.join("tied"), "none", 1 << 20)
}

/// A byte-level BPE vocabulary without merges: token b (< 256) is byte b, in GPT-2's
/// byte-to-character mapping; the rest are control tokens.
fn byte_level_vocab() -> GgufVocab {
    let printable = |b: u32| {
        (b'!' as u32..=b'~' as u32).contains(&b)
            || (0xA1..=0xAC).contains(&b)
            || (0xAE..=0xFF).contains(&b)
    };
    let mut extra = 0;
    let mut tokens: Vec<String> = (0..256u32)
        .map(|b| {
            let c = if printable(b) {
                b
            } else {
                extra += 1;
                255 + extra
            };
            char::from_u32(c).expect("a valid char").to_string()
        })
        .collect();
    tokens.extend((256..VOCAB).map(|i| format!("<ctl{i}>")));
    GgufVocab {
        model: "gpt2".into(),
        pre: None,
        token_types: (0..VOCAB).map(|i| if i < 256 { 1 } else { 3 }).collect(),
        tokens,
        merges: Vec::new(),
        scores: Vec::new(),
        add_space_prefix: false,
    }
}

/// Greedy sampling, `max_tokens` at most, stop strings as given.
pub fn greedy(max_tokens: usize, stop: &[&str], ignore_eos: bool) -> GenerateParams {
    GenerateParams {
        stop: stop.iter().map(|s| s.to_string()).collect(),
        ..GenerateParams::greedy(max_tokens, ignore_eos)
    }
}
