//! The store end to end: packing every fixture dtype with every codec round-trips, the two
//! importers agree, and the real SmolLM2 packs, inspects and verifies.

use sluice::import::{self, ImportedModel};
use sluice::store::codec::Codec;
use sluice::store::writer::{pack, PackOptions};
use sluice::store::{Store, UnitKind};
use sluice_tests::*;
use std::collections::BTreeMap;
use std::path::Path;

/// Every tensor of a store, decoded through the plain reader: name -> (dtype, shape, bytes).
fn read_all(store: &Store) -> BTreeMap<String, (String, Vec<u64>, Vec<u8>)> {
    let file = store.open_weights().unwrap();
    let mut dec = store
        .frame_decoder(store.manifest().frame_raw_len_max() as usize)
        .unwrap();
    let mut stored = Vec::new();
    let mut out = BTreeMap::new();
    for (i, u) in store.units().iter().enumerate() {
        let mut raw = vec![0u8; u.raw_len as usize];
        store
            .read_unit(&file, i, &mut stored, &mut raw, &mut dec)
            .unwrap();
        for t in &u.tensors {
            let bytes = raw[t.offset as usize..(t.offset + t.len) as usize].to_vec();
            out.insert(
                t.name.clone(),
                (t.dtype.to_string(), t.shape.clone(), bytes),
            );
        }
    }
    out
}

fn pack_to(model: &ImportedModel, out: &Path, codec: Codec, frame_size: u32) -> Store {
    let units = model.units().unwrap();
    let opts = PackOptions {
        auto: None,
        codec,
        frame_size,
        threads: 2,
        force: true,
        link: false,
    };
    pack(model, &units, out, &opts, |_| {}).unwrap();
    Store::open(out).unwrap()
}

