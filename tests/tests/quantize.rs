//! `sluiced pack --quantize` on a whole model, against llama.cpp's own quantizer: the
//! stores it writes hold, tensor for tensor, the bytes of `llama_model_quantize --pure`'s
//! GGUF (tests/fixtures/make_tiny_quantized.py) packed as it is, from a source of f16, bf16
//! and f32 tensors; and the flag's bad uses are refused with what to do. (The quantizers'
//! blocks against ggml's, row by row and for every type, are in quants.rs.)

use serde_json::Value;
use sluice_tests::{fixture, sluiced_err, sluiced_ok};

/// Every tensor of the store at `dir` (`sluiced inspect --tensors --json`): (name, dtype,
/// shape, bytes, digest of its decoded bytes), in blob order.
fn tensors(dir: &std::path::Path) -> Vec<(String, String, String, u64, String)> {
    let out = sluiced_ok(&[
        "inspect",
        "--tensors",
        "--json",
        dir.to_str().expect("path"),
    ]);
    let j: Value = serde_json::from_str(&out).expect("inspect's JSON");
    j["tensors"]
        .as_array()
        .expect("tensors")
        .iter()
        .map(|t| {
            (
                t["name"].as_str().expect("name").to_string(),
                t["dtype"].as_str().expect("dtype").to_string(),
                t["shape"].to_string(),
                t["bytes"].as_u64().expect("bytes"),
                t["xxh3"].as_str().expect("xxh3").to_string(),
            )
        })
        .collect()
}

#[test]
fn pack_quantize_writes_the_tensors_llama_quantize_pure_writes() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let src = fixture("tiny-llama.gguf");
    for (t, stored_as) in [
        ("q8_0", "q8_0"),
        ("q4_0", "q4_0"),
        ("q5_1", "q5_1"),
        ("q4_k", "q5_0"),
    ] {
        let ours = tmp.path().join(format!("ours-{t}"));
        let theirs = tmp.path().join(format!("llama-{t}"));
        let log = sluiced_ok(&[
            "pack",
            src.to_str().expect("path"),
            "-o",
            ours.to_str().expect("path"),
            "--quantize",
            t,
            "--codec",
            "none",
        ]);
        let reference = fixture(&format!("tiny-llama-pure-{t}.gguf"));
        sluiced_ok(&[
            "pack",
            reference.to_str().expect("path"),
            "-o",
            theirs.to_str().expect("path"),
            "--codec",
            "none",
        ]);
        let (a, b) = (tensors(&ours), tensors(&theirs));
        assert_eq!(a.len(), 21, "{t}: {a:?}");
        for (x, y) in a.iter().zip(&b) {
            assert_eq!(x, y, "{t}: ours, then llama.cpp's\n{log}");
        }
        assert_eq!(a.len(), b.len());
        // Every matrix took the type (or its fallback); vectors stayed f32.
        let matrices = a.iter().filter(|x| x.1 == stored_as).count();
        let vectors = a.iter().filter(|x| x.1 == "f32").count();
        assert_eq!((matrices, vectors), (16, 5), "{t}: {a:?}");
        assert!(log.contains(&format!("to {stored_as}")), "{log}");
    }
}

#[test]
fn bad_quantize_uses_are_refused_with_what_to_do() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let src = fixture("tiny-llama.gguf");
    let out = tmp.path().join("s");
    let (src, out) = (src.to_str().expect("path"), out.to_str().expect("path"));
    let e = sluiced_err(&["pack", src, "-o", out, "--quantize", "q7_k"]);
    assert!(
        e.contains("--quantize q7_k") && e.contains("q4_k") && e.contains("q8_0"),
        "{e}"
    );
    let e = sluiced_err(&["pack", src, "-o", out, "--quantize", "iq4_nl"]);
    assert!(e.contains("expected one of"), "{e}");
    let e = sluiced_err(&["pack", src, "-o", out, "--quantize", "q8_0", "--link"]);
    assert!(e.contains("--link") && e.contains("--quantize"), "{e}");
    assert!(
        !std::path::Path::new(out).exists(),
        "a refused pack wrote {out}"
    );
}
