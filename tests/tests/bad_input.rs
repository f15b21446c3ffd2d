//! Every bad input gets a clear error naming what and where, never a panic and never a
//! silently wrong tensor; an interrupted pack leaves no store behind.

use sluice::import;
use sluice::store::verify::verify;
use sluice::store::{Store, StoreError};
use sluice_tests::*;
use std::path::{Path, PathBuf};

fn import_err(path: &Path) -> String {
    match import::open(path).and_then(|m| m.units().map(|_| ())) {
        Ok(()) => panic!("{} imported but should not have", path.display()),
        Err(e) => e.to_string(),
    }
}

fn find(hay: &[u8], needle: &[u8]) -> usize {
    hay.windows(needle.len())
        .position(|w| w == needle)
        .expect("needle in file")
}

#[test]
fn truncated_gguf_is_an_error_at_every_cut() {
    let bytes = std::fs::read(fixture("tiny-llama.gguf")).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("cut.gguf");
    let mut cuts: Vec<usize> = (0..bytes.len()).step_by(1009).collect();
    cuts.extend([4, 8, 16, 23, 24, 25, bytes.len() - 1]);
    for cut in cuts {
        std::fs::write(&path, &bytes[..cut]).unwrap();
        let e = import_err(&path);
        assert!(
            e.contains("cut.gguf"),
            "cut at {cut}: error does not name the file: {e}"
        );
        if cut >= 4 {
            assert!(
                e.contains("truncated") || e.contains("offset"),
                "cut at {cut}: {e}"
            );
        }
    }
    // In the data section the error names the tensor that runs past the end.
    std::fs::write(&path, &bytes[..bytes.len() - 100]).unwrap();
    let e = import_err(&path);
    assert!(
        e.contains("tensor") && e.contains("past the end of the file"),
        "{e}"
    );
    // Through the CLI: an error, a non-zero exit, no panic, no store.
    let out = tmp.path().join("store");
    let e = sluiced_err(&["pack", path.to_str().unwrap(), "-o", out.to_str().unwrap()]);
    assert!(e.contains("cut.gguf"), "{e}");
    assert!(!out.exists());
}

#[test]
fn corrupted_gguf_headers_are_clear_errors() {
    let bytes = std::fs::read(fixture("tiny-llama.gguf")).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("bad.gguf");
    let write = |b: &[u8]| std::fs::write(&path, b).unwrap();

    // Wrong magic: not recognised as GGUF at all.
    let mut b = bytes.clone();
    b[0] = b'X';
    write(&b);
    assert!(import_err(&path).contains("neither a GGUF file"));
    assert!(sluice::import::gguf::parse(&b, &path)
        .err()
        .unwrap()
        .to_string()
        .contains("bad magic"));

    // Unsupported version.
    let mut b = bytes.clone();
    b[4..8].copy_from_slice(&7u32.to_le_bytes());
    write(&b);
    assert!(import_err(&path).contains("GGUF version 7"));

    // A tensor count no file could hold is refused before any allocation.
    let mut b = bytes.clone();
    b[8..16].copy_from_slice(&u64::MAX.to_le_bytes());
    write(&b);
    let e = import_err(&path);
    assert!(e.contains("tensor count") && e.contains("offset 8"), "{e}");

    // An unsupported dtype names the tensor, the type and what is supported.
    let name = b"blk.0.attn_q.weight";
    let type_at = find(&bytes, name) + name.len() + 4 + 2 * 8;
    for (id, want) in [(16u32, "IQ2_XXS"), (99, "unknown")] {
        let mut b = bytes.clone();
        b[type_at..type_at + 4].copy_from_slice(&id.to_le_bytes());
        write(&b);
        let e = import_err(&path);
        assert!(
            e.contains("blk.0.attn_q.weight")
                && e.contains(&format!("GGML type {id} ({want})"))
                && e.contains("Q4_K")
                && e.contains("llama-quantize"),
            "{e}"
        );
    }

    // A K-quant tensor whose rows (64 here) are not whole super-blocks of 256.
    let mut b = bytes.clone();
    b[type_at..type_at + 4].copy_from_slice(&12u32.to_le_bytes()); // Q4_K
    write(&b);
    let e = import_err(&path);
    assert!(
        e.contains("blk.0.attn_q.weight")
            && e.contains("a row of 64 elements is not a whole number of Q4_K blocks (256"),
        "{e}"
    );

    // An unknown architecture is named.
    let mut b = bytes.clone();
    let at = find(&b, b"general.architecture") + "general.architecture".len() + 4 + 8;
    b[at..at + 5].copy_from_slice(b"mamba");
    write(&b);
    let e = import_err(&path);
    assert!(e.contains("\"mamba\"") && e.contains("supports"), "{e}");
}