#[test]
fn every_dtype_and_codec_round_trips_bit_exactly() {
    // The fixtures hold f32, f16, bf16 (tiny-llama) and q8_0, q4_0, q4_1 (tiny-llama-q).
    let tmp = tempfile::tempdir().unwrap();
    let mut dtypes_seen = std::collections::BTreeSet::new();
    for src in ["tiny-llama", "tiny-llama-q.gguf", "tiny-qwen2.gguf"] {
        let model = import::open(&fixture(src)).unwrap();
        for codec in ["none", "lz4", "zstd:1", "zstd:3", "float", "float-fast"] {
            // A small frame size splits tensors into many frames, exercising frame edges.
            for frame_size in [4096u32, 1 << 20] {
                let out = tmp.path().join(format!("{src}-{codec}-{frame_size}"));
                let store = pack_to(&model, &out, codec.parse().unwrap(), frame_size);
                // The float codec's small frames share codes the manifest holds (every
                // float tensor of these models is small).
                let codes = store.manifest().codes.len();
                if codec.starts_with("float") {
                    assert!(codes > 0, "{src} {codec} {frame_size}: no shared codes");
                    // float-fast's frames are float frames: the store says float.
                    assert_eq!(store.manifest().codec, sluice::store::codec::Codec::Float);
                } else {
                    assert_eq!(codes, 0, "{src} {codec}");
                }
                let got = read_all(&store);
                assert_eq!(got.len(), model.tensors.len());
                for (name, t) in &model.tensors {
                    let mut want = vec![0u8; t.len as usize];
                    model.copy_source(t, &mut want);
                    let (dtype, shape, bytes) = &got[name];
                    assert_eq!(dtype, &t.dtype.to_string(), "{src} {codec} {name}");
                    assert_eq!(shape, &t.shape, "{src} {codec} {name}");
                    assert!(
                        bytes == &want,
                        "{src} {codec} frame {frame_size}: tensor {name} differs"
                    );
                    dtypes_seen.insert(dtype.clone());
                }
                // Blobs are O_DIRECT-ready and tensors device-aligned.
                for u in store.units() {
                    assert_eq!(u.file_offset % 4096, 0);
                    assert!(u.tensors.iter().all(|t| t.offset % 256 == 0));
                    assert!(u.frames.iter().all(|f| f.raw_len <= frame_size));
                }
            }
        }
    }
    let want: std::collections::BTreeSet<String> = ["f32", "f16", "bf16", "q8_0", "q4_0", "q4_1"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    assert_eq!(dtypes_seen, want);
}

#[test]
fn gguf_and_safetensors_importers_yield_identical_tensors() {
    // make_tiny.py writes the same weights both ways; the GGUF side has llama q/k rows
    // permuted by llama.cpp's own converter code, so equality proves the un-permutation.
    let tmp = tempfile::tempdir().unwrap();
    for (hf, gg) in [
        ("tiny-llama", "tiny-llama.gguf"),
        ("tiny-qwen2", "tiny-qwen2.gguf"),
    ] {
        let a = import::open(&fixture(hf)).unwrap();
        let b = import::open(&fixture(gg)).unwrap();
        let (mut ca, mut cb) = (a.arch.clone(), b.arch.clone());
        ca.name.clear();
        cb.name.clear();
        assert_eq!(ca, cb, "{hf} vs {gg}: configs differ");
        assert_eq!(a.special.eos, b.special.eos);
        assert_eq!(a.special.end_tokens, b.special.end_tokens);
        assert_eq!(a.chat_template, b.chat_template);
        let sa = read_all(&pack_to(
            &a,
            &tmp.path().join(hf),
            Codec::Zstd { level: 1 },
            1 << 20,
        ));
        let sb = read_all(&pack_to(&b, &tmp.path().join(gg), Codec::Lz4, 8192));
        assert_eq!(sa.keys().collect::<Vec<_>>(), sb.keys().collect::<Vec<_>>());
        for (name, ta) in &sa {
            assert!(ta == &sb[name], "{hf} vs {gg}: tensor {name} differs");
        }
    }
    // The permutation is not the identity for these shapes: the raw GGUF q rows differ.
    let b = import::open(&fixture("tiny-llama.gguf")).unwrap();
    let q = &b.tensors["model.layers.1.self_attn.q_proj.weight"];
    let mut canon = vec![0u8; q.len as usize];
    b.copy_source(q, &mut canon);
    assert_ne!(canon, b.source_bytes(q));
}

#[test]
fn smollm2_packs_inspects_and_verifies() {
    let gguf = smollm2_gguf();
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("smollm2");
    let msg = sluiced_ok(&[
        "pack",
        gguf.to_str().unwrap(),
        "-o",
        out.to_str().unwrap(),
        "--codec",
        "zstd:3",
    ]);
    assert!(msg.contains("32 units"), "{msg}");
    let json: serde_json::Value =
        serde_json::from_str(&sluiced_ok(&["inspect", out.to_str().unwrap(), "--json"])).unwrap();
    let c = &json["config"];
    assert_eq!(c["arch"], "llama");
    assert_eq!(c["n_layers"], 30);
    assert_eq!(c["hidden"], 576);
    assert_eq!(c["n_heads"], 9);
    assert_eq!(c["n_kv_heads"], 3);
    assert_eq!(c["head_dim"], 64);
    assert_eq!(c["intermediate"], 1536);
    assert_eq!(c["vocab"], 49152);
    assert_eq!(c["tied_embeddings"], true);
    assert_eq!(json["tokenizer"]["tokens"], 49152);
    assert_eq!(json["tokenizer"]["pre"], "smollm");
    assert_eq!(json["chat_template"], true);
    assert_eq!(json["units"].as_array().unwrap().len(), 32);
    let dtypes: Vec<&str> = json["dtypes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["dtype"].as_str().unwrap())
        .collect();
    assert_eq!(dtypes, ["f32", "q8_0", "q4_1"]);
    let text = sluiced_ok(&["inspect", out.to_str().unwrap()]);
    assert!(
        text.contains("layers 30, hidden 576, heads 9, kv heads 3"),
        "{text}"
    );
    let ok = sluiced_ok(&["verify", out.to_str().unwrap()]);
    assert!(ok.starts_with("ok: 32 units"), "{ok}");

    // The store's tensors are the GGUF's, un-permuted where llama permutes.
    let model = import::open(&gguf).unwrap();
    let store = Store::open(&out).unwrap();
    let got = read_all(&store);
    for (name, t) in &model.tensors {
        let mut want = vec![0u8; t.len as usize];
        model.copy_source(t, &mut want);
        assert!(got[name].2 == want, "tensor {name} differs");
    }
    assert_eq!(store.units()[0].kind, UnitKind::Embedding);
    assert_eq!(store.units()[31].kind, UnitKind::Head);
    assert_eq!(store.manifest().special.end_tokens, vec![2]);
}

#[test]
fn smollm2_norm_vectors_share_a_frame_per_layer_in_the_float_codecs_top_split_and_read_back() {
    // A GGUF's F32 norm vectors (bf16 values near a centre): pack lays a unit's vectors
    // out first and cuts each layer's two into one frame, which the float codec stores in
    // its five-plane F32Top layout (format 9); the manifest check accepts it and the
    // reader decodes the GGUF's bytes.
    let gguf = smollm2_gguf();
    let tmp = tempfile::tempdir().unwrap();
    let model = import::open(&gguf).unwrap();
    let store = pack_to(&model, &tmp.path().join("float"), Codec::Float, 1 << 20);
    let mut norm_frames = 0;
    for u in store
        .units()
        .iter()
        .filter(|u| matches!(u.kind, UnitKind::Decoder(_)))
    {
        let [a, b] = [&u.tensors[0], &u.tensors[1]];
        assert!(
            a.name.ends_with("input_layernorm.weight")
                && b.name.ends_with("post_attention_layernorm.weight"),
            "{}: the vectors first, in order: {} {}",
            u.kind,
            a.name,
            b.name
        );
        let f = &u.frames[0];
        assert_eq!(
            (f.raw_offset, f.raw_len as u64),
            (0, b.offset + b.len),
            "{}: one frame for both norms",
            u.kind
        );
        assert_eq!(f.codec, Codec::Float, "{}", u.kind);
        norm_frames += (f.planes.len() == 5) as usize;
        assert!(u.frames[1].raw_offset >= b.offset + b.len);
    }
    assert!(
        norm_frames >= 29,
        "{norm_frames} F32Top frames of SmolLM2's 30 layers' norm pairs"
    );
    let got = read_all(&store);
    for (name, t) in &model.tensors {
        let mut want = vec![0u8; t.len as usize];
        model.copy_source(t, &mut want);
        assert!(got[name].2 == want, "tensor {name} differs");
    }
}

#[test]
fn the_shared_code_census_sees_every_small_frame_as_pack_cuts_it() {
    // 4 KiB frames cut a synthetic model's 16 KiB f32 matrices (a frame a piece of a
    // tensor) and join each layer's two norms: the store's shared codes are the census of
    // its small frames' own bytes, as the reader decodes them.
    use sluice::store::codec::{CodeCensus, SHARED_FRAME_BYTES_MAX};
    let spec = import::synth::SynthSpec::llama_like(64, 2, sluice::dtype::DType::F32);
    let model = import::synth::model(&spec);
    let tmp = tempfile::tempdir().unwrap();
    let store = pack_to(&model, &tmp.path().join("s"), Codec::Float, 4096);
    let file = store.open_weights().unwrap();
    let mut dec = store.frame_decoder(4096).unwrap();
    let (mut census, mut pieces_of_tensors) = (CodeCensus::default(), 0);
    for (i, u) in store.units().iter().enumerate() {
        let mut raw = vec![0u8; u.raw_len as usize];
        store
            .read_unit(&file, i, &mut Vec::new(), &mut raw, &mut dec)
            .unwrap();
        for f in &u.frames {
            let t = &u.tensors[u.tensor_at(f.raw_offset).unwrap()];
            if t.len as usize <= SHARED_FRAME_BYTES_MAX {
                pieces_of_tensors += ((f.raw_len as u64) < t.len) as usize;
                let at = f.raw_offset as usize;
                census.add(&raw[at..at + f.raw_len as usize], t.dtype);
            }
        }
    }
    assert!(pieces_of_tensors > 0, "no frame holds a piece of a tensor");
    let codes = &store.manifest().codes;
    assert!(!codes.is_empty());
    assert_eq!(*codes, census.codes());
}

#[test]
fn an_untied_embedding_is_cut_in_small_frames_so_a_gathered_row_reads_little() {
    // A streamed embedding costs a frame per distinct token of a step. An untied table (a
    // synthetic model's, 4096 rows) is cut in frames of 64 KiB whichever codec the store
    // names, but the float codec on a float table; the layers keep the store's frame size
    // (256 KiB here). A tied table (SmolLM2's, which streams whole as the head) keeps it
    // too. Every store verifies.
    let tmp = tempfile::tempdir().unwrap();
    for (codec, dtype, emb_want) in [
        ("none", "q8_0", 64 << 10),
        ("zstd:1", "q8_0", 64 << 10),
        ("float", "bf16", 256 << 10),
    ] {
        let out = tmp.path().join(format!("{codec}-{dtype}"));
        let o = out.to_str().unwrap();
        sluiced_ok(&[
            "synth",
            "-o",
            o,
            "--layers",
            "2",
            "--hidden",
            "256",
            "--intermediate",
            "1024",
            "--heads",
            "4",
            "--kv-heads",
            "2",
            "--vocab",
            "4096",
            "--dtype",
            dtype,
            "--codec",
            codec,
            "--frame-size",
            "256KiB",
        ]);
        let store = Store::open(&out).unwrap();
        let largest = |u: &sluice::store::LayerUnit| u.frames.iter().map(|f| f.raw_len).max();
        let units = store.units();
        assert_eq!(units[0].kind, UnitKind::Embedding);
        assert_eq!(
            largest(&units[0]),
            Some(emb_want),
            "{codec} {dtype}: the table's frames"
        );
        let layers = units[1..].iter().filter_map(largest).max();
        assert_eq!(
            layers,
            Some(256 << 10),
            "{codec} {dtype}: the layers' frames"
        );
        sluiced_ok(&["verify", o]);
    }
    let model = import::open(&smollm2_gguf()).unwrap();
    let store = pack_to(&model, &tmp.path().join("smollm2"), Codec::None, 256 << 10);
    let emb = store.units()[0].frames.iter().map(|f| f.raw_len).max();
    assert_eq!(
        emb,
        Some(256 << 10),
        "SmolLM2's tied table keeps the store's frames"
    );
}

#[test]
fn bench_codec_measures_every_codec_on_the_same_bytes_of_each_dtype() {
    // A safetensors shard (f32, f16 and bf16 tensors) and a GGUF (quantized and f32).
    for (src, dtypes) in [
        (
            fixture("tiny-llama/model-00002-of-00002.safetensors"),
            &["bf16", "f16", "f32"][..],
        ),
        (
            fixture("tiny-llama-q.gguf"),
            &["f32", "q4_0", "q4_1", "q8_0"][..],
        ),
    ] {
        let out = sluiced_ok(&["bench-codec", src.to_str().unwrap(), "--json"]);
        let j: serde_json::Value = serde_json::from_str(&out).unwrap();
        let groups = j["groups"].as_array().unwrap();
        // A model sluice imports is cut as pack cuts it: the f32 vectors of a layer share
        // a frame. The shard alone is not a model, and its tensors are cut one by one.
        for g in groups {
            let (framing, tensors, frames) = (
                g["framing"].as_str().unwrap(),
                g["tensors"].as_u64().unwrap(),
                g["frames"].as_u64().unwrap(),
            );
            if src.extension().is_some_and(|e| e == "gguf") {
                assert_eq!(framing, "pack", "{g}");
                if g["dtype"] == "f32" {
                    assert!(frames < tensors, "{g}");
                }
            } else {
                assert_eq!(framing, "tensor", "{g}");
                assert!(frames >= tensors, "{g}");
            }
        }
        let seen: Vec<&str> = groups
            .iter()
            .map(|g| g["dtype"].as_str().unwrap())
            .collect();
        assert_eq!(seen, dtypes, "{}", src.display());
        for g in groups {
            let codecs: Vec<&str> = g["codecs"]
                .as_array()
                .unwrap()
                .iter()
                .map(|c| c["codec"].as_str().unwrap())
                .collect();
            assert_eq!(
                codecs,
                ["none", "lz4", "zstd:1", "zstd:3", "float", "float-fast"]
            );
            for c in g["codecs"].as_array().unwrap() {
                let ratio = c["ratio"].as_f64().unwrap();
                // Kept raw where coding does not pay: never more than the raw bytes.
                assert!(ratio > 0.0 && ratio <= 1.0, "{g}");
                if c["codec"] == "none" {
                    assert_eq!(ratio, 1.0);
                }
                assert!(c["decompress_gbps"].as_f64().unwrap() > 0.0, "{g}");
                assert!(c["compress_gbps"].as_f64().unwrap() > 0.0, "{g}");
            }
        }
    }
    let e = sluiced_err(&["bench-codec", "/nonexistent/model.gguf"]);
    assert!(e.contains("/nonexistent/model.gguf"), "{e}");
}

#[test]
fn codec_auto_follows_the_disk_it_is_told_and_round_trips() {
    // tiny-qwen3 is bf16. A slow disk: the smallest ratio (the float codec on the
    // matrices); a disk faster than any decoder at one worker: every frame raw (a copy;
    // only `--link` links). Either way every tensor reads back as imported.
    let tmp = tempfile::tempdir().unwrap();
    let model = import::open(&fixture("tiny-qwen3")).unwrap();
    let want = read_all(&pack_to(
        &model,
        &tmp.path().join("none"),
        Codec::None,
        4096,
    ));
    for (disk, expect) in [("0.05", Codec::Float), ("1000", Codec::None)] {
        let out = tmp.path().join(format!("auto-{disk}"));
        let o = sluiced_ok(&[
            "pack",
            fixture("tiny-qwen3").to_str().unwrap(),
            "-o",
            out.to_str().unwrap(),
            "--codec",
            "auto",
            "--disk-gbps",
            disk,
            "--decode-workers",
            "1",
        ]);
        assert!(o.contains("--codec auto for a disk of"), "{o}");
        assert!(
            o.contains("bf16: ratio/GB/s->effective: none 1.000/"),
            "{o}"
        );
        let store = Store::open(&out).unwrap();
        let frames: Vec<Codec> = store
            .units()
            .iter()
            .flat_map(|u| u.frames.iter().map(|f| f.codec))
            .collect();
        if expect == Codec::None {
            // Every frame is the source's bytes again: auto stores every tensor raw (read
            // straight into the staging slots), still a copy (it streams faster than a
            // linked store under a tight budget), and names `--link` as what would save
            // the disk.
            assert!(
                frames.iter().all(|&c| c == Codec::None),
                "{disk}: {frames:?}"
            );
            assert!(
                o.contains("every tensor is stored raw")
                    && o.contains("`pack --link` would point at it instead of copying it"),
                "{o}"
            );
            assert!(out.join("weights.bin").exists());
            assert!(store.manifest().link.is_none(), "{disk}");
        } else {
            assert!(frames.contains(&expect), "{disk}: {frames:?}");
            assert!(o.contains("(at least 3 %)"), "{o}");
        }
        assert_eq!(store.manifest().codec, expect, "{disk}");
        assert!(read_all(&store) == want, "{disk}: tensors differ");
    }
    let e = sluiced_err(&[
        "pack",
        fixture("tiny-qwen3").to_str().unwrap(),
        "-o",
        tmp.path().join("x").to_str().unwrap(),
        "--disk-gbps",
        "2",
    ]);
    assert!(
        e.contains("--disk-gbps and --decode-workers go with --codec auto"),
        "{e}"
    );
    let e = sluiced_err(&[
        "pack",
        fixture("tiny-qwen3").to_str().unwrap(),
        "-o",
        tmp.path().join("y").to_str().unwrap(),
        "--codec",
        "brotli",
    ]);
    assert!(e.contains("unknown codec \"brotli\""), "{e}");
}

/// The checksums sluice writes and checks (`util::xxh3`, twox-hash) are the ones stores
/// of earlier builds hold (xxhash-rust's XXH3-64): every length through the short, mid and
/// long inputs' paths (0–16, 17–128, 129–240, then stripes and 1 KiB blocks), every start
/// offset in a word, and a few frames of a megabyte or so.
#[test]
fn frame_checksums_are_the_xxh3_earlier_stores_hold() {
    let mut rng = sluice::util::rng::Rng::new(0x9e37_79b9_7f4a_7c15);
    let bytes: Vec<u8> = (0..(1 << 20) + 4099)
        .map(|_| (rng.next_u64() >> 24) as u8)
        .collect();
    let mut seen = std::collections::HashSet::new();
    for len in (0..=2200).chain([4095, 4096, 65_536, 1 << 20, (1 << 20) + 4091]) {
        for off in [0, 1, 3, 7] {
            let b = &bytes[off..off + len];
            let want = xxhash_rust::xxh3::xxh3_64(b);
            assert_eq!(sluice::util::xxh3(b), want, "{len} bytes at offset {off}");
            seen.insert(want);
        }
    }
    // The inputs differ, so must their checksums (a constant function would pass above
    // only if xxhash-rust's were one too).
    assert!(seen.len() > 8000, "{} distinct checksums", seen.len());
}
