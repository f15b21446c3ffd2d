//! Decode rows with 8-bit activations: each activation row is quantized once per matmul to
//! blocks of 32 (an f32 scale and 32 i8, as llama.cpp's q8_0 but with an f32 scale), and
//! a weight block meets it in integer dot products (AVX2 `maddubs`: u8 x i8 pairs summed
//! to i16, then to i32), scaled once per block. This is the default path; `--exact` keeps
//! f32 activations (`kernels.rs`).
//!
//! Covered weight formats: q4_0, q4_1 and q8_0. A row's result does not depend on the
//! other rows of the batch: each kernel is generic over the rows N it applies a weight
//! block to, and every row accumulates in the same order whatever N is.

use crate::dtype::DType;

/// One block of 32 activations: x[i] ~= d * q[i]; `ds` = d * sum(q) (the offset term of
/// formats with a minimum or a zero point).
#[derive(Clone, Copy, Debug)]
#[repr(C, align(32))]
pub struct Q8Block {
    pub q: [i8; 32],
    pub d: f32,
    pub ds: f32,
}

impl Default for Q8Block {
    fn default() -> Self {
        Q8Block {
            q: [0; 32],
            d: 0.0,
            ds: 0.0,
        }
    }
}

/// Weight formats with an 8-bit-activation kernel.
pub fn covers(dtype: DType) -> bool {
    matches!(dtype, DType::Q4_0 | DType::Q4_1 | DType::Q8_0) && super::kernels::has_gemv4(dtype)
}

/// Quantizes `rows` rows of `k` (a multiple of 32) into `out` (k / 32 blocks a row):
/// scale max|x| / 127, each value rounded to nearest (ties away from zero).
pub fn quantize_rows(xs: &[f32], k: usize, out: &mut Vec<Q8Block>) {
    debug_assert!(k.is_multiple_of(32) && xs.len().is_multiple_of(k));
    out.clear();
    out.extend(xs.chunks_exact(32).map(|c| {
        let amax = c.iter().fold(0f32, |m, &v| m.max(v.abs()));
        let d = amax / 127.0;
        let id = if d > 0.0 { 1.0 / d } else { 0.0 };
        let mut b = Q8Block {
            d,
            ..Q8Block::default()
        };
        let mut sum = 0i32;
        for (q, &v) in b.q.iter_mut().zip(c) {
            *q = (v * id).round() as i8;
            sum += *q as i32;
        }
        b.ds = d * sum as f32;
        b
    }));
}

/// out[j][r] = weight row j . activation row r, for the N rows of `xq` (1 to 4).
pub fn gemv_rows(
    dtype: DType,
    w: &[u8],
    row_bytes: usize,
    xq: &[&[Q8Block]],
    out: &mut [[f32; 4]],
) {
    assert!(covers(dtype), "no 8-bit kernel for {dtype:?}");
    #[cfg(target_arch = "x86_64")]
    // SAFETY: AVX2/FMA/F16C present (covers checks); rows are whole blocks (validated
    // shapes) and each xq row has the blocks of one weight row.
    unsafe {
        match xq.len() {
            1 => avx2::gemv::<1>(dtype, w, row_bytes, xq, out),
            2 => avx2::gemv::<2>(dtype, w, row_bytes, xq, out),
            3 => avx2::gemv::<3>(dtype, w, row_bytes, xq, out),
            4 => avx2::gemv::<4>(dtype, w, row_bytes, xq, out),
            n => panic!("{n} rows: 1 to 4 at a time"),
        }
    }
}