#[test]
fn a_truncated_k_quant_block_and_a_vocabulary_without_byte_fallback_are_named() {
    // The last tensor in the file becomes Q4_K rows of 256 (144 bytes each), one row more
    // than the file has room for: its final block is cut.
    let bytes = std::fs::read(fixture("tiny-llama.gguf")).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("cut.gguf");
    let g = sluice::import::gguf::parse(&bytes, &path).unwrap();
    let last = g.tensors.iter().max_by_key(|t| t.offset).unwrap();
    assert_eq!(last.dims.len(), 2, "{}", last.name);
    let room = bytes.len() as u64 - g.data_start - last.offset;
    let rows = room / 144 + 1;
    let mut b = bytes.clone();
    // Its tensor info: the name as a GGUF string (u64 length first, so that "output.weight"
    // is not found inside "blk.0.attn_output.weight"), n_dims u32, dims, type.
    let key = [
        &(last.name.len() as u64).to_le_bytes()[..],
        last.name.as_bytes(),
    ]
    .concat();
    let info = find(&b, &key) + key.len() + 4;
    b[info..info + 8].copy_from_slice(&256u64.to_le_bytes());
    b[info + 8..info + 16].copy_from_slice(&rows.to_le_bytes());
    b[info + 16..info + 20].copy_from_slice(&12u32.to_le_bytes()); // Q4_K
                                                                   // The file ends inside the last block.
    let end = g.data_start + last.offset + rows * 144;
    assert!(end > b.len() as u64 && end - (b.len() as u64) <= 144);
    std::fs::write(&path, &b).unwrap();
    let e = import_err(&path);
    assert!(
        e.contains(&format!("tensor {} (q4_k", last.name))
            && e.contains("past the end of the file")
            && e.contains("cut.gguf"),
        "{e}"
    );

    // A SentencePiece vocabulary with no <0xNN> tokens cannot cover arbitrary text.
    let vocab = sluice::store::format::GgufVocab {
        model: "llama".into(),
        pre: None,
        tokens: vec!["<unk>".into(), "<s>".into(), "\u{2581}a".into(), "b".into()],
        token_types: vec![2, 3, 1, 1],
        merges: Vec::new(),
        scores: vec![0.0, 0.0, -1.0, -2.0],
        add_space_prefix: true,
    };
    let e = sluice::text::spm::Spm::new(&vocab).err().expect("refused");
    assert!(e.contains("byte-fallback token <0x00>"), "{e}");
}

/// A copy of a fixture model directory the test may damage.
fn hf_copy(name: &str, tmp: &Path) -> PathBuf {
    let dir = tmp.join(name);
    copy_dir(&fixture(name), &dir);
    dir
}

