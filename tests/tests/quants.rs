//! Every GGML block type sluice decodes, bit for bit against gguf-py's
//! `gguf.quants.dequantize` (tests/fixtures/make_quant_reference.py wrote its outputs):
//! seeded random blocks and blocks with extreme scales (the largest finite f16 and its
//! negative, the smallest subnormal, zero, infinity; E8M0 exponents 0, 1, 2, 127, 254, 255).

use sluice::dtype::ggml::dequantize;
use sluice::dtype::{DType, ALL_DTYPES};

/// The formats of K-quant-era GGUFs, the ones the gguf-py fixtures cover.
fn new_formats() -> impl Iterator<Item = DType> {
    ALL_DTYPES
        .into_iter()
        .filter(|t| t.is_quantized() && !matches!(t, DType::Q8_0 | DType::Q4_0 | DType::Q4_1))
}
use sluice_tests::fixture;

fn reference(t: DType) -> (Vec<u8>, Vec<f32>) {
    let dir = fixture("reference/quants");
    let name = t.name();
    let input = std::fs::read(dir.join(format!("{name}.in")))
        .unwrap_or_else(|e| panic!("{name}.in: {e} (run tests/fixtures/make_quant_reference.py)"));
    let out = std::fs::read(dir.join(format!("{name}.out"))).expect("reference output");
    let values = out
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    (input, values)
}

#[test]
fn every_block_type_dequantizes_bit_exactly_like_gguf_py() {
    let mut checked = 0;
    for t in new_formats() {
        let (input, want) = reference(t);
        assert_eq!(
            input.len() % t.block_bytes() as usize,
            0,
            "{}: fixture is not whole blocks",
            t.ggml_name()
        );
        let blocks = input.len() / t.block_bytes() as usize;
        assert!(blocks >= 30, "{}: only {blocks} blocks", t.ggml_name());
        assert_eq!(
            want.len(),
            blocks * t.block_elems() as usize,
            "{}",
            t.ggml_name()
        );
        let mut got = vec![0f32; want.len()];
        dequantize(t, &input, &mut got).expect("whole blocks");
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            // Bit for bit; a NaN (an infinite scale times a zero level) only has to be NaN.
            let same = g.to_bits() == w.to_bits() || (g.is_nan() && w.is_nan());
            assert!(
                same,
                "{}: value {i} (block {}, element {}) is {g:e} ({:#010x}), gguf-py gives {w:e} ({:#010x})",
                t.ggml_name(),
                i / t.block_elems() as usize,
                i % t.block_elems() as usize,
                g.to_bits(),
                w.to_bits()
            );
        }
        checked += want.len();
        // The extreme-scale blocks really are extreme.
        let (inf, tiny) = (
            want.iter().filter(|v| !v.is_finite()).count(),
            want.iter().filter(|v| **v != 0.0 && v.abs() < 1e-5).count(),
        );
        assert!(
            inf > 0 && tiny > 0,
            "{}: {inf} non-finite, {tiny} tiny values",
            t.ggml_name()
        );
    }
    assert!(checked > 50_000, "{checked} values checked");
}

#[test]
fn a_truncated_block_is_an_error_naming_the_type() {
    for t in new_formats() {
        let bytes = vec![0u8; t.block_bytes() as usize * 2 - 1];
        let mut out = vec![0f32; t.block_elems() as usize * 2];
        let e = dequantize(t, &bytes, &mut out)
            .expect_err("a partial block")
            .to_string();
        assert!(
            e.starts_with(&t.ggml_name()) && e.contains("whole blocks"),
            "{e}"
        );
    }
}

