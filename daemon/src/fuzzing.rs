//! The bodies of the fuzz targets in `fuzz/` (cargo-fuzz, libFuzzer, nightly), kept in the
//! library so that the committed corpora also run on stable as plain tests
//! (`tests/tests/fuzz_corpus.rs`). Each takes arbitrary bytes and feeds them to one parser
//! that reads what sluice did not write; any input may be refused, none may panic, hang or
//! allocate without bound. Where a round trip is defined (frames), it must hold.

use crate::dtype::DType;
use crate::import::ImportedModel;
use crate::store::codec::{CodeCensus, Codec, FrameDecoder, FrameEncoder, Plane};
use crate::store::float::SharedTables;
use crate::text::{ChatMessage, ChatTemplate, Tokenizer};
use std::path::Path;
use std::sync::{Arc, OnceLock};

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

/// Zero bytes the gguf target appends for tensor data: the seeds are headers, and the tiny
/// models' tensors fit.
const GGUF_DATA_PAD: usize = 384 << 10;

/// A GGUF file's header, metadata and tensor table; then, with zeros for tensor data, the
/// whole import (architecture, config, tensor map, tokenizer) and a tokenizer built from
/// what it read, which tokenizes a line.
pub fn gguf(data: &[u8]) {
    let path = Path::new("fuzz.gguf");
    let _ = crate::import::gguf::parse(data, path);
    let Ok(m) = crate::import::gguf::import_bytes(&with_data_pad(data), path) else {
        return;
    };
    if let Ok(t) = Tokenizer::new(&m.tokenizer, &m.special, m.arch.vocab) {
        if let Ok(ids) = t.encode("Hello world, caf\u{e9} 42.", true) {
            let _ = t.decode(&ids);
        }
    }
}

/// `data` and `GGUF_DATA_PAD` zero bytes after it.
fn with_data_pad(data: &[u8]) -> Vec<u8> {
    let mut file = Vec::with_capacity(data.len() + GGUF_DATA_PAD);
    file.extend_from_slice(data);
    file.resize(data.len() + GGUF_DATA_PAD, 0);
    file
}

/// A safetensors file (its header) and a config.json: the first 0 byte splits them.
pub fn safetensors(data: &[u8]) {
    let (st, config) = match data.iter().position(|&b| b == 0) {
        Some(i) => (&data[..i], &data[i + 1..]),
        None => (data, &[][..]),
    };
    let _ = crate::import::hf::check_header_bytes(Path::new("fuzz.safetensors"), st)
        .map(|()| safetensors::SafeTensors::deserialize(st).map(|t| t.tensors().len()));
    if let Ok(v) = serde_json::from_slice::<serde_json::Value>(config) {
        let _ = crate::import::hf::arch_of_config(&v, Path::new("config.json"));
    }
}

/// A manifest: with a first byte 0, the rest is a whole manifest.bin (header, payload,
/// checksum); otherwise the rest is a decompressed payload of the format that byte picks,
/// decoded and validated as if its checksum held (mutations of a whole file almost never
/// get past the checksum to the fields and `validate`).
pub fn manifest(data: &[u8]) {
    use crate::store::format::{Manifest, FORMAT_VERSION, FORMAT_VERSION_MIN};
    let path = Path::new("manifest.bin");
    match data.split_first() {
        Some((0, file)) => {
            let _ = Manifest::decode(file, path);
        }
        Some((&v, payload)) => {
            let versions = FORMAT_VERSION - FORMAT_VERSION_MIN + 1;
            let version = FORMAT_VERSION_MIN + (u32::from(v) - 1) % versions;
            let _ = Manifest::decode_payload(version, payload, path);
        }
        None => {}
    }
}