#[test]
fn bad_hugging_face_directories_are_clear_errors() {
    let tmp = tempfile::tempdir().unwrap();

    // A truncated shard names the file.
    let dir = hf_copy("tiny-llama", &tmp.path().join("a"));
    let shard = dir.join("model-00002-of-00002.safetensors");
    let len = std::fs::metadata(&shard).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&shard)
        .unwrap()
        .set_len(len / 2)
        .unwrap();
    let e = import_err(&dir);
    assert!(
        e.contains("model-00002-of-00002.safetensors") && e.contains("invalid safetensors"),
        "{e}"
    );

    // A garbage header length.
    let dir = hf_copy("tiny-llama", &tmp.path().join("b"));
    let shard = dir.join("model-00001-of-00002.safetensors");
    let mut b = std::fs::read(&shard).unwrap();
    b[..8].copy_from_slice(&u64::MAX.to_le_bytes());
    std::fs::write(&shard, b).unwrap();
    assert!(import_err(&dir).contains("model-00001-of-00002.safetensors"));

    // An unsupported dtype names the tensor (same width, so the file stays well formed).
    let dir = hf_copy("tiny-qwen2", &tmp.path().join("c"));
    let st = dir.join("model.safetensors");
    let mut b = std::fs::read(&st).unwrap();
    let at = find(&b, b"\"F32\"");
    b[at + 1..at + 4].copy_from_slice(b"I32");
    std::fs::write(&st, b).unwrap();
    let e = import_err(&dir);
    assert!(e.contains("I32") && e.contains("tensor"), "{e}");

    // Config problems: unknown model type, a layer the weights lack, a wrong size.
    let edit_config = |sub: &str, from: &str, to: &str| -> String {
        let dir = hf_copy("tiny-llama", &tmp.path().join(sub));
        let cfg = dir.join("config.json");
        let text = std::fs::read_to_string(&cfg).unwrap();
        assert!(text.contains(from));
        std::fs::write(&cfg, text.replace(from, to)).unwrap();
        import_err(&dir)
    };
    let e = edit_config(
        "d",
        "\"model_type\": \"llama\"",
        "\"model_type\": \"gpt_neox\"",
    );
    assert!(e.contains("gpt_neox") && e.contains("config.json"), "{e}");
    let e = edit_config("e", "\"num_hidden_layers\": 2", "\"num_hidden_layers\": 3");
    assert!(
        e.contains("model.layers.2.input_layernorm.weight is missing"),
        "{e}"
    );
    let e = edit_config(
        "f",
        "\"intermediate_size\": 128",
        "\"intermediate_size\": 96",
    );
    assert!(
        e.contains("mlp.gate_proj.weight has shape [128, 64]") && e.contains("[96, 64]"),
        "{e}"
    );
    let e = edit_config("g", "\"hidden_size\": 64", "\"hidden_size\": 64,,");
    assert!(e.contains("invalid JSON at line"), "{e}");
    let e = edit_config(
        "h",
        "\"num_key_value_heads\": 2",
        "\"num_key_value_heads\": 3",
    );
    assert!(e.contains("not a multiple of 3 kv heads"), "{e}");
}

fn packed_tiny(dir: &Path, codec: &str) -> std::sync::Arc<Store> {
    pack_store(&fixture("tiny-llama"), dir, codec, 4096)
}