/// Every tensor of the real Gemma 3 270M (F32, Q8_0, Q5_0, Q4_K, Q6_K), dequantized by
/// sluice, hashes like gguf-py's dequantization of it
/// (tests/fixtures/make_gemma_tensor_hashes.py).
#[test]
fn gemma3_270m_every_tensor_dequantizes_like_gguf_py() {
    let path = sluice_tests::gemma3_gguf();
    let bytes = std::fs::read(&path).expect("read the GGUF");
    let g = sluice::import::gguf::parse(&bytes, &path).expect("parse the GGUF");
    let refs: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(fixture("reference/gemma3-270m-tensors.json"))
            .expect("reference hashes"),
    )
    .expect("JSON");
    let refs = refs["tensors"].as_object().expect("tensors");
    assert_eq!(g.tensors.len(), refs.len(), "tensor count");
    let mut by_type = std::collections::BTreeMap::new();
    for t in &g.tensors {
        let want = &refs[&t.name];
        let n: u64 = t.dims.iter().product();
        assert_eq!(want["elements"].as_u64(), Some(n), "{}", t.name);
        let at = (g.data_start + t.offset) as usize;
        let mut values = vec![0f32; n as usize];
        let dt = DType::from_ggml(t.ggml_type)
            .unwrap_or_else(|| panic!("{}: GGML type {}", t.name, t.ggml_type));
        let cols = t.dims[0];
        let rows = n / cols;
        let rb = dt.row_bytes(cols).expect("whole blocks") as usize;
        sluice::backend::cpu::dequant_rows(
            dt,
            &bytes[at..at + rb * rows as usize],
            rb,
            cols as usize,
            &mut values,
        );
        let name = dt.ggml_name();
        let raw: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        let got = format!("{:016x}", xxhash_rust::xxh3::xxh3_64(&raw));
        assert_eq!(
            Some(got.as_str()),
            want["xxh3"].as_str(),
            "{} ({name}): dequantized values differ from gguf-py's",
            t.name
        );
        *by_type.entry(name).or_insert(0) += 1;
    }
    eprintln!("tensors checked by type: {by_type:?}");
    for ty in ["F32", "Q8_0", "Q5_0", "Q4_K", "Q6_K"] {
        assert!(
            by_type.contains_key(ty),
            "no {ty} tensor checked: {by_type:?}"
        );
    }
}

/// `pack --quantize`'s quantizers, byte for byte against blocks ggml itself wrote
/// (`ggml_quantize_chunk`, no importance matrix: tests/fixtures/make_quantize_reference.py)
/// for rows that take every path: Gaussians (some rounded through f16), outliers, one-signed,
/// constant, zero, below ggml's zero threshold, large, sparse, exact ties.
#[test]
fn every_quantizer_writes_the_blocks_ggml_writes() {
    use sluice::dtype::quantize::{can_quantize, quantize_row};
    let dir = fixture("reference/quantize");
    let meta: serde_json::Value = serde_json::from_slice(
        &std::fs::read(dir.join("meta.json"))
            .expect("meta.json (run tests/fixtures/make_quantize_reference.py)"),
    )
    .expect("meta.json");
    let (rows, cols) = (
        meta["rows"].as_u64().expect("rows") as usize,
        meta["cols"].as_u64().expect("cols") as usize,
    );
    let x: Vec<f32> = std::fs::read(dir.join("input.f32"))
        .expect("input.f32")
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    assert_eq!(x.len(), rows * cols);
    let types: Vec<DType> = ALL_DTYPES
        .into_iter()
        .filter(|&t| can_quantize(t))
        .collect();
    assert_eq!(types.len(), 10, "{types:?}");
    for t in types {
        let want = std::fs::read(dir.join(format!("{}.bin", t.name())))
            .unwrap_or_else(|e| panic!("{}.bin: {e}", t.name()));
        let row_bytes = cols / t.block_elems() as usize * t.block_bytes() as usize;
        assert_eq!(want.len(), rows * row_bytes, "{}", t.ggml_name());
        let mut got = vec![0u8; row_bytes];
        for r in 0..rows {
            quantize_row(t, &x[r * cols..(r + 1) * cols], &mut got);
            let w = &want[r * row_bytes..(r + 1) * row_bytes];
            if let Some(i) = got.iter().zip(w).position(|(a, b)| a != b) {
                let b = i / t.block_bytes() as usize;
                panic!(
                    "{} row {r}: block {b}, byte {} is {:#04x}, ggml wrote {:#04x}\n ours {:02x?}\n ggml {:02x?}",
                    t.ggml_name(),
                    i % t.block_bytes() as usize,
                    got[i],
                    w[i],
                    &got[b * t.block_bytes() as usize..(b + 1) * t.block_bytes() as usize],
                    &w[b * t.block_bytes() as usize..(b + 1) * t.block_bytes() as usize],
                );
            }
        }
    }
}
