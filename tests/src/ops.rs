//! Random inputs for the op tests of the CUDA backend and of its kernels on the CPU
//! emulator (tests/tests/cuda.rs, tests/tests/cuda_emulated.rs), and how their outputs are
//! compared with the CPU backend's.

use sluice::backend::{AttnShape, KvDtype, LayerCache, SeqSpan, WeightRef};
use sluice::dtype::DType;

pub use sluice::util::rng::Rng;

/// f16 bits of `x` (test data only: below 2^-14 it is flushed to zero, and |x| <= 65504).
pub fn f16_bits(x: f32) -> u16 {
    let s = if x < 0.0 { 0x8000 } else { 0 };
    let a = x.abs();
    if a < 6.104e-5 {
        return s;
    }
    let e = a.log2().floor() as i32;
    let m = ((a / 2f32.powi(e) - 1.0) * 1024.0).round() as u32;
    let (e, m) = if m == 1024 { (e + 1, 0) } else { (e, m) };
    s | (((e + 15) as u16) << 10) | m as u16
}

pub fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// `rows` x `cols` weights of `dtype` with random values of a trained model's scale.
pub fn random_weights(dtype: DType, rows: usize, cols: usize, rng: &mut Rng) -> Vec<u8> {
    let n = rows * cols;
    let mut out = Vec::new();
    match dtype {
        DType::F32 => {
            out = f32_bytes(
                &(0..n)
                    .map(|_| rng.symmetric_f32() * 0.1)
                    .collect::<Vec<_>>(),
            )
        }
        DType::F16 => {
            for _ in 0..n {
                out.extend_from_slice(&f16_bits(rng.symmetric_f32() * 0.1 + 0.0001).to_le_bytes())
            }
        }
        DType::BF16 => {
            for _ in 0..n {
                out.extend_from_slice(
                    &(((rng.symmetric_f32() * 0.1).to_bits() >> 16) as u16).to_le_bytes(),
                )
            }
        }
        DType::Q8_0 => {
            for _ in 0..n / 32 {
                out.extend_from_slice(
                    &f16_bits(0.001 + 0.002 * rng.symmetric_f32().abs()).to_le_bytes(),
                );
                out.extend((0..32).map(|_| (rng.next_u64() % 256) as u8));
            }
        }
        DType::Q4_0 | DType::Q4_1 => {
            for _ in 0..n / 32 {
                out.extend_from_slice(
                    &f16_bits(0.005 + 0.01 * rng.symmetric_f32().abs()).to_le_bytes(),
                );
                if dtype == DType::Q4_1 {
                    out.extend_from_slice(
                        &f16_bits(-0.04 - 0.01 * rng.symmetric_f32().abs()).to_le_bytes(),
                    );
                }
                out.extend((0..16).map(|_| (rng.next_u64() % 256) as u8));
            }
        }
        _ => {
            let blocks = n / dtype.block_elems() as usize;
            out = sluice::dtype::ggml::sample_blocks(dtype, blocks, &mut || rng.next_u64());
        }
    }
    assert_eq!(
        out.len() as u64,
        dtype.row_bytes(cols as u64).unwrap() * rows as u64
    );
    out
}

/// max |gpu - cpu| over max |cpu| (row by row when `cols` is given), must be below `tol`;
/// a NaN or an infinity on either side fails (`f64::max` would drop a NaN).
pub fn close(what: &str, cpu: &[f32], gpu: &[f32], cols: usize, tol: f64) {
    assert_eq!(cpu.len(), gpu.len());
    for (r, (c, g)) in cpu.chunks(cols).zip(gpu.chunks(cols)).enumerate() {
        for (side, xs) in [("cpu", c), ("gpu", g)] {
            if let Some(i) = xs.iter().position(|x| !x.is_finite()) {
                panic!("{what}: row {r}: {side} element {i} is {}", xs[i]);
            }
        }
        let scale = c.iter().fold(1e-6f64, |m, x| m.max(x.abs() as f64));
        let err = c
            .iter()
            .zip(g)
            .fold(0f64, |m, (x, y)| m.max((*x as f64 - *y as f64).abs()));
        assert!(
            err / scale <= tol,
            "{what}: row {r}: relative error {:.3e} > {tol:.1e} (cpu {:?} gpu {:?})",
            err / scale,
            &c[..c.len().min(4)],
            &g[..g.len().min(4)]
        );
    }
}

/// One attention step over a KV cache of random values: `slots` 3, two decode rows (the
/// last position of slot 0, the middle of slot 1) and a prefill span of 5 rows at position
/// 10 of slot 2; queries of random values; a ring of window + 16 positions where there is
/// a window.
pub struct AttnCase {
    pub shape: AttnShape,
    pub cache: LayerCache,
    /// The K and V caches, in the cache's element type.
    pub k: Vec<u8>,
    pub v: Vec<u8>,
    pub spans: [SeqSpan; 3],
    pub rows: usize,
    pub q: Vec<f32>,
}

impl AttnCase {
    pub fn new(
        kv: KvDtype,
        (heads, kv_heads, head_dim): (usize, usize, usize),
        ctx: usize,
        window: Option<usize>,
        rng: &mut Rng,
    ) -> AttnCase {
        let shape = AttnShape {
            kv,
            heads,
            kv_heads,
            head_dim,
            max_context: ctx,
            slots: 3,
            scale: 1.0 / (head_dim as f32).sqrt(),
        };
        let cache = LayerCache {
            base: 0,
            cap: window.map_or(ctx, |w| w + 16),
            window,
        };
        let elems = cache.elems(&shape);
        let mut fill = || -> Vec<u8> {
            match kv {
                KvDtype::F32 => {
                    f32_bytes(&(0..elems).map(|_| rng.symmetric_f32()).collect::<Vec<_>>())
                }
                KvDtype::F16 => (0..elems)
                    .flat_map(|_| f16_bits(rng.symmetric_f32()).to_le_bytes())
                    .collect(),
            }
        };
        let (k, v) = (fill(), fill());
        let span = |row, n, pos, slot| SeqSpan { row, n, pos, slot };
        let spans = [
            span(0, 1, ctx - 1, 0),
            span(1, 1, ctx / 2, 1),
            span(2, 5, 10, 2),
        ];
        let rows = 7;
        let q = (0..rows * heads * head_dim)
            .map(|_| rng.symmetric_f32() * 2.0)
            .collect();
        AttnCase {
            shape,
            cache,
            k,
            v,
            spans,
            rows,
            q,
        }
    }
}

/// A whole allocation as a `rows` x `cols` weight of `dtype`.
pub fn wref<M>(mem: &M, dtype: DType, rows: usize, cols: usize) -> WeightRef<'_, M> {
    WeightRef {
        mem,
        offset: 0,
        dtype,
        rows,
        cols,
    }
}

#[cfg(test)]
mod tests {
    /// `close` fails on a NaN or an infinity on either side, and on a real difference.
    #[test]
    fn close_fails_on_nan_on_either_side() {
        let ok = [1.0f32, 2.0, 3.0, 4.0];
        super::close("same", &ok, &ok, 2, 1e-6);
        for (cpu, gpu) in [
            ([f32::NAN, 2.0, 3.0, 4.0], ok),
            (ok, [1.0, 2.0, f32::NAN, 4.0]),
            (ok, [1.0, f32::INFINITY, 3.0, 4.0]),
            (ok, [1.0, 2.0, 3.0, 4.5]),
        ] {
            let r = std::panic::catch_unwind(|| super::close("bad", &cpu, &gpu, 2, 1e-3));
            assert!(r.is_err(), "passed: {cpu:?} against {gpu:?}");
        }
    }
}