#[test]
fn damaged_manifests_are_clear_errors() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("s");
    packed_tiny(&dir, "zstd:3");
    let mpath = dir.join("manifest.bin");
    let good = std::fs::read(&mpath).unwrap();
    let open_err = |b: &[u8]| -> String {
        std::fs::write(&mpath, b).unwrap();
        let e = Store::open(&dir).err().expect("open must fail").to_string();
        assert!(
            e.contains("manifest.bin"),
            "error does not name the file: {e}"
        );
        e
    };
    let mut b = good.clone();
    b[0] = b'X';
    assert!(open_err(&b).contains("not a sluice manifest"));
    let mut b = good.clone();
    b[8] = 12;
    assert!(open_err(&b).contains("store format version 12"));
    // Format 6 compresses the payload; the formats before it wrote it as it is.
    let end = good.len() - 8;
    let payload = zstd::bulk::decompress(&good[20..end], 1 << 30).unwrap();
    // Format 11 appends what the source says of itself: for this model (a Hugging Face
    // directory without generation_config.json) no file type and no sampling, six zero
    // bytes. The older formats below are cut from format 10's manifest.
    assert_eq!(
        &payload[payload.len() - 6..],
        &[0u8; 6],
        "an empty SourceMeta"
    );
    let payload = payload[..payload.len() - 6].to_vec();
    let good = {
        let mut v = good[..8].to_vec();
        v.extend_from_slice(&10u32.to_le_bytes());
        let z = zstd::bulk::compress(&payload, 3).unwrap();
        v.extend_from_slice(&(z.len() as u64).to_le_bytes());
        v.extend_from_slice(&z);
        let sum = xxhash_rust::xxh3::xxh3_64(&v);
        v.extend_from_slice(&sum.to_le_bytes());
        v
    };
    std::fs::write(&mpath, &good).unwrap();
    Store::open(&dir).expect("a format-10 store opens");
    // A format-1 store (the manifest without the trailing architecture extension: four
    // zero bytes, its empty options and list, for a Llama model; nor format 3's mixture of
    // experts, one zero byte, None; nor format 4's SwiGLU clamp, one zero byte, None; nor
    // format 6's linked source, one zero byte, None; nor format 8's shared codes, one zero
    // byte, none for a zstd store) still opens, with the Llama defaults.
    let n = payload.len();
    assert_eq!(&payload[n - 8..], &[0u8; 8], "a Llama model's extensions");
    // The manifest as an older format wrote it: the payload without its last `cut` bytes,
    // uncompressed, under `version`, checksummed.
    let older = |version: u32, cut: usize| -> Vec<u8> {
        let mut v = good[..8].to_vec();
        v.extend_from_slice(&version.to_le_bytes());
        v.extend_from_slice(&((n - cut) as u64).to_le_bytes());
        v.extend_from_slice(&payload[..n - cut]);
        let sum = xxhash_rust::xxh3::xxh3_64(&v);
        v.extend_from_slice(&sum.to_le_bytes());
        v
    };
    // Format 8: the payload of 9 (which added a layout of the float codec, not a field).
    let mut v8 = good.clone();
    v8[8..12].copy_from_slice(&8u32.to_le_bytes());
    let sum = xxhash_rust::xxh3::xxh3_64(&v8[..v8.len() - 8]);
    let at = v8.len() - 8;
    v8[at..].copy_from_slice(&sum.to_le_bytes());
    std::fs::write(&mpath, &v8).unwrap();
    Store::open(&dir).expect("a format-8 store opens");
    // Format 7: compressed, without the shared codes.
    let mut v7 = good[..8].to_vec();
    v7.extend_from_slice(&7u32.to_le_bytes());
    let z = zstd::bulk::compress(&payload[..n - 1], 3).unwrap();
    v7.extend_from_slice(&(z.len() as u64).to_le_bytes());
    v7.extend_from_slice(&z);
    let sum = xxhash_rust::xxh3::xxh3_64(&v7);
    v7.extend_from_slice(&sum.to_le_bytes());
    std::fs::write(&mpath, &v7).unwrap();
    let old = Store::open(&dir).expect("a format-7 store opens");
    assert!(old.manifest().codes.is_empty());
    // Formats 5 and 4: without the link and the codes (format 5 added the float codec);
    // format 3: without the clamp; format 2: without the mixture either.
    std::fs::write(&mpath, older(5, 2)).unwrap();
    let old = Store::open(&dir).expect("a format-5 store opens");
    assert_eq!(old.manifest().link, None);
    std::fs::write(&mpath, older(4, 2)).unwrap();
    Store::open(&dir).expect("a format-4 store opens");
    std::fs::write(&mpath, older(3, 3)).unwrap();
    let old = Store::open(&dir).expect("a format-3 store opens");
    assert_eq!(old.manifest().arch.swiglu, None);
    std::fs::write(&mpath, older(2, 4)).unwrap();
    let old = Store::open(&dir).expect("a format-2 store opens");
    assert_eq!(old.manifest().arch.moe, None);
    let mut v1 = older(1, 8);
    std::fs::write(&mpath, &v1).unwrap();
    let old = Store::open(&dir).expect("a format-1 store opens");
    assert_eq!(old.manifest().arch.ext, Default::default());
    // The same bytes claiming format 2 lack the extension: an error, not a guess.
    v1.truncate(v1.len() - 8);
    v1[8..12].copy_from_slice(&2u32.to_le_bytes());
    let sum = xxhash_rust::xxh3::xxh3_64(&v1);
    v1.extend_from_slice(&sum.to_le_bytes());
    assert!(open_err(&v1).contains("payload does not decode"));
    // A format-6 payload that is not a zstd frame.
    assert!(open_err(&older(6, 0)).contains("payload does not decompress"));
    for pos in [20, good.len() / 2, good.len() - 9] {
        let mut b = good.clone();
        b[pos] ^= 1;
        assert!(open_err(&b).contains("checksum mismatch"), "flip at {pos}");
    }
    assert!(open_err(&good[..good.len() - 3]).contains("truncated"));
    assert!(open_err(&good[..10]).contains("truncated"));
    let mut b = good.clone();
    b.push(0);
    assert!(open_err(&b).contains("trailing bytes"));
    std::fs::write(&mpath, &good).unwrap();
    Store::open(&dir).unwrap();
    // A missing store directory says so.
    let e = Store::open(&tmp.path().join("nope"))
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.contains("open store directory") && e.contains("nope"),
        "{e}"
    );
}

