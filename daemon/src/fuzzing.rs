//! The fuzz targets of `fuzz/` (cargo-fuzz, libFuzzer, nightly), by name: their bodies live
//! beside what they parse (`import::fuzz`, `store::fuzz`, `text::fuzz`, `server::fuzz`);
//! here are the table of them and the tiny models the text targets use. Built with the
//! `fuzz` feature (which the `fuzz/` crate turns on) and in the library's tests, where the
//! committed corpora run on stable as plain tests. Any input may be refused; none may
//! panic, hang or allocate without bound. Where a round trip is defined (frames), it must
//! hold.
//!
//! The corpora: `fuzz/corpus/TARGET/` (seeds from `fuzz/make_seeds.py`) and
//! `fuzz/regressions/TARGET/` (inputs a fuzzer found, kept once fixed); `scripts/fuzz.sh
//! [SECONDS]` fuzzes each target on nightly.

use crate::import::ImportedModel;
use crate::text::{ChatTemplate, Tokenizer};
use std::path::Path;
use std::sync::OnceLock;

pub use crate::import::fuzz::safetensors;
pub use crate::server::fuzz::{grpc, openai};
pub use crate::store::fuzz::{frame, manifest};

/// A target's body.
pub type Target = fn(&[u8]);

/// Every target, by the name of its `fuzz/fuzz_targets/NAME.rs` and corpus directory.
pub const TARGETS: [(&str, Target); 8] = [
    ("gguf", gguf),
    ("safetensors", safetensors),
    ("manifest", manifest),
    ("frame", frame),
    ("template", template),
    ("tokenizer", tokenizer),
    ("openai", openai),
    ("grpc", grpc),
];

/// A GGUF file through the whole import (`import::fuzz::gguf`), and a tokenizer built from
/// what it read, which tokenizes a line.
pub fn gguf(data: &[u8]) {
    let Some(m) = crate::import::fuzz::gguf(data) else {
        return;
    };
    if let Ok(t) = Tokenizer::new(&m.tokenizer, &m.special, m.arch.vocab) {
        if let Ok(ids) = t.encode("Hello world, caf\u{e9} 42.", true) {
            let _ = t.decode(&ids);
        }
    }
}

/// Chat templates (ChatML's and Gemma's) rendering messages from the input
/// (`text::fuzz::template`).
pub fn template(data: &[u8]) {
    crate::text::fuzz::template(data, templates());
}

/// The committed tiny models' tokenizers (byte-level BPE and SentencePiece) on the input
/// (`text::fuzz::tokenizer`).
pub fn tokenizer(data: &[u8]) {
    crate::text::fuzz::tokenizer(data, tokenizers());
}

/// The committed tiny GGUF models, imported once per process.
fn fixtures() -> &'static [ImportedModel] {
    static M: OnceLock<Vec<ImportedModel>> = OnceLock::new();
    M.get_or_init(|| {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures");
        ["tiny-llama.gguf", "tiny-gemma3.gguf"]
            .iter()
            .filter_map(|f| crate::import::open(&dir.join(f)).ok())
            .collect()
    })
}

fn tokenizers() -> &'static [Tokenizer] {
    static T: OnceLock<Vec<Tokenizer>> = OnceLock::new();
    T.get_or_init(|| {
        fixtures()
            .iter()
            .filter_map(|m| Tokenizer::new(&m.tokenizer, &m.special, m.arch.vocab).ok())
            .collect()
    })
}

fn templates() -> &'static [ChatTemplate] {
    static T: OnceLock<Vec<ChatTemplate>> = OnceLock::new();
    T.get_or_init(|| {
        let chatml = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";
        let gemma = "{{ bos_token }}{% for m in messages %}{% if m.role == 'assistant' %}{% set role = 'model' %}{% else %}{% set role = m.role %}{% endif %}<start_of_turn>{{ role }}\n{{ m.content | trim }}<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}";
        [chatml, gemma]
            .iter()
            .filter_map(|s| ChatTemplate::new(s, "<s>".into(), "</s>".into()).ok())
            .collect()
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::import::fuzz::with_data_pad;

    /// Every committed seed and regression input of every target, once, on stable: what
    /// the fuzzers found stays fixed.
    #[test]
    fn committed_fuzz_corpora_run_clean() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz");
        for (name, run) in TARGETS {
            let mut n = 0;
            for dir in ["corpus", "regressions"] {
                let Ok(rd) = std::fs::read_dir(root.join(dir).join(name)) else {
                    continue;
                };
                for entry in rd {
                    let path = entry.expect("corpus entry").path();
                    let data = std::fs::read(&path).expect("corpus file");
                    run(&data);
                    n += 1;
                }
            }
            assert!(n > 0, "fuzz/corpus/{name} is empty: run fuzz/make_seeds.py");
        }
    }

    /// The gguf target's whole-header seeds import with their tensor data padded, and
    /// their tokenizers build: the fuzzer starts past the header, in the importer.
    #[test]
    fn the_gguf_seeds_import_with_zeros_for_data() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz/corpus/gguf");
        for name in ["tiny-llama-q", "tiny-qwen3"] {
            let file = with_data_pad(&std::fs::read(dir.join(name)).expect("seed"));
            let m = crate::import::gguf::import_bytes(&file, Path::new(name))
                .unwrap_or_else(|e| panic!("{name}: {e}"));
            let t = Tokenizer::new(&m.tokenizer, &m.special, m.arch.vocab)
                .unwrap_or_else(|e| panic!("{name}: {e}"));
            assert!(!t.encode("Hello world", true).expect("encodes").is_empty());
        }
    }

    /// The manifest target's two seeds (a whole file, a version and its payload) are
    /// the same valid manifest, so the fuzzer starts both ways from one that decodes.
    #[test]
    fn the_manifest_seeds_decode_to_one_manifest() {
        use crate::store::format::Manifest;
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz/corpus/manifest");
        let file = std::fs::read(dir.join("tiny-llama-q")).expect("seed");
        let payload = std::fs::read(dir.join("tiny-llama-q-payload")).expect("seed");
        assert_eq!(file[0], 0);
        let whole = Manifest::decode(&file[1..], Path::new("seed")).expect("whole-file seed");
        let version = u32::from(payload[0]);
        let parts = Manifest::decode_payload(version, &payload[1..], Path::new("seed"))
            .expect("payload seed");
        assert_eq!(whole, parts);
        assert!(!whole.units.is_empty());
    }

    #[test]
    fn the_fixtures_behind_the_tokenizer_and_template_targets_load() {
        assert_eq!(tokenizers().len(), 2);
        assert_eq!(templates().len(), 2);
    }

    /// The frame target on seeded random inputs (every codec, the float one included):
    /// no panic, and every round trip holds.
    #[test]
    fn random_frames_are_refused_or_decoded_and_round_trip() {
        let mut rng = crate::util::rng::Rng::new(0x243f_6a88_85a3_08d3);
        let mut next = move || rng.next_u64();
        for i in 0..4000usize {
            let len = 8 + (next() % 3000) as usize;
            let mut data: Vec<u8> = (0..len).map(|_| next() as u8).collect();
            if i % 2 == 0 {
                // Weight-like bodies (small floats) so the encoders have something to code.
                for c in data[8..].chunks_exact_mut(4) {
                    let v = ((next() >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.1;
                    c.copy_from_slice(&v.to_le_bytes());
                }
            }
            frame(&data);
        }
    }
}