/// The reference of one block pair in integers, for tests: sum of w_int * q over the
/// block, and the weight block's (d, m) scale and minimum.
#[cfg(test)]
pub fn reference_dot(dtype: DType, w: &[u8], x: &[Q8Block]) -> f64 {
    use crate::dtype::ggml;
    let mut vals = vec![0f32; x.len() * 32];
    ggml::dequantize(dtype, w, &mut vals).expect("whole blocks");
    vals.iter()
        .enumerate()
        .map(|(i, &v)| v as f64 * x[i / 32].d as f64 * x[i / 32].q[i % 32] as f64)
        .sum()
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::Q8Block;
    use crate::backend::cpu::kernels::avx2::{f16_scalar, hsum256};
    use crate::dtype::DType;
    use std::arch::x86_64::*;

    /// 16 bytes of nibbles as 32 u8: low nibbles (elements 0..16), then high (16..32).
    ///
    /// # Safety
    /// AVX2; `p` points at 16 readable bytes.
    #[inline(always)]
    unsafe fn nibbles(p: *const u8) -> __m256i {
        // SAFETY: this function's contract, which its caller upholds.
        unsafe {
            let b = _mm_loadu_si128(p as *const __m128i);
            let m = _mm_set1_epi8(0x0f);
            let lo = _mm_and_si128(b, m);
            let hi = _mm_and_si128(_mm_srli_epi16(b, 4), m);
            _mm256_set_m128i(hi, lo)
        }
    }

    /// Sum of u8 a[i] * i8 b[i] as eight i32 lanes, as f32. Pairs of products stay within
    /// i16 (maddubs saturates): a <= 128 and |b| <= 127 here.
    ///
    /// # Safety
    /// AVX2.
    #[inline(always)]
    unsafe fn dot_u8_i8(a: __m256i, b: __m256i) -> __m256 {
        // SAFETY: this function's contract, which its caller upholds.
        unsafe {
            let p = _mm256_maddubs_epi16(a, b);
            _mm256_cvtepi32_ps(_mm256_madd_epi16(p, _mm256_set1_epi16(1)))
        }
    }

    /// Signed i8 x i8 through the sign trick: |a| * (b with a's sign).
    ///
    /// # Safety
    /// AVX2.
    #[inline(always)]
    unsafe fn dot_i8_i8(a: __m256i, b: __m256i) -> __m256 {
        // SAFETY: this function's contract, which its caller upholds.
        unsafe { dot_u8_i8(_mm256_sign_epi8(a, a), _mm256_sign_epi8(b, a)) }
    }

    /// # Safety
    /// AVX2, FMA and F16C; `w` holds whole rows of `row_bytes`; each `xq[r]` (N of them)
    /// has one block per weight block of a row; `out` has a slot per weight row.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn gemv<const N: usize>(
        dtype: DType,
        w: &[u8],
        row_bytes: usize,
        xq: &[&[Q8Block]],
        out: &mut [[f32; 4]],
    ) {
        let bb = match dtype {
            DType::Q4_0 => 18,
            DType::Q4_1 => 20,
            DType::Q8_0 => 34,
            _ => unreachable!("covers() checked"),
        };
        let nb = row_bytes / bb;
        assert!(xq.len() == N && xq.iter().all(|x| x.len() >= nb));
        // SAFETY: this function's contract; every pointer read is inside `blk` (bb bytes)
        // or a Q8Block's 32 aligned quants.
        unsafe {
            for (o, row) in out.iter_mut().zip(w.chunks_exact(row_bytes)) {
                let mut acc = [_mm256_setzero_ps(); N];
                let mut offs = [0f32; N];
                for b in 0..nb {
                    let blk = &row[b * bb..(b + 1) * bb];
                    let d = f16_scalar(blk, 0);
                    match dtype {
                        DType::Q4_0 => {
                            // Nibbles - 8 as signed i8.
                            let wq =
                                _mm256_sub_epi8(nibbles(blk.as_ptr().add(2)), _mm256_set1_epi8(8));
                            for r in 0..N {
                                let x = &xq[r][b];
                                let xv = _mm256_load_si256(x.q.as_ptr() as *const __m256i);
                                let s = _mm256_set1_ps(d * x.d);
                                acc[r] = _mm256_fmadd_ps(dot_i8_i8(wq, xv), s, acc[r]);
                            }
                        }
                        DType::Q4_1 => {
                            let m = f16_scalar(blk, 2);
                            let wq = nibbles(blk.as_ptr().add(4));
                            for r in 0..N {
                                let x = &xq[r][b];
                                let xv = _mm256_load_si256(x.q.as_ptr() as *const __m256i);
                                let s = _mm256_set1_ps(d * x.d);
                                acc[r] = _mm256_fmadd_ps(dot_u8_i8(wq, xv), s, acc[r]);
                                offs[r] += m * x.ds;
                            }
                        }
                        _ => {
                            let wq = _mm256_loadu_si256(blk.as_ptr().add(2) as *const __m256i);
                            for r in 0..N {
                                let x = &xq[r][b];
                                let xv = _mm256_load_si256(x.q.as_ptr() as *const __m256i);
                                let s = _mm256_set1_ps(d * x.d);
                                acc[r] = _mm256_fmadd_ps(dot_i8_i8(wq, xv), s, acc[r]);
                            }
                        }
                    }
                }
                for r in 0..N {
                    o[r] = hsum256(acc[r]) + offs[r];
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::kernels::tests::rand_vec;
    use crate::dtype::ggml;

    fn rng_floats(seed: u64, n: usize) -> Vec<f32> {
        rand_vec(n, seed)
    }

    #[test]
    fn quantized_rows_round_trip_within_half_a_step() {
        let x = rng_floats(1, 256);
        let mut q = Vec::new();
        quantize_rows(&x, 256, &mut q);
        assert_eq!(q.len(), 8);
        for (i, &v) in x.iter().enumerate() {
            let b = &q[i / 32];
            assert!((b.q[i % 32] as f32 * b.d - v).abs() <= b.d * 0.5 + 1e-7);
        }
        // A zero block has a zero scale and no NaN.
        quantize_rows(&[0.0; 32], 32, &mut q);
        assert_eq!((q[0].d, q[0].ds, q[0].q), (0.0, 0.0, [0; 32]));
    }

    /// Every covered format: the integer kernel equals the f64 dot of the decoded weights
    /// with the dequantized activations (up to f32 rounding), and a row's result is the same
    /// bits at every batch size.
    #[test]
    fn integer_dots_match_the_reference_and_do_not_depend_on_the_batch() {
        for dtype in [DType::Q4_0, DType::Q4_1, DType::Q8_0] {
            if !covers(dtype) {
                eprintln!("SKIPPED {dtype:?}: no AVX2 on this CPU");
                continue;
            }
            let (k, m) = (256usize, 7usize);
            let rb = dtype.row_bytes(k as u64).unwrap() as usize;
            let w = ggml::sample_blocks(dtype, m * k / 32, 5);
            let xs = rng_floats(9, 4 * k);
            let mut xq = Vec::new();
            quantize_rows(&xs, k, &mut xq);
            let rows: Vec<&[Q8Block]> = xq.chunks_exact(k / 32).collect();
            let mut all = vec![[0f32; 4]; m];
            gemv_rows(dtype, &w, rb, &rows, &mut all);
            for n in 1..=4 {
                for r0 in 0..=(4 - n) {
                    let mut part = vec![[0f32; 4]; m];
                    gemv_rows(dtype, &w, rb, &rows[r0..r0 + n], &mut part);
                    for j in 0..m {
                        for i in 0..n {
                            assert_eq!(
                                part[j][i].to_bits(),
                                all[j][r0 + i].to_bits(),
                                "{dtype:?}: row {} alone in {n} differs",
                                r0 + i
                            );
                        }
                    }
                }
            }
            for j in 0..m {
                for r in 0..4 {
                    let want = reference_dot(dtype, &w[j * rb..(j + 1) * rb], rows[r]);
                    let got = all[j][r] as f64;
                    assert!(
                        (got - want).abs() <= 1e-4 * (1.0 + want.abs()),
                        "{dtype:?} row {j} x {r}: {got} vs {want}"
                    );
                }
            }
        }
    }
}