#[test]
fn short_weights_file_is_an_error_naming_the_layer() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("s");
    let store = packed_tiny(&dir, "zstd:3");
    let last = store.units().last().unwrap().clone();
    drop(store);
    let w = dir.join("weights.bin");
    std::fs::OpenOptions::new()
        .write(true)
        .open(&w)
        .unwrap()
        .set_len(last.file_offset + 10)
        .unwrap();
    let e = Store::open(&dir).err().unwrap();
    assert!(e.is_data_loss());
    let e = e.to_string();
    assert!(
        e.contains("weights.bin") && e.contains("head") && e.contains("truncated"),
        "{e}"
    );
    let e = sluiced_err(&["verify", dir.to_str().unwrap()]);
    assert!(e.contains("weights.bin") && e.contains("truncated"), "{e}");
}

#[test]
fn a_flipped_byte_in_any_frame_is_found_and_named() {
    let tmp = tempfile::tempdir().unwrap();
    for codec in ["none", "lz4", "zstd:3", "float"] {
        let dir = tmp.path().join(codec.replace(':', "-"));
        let store = packed_tiny(&dir, codec);
        let w = dir.join("weights.bin");
        let good = std::fs::read(&w).unwrap();
        let frames: Vec<(usize, usize, u64, u64)> = store
            .units()
            .iter()
            .enumerate()
            .flat_map(|(ui, u)| {
                u.frames
                    .iter()
                    .enumerate()
                    .map(move |(fi, f)| (ui, fi, f.file_offset, f.stored_len()))
            })
            .collect();
        drop(store);
        for &(ui, fi, offset, len) in &frames {
            for pos in [offset, offset + len / 2, offset + len - 1] {
                let mut b = good.clone();
                b[pos as usize] ^= 0x10;
                std::fs::write(&w, &b).unwrap();
                let store = Store::open(&dir).unwrap();
                let report = verify(&store, |_| {}).unwrap();
                assert_eq!(
                    report.faults.len(),
                    1,
                    "{codec}: flip at {pos} in unit {ui} frame {fi}: {:?}",
                    report.faults
                );
                match &report.faults[0] {
                    StoreError::Frame {
                        path,
                        unit,
                        frame,
                        offset: o,
                        ..
                    } => {
                        assert_eq!(
                            (unit.as_str(), *frame, *o),
                            (store.units()[ui].kind.to_string().as_str(), fi, offset)
                        );
                        assert!(path.ends_with("weights.bin"));
                    }
                    other => panic!("unexpected fault {other}"),
                }
                // The plain reader refuses the unit too: no silently wrong tensor.
                let file = store.open_weights().unwrap();
                let mut dec = store.frame_decoder(4096).unwrap();
                let mut raw = vec![0u8; store.units()[ui].raw_len as usize];
                let e = store
                    .read_unit(&file, ui, &mut Vec::new(), &mut raw, &mut dec)
                    .unwrap_err();
                assert!(e.is_data_loss());
            }
        }
        std::fs::write(&w, &good).unwrap();
        // The CLI names file, layer, frame and offset, and exits non-zero.
        let (ui, fi, offset, len) = frames[frames.len() / 2];
        let mut b = good.clone();
        b[(offset + len / 2) as usize] ^= 0x10;
        std::fs::write(&w, &b).unwrap();
        let e = sluiced_err(&["verify", dir.to_str().unwrap()]);
        let unit = Store::open(&dir).unwrap().units()[ui].kind.to_string();
        for want in [
            "weights.bin".to_string(),
            format!("{unit}, frame {fi} at offset {offset}"),
            "1 of".into(),
        ] {
            assert!(
                e.contains(&want),
                "{codec}: verify output lacks {want:?}: {e}"
            );
        }
    }
}

