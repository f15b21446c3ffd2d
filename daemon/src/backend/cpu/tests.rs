//! Every CPU op against a naive f64 reference on seeded random inputs.

use super::attention::{self, kernels};
use super::elementwise::{gelu_tanh, silu};
use super::CpuBackend;
use crate::backend::{AttnShape, AttnStep, Backend, KvDtype, LayerCache, SeqSpan, WeightRef};
use crate::dtype::{DType, ALL_DTYPES};
use half::{bf16, f16};

use crate::util::rng::Rng;

/// `n` seeded values uniform in [-1, 1) (`Rng`'s): the inputs of the kernels' tests too
/// (`gemv.rs`, `attention/tests.rs`, `q8.rs`).
pub(super) fn rand_vec(n: usize, seed: u64) -> Vec<f32> {
    Rng::new(seed).symmetric_vec(n)
}

fn backend() -> CpuBackend {
    CpuBackend::new(1 << 30, 2).unwrap()
}

fn mem_f32(b: &CpuBackend, v: &[f32]) -> super::CpuMem {
    let mut m = b.alloc(v.len() * 4, "test").unwrap();
    m.f32s_mut()[..v.len()].copy_from_slice(v);
    m
}

fn mem_bytes(b: &CpuBackend, v: &[u8]) -> super::CpuMem {
    let mut m = b.alloc(v.len(), "test").unwrap();
    b.upload(&mut m, v).unwrap();
    m
}

/// Quantizes like llama.cpp's reference quantizers; returns bytes and the exact values the
/// bytes encode (the reference multiplies with those).
fn encode(dtype: DType, v: &[f32]) -> (Vec<u8>, Vec<f64>) {
    let mut out = Vec::new();
    let mut exact = Vec::new();
    match dtype {
        DType::F32 => v.iter().for_each(|x| {
            out.extend_from_slice(&x.to_le_bytes());
            exact.push(*x as f64);
        }),
        DType::F16 => v.iter().for_each(|x| {
            let h = f16::from_f32(*x);
            out.extend_from_slice(&h.to_le_bytes());
            exact.push(h.to_f64());
        }),
        DType::BF16 => v.iter().for_each(|x| {
            let h = bf16::from_f32(*x);
            out.extend_from_slice(&h.to_le_bytes());
            exact.push(h.to_f64());
        }),
        DType::Q8_0 | DType::Q4_0 | DType::Q4_1 => {
            for b in v.chunks(32) {
                let (mn, mx) = b
                    .iter()
                    .fold((f32::MAX, f32::MIN), |(a, c), x| (a.min(*x), c.max(*x)));
                let amax = mx.abs().max(mn.abs());
                let (d, m) = match dtype {
                    DType::Q8_0 => (amax / 127.0, 0.0),
                    DType::Q4_0 => (amax / 8.0, 0.0),
                    _ => ((mx - mn) / 15.0, mn),
                };
                let dh = f16::from_f32(d);
                let mh = f16::from_f32(m);
                out.extend_from_slice(&dh.to_le_bytes());
                if dtype == DType::Q4_1 {
                    out.extend_from_slice(&mh.to_le_bytes());
                }
                let (d64, m64) = (dh.to_f64(), mh.to_f64());
                let q = |x: f32| -> i32 {
                    let d = dh.to_f32();
                    if d == 0.0 {
                        return if dtype == DType::Q4_0 { 8 } else { 0 };
                    }
                    match dtype {
                        DType::Q8_0 => ((x / d).round() as i32).clamp(-127, 127),
                        DType::Q4_0 => ((x / d).round() as i32 + 8).clamp(0, 15),
                        _ => (((x - mh.to_f32()) / d).round() as i32).clamp(0, 15),
                    }
                };
                let qs: Vec<i32> = b.iter().map(|&x| q(x)).collect();
                if dtype == DType::Q8_0 {
                    qs.iter().for_each(|&q| out.push(q as i8 as u8));
                } else {
                    (0..16).for_each(|j| out.push((qs[j] | (qs[j + 16] << 4)) as u8));
                }
                for &q in &qs {
                    exact.push(match dtype {
                        DType::Q8_0 => d64 * q as f64,
                        DType::Q4_0 => d64 * (q - 8) as f64,
                        _ => d64 * q as f64 + m64,
                    });
                }
            }
        }
        // The K-quant-era formats: seeded random blocks, valued by the reference decoder
        // (bit-exact against gguf-py, tests/tests/quants.rs).
        _ => {
            let blocks = v.len() / dtype.block_elems() as usize;
            out = crate::dtype::ggml::sample_blocks(dtype, blocks, &mut Rng::new(3).into_fn());
            let mut vals = vec![0f32; v.len()];
            crate::dtype::ggml::dequantize(dtype, &out, &mut vals).unwrap();
            exact = vals.iter().map(|&x| x as f64).collect();
        }
    }
    (out, exact)
}