/// One stored frame: the first 8 bytes choose the codec, the byte planes, which planes are
/// coded, the raw length and the checksum; the rest are the stored bytes. The decoder must
/// refuse or fill exactly the frame. Then the rest is encoded and must decode back to itself.
pub fn frame(data: &[u8]) {
    let Some((head, body)) = data.split_first_chunk::<8>() else {
        return;
    };
    let codec = [
        Codec::None,
        Codec::Lz4,
        Codec::Zstd { level: 1 },
        Codec::Float,
        // A linked frame: heads of 2 to 16 rows of 1 to 64 bytes (or none).
        Codec::Source {
            head_rows: u32::from(head[1] >> 4 & 0x7) * 2,
            row_bytes: u32::from(head[2] & 0x3f) + 1,
        },
    ][head[0] as usize % 5];
    let width = [1usize, 2, 3, 4][head[1] as usize % 4];
    let raw_len = (u16::from_le_bytes([head[2], head[3]]) as usize).min(1 << 14);
    let checksum = u64::from(u32::from_le_bytes([head[4], head[5], head[6], head[7]]));
    // The stored bytes split into `width` planes at proportional cuts.
    let mut planes = Vec::with_capacity(width);
    let mut at = 0usize;
    for i in 0..width {
        let end = if i + 1 == width {
            body.len()
        } else {
            body.len() * (i + 1) / width
        };
        planes.push(Plane {
            stored_len: (end - at) as u32,
            compressed: head[0] & (0x10 << i) != 0,
        });
        at = end;
    }
    // The float codec takes the frame as elements of a float dtype; its shared codes are
    // made from the frame's own bytes (a plane may name one: mode 2).
    let dtype = [DType::Q8_0, DType::BF16, DType::F16, DType::F32][head[1] as usize % 4];
    let raw = &body[..body.len().min(1 << 14)];
    let mut census = CodeCensus::default();
    census.add(&raw[..raw.len() / 4 * 4], dtype);
    let codes = census.codes();
    let Ok(tables) = SharedTables::new(&codes) else {
        panic!("the census made shared codes that do not check: {codes:?}");
    };
    let tables = Arc::new(tables);
    let Ok(dec) = FrameDecoder::new(raw_len) else {
        return;
    };
    let mut dec = dec.with_shared(tables.clone());
    let mut dst = vec![0u8; raw_len];
    let _ = dec.decode(codec, &planes, checksum, body, &mut dst);

    // The round trip: whatever the encoder makes of the bytes decodes back to them.
    let Ok(mut enc) = FrameEncoder::new(codec) else {
        return;
    };
    enc.set_shared(&codes);
    let e = if codec == Codec::Float {
        enc.encode(&raw[..raw.len() / 4 * 4], dtype)
    } else {
        enc.encode_split(raw, [1, 2, 4][head[1] as usize % 3])
    };
    let Ok(e) = e else {
        return;
    };
    let raw = if codec == Codec::Float {
        &raw[..raw.len() / 4 * 4]
    } else {
        raw
    };
    let (codec, planes, bytes) = (e.codec, e.planes.clone(), e.bytes.to_vec());
    let sum = crate::util::xxh3(raw);
    let Ok(dec) = FrameDecoder::new(raw.len()) else {
        return;
    };
    let mut dec = dec.with_shared(tables);
    let mut back = vec![0u8; raw.len()];
    let r = dec.decode(codec, &planes, sum, &bytes, &mut back);
    assert!(
        r.is_ok() && back == raw,
        "a frame sluice encoded did not decode to its bytes: {r:?}"
    );
}

/// Messages (split at 0 bytes, roles in turn) rendered by real templates, and by the
/// input's first line taken as a template of its own.
pub fn template(data: &[u8]) {
    let text = String::from_utf8_lossy(data);
    let mut parts = text.split('\0');
    let source = parts.next().unwrap_or_default();
    let roles = ["system", "user", "assistant", "user", "tool"];
    let messages: Vec<ChatMessage> = parts
        .take(64)
        .enumerate()
        .map(|(i, c)| ChatMessage {
            role: roles[i % roles.len()].to_string(),
            content: c.to_string(),
        })
        .collect();
    for t in templates() {
        let _ = t.render(&messages, true);
    }
    if let Ok(t) = ChatTemplate::new(source, "<s>".into(), "</s>".into()) {
        let _ = t.render(&messages, true);
    }
}

/// Text through the tokenizers of the committed tiny models (byte-level BPE and
/// SentencePiece), and back.
pub fn tokenizer(data: &[u8]) {
    let text = String::from_utf8_lossy(data);
    for t in tokenizers() {
        if let Ok(ids) = t.encode(&text, true) {
            let _ = t.decode(&ids);
        }
    }
}

/// Both OpenAI bodies.
pub fn openai(data: &[u8]) {
    let _ = crate::server::openai::parse_chat(data);
    let _ = crate::server::openai::parse_completion(data, 16);
}

/// A protobuf GenerateRequest as a client sends it, through the validation that does not
/// need a model.
pub fn grpc(data: &[u8]) {
    use prost::Message;
    if let Ok(r) = sluice_proto::v1::GenerateRequest::decode(data) {
        let _ = crate::server::models::parse_keep_alive(&r.keep_alive);
        if let Ok(input) = crate::server::service::input_of(r, &crate::text::sampler::FAMILIAR) {
            let _ = input.sampling.validate();
        }
    }
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
        let mut x = 0x243f_6a88_85a3_08d3u64;
        let mut next = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
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
            super::frame(&data);
        }
    }
}