#[test]
fn an_interrupted_pack_leaves_no_store_behind() {
    let gguf = smollm2_gguf();
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("smollm2");
    // zstd:19 takes many seconds on this model: kill the pack while it writes.
    let mut child = std::process::Command::new(bin("sluiced"))
        .args([
            "pack",
            gguf.to_str().unwrap(),
            "-o",
            out.to_str().unwrap(),
            "--codec",
            "zstd:19",
        ])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let partial = tmp.path().join(".smollm2.partial");
    let t0 = std::time::Instant::now();
    while !partial.join("weights.bin").exists() && t0.elapsed().as_secs() < 30 {
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    std::thread::sleep(std::time::Duration::from_millis(300));
    assert!(
        child.try_wait().unwrap().is_none(),
        "pack finished before it could be interrupted"
    );
    child.kill().unwrap();
    child.wait().unwrap();
    assert!(!out.exists(), "a killed pack left a store at the target");
    assert!(Store::open(&out).is_err());
    // A rerun removes the stale partial directory and completes.
    sluiced_ok(&[
        "pack",
        gguf.to_str().unwrap(),
        "-o",
        out.to_str().unwrap(),
        "--codec",
        "lz4",
    ]);
    assert!(!partial.exists());
    sluiced_ok(&["verify", out.to_str().unwrap()]);
    // Packing over an existing store needs --force.
    let e = sluiced_err(&["pack", gguf.to_str().unwrap(), "-o", out.to_str().unwrap()]);
    assert!(e.contains("already exists") && e.contains("--force"), "{e}");
}

#[test]
fn a_gguf_or_a_missing_path_given_for_a_store_says_what_to_do_once() {
    let gguf = fixture("tiny-llama.gguf");
    let e = sluiced_err(&["run", gguf.to_str().unwrap(), "--prompt", "hi"]);
    assert!(
        e.contains("this is a GGUF file, not a sluice store") && e.contains("sluiced pack"),
        "{e}"
    );
    let e = sluiced_err(&["run", "/nonexistent/store", "--prompt", "hi"]);
    assert_eq!(
        e.matches("No such file or directory").count(),
        1,
        "the OS error once: {e}"
    );
    assert!(e.contains("/nonexistent/store"), "{e}");
}

#[test]
fn hostile_model_files_are_refused_before_they_cost_memory() {
    let bytes = std::fs::read(fixture("tiny-llama.gguf")).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("hostile.gguf");
    let write = |b: &[u8]| std::fs::write(&path, b).unwrap();

    // A metadata string, and an array, that claim far more than the file holds.
    let key = b"general.architecture";
    let len_at = find(&bytes, key) + key.len() + 4;
    let mut b = bytes.clone();
    b[len_at..len_at + 8].copy_from_slice(&(1u64 << 40).to_le_bytes());
    write(&b);
    let e = import_err(&path);
    assert!(e.contains("hostile.gguf") && e.contains("offset"), "{e}");
    let key = b"tokenizer.ggml.tokens";
    let count_at = find(&bytes, key) + key.len() + 4 + 4;
    let mut b = bytes.clone();
    b[count_at..count_at + 8].copy_from_slice(&(u64::MAX / 2).to_le_bytes());
    write(&b);
    let e = import_err(&path);
    assert!(
        e.contains("tokenizer.ggml.tokens") && e.contains("offset"),
        "{e}"
    );

    // Two tensors that share bytes: the second one's offset moved onto the first's.
    let g = sluice::import::gguf::parse(&bytes, &path).unwrap();
    let (first, second) = (&g.tensors[0], &g.tensors[1]);
    let name = [
        &(second.name.len() as u64).to_le_bytes()[..],
        second.name.as_bytes(),
    ]
    .concat();
    let offset_at = find(&bytes, &name) + name.len() + 4 + 8 * second.dims.len() + 4;
    let mut b = bytes.clone();
    b[offset_at..offset_at + 8].copy_from_slice(&first.offset.to_le_bytes());
    write(&b);
    let e = import_err(&path);
    assert!(
        e.contains("overlap") && e.contains(&first.name) && e.contains(&second.name),
        "{e}"
    );

    // A safetensors header of 100 MB is refused before it is parsed.
    let dir = hf_copy("tiny-llama", tmp.path());
    let shard = dir.join("model-00001-of-00002.safetensors");
    let mut st = std::fs::read(&shard).unwrap();
    st[..8].copy_from_slice(&100_000_000u64.to_le_bytes());
    std::fs::write(&shard, &st).unwrap();
    let e = import_err(&dir);
    assert!(
        e.contains("model-00001-of-00002.safetensors") && e.contains("header claims 100000000"),
        "{e}"
    );

    // A config.json of a gigabyte (sparse: it costs no disk) is refused unread.
    let dir = hf_copy("tiny-llama", &tmp.path().join("big"));
    std::fs::File::options()
        .write(true)
        .open(dir.join("config.json"))
        .unwrap()
        .set_len(1 << 30)
        .unwrap();
    let e = import_err(&dir);
    assert!(
        e.contains("config.json") && e.contains("1073741824 bytes"),
        "{e}"
    );

    // A symlink out of the model directory is refused, naming it and its target...
    let dir = hf_copy("tiny-llama", &tmp.path().join("link"));
    let outside = tmp.path().join("elsewhere.json");
    std::fs::copy(dir.join("tokenizer.json"), &outside).unwrap();
    std::fs::remove_file(dir.join("tokenizer.json")).unwrap();
    std::os::unix::fs::symlink(&outside, dir.join("tokenizer.json")).unwrap();
    let e = import_err(&dir);
    assert!(
        e.contains("tokenizer.json") && e.contains("elsewhere.json") && e.contains("symlink"),
        "{e}"
    );
    // ...but the Hugging Face hub cache's layout, snapshots linking to blobs, imports.
    let repo = tmp.path().join("hub/models--tiny--llama");
    let snap = repo.join("snapshots/0123abc");
    std::fs::create_dir_all(&snap).unwrap();
    std::fs::create_dir_all(repo.join("blobs")).unwrap();
    let src = fixture("tiny-llama");
    for (i, entry) in std::fs::read_dir(&src).unwrap().enumerate() {
        let f = entry.unwrap().path();
        let blob = repo.join("blobs").join(format!("blob{i}"));
        std::fs::copy(&f, &blob).unwrap();
        std::os::unix::fs::symlink(
            Path::new("../../blobs").join(format!("blob{i}")),
            snap.join(f.file_name().unwrap()),
        )
        .unwrap();
    }
    let m = import::open(&snap).expect("a hub cache snapshot imports");
    assert!(m.units().is_ok());
}

/// Doubles a string 40 times: a terabyte asked for in a few hundred instructions, under
/// every minijinja bound (fuel, recursion, output).
const DOUBLING: &str = "{% set s = namespace(v='xxxxxxxx') %}{% for i in range(40) %}{% set s.v = s.v ~ s.v %}{% endfor %}{{ s.v|length }}";

#[test]
fn a_chat_template_that_builds_a_huge_string_kills_only_its_worker() {
    use sluice::text::sandbox::TemplateSandbox;
    use sluice::text::{ChatMessage, ChatTemplate};
    let sandbox = std::sync::Arc::new(TemplateSandbox::new(bin("sluiced")));
    let msgs = [ChatMessage::new("user", "hello")];
    let hostile =
        ChatTemplate::sandboxed(DOUBLING, "<s>".into(), "</s>".into(), sandbox.clone()).unwrap();
    let chatml =
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}";
    let good = ChatTemplate::sandboxed(chatml, "<s>".into(), "</s>".into(), sandbox).unwrap();
    for _ in 0..2 {
        let t0 = std::time::Instant::now();
        let e = hostile.render(&msgs, true).unwrap_err().to_string();
        assert!(
            e.contains("1024 MiB its worker process may use") && e.contains("hostile"),
            "{e}"
        );
        assert!(t0.elapsed().as_secs() < 10, "{:?}", t0.elapsed());
        // The next render gets a fresh worker.
        assert_eq!(
            good.render(&msgs, false).unwrap(),
            "<|im_start|>user\nhello<|im_end|>\n"
        );
    }
}