#[test]
fn matmul_matches_f64_for_every_dtype_in_both_paths() {
    let b = backend();
    let mut r = Rng::new(1);
    // k is whole K-quant super-blocks (256).
    let (m, k) = (70, 512);
    for dtype in ALL_DTYPES {
        let (wb, wx) = encode(dtype, &r.symmetric_vec(m * k));
        let w = mem_bytes(&b, &wb);
        let bias = r.symmetric_vec(m);
        let bias_mem = mem_f32(&b, &bias);
        // gemv rows (decode kernels) and tile rows (sgemm) in several mixes.
        for (rows, gemv_rows, with_bias) in [
            (1, 1, true),
            (1, 1, false),
            (3, 3, true),
            (3, 3, false),
            (5, 5, true),
            (5, 0, false),
            (17, 2, true),
            (17, 17, false),
            (17, 0, true),
            (1, 0, false),
        ] {
            let x = r.symmetric_vec(rows * k);
            let xm = mem_f32(&b, &x);
            let mut out = b.alloc(rows * m * 4, "out").unwrap();
            let wr = WeightRef {
                mem: &w,
                offset: 0,
                dtype,
                rows: m,
                cols: k,
            };
            let br = WeightRef {
                mem: &bias_mem,
                offset: 0,
                dtype: DType::F32,
                rows: 1,
                cols: m,
            };
            b.matmul(&xm, rows, gemv_rows, wr, with_bias.then_some(br), &mut out);
            for i in 0..rows {
                for j in 0..m {
                    let b = if with_bias { bias[j] as f64 } else { 0.0 };
                    let want: f64 = (0..k)
                        .map(|c| x[i * k + c] as f64 * wx[j * k + c])
                        .sum::<f64>()
                        + b;
                    let got = out.f32s()[i * m + j] as f64;
                    assert!(
                        (got - want).abs() <= 2e-5 * (1.0 + want.abs()),
                        "{dtype} rows {rows} (bias {with_bias}) [{i},{j}]: {got} vs {want}"
                    );
                }
            }
        }
    }
}

#[test]
fn embedding_rms_norm_silu_add_match_f64() {
    let b = backend();
    let mut r = Rng::new(2);
    let (vocab, h) = (40, 256);
    for dtype in ALL_DTYPES {
        let (tb, tx) = encode(dtype, &r.symmetric_vec(vocab * h));
        let t = mem_bytes(&b, &tb);
        let ids = [3u32, 0, 39, 3];
        let mut out = b.alloc(ids.len() * h * 4, "out").unwrap();
        b.embedding(
            WeightRef {
                mem: &t,
                offset: 0,
                dtype,
                rows: vocab,
                cols: h,
            },
            &ids,
            &mut out,
        );
        for (i, &id) in ids.iter().enumerate() {
            for c in 0..h {
                let want = tx[id as usize * h + c];
                assert!(
                    (out.f32s()[i * h + c] as f64 - want).abs() <= 1e-6 * want.abs().max(1e-3),
                    "{dtype}"
                );
            }
        }
    }
    let rows = 3;
    let x = r.symmetric_vec(rows * h);
    let g = r.symmetric_vec(h);
    let (xm, gm) = (mem_f32(&b, &x), mem_f32(&b, &g));
    let mut out = b.alloc(rows * h * 4, "out").unwrap();
    b.rms_norm(
        &xm,
        WeightRef {
            mem: &gm,
            offset: 0,
            dtype: DType::F32,
            rows: 1,
            cols: h,
        },
        1e-5,
        rows,
        &mut out,
    );
    for i in 0..rows {
        let ms: f64 = x[i * h..(i + 1) * h]
            .iter()
            .map(|&v| (v as f64).powi(2))
            .sum::<f64>()
            / h as f64;
        for c in 0..h {
            let want = x[i * h + c] as f64 / (ms + 1e-5).sqrt() * g[c] as f64;
            assert!((out.f32s()[i * h + c] as f64 - want).abs() <= 1e-5 * (1.0 + want.abs()));
        }
    }
    let (gate, up) = (r.symmetric_vec(100), r.symmetric_vec(100));
    let mut gm = mem_f32(&b, &gate);
    let um = mem_f32(&b, &up);
    b.silu_mul(&mut gm, &um, 100);
    for i in 0..100 {
        let g = gate[i] as f64;
        let want = g / (1.0 + (-g).exp()) * up[i] as f64;
        assert!((gm.f32s()[i] as f64 - want).abs() <= 1e-6);
    }
    // GeGLU against the tanh form in f64, gates from -8 to 8.
    let wide: Vec<f32> = gate.iter().map(|g| g * 8.0).collect();
    let mut gm = mem_f32(&b, &wide);
    b.gelu_mul(&mut gm, &um, 100);
    for i in 0..100 {
        let g = wide[i] as f64;
        let u = (2.0 / std::f64::consts::PI).sqrt() * (g + 0.044715 * g.powi(3));
        let want = 0.5 * g * (1.0 + u.tanh()) * up[i] as f64;
        let got = gm.f32s()[i] as f64;
        assert!(
            (got - want).abs() <= 1e-6 * (1.0 + want.abs()),
            "gelu({g}): {got} vs {want}"
        );
    }
    let mut am = mem_f32(&b, &gate);
    b.add(&mut am, &um, 100);
    assert!((0..100).all(|i| am.f32s()[i] == gate[i] + up[i]));
}