#[test]
fn a_daemon_whose_model_has_a_hostile_template_refuses_chats_and_keeps_serving() {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("hostile-llama");
    copy_dir(&fixture("tiny-llama"), &src);
    let cfg = src.join("tokenizer_config.json");
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&cfg).unwrap()).unwrap();
    v["chat_template"] = DOUBLING.into();
    std::fs::write(&cfg, v.to_string()).unwrap();
    let store = tmp.path().join("store");
    sluiced_ok(&["pack", src.to_str().unwrap(), "-o", store.to_str().unwrap()]);
    let store = store.to_str().unwrap().to_string();
    let d = Daemon::serve(tmp, &["--model", &store], &["--max-context", "64"]);
    let post = |path: &str, body: &str| post_json(&d.http, path, body);
    let chat = r#"{"messages":[{"role":"user","content":"hi"}],"max_tokens":2}"#;
    for _ in 0..2 {
        let (code, body) = post("/v1/chat/completions", chat);
        assert_eq!(code, 400, "{body}");
        assert!(body.contains("worker process may use"), "{body}");
        // A completion needs no template: it is served.
        let (code, body) = post("/v1/completions", r#"{"prompt":"hi","max_tokens":2}"#);
        assert_eq!(code, 200, "{body}");
    }
    let mut d = d;
    assert!(d.child.try_wait().unwrap().is_none(), "the daemon died");
}