#[test]
fn attention_is_causal_grouped_query_over_the_cache() {
    for kv in [KvDtype::F32, KvDtype::F16] {
        attention_over_the_cache(kv);
    }
}

/// With an f16 cache the reference takes K and V rounded to f16 (nearest even): the only
/// difference the cache type may make.
fn attention_over_the_cache(kv: KvDtype) {
    let b = backend();
    let mut r = Rng::new(4);
    let round = |x: &[f32]| -> Vec<f32> {
        match kv {
            KvDtype::F32 => x.to_vec(),
            KvDtype::F16 => x.iter().map(|&v| half::f16::from_f32(v).to_f32()).collect(),
        }
    };
    let shape = AttnShape {
        kv,
        heads: 4,
        kv_heads: 2,
        head_dim: 16,
        max_context: 32,
        slots: 3,
        scale: 0.25,
    };
    let (wq, wkv) = (
        shape.heads * shape.head_dim,
        shape.kv_heads * shape.head_dim,
    );
    // Two sequences in one step: slot 2 prefills 5 tokens, slot 0 decodes 1 token at
    // position 6 (its cache already holds 6 positions).
    let spans = [
        SeqSpan {
            row: 0,
            n: 5,
            pos: 0,
            slot: 2,
        },
        SeqSpan {
            row: 5,
            n: 1,
            pos: 6,
            slot: 0,
        },
    ];
    let rows = 6;
    let layer_elems = shape.slots * shape.max_context * wkv;
    let mut ck = b.alloc(2 * layer_elems * kv.bytes(), "k").unwrap();
    let mut cv = b.alloc(2 * layer_elems * kv.bytes(), "v").unwrap();
    let layer = 1;
    let cache = LayerCache {
        base: layer_elems,
        cap: shape.max_context,
        window: None,
    };
    // Earlier positions of slot 0.
    let old_k = r.symmetric_vec(6 * wkv);
    let old_v = r.symmetric_vec(6 * wkv);
    let base = layer * layer_elems;
    for (c, old) in [(&mut ck, &old_k), (&mut cv, &old_v)] {
        match kv {
            KvDtype::F32 => c.f32s_mut()[base..base + 6 * wkv].copy_from_slice(old),
            KvDtype::F16 => {
                for (d, &x) in c.u16s_mut()[base..base + 6 * wkv].iter_mut().zip(old) {
                    *d = half::f16::from_f32(x).to_bits();
                }
            }
        }
    }
    let (q, k, v) = (
        r.symmetric_vec(rows * wq),
        r.symmetric_vec(rows * wkv),
        r.symmetric_vec(rows * wkv),
    );
    let (qm, km, vm) = (mem_f32(&b, &q), mem_f32(&b, &k), mem_f32(&b, &v));
    let (old_k, old_v, k, v) = (round(&old_k), round(&old_v), round(&k), round(&v));
    let mut out = b.alloc(rows * wq * 4, "out").unwrap();
    let step = AttnStep {
        layer,
        spans: &spans,
        shape,
        cache,
        ancestors: &[],
    };
    b.kv_store(&km, &vm, &mut ck, &mut cv, &step);
    // Without and with attention sinks (gpt-oss: a logit per head in each softmax).
    let sinks = [0.5f32, -1.0, 3.0, 0.0];
    let sm = mem_f32(&b, &sinks);
    for sink in [None, Some(&sinks)] {
        let w = sink.map(|_| WeightRef {
            mem: &sm,
            offset: 0,
            dtype: DType::F32,
            rows: 1,
            cols: 4,
        });
        b.attention(&qm, &ck, &cv, &step, w, &mut out);
        // Reference: for each query row, keys/values of its own sequence up to its position.
        let seq_kv = |si: usize| -> (Vec<f32>, Vec<f32>) {
            if si == 0 {
                (k[..5 * wkv].to_vec(), v[..5 * wkv].to_vec())
            } else {
                (
                    [old_k.clone(), k[5 * wkv..].to_vec()].concat(),
                    [old_v.clone(), v[5 * wkv..].to_vec()].concat(),
                )
            }
        };
        for (si, sp) in spans.iter().enumerate() {
            let (ks, vs) = seq_kv(si);
            for t in 0..sp.n {
                let p = sp.pos + t;
                for h in 0..shape.heads {
                    let g = h / 2;
                    let qr = &q[(sp.row + t) * wq + h * 16..][..16];
                    let scores: Vec<f64> = (0..=p)
                        .map(|j| {
                            (0..16)
                                .map(|d| qr[d] as f64 * ks[j * wkv + g * 16 + d] as f64)
                                .sum::<f64>()
                                / 4.0
                        })
                        .collect();
                    let sk = sink.map(|s| s[h] as f64);
                    let mx = scores.iter().cloned().chain(sk).fold(f64::MIN, f64::max);
                    let e: Vec<f64> = scores.iter().map(|s| (s - mx).exp()).collect();
                    let z: f64 = e.iter().sum::<f64>() + sk.map_or(0.0, |s| (s - mx).exp());
                    for d in 0..16 {
                        let want: f64 = (0..=p)
                            .map(|j| e[j] / z * vs[j * wkv + g * 16 + d] as f64)
                            .sum();
                        let got = out.f32s()[(sp.row + t) * wq + h * 16 + d] as f64;
                        assert!(
                            (got - want).abs() <= 1e-5,
                            "{kv} sinks {} seq {si} t {t} head {h} dim {d}: {got} vs {want}",
                            sink.is_some()
                        );
                    }
                }
            }
        }
    }
}

/// The f32 cache's attention (`--exact`) runs a KV head at a time with each key read once
/// for its query heads, over contexts longer than a chunk of keys: every output has the
/// bits of the head-at-a-time form (`dot_f32` per key, `softmax_scaled` over the row,
/// `axpy_f32` per key in order), with and without sinks, for a decode row at position
/// 600 and a prefill beside it, and for the decode row alone (too few tasks for two
/// threads: its scores a chunk of keys a task, its values a block of columns a task), in
/// a window and without one.
#[test]
fn f32_attention_by_kv_head_is_the_bits_of_a_head_at_a_time() {
    let b = backend();
    let mut r = Rng::new(9);
    let shape = AttnShape {
        kv: KvDtype::F32,
        heads: 6,
        kv_heads: 2,
        head_dim: 64,
        max_context: 640,
        slots: 2,
        scale: 0.125,
    };
    let (hd, wq, wkv) = (64, 6 * 64, 2 * 64);
    let spans = [
        SeqSpan {
            row: 0,
            n: 1,
            pos: 600,
            slot: 1,
        },
        SeqSpan {
            row: 1,
            n: 3,
            pos: 0,
            slot: 0,
        },
    ];
    let elems = shape.slots * shape.max_context * wkv;
    let (kd, vd) = (r.symmetric_vec(elems), r.symmetric_vec(elems));
    let (ck, cv) = (mem_f32(&b, &kd), mem_f32(&b, &vd));
    let q = r.symmetric_vec(4 * wq);
    let qm = mem_f32(&b, &q);
    let sinks = r.symmetric_vec(6);
    let sm = mem_f32(&b, &sinks);
    let mut out = b.alloc(4 * wq * 4, "out").unwrap();
    let cases = [None, Some(300)]
        .into_iter()
        .flat_map(|w| [(w, &spans[..]), (w, &spans[..1])]);
    for (window, spans) in cases {
        let cache = LayerCache {
            base: 0,
            cap: shape.max_context,
            window,
        };
        let step = AttnStep {
            layer: 0,
            spans,
            shape,
            cache,
            ancestors: &[],
        };
        for sink in [None, Some(&sinks)] {
            let w = sink.map(|_| WeightRef {
                mem: &sm,
                offset: 0,
                dtype: DType::F32,
                rows: 1,
                cols: 6,
            });
            b.attention(&qm, &ck, &cv, &step, w, &mut out);
            for sp in spans {
                for t in 0..sp.n {
                    let p = sp.pos + t;
                    let lo = cache.first_visible(p);
                    for h in 0..6 {
                        let at = |j: usize| cache.at(&shape, sp.slot, j) + h / 3 * hd;
                        let qr = &q[(sp.row + t) * wq + h * hd..][..hd];
                        let mut sc: Vec<f32> = (lo..=p)
                            .map(|j| kernels::dot_f32(qr, &kd[at(j)..at(j) + hd]))
                            .collect();
                        attention::softmax_scaled(&mut sc, 0.125, sink.map(|s| s[h]));
                        let mut want = vec![0f32; hd];
                        for (i, j) in (lo..=p).enumerate() {
                            kernels::axpy_f32(sc[i], &vd[at(j)..at(j) + hd], &mut want);
                        }
                        let got = &out.f32s()[(sp.row + t) * wq + h * hd..][..hd];
                        assert_eq!(
                            got.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                            want.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                            "window {window:?} spans {} sinks {} pos {p} head {h}",
                            spans.len(),
                            sink.is_some()
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn a_sliding_window_ring_attends_to_its_window_only() {
    for kv in [KvDtype::F32, KvDtype::F16] {
        sliding_window_ring(kv);
    }
}

/// One sequence through 40 positions in steps of 1 to 7 tokens, window 6, in a ring of
/// 6 + 7 - 1 = 12 positions: every query sees exactly positions p - 5..=p (checked in
/// f64 against the whole history, K and V rounded as the cache stores them), though the
/// ring wrapped three times. The f16 cache runs the grouped kernels (two query heads a KV
/// head).
fn sliding_window_ring(kv: KvDtype) {
    let b = backend();
    let mut r = Rng::new(5);
    let round = |x: &[f32]| -> Vec<f32> {
        match kv {
            KvDtype::F32 => x.to_vec(),
            KvDtype::F16 => x.iter().map(|&v| half::f16::from_f32(v).to_f32()).collect(),
        }
    };
    let shape = AttnShape {
        kv,
        heads: 2,
        kv_heads: 1,
        head_dim: 8,
        max_context: 64,
        slots: 2,
        scale: 0.3,
    };
    let (window, chunk) = (6, 7);
    let cache = LayerCache {
        base: 0,
        cap: window + chunk - 1,
        window: Some(window),
    };
    let elems = cache.elems(&shape);
    let mut ck = b.alloc(elems * kv.bytes(), "k").unwrap();
    let mut cv = b.alloc(elems * kv.bytes(), "v").unwrap();
    let (mut all_k, mut all_v) = (Vec::new(), Vec::new());
    let mut pos = 0;
    for n in [7, 1, 3, 7, 2, 1, 7, 5, 7] {
        let (q, k, v) = (
            r.symmetric_vec(n * 16),
            r.symmetric_vec(n * 8),
            r.symmetric_vec(n * 8),
        );
        all_k.extend_from_slice(&round(&k));
        all_v.extend_from_slice(&round(&v));
        let spans = [SeqSpan {
            row: 0,
            n,
            pos,
            slot: 1,
        }];
        assert!(cache.fits(&shape, pos, n));
        let step = AttnStep {
            layer: 0,
            spans: &spans,
            shape,
            cache,
            ancestors: &[],
        };
        let (qm, km, vm) = (mem_f32(&b, &q), mem_f32(&b, &k), mem_f32(&b, &v));
        let mut out = b.alloc(n * 16 * 4, "out").unwrap();
        b.kv_store(&km, &vm, &mut ck, &mut cv, &step);
        b.attention(&qm, &ck, &cv, &step, None, &mut out);
        for t in 0..n {
            let p = pos + t;
            let lo = (p + 1).saturating_sub(window);
            for h in 0..2 {
                let qr = &q[t * 16 + h * 8..][..8];
                let s: Vec<f64> = (lo..=p)
                    .map(|j| {
                        (0..8)
                            .map(|d| qr[d] as f64 * all_k[j * 8 + d] as f64)
                            .sum::<f64>()
                            * 0.3
                    })
                    .collect();
                let mx = s.iter().cloned().fold(f64::MIN, f64::max);
                let e: Vec<f64> = s.iter().map(|x| (x - mx).exp()).collect();
                let z: f64 = e.iter().sum();
                for d in 0..8 {
                    let want: f64 = (lo..=p)
                        .map(|j| e[j - lo] / z * all_v[j * 8 + d] as f64)
                        .sum();
                    let got = out.f32s()[t * 16 + h * 8 + d] as f64;
                    assert!(
                        (got - want).abs() <= 1e-5,
                        "{kv} pos {p} head {h}: {got} vs {want}"
                    );
                }
            }
        }
        pos += n;
    }
    // A span longer than the ring leaves room for is refused, not silently wrong.
    assert!(!cache.fits(&shape, pos, chunk + 1));
}

#[test]
fn gelu_mul_and_scale_match_f64() {
    let b = backend();
    let mut r = Rng::new(6);
    let (gate, up) = (r.symmetric_vec(100), r.symmetric_vec(100));
    let mut gm = mem_f32(&b, &gate.iter().map(|x| x * 4.0).collect::<Vec<_>>());
    let um = mem_f32(&b, &up);
    b.gelu_mul(&mut gm, &um, 100);
    for i in 0..100 {
        let g = gate[i] as f64 * 4.0;
        let gelu = 0.5
            * g
            * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (g + 0.044715 * g.powi(3))).tanh());
        let want = gelu * up[i] as f64;
        assert!((gm.f32s()[i] as f64 - want).abs() <= 1e-5, "{i}");
    }
    let x = r.symmetric_vec(50);
    let mut xm = mem_f32(&b, &x);
    b.scale(&mut xm, 25.3, 40);
    for (i, &v) in x.iter().enumerate() {
        // The first 40 scaled (rounded once, like x * s in f32), the rest untouched.
        let want = if i < 40 { v * 25.3 } else { v };
        assert_eq!(xm.f32s()[i], want, "{i}");
    }
}

#[test]
fn the_budget_refuses_past_its_limit_and_reports_the_peak() {
    let b = CpuBackend::new(64 << 10, 1).unwrap();
    let a = b.alloc(40 << 10, "a").unwrap();
    let e = b
        .alloc(40 << 10, "weights of layer 3")
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.contains("weights of layer 3") && e.contains("--device-memory"),
        "{e}"
    );
    drop(a);
    let _c = b.alloc(60 << 10, "c").unwrap();
    assert_eq!(b.budget().peak(), 60 << 10);
    assert_eq!(b.budget().used(), 60 << 10);
}

#[test]
fn a_rows_result_does_not_depend_on_the_other_rows() {
    // Batch invariance: a sequence gets bit-identical numbers alone or in any batch, for
    // decode rows (1, 2-4, 5-8 rows through the dot kernels) and prefill rows (sgemm tiles
    // with different row counts).
    let b = backend();
    let mut r = Rng::new(9);
    let (m, k) = (50, 256);
    for dtype in ALL_DTYPES {
        let (wb, _) = encode(dtype, &r.symmetric_vec(m * k));
        let w = mem_bytes(&b, &wb);
        let wr = WeightRef {
            mem: &w,
            offset: 0,
            dtype,
            rows: m,
            cols: k,
        };
        let x = r.symmetric_vec(9 * k);
        let run = |rows: usize, gemv_rows: usize, first_row: usize| -> Vec<u32> {
            let xm = mem_f32(&b, &x[first_row * k..(first_row + rows) * k]);
            let mut out = b.alloc(rows * m * 4, "out").unwrap();
            b.matmul(&xm, rows, gemv_rows, wr, None, &mut out);
            out.f32s()[..m].iter().map(|v| v.to_bits()).collect()
        };
        // Row 0 as a decode row alone, with 1, 3 and 8 others.
        let alone = run(1, 1, 0);
        for n in [2, 4, 9] {
            assert_eq!(
                run(n, n, 0),
                alone,
                "{dtype}: decode row changes in a batch of {n}"
            );
        }
        // Row 0 as a prefill row in tiles of 2, 5 and 9 rows, and after decode rows.
        let tile = run(2, 0, 0);
        for n in [5, 9] {
            assert_eq!(
                run(n, 0, 0),
                tile,
                "{dtype}: prefill row changes with {n} rows"
            );
        }
    }
}

#[test]
fn activations_split_across_threads_give_the_same_bits() {
    // A prefill's worth (past the 32768 elements where the pool takes pieces, with a
    // ragged last piece): two threads agree bit for bit with one thread and with the
    // formula element by element.
    let n = 3 * 16 * 1024 + 77;
    let mut r = Rng::new(11);
    let (gate, up) = (r.symmetric_vec(n), r.symmetric_vec(n));
    let gate: Vec<f32> = gate.iter().map(|x| x * 6.0).collect();
    let (one, two) = (
        CpuBackend::new(1 << 24, 1).unwrap(),
        CpuBackend::new(1 << 24, 2).unwrap(),
    );
    for gelu in [false, true] {
        let run = |b: &CpuBackend| {
            let mut g = mem_f32(b, &gate);
            let u = mem_f32(b, &up);
            if gelu {
                b.gelu_mul(&mut g, &u, n);
            } else {
                b.silu_mul(&mut g, &u, n);
            }
            g.f32s().to_vec()
        };
        let (a, b) = (run(&one), run(&two));
        for i in 0..n {
            let (x, u) = (gate[i], up[i]);
            let want = if gelu { gelu_tanh(x) * u } else { silu(x) * u };
            assert_eq!(
                a[i].to_bits(),
                want.to_bits(),
                "gelu {gelu} element {i}, one thread"
            );
            assert_eq!(
                b[i].to_bits(),
                want.to_bits(),
                "gelu {gelu} element {i}, two threads"
            );
        }
    }
}

#[test]
fn a_long_row_is_the_same_bits_split_in_chunks_alone_in_a_batch_or_in_a_prefill() {
    // 700 positions (three chunks of keys) over an f16 cache, two KV heads of two query
    // heads each. The last row computed three ways: inside a 700-token prefill (its chunks
    // merged in its task), as a decode row alone (too few tasks for two threads: its chunks
    // run as tasks of their own and merge after), and as a decode row beside three other
    // sequences (a task a (span, KV head) again). The same bits each way, and f64's
    // numbers (K and V rounded to f16 as the cache holds them).
    let b = backend();
    let mut r = Rng::new(12);
    let shape = AttnShape {
        kv: KvDtype::F16,
        heads: 4,
        kv_heads: 2,
        head_dim: 16,
        max_context: 800,
        slots: 4,
        scale: 0.25,
    };
    let (wq, wkv, n) = (64, 32, 700);
    let cache = LayerCache {
        base: 0,
        cap: shape.max_context,
        window: None,
    };
    let elems = cache.elems(&shape);
    let mut ck = b.alloc(elems * 2, "k").unwrap();
    let mut cv = b.alloc(elems * 2, "v").unwrap();
    let (q, k, v) = (
        r.symmetric_vec(n * wq),
        r.symmetric_vec(n * wkv),
        r.symmetric_vec(n * wkv),
    );
    let run = |ck: &mut super::CpuMem,
               cv: &mut super::CpuMem,
               spans: &[SeqSpan],
               q: &[f32],
               k: &[f32],
               v: &[f32]| {
        let step = AttnStep {
            layer: 0,
            spans,
            shape,
            cache,
            ancestors: &[],
        };
        let rows: usize = spans.iter().map(|s| s.n).sum();
        let mut out = b.alloc(rows * wq * 4, "out").unwrap();
        b.kv_store(&mem_f32(&b, k), &mem_f32(&b, v), ck, cv, &step);
        b.attention(&mem_f32(&b, q), ck, cv, &step, None, &mut out);
        out.f32s()[..rows * wq].to_vec()
    };
    let prefill = run(
        &mut ck,
        &mut cv,
        &[SeqSpan {
            row: 0,
            n,
            pos: 0,
            slot: 0,
        }],
        &q,
        &k,
        &v,
    );
    let last = &prefill[(n - 1) * wq..n * wq];
    let (ql, kl, vl) = (&q[(n - 1) * wq..], &k[(n - 1) * wkv..], &v[(n - 1) * wkv..]);
    let alone = run(
        &mut ck,
        &mut cv,
        &[SeqSpan {
            row: 0,
            n: 1,
            pos: n - 1,
            slot: 0,
        }],
        ql,
        kl,
        vl,
    );
    let others: Vec<SeqSpan> = (1..4)
        .map(|s| SeqSpan {
            row: s,
            n: 1,
            pos: 0,
            slot: s,
        })
        .collect();
    let spans: Vec<SeqSpan> = std::iter::once(SeqSpan {
        row: 0,
        n: 1,
        pos: n - 1,
        slot: 0,
    })
    .chain(others)
    .collect();
    let (q4, k4, v4) = (
        [ql.to_vec(), r.symmetric_vec(3 * wq)].concat(),
        [kl.to_vec(), r.symmetric_vec(3 * wkv)].concat(),
        [vl.to_vec(), r.symmetric_vec(3 * wkv)].concat(),
    );
    let batch = run(&mut ck, &mut cv, &spans, &q4, &k4, &v4);
    let f16 = |x: f32| half::f16::from_f32(x).to_f32() as f64;
    for h in 0..4 {
        let g = h / 2;
        let qr = &ql[h * 16..(h + 1) * 16];
        let s: Vec<f64> = (0..n)
            .map(|j| {
                (0..16)
                    .map(|d| qr[d] as f64 * f16(k[j * wkv + g * 16 + d]))
                    .sum::<f64>()
                    * 0.25
            })
            .collect();
        let mx = s.iter().cloned().fold(f64::MIN, f64::max);
        let e: Vec<f64> = s.iter().map(|x| (x - mx).exp()).collect();
        let z: f64 = e.iter().sum();
        for d in 0..16 {
            let i = h * 16 + d;
            assert_eq!(
                alone[i].to_bits(),
                last[i].to_bits(),
                "head {h} dim {d}: alone vs prefill"
            );
            assert_eq!(
                batch[i].to_bits(),
                last[i].to_bits(),
                "head {h} dim {d}: in a batch vs prefill"
            );
            let want: f64 = (0..n)
                .map(|j| e[j] / z * f16(v[j * wkv + g * 16 + d]))
                .sum();
            assert!(
                (last[i] as f64 - want).abs() <= 1e-5,
                "head {h} dim {d}: {} vs {want}",
                last[i]
            );
        }
    }
}

#[test]
fn matmuls_of_one_activation_give_each_matmuls_bits() {
    // q, k, v (and gate, up) run as one op over one conversion of the decode rows: each
    // product must be bit for bit what its own `matmul` gives, for weights of different
    // dtypes (so different decode paths share the op), with and without biases, with
    // decode and prefill rows, on both activation paths.
    use crate::backend::MatmulOut;
    let b = backend();
    let mut r = Rng::new(21);
    let k = 512;
    let groups: [&[(DType, usize)]; 3] = [
        &[(DType::Q4K, 96), (DType::Q6K, 32), (DType::Q8_0, 32)],
        &[
            (DType::F16, 40),
            (DType::Q4_0, 70),
            (DType::F32, 24),
            (DType::Q5K, 16),
        ],
        &[(DType::Q4_1, 130), (DType::BF16, 130)],
    ];
    for group in groups {
        let weights: Vec<(DType, usize, super::CpuMem, super::CpuMem)> = group
            .iter()
            .map(|&(dtype, m)| {
                let (wb, _) = encode(dtype, &r.symmetric_vec(m * k));
                (
                    dtype,
                    m,
                    mem_bytes(&b, &wb),
                    mem_f32(&b, &r.symmetric_vec(m)),
                )
            })
            .collect();
        let refs = |bias: bool| -> Vec<(
            WeightRef<'_, super::CpuMem>,
            Option<WeightRef<'_, super::CpuMem>>,
        )> {
            weights
                .iter()
                .map(|(dtype, m, w, bm)| {
                    let wr = WeightRef {
                        mem: w,
                        offset: 0,
                        dtype: *dtype,
                        rows: *m,
                        cols: k,
                    };
                    let br = WeightRef {
                        mem: bm,
                        offset: 0,
                        dtype: DType::F32,
                        rows: 1,
                        cols: *m,
                    };
                    (wr, bias.then_some(br))
                })
                .collect()
        };
        for int8 in [true, false] {
            b.set_int8_activations(int8);
            for (rows, gemv_rows, bias) in
                [(1, 1, false), (3, 3, true), (6, 2, true), (9, 0, false)]
            {
                let xm = mem_f32(&b, &r.symmetric_vec(rows * k));
                let ws = refs(bias);
                let mut alone: Vec<super::CpuMem> = Vec::new();
                for (wr, br) in &ws {
                    let mut out = b.alloc(rows * wr.rows * 4, "out").unwrap();
                    b.matmul(&xm, rows, gemv_rows, *wr, *br, &mut out);
                    alone.push(out);
                }
                let mut outs: Vec<super::CpuMem> = ws
                    .iter()
                    .map(|(wr, _)| b.alloc(rows * wr.rows * 4, "out").unwrap())
                    .collect();
                let mut products: Vec<MatmulOut<'_, super::CpuMem>> = ws
                    .iter()
                    .zip(outs.iter_mut())
                    .map(|((w, bias), out)| MatmulOut {
                        w: *w,
                        bias: *bias,
                        out,
                    })
                    .collect();
                b.matmuls(&xm, rows, gemv_rows, &mut products);
                drop(products);
                for (i, ((wr, _), (a, o))) in ws.iter().zip(alone.iter().zip(&outs)).enumerate() {
                    let n = rows * wr.rows;
                    let bits = |m: &super::CpuMem| -> Vec<u32> {
                        m.f32s()[..n].iter().map(|v| v.to_bits()).collect()
                    };
                    assert_eq!(
                        bits(o),
                        bits(a),
                        "product {i} ({}) of {group:?}, rows {rows} ({gemv_rows} decode), \
                         bias {bias}, int8 {int8}",
                        wr.dtype
                    );
                }
            }
        }
    }
}

#[test]
fn prefill_rows_of_narrow_16_bit_weights_on_the_default_path() {
    // Rows narrower than the bf16 kernel's 32-element steps, on the default numerics (bf16
    // activations where the CPU has AVX-512 BF16): within bf16 rounding of f64.
    let b = backend();
    b.set_int8_activations(true);
    let mut r = Rng::new(12);
    for (dtype, k) in [(DType::BF16, 8usize), (DType::BF16, 20), (DType::F16, 8)] {
        let m = 5;
        let (wb, wx) = encode(dtype, &r.symmetric_vec(m * k));
        let w = mem_bytes(&b, &wb);
        let rows = 7;
        let x = r.symmetric_vec(rows * k);
        let xm = mem_f32(&b, &x);
        let mut out = b.alloc(rows * m * 4, "out").unwrap();
        let wr = WeightRef {
            mem: &w,
            offset: 0,
            dtype,
            rows: m,
            cols: k,
        };
        b.matmul(&xm, rows, 0, wr, None, &mut out);
        for i in 0..rows {
            for j in 0..m {
                let want: f64 = (0..k).map(|c| x[i * k + c] as f64 * wx[j * k + c]).sum();
                let got = out.f32s()[i * m + j] as f64;
                assert!(
                    (got - want).abs() <= 1e-2 * (1.0 + want.abs()),
                    "{dtype} k {k} [{i},{j}]: {got} vs {want}"
                );
            }
        }
    }
}