/// OpenAI's gpt-oss checkpoints hold their experts as MXFP4 blocks and scales
/// (`mlp.experts.gate_up_proj_blocks`, `_scales`): a blocks tensor without its scales, or
/// of the wrong shape, is refused naming the tensor.
#[test]
fn a_gpt_oss_mxfp4_expert_without_its_scales_or_of_the_wrong_shape_is_refused() {
    use safetensors::tensor::{serialize_to_file, Dtype, TensorView};
    let tmp = tempfile::tempdir().unwrap();
    let write = |dir: &Path, tensors: &[(&str, Vec<usize>)]| {
        std::fs::create_dir_all(dir).unwrap();
        for f in ["config.json", "tokenizer.json", "tokenizer_config.json"] {
            std::fs::copy(fixture("tiny-gptoss-mxfp4-hf").join(f), dir.join(f)).unwrap();
        }
        let data: Vec<Vec<u8>> = tensors
            .iter()
            .map(|(_, s)| vec![0u8; s.iter().product()])
            .collect();
        let views: Vec<(String, TensorView)> = tensors
            .iter()
            .zip(&data)
            .map(|((n, s), d)| {
                (
                    n.to_string(),
                    TensorView::new(Dtype::U8, s.clone(), d).unwrap(),
                )
            })
            .collect();
        serialize_to_file(views, None, &dir.join("model.safetensors")).unwrap();
    };
    let name = "model.layers.0.mlp.experts.gate_up_proj";
    let dir = tmp.path().join("no-scales");
    write(&dir, &[(&format!("{name}_blocks"), vec![4, 192, 2, 16])]);
    let e = import_err(&dir);
    assert!(
        e.contains(&format!("{name}_blocks")) && e.contains(&format!("{name}_scales")),
        "{e}"
    );
    let dir = tmp.path().join("wrong-shape");
    write(
        &dir,
        &[
            (&format!("{name}_blocks"), vec![4, 96, 2, 16]),
            (&format!("{name}_scales"), vec![4, 96, 2]),
        ],
    );
    let e = import_err(&dir);
    assert!(e.contains(name) && e.contains("[4, 192, 2, 16]"), "{e}");
}
