//! CPU inner loops: dot products and row dequantization for every weight dtype. Written
//! with fixed 8-lane accumulators so the compiler vectorizes them; each is compiled twice,
//! for baseline x86-64 and for AVX2+FMA, and the AVX2 version is chosen at run time.
//!
//! GGML block layouts (ggml-common.h): q8_0 = f16 d + 32 x i8, value d*q; q4_0 = f16 d +
//! 16 bytes, value d*(q-8); q4_1 = f16 d + f16 m + 16 bytes, value d*q + m. In both 4-bit
//! formats byte j holds element j in its low nibble and element j+16 in its high nibble.
//! The formats of K-quant GGUFs (Q4_K, Q6_K, ...) have their AVX2 kernels in `kquant.rs`;
//! without AVX2 they, like everything here, go through the scalar loops below.

use crate::dtype::{ggml, DType};
use half::{bf16, f16};

#[inline(always)]
fn f16_at(b: &[u8], at: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([b[at], b[at + 1]])).to_f32()
}

#[inline(always)]
fn madd<const FMA: bool>(a: f32, b: f32, c: f32) -> f32 {
    if FMA {
        a.mul_add(b, c)
    } else {
        a * b + c
    }
}

#[inline(always)]
fn hsum(a: [f32; 8]) -> f32 {
    ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7]))
}

/// dot(w_row, x) for one row of `k = x.len()` elements.
#[inline(always)]
fn dot_impl<const FMA: bool>(dtype: DType, w: &[u8], x: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    match dtype {
        DType::F32 => {
            for (wc, xc) in w.chunks_exact(32).zip(x.chunks_exact(8)) {
                for l in 0..8 {
                    let wv = f32::from_le_bytes([
                        wc[4 * l],
                        wc[4 * l + 1],
                        wc[4 * l + 2],
                        wc[4 * l + 3],
                    ]);
                    acc[l] = madd::<FMA>(wv, xc[l], acc[l]);
                }
            }
            let tail = x.len() / 8 * 8;
            let mut s = hsum(acc);
            for i in tail..x.len() {
                s +=
                    f32::from_le_bytes([w[4 * i], w[4 * i + 1], w[4 * i + 2], w[4 * i + 3]]) * x[i];
            }
            s
        }
        DType::BF16 => {
            for (wc, xc) in w.chunks_exact(16).zip(x.chunks_exact(8)) {
                for l in 0..8 {
                    let wv = f32::from_bits(
                        (u16::from_le_bytes([wc[2 * l], wc[2 * l + 1]]) as u32) << 16,
                    );
                    acc[l] = madd::<FMA>(wv, xc[l], acc[l]);
                }
            }
            let tail = x.len() / 8 * 8;
            let mut s = hsum(acc);
            for i in tail..x.len() {
                s += bf16::from_bits(u16::from_le_bytes([w[2 * i], w[2 * i + 1]])).to_f32() * x[i];
            }
            s
        }
        DType::F16 => {
            let mut tmp = [0f32; 64];
            let mut i = 0;
            while i < x.len() {
                let n = (x.len() - i).min(64);
                for (t, c) in tmp[..n]
                    .iter_mut()
                    .zip(w[2 * i..2 * (i + n)].chunks_exact(2))
                {
                    *t = f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32();
                }
                if n == 64 {
                    for (tc, xc) in tmp.chunks_exact(8).zip(x[i..i + 64].chunks_exact(8)) {
                        for l in 0..8 {
                            acc[l] = madd::<FMA>(tc[l], xc[l], acc[l]);
                        }
                    }
                } else {
                    for j in 0..n {
                        acc[j % 8] = madd::<FMA>(tmp[j], x[i + j], acc[j % 8]);
                    }
                }
                i += n;
            }
            hsum(acc)
        }
        DType::Q8_0 => {
            for (blk, xs) in w.chunks_exact(34).zip(x.chunks_exact(32)) {
                let d = f16_at(blk, 0);
                let mut s = [0f32; 8];
                for c in 0..4 {
                    for l in 0..8 {
                        s[l] = madd::<FMA>(blk[2 + c * 8 + l] as i8 as f32, xs[c * 8 + l], s[l]);
                    }
                }
                for l in 0..8 {
                    acc[l] = madd::<FMA>(d, s[l], acc[l]);
                }
            }
            hsum(acc)
        }
        DType::Q4_0 | DType::Q4_1 => {
            let (bb, qo) = if dtype == DType::Q4_0 {
                (18, 2)
            } else {
                (20, 4)
            };
            let mut macc = 0f32;
            for (blk, xs) in w.chunks_exact(bb).zip(x.chunks_exact(32)) {
                let d = f16_at(blk, 0);
                let mut s = [0f32; 8];
                for c in 0..2 {
                    for l in 0..8 {
                        let q = blk[qo + c * 8 + l];
                        s[l] = madd::<FMA>((q & 15) as f32, xs[c * 8 + l], s[l]);
                        s[l] = madd::<FMA>((q >> 4) as f32, xs[16 + c * 8 + l], s[l]);
                    }
                }
                for l in 0..8 {
                    acc[l] = madd::<FMA>(d, s[l], acc[l]);
                }
                // The offset term: q4_0 subtracts 8*d per element, q4_1 adds m.
                let xsum: f32 = {
                    let mut t = [0f32; 8];
                    for c in 0..4 {
                        for l in 0..8 {
                            t[l] += xs[c * 8 + l];
                        }
                    }
                    hsum(t)
                };
                let off = if dtype == DType::Q4_0 {
                    -8.0 * d
                } else {
                    f16_at(blk, 2)
                };
                macc = madd::<FMA>(off, xsum, macc);
            }
            hsum(acc) + macc
        }
        _ => {
            // Each block through the reference decoder, then the same 8-lane sums.
            let (be, bb) = (dtype.block_elems() as usize, dtype.block_bytes() as usize);
            let mut tmp = [0f32; 256];
            for (blk, xs) in w.chunks_exact(bb).zip(x.chunks_exact(be)) {
                ggml::dequantize_block(dtype, blk, &mut tmp[..be]);
                for (tc, xc) in tmp[..be].chunks_exact(8).zip(xs.chunks_exact(8)) {
                    for l in 0..8 {
                        acc[l] = madd::<FMA>(tc[l], xc[l], acc[l]);
                    }
                }
            }
            hsum(acc)
        }
    }
}

/// Dequantizes (or converts) one row into f32.
#[inline(always)]
fn dequant_impl(dtype: DType, w: &[u8], out: &mut [f32]) {
    match dtype {
        DType::F32 => {
            for (o, c) in out.iter_mut().zip(w.chunks_exact(4)) {
                *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
        DType::BF16 => {
            for (o, c) in out.iter_mut().zip(w.chunks_exact(2)) {
                *o = f32::from_bits((u16::from_le_bytes([c[0], c[1]]) as u32) << 16);
            }
        }
        DType::F16 => {
            for (o, c) in out.iter_mut().zip(w.chunks_exact(2)) {
                *o = f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32();
            }
        }
        DType::Q8_0 => {
            for (blk, o) in w.chunks_exact(34).zip(out.chunks_exact_mut(32)) {
                let d = f16_at(blk, 0);
                for j in 0..32 {
                    o[j] = d * blk[2 + j] as i8 as f32;
                }
            }
        }
        DType::Q4_0 | DType::Q4_1 => {
            let (bb, qo) = if dtype == DType::Q4_0 {
                (18, 2)
            } else {
                (20, 4)
            };
            for (blk, o) in w.chunks_exact(bb).zip(out.chunks_exact_mut(32)) {
                let d = f16_at(blk, 0);
                let (scale, off) = if dtype == DType::Q4_0 {
                    (d, -8.0 * d)
                } else {
                    (d, f16_at(blk, 2))
                };
                for j in 0..16 {
                    let q = blk[qo + j];
                    o[j] = (q & 15) as f32 * scale + off;
                    o[j + 16] = (q >> 4) as f32 * scale + off;
                }
            }
        }
        _ => {
            let (be, bb) = (dtype.block_elems() as usize, dtype.block_bytes() as usize);
            for (blk, o) in w.chunks_exact(bb).zip(out.chunks_exact_mut(be)) {
                ggml::dequantize_block(dtype, blk, o);
            }
        }
    }
}

/// out[r] = dot(row r of w, x) for the `out.len()` rows of w (each `row_bytes` long).
#[inline(always)]
fn gemv_impl<const FMA: bool>(
    dtype: DType,
    w: &[u8],
    row_bytes: usize,
    x: &[f32],
    out: &mut [f32],
) {
    for (o, row) in out.iter_mut().zip(w.chunks_exact(row_bytes)) {
        *o = dot_impl::<FMA>(dtype, row, x);
    }
}

#[inline(always)]
fn dequant_rows_impl(dtype: DType, w: &[u8], row_bytes: usize, cols: usize, out: &mut [f32]) {
    for (row, o) in w.chunks_exact(row_bytes).zip(out.chunks_exact_mut(cols)) {
        dequant_impl(dtype, row, o);
    }
}

#[cfg(target_arch = "x86_64")]
pub(super) mod avx2 {
    //! Hand-written AVX2 dot products for the block formats (the loops the compiler does
    //! not vectorize well: nibble and byte unpacking to f32). Activations stay f32, so the
    //! results match a dequantize-then-multiply reference to f32 rounding.
    use super::*;
    use crate::backend::cpu::kquant;
    pub(in crate::backend::cpu) use crate::backend::cpu::simd::{dot32, f16_scalar, hsum256};
    use std::arch::x86_64::*;

    /// # Safety
    /// AVX2, FMA and F16C; `q` and `k` have equal lengths.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(in crate::backend::cpu) unsafe fn dot_f16(q: &[f32], k: &[u16]) -> f32 {
        let n = q.len() / 8 * 8;
        // SAFETY: loads stay below n <= len of both slices.
        unsafe {
            let mut acc = _mm256_setzero_ps();
            for i in (0..n).step_by(8) {
                let kv = _mm256_cvtph_ps(_mm_loadu_si128(k.as_ptr().add(i) as *const __m128i));
                acc = _mm256_fmadd_ps(_mm256_loadu_ps(q.as_ptr().add(i)), kv, acc);
            }
            // The scalar fallback's order: lanes (0+4)+(2+6), (1+5)+(3+7).
            let h = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
            let h = _mm_add_ps(h, _mm_movehl_ps(h, h));
            let s = _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
            (n..q.len()).fold(s, |d, i| {
                d + q[i] * _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(k[i] as i32)))
            })
        }
    }

    /// The sums of KB (2 or 4) vectors of eight lanes, lane by lane in one fixed tree
    /// whatever KB: ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)); sum k in lane k.
    ///
    /// # Safety
    /// AVX.
    #[inline(always)]
    unsafe fn sums_of<const KB: usize>(a: &[__m256; KB]) -> __m128 {
        // SAFETY: this function's contract, which its caller upholds.
        unsafe {
            let h = if KB == 4 {
                _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]))
            } else {
                let h01 = _mm256_hadd_ps(a[0], a[1]);
                _mm256_hadd_ps(h01, h01)
            };
            _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps::<1>(h))
        }
    }

    /// `sc[g * n + j] = q[g] . key j` for the G query heads of one KV head (`q`: G rows
    /// of `hd`, hd a multiple of 8), each key converted from f16 once for all G; KB keys
    /// at a time (the last group padded with the last key), their lanes summed together
    /// (`sums_of`), so a score's bits do not depend on G, KB or where its key falls.
    ///
    /// # Safety
    /// AVX2, FMA and F16C; every `ks[ats[j]..ats[j] + hd]` is in bounds; `sc` has G * n;
    /// KB is 2 or 4.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(in crate::backend::cpu) unsafe fn group_scores_f16<const G: usize, const KB: usize>(
        q: &[f32],
        hd: usize,
        ks: &[u16],
        ats: &[usize],
        sc: &mut [f32],
    ) {
        let n = ats.len();
        // SAFETY: this function's contract.
        unsafe {
            let mut j = 0;
            while j < n {
                let at: [usize; KB] =
                    std::array::from_fn(|i| *ats.get_unchecked((j + i).min(n - 1)));
                let mut acc = [[_mm256_setzero_ps(); KB]; G];
                for c in (0..hd).step_by(8) {
                    for (kk, &a) in at.iter().enumerate() {
                        let kv = _mm256_cvtph_ps(_mm_loadu_si128(
                            ks.as_ptr().add(a + c) as *const __m128i
                        ));
                        for (g, acc_g) in acc.iter_mut().enumerate() {
                            acc_g[kk] = _mm256_fmadd_ps(
                                _mm256_loadu_ps(q.as_ptr().add(g * hd + c)),
                                kv,
                                acc_g[kk],
                            );
                        }
                    }
                }
                let take = KB.min(n - j);
                for (g, acc_g) in acc.iter().enumerate() {
                    let mut out = [0f32; 4];
                    _mm_storeu_ps(out.as_mut_ptr(), sums_of::<KB>(acc_g));
                    sc[g * n + j..g * n + j + take].copy_from_slice(&out[..take]);
                }
                j += KB;
            }
        }
    }

    /// `o[g] = sum over j of p[g * n + j] * value j`, keys in order, for the G heads of
    /// one KV head (`o`: G rows of `hd`, a multiple of 8), each value converted once for
    /// all G.
    ///
    /// # Safety
    /// AVX2, FMA and F16C; every `vs[ats[j]..ats[j] + hd]` is in bounds; `p` has G * n.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(in crate::backend::cpu) unsafe fn group_pv_f16<const G: usize>(
        p: &[f32],
        hd: usize,
        vs: &[u16],
        ats: &[usize],
        o: &mut [f32],
    ) {
        let n = ats.len();
        // SAFETY: this function's contract.
        unsafe {
            for c in (0..hd).step_by(8) {
                let mut acc = [_mm256_setzero_ps(); G];
                for (j, &at) in ats.iter().enumerate() {
                    let vv =
                        _mm256_cvtph_ps(_mm_loadu_si128(vs.as_ptr().add(at + c) as *const __m128i));
                    for (g, a) in acc.iter_mut().enumerate() {
                        *a = _mm256_fmadd_ps(_mm256_set1_ps(*p.get_unchecked(g * n + j)), vv, *a);
                    }
                }
                for (g, a) in acc.into_iter().enumerate() {
                    _mm256_storeu_ps(o.as_mut_ptr().add(g * hd + c), a);
                }
            }
        }
    }

    /// `map2`'s loop with AVX2 enabled, `f` inlined into it.
    ///
    /// # Safety
    /// AVX2.
    #[target_feature(enable = "avx2")]
    pub(in crate::backend::cpu) unsafe fn map2(
        x: &mut [f32],
        y: &[f32],
        f: impl Fn(f32, f32) -> f32,
    ) {
        x.iter_mut().zip(y).for_each(|(a, &b)| *a = f(*a, b));
    }

    /// `map1`'s loop with AVX2 enabled.
    ///
    /// # Safety
    /// AVX2.
    #[target_feature(enable = "avx2")]
    pub(in crate::backend::cpu) unsafe fn map1(x: &mut [f32], f: impl Fn(f32) -> f32) {
        x.iter_mut().for_each(|a| *a = f(*a));
    }

    /// Asks for the cache lines of `n` f32s from `row` (a hint: no fault, no effect on a
    /// result).
    #[inline(always)]
    fn prefetch_row(row: *const f32, n: usize) {
        for l in (0..n).step_by(16) {
            // SAFETY: a prefetch hint reads nothing and cannot fault, whatever the address.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(row.wrapping_add(l) as *const i8) };
        }
    }

    /// `sc[g * stride + j] = q[g] . key j` for the G query heads of one KV head over f32
    /// keys (`q`: G rows of `hd`, hd a multiple of 8), each key loaded once for all G, KB
    /// at a time (the last group padded with the last key): per score `dot_f32`'s lanes
    /// (a product, then a sum) and `lanes_sum`, so its bits are `dot_f32`'s.
    ///
    /// # Safety
    /// AVX2; every `ks[ats[j]..ats[j] + hd]` is in bounds; `sc` has (G - 1) * stride + n.
    #[target_feature(enable = "avx2")]
    pub(in crate::backend::cpu) unsafe fn group_scores_f32<const G: usize, const KB: usize>(
        q: &[f32],
        hd: usize,
        ks: &[f32],
        ats: &[usize],
        (sc, stride): (&mut [f32], usize),
    ) {
        let n = ats.len();
        // SAFETY: this function's contract.
        unsafe {
            let mut j = 0;
            while j < n {
                let at: [usize; KB] =
                    std::array::from_fn(|i| *ats.get_unchecked((j + i).min(n - 1)));
                // The keys two steps on, a cache line at a time (the hardware's prefetch
                // does not follow rows a KV cache's width apart across pages).
                for i in 2 * KB..3 * KB {
                    if let Some(&a) = ats.get(j + i) {
                        prefetch_row(ks.as_ptr().wrapping_add(a), hd);
                    }
                }
                let mut acc = [[_mm256_setzero_ps(); KB]; G];
                for c in (0..hd).step_by(8) {
                    for (kk, &a) in at.iter().enumerate() {
                        let kv = _mm256_loadu_ps(ks.as_ptr().add(a + c));
                        for (g, acc_g) in acc.iter_mut().enumerate() {
                            let qv = _mm256_loadu_ps(q.as_ptr().add(g * hd + c));
                            acc_g[kk] = _mm256_add_ps(acc_g[kk], _mm256_mul_ps(qv, kv));
                        }
                    }
                }
                for (g, acc_g) in acc.iter().enumerate() {
                    for (kk, a) in acc_g.iter().enumerate().take(n - j) {
                        let mut l = [0f32; 8];
                        _mm256_storeu_ps(l.as_mut_ptr(), *a);
                        *sc.get_unchecked_mut(g * stride + j + kk) = lanes_sum(l);
                    }
                }
                j += KB;
            }
        }
    }

    /// `o[g] += sum over j of p[g * stride + j] * value j` for the G heads of one KV head
    /// over f32 values (`o`: G rows of `hd`, a multiple of 8): per element the keys in
    /// order, each a product then a sum, so the bits are `axpy_f32`'s key after key; each
    /// value loaded once for all G.
    ///
    /// # Safety
    /// AVX2; every `vs[ats[j]..ats[j] + hd]` is in bounds; `p` has (G - 1) * stride + n.
    #[target_feature(enable = "avx2")]
    pub(in crate::backend::cpu) unsafe fn group_pv_f32<const G: usize>(
        (p, stride): (&[f32], usize),
        hd: usize,
        vs: &[f32],
        ats: &[usize],
        o: &mut [f32],
    ) {
        // SAFETY: this function's contract.
        unsafe {
            for c in (0..hd).step_by(8) {
                let mut acc: [__m256; G] =
                    std::array::from_fn(|g| _mm256_loadu_ps(o.as_ptr().add(g * hd + c)));
                for (j, &at) in ats.iter().enumerate() {
                    if c == 0 {
                        if let Some(&a) = ats.get(j + 8) {
                            prefetch_row(vs.as_ptr().wrapping_add(a), hd);
                        }
                    }
                    let vv = _mm256_loadu_ps(vs.as_ptr().add(at + c));
                    for (g, a) in acc.iter_mut().enumerate() {
                        let w = _mm256_set1_ps(*p.get_unchecked(g * stride + j));
                        *a = _mm256_add_ps(*a, _mm256_mul_ps(w, vv));
                    }
                }
                for (g, a) in acc.into_iter().enumerate() {
                    _mm256_storeu_ps(o.as_mut_ptr().add(g * hd + c), a);
                }
            }
        }
    }

    /// # Safety
    /// AVX2, FMA and F16C; each `k[at[r]..at[r] + q.len()]` is in bounds.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(in crate::backend::cpu) unsafe fn dot4_f16(
        q: &[f32],
        k: &[u16],
        at: [usize; 4],
    ) -> [f32; 4] {
        let n = q.len() / 8 * 8;
        // SAFETY: this function's contract.
        unsafe {
            let acc = dot4_lanes(q, |acc, qv, r, i| {
                let kv =
                    _mm256_cvtph_ps(_mm_loadu_si128(k.as_ptr().add(at[r] + i) as *const __m128i));
                _mm256_fmadd_ps(qv, kv, acc)
            });
            std::array::from_fn(|r| {
                let a = acc[r];
                let h = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
                let h = _mm_add_ps(h, _mm_movehl_ps(h, h));
                let s = _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
                (n..q.len()).fold(s, |d, i| {
                    let kk = _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(k[at[r] + i] as i32)));
                    d + q[i] * kk
                })
            })
        }
    }

    /// # Safety
    /// AVX2, FMA and F16C; each `v[at[r]..at[r] + o.len()]` is in bounds.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(in crate::backend::cpu) unsafe fn axpy4_f16(
        w: [f32; 4],
        v: &[u16],
        at: [usize; 4],
        o: &mut [f32],
    ) {
        // SAFETY: this function's contract.
        unsafe {
            let n = axpy4_lanes(w, o, |acc, w, r, i| {
                let vv =
                    _mm256_cvtph_ps(_mm_loadu_si128(v.as_ptr().add(at[r] + i) as *const __m128i));
                _mm256_fmadd_ps(w, vv, acc)
            });
            for i in n..o.len() {
                for r in 0..4 {
                    let vv = _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(v[at[r] + i] as i32)));
                    o[i] = w[r].mul_add(vv, o[i]);
                }
            }
        }
    }

    /// The four-row dots' lanes over q's whole groups of 8 elements: q loaded once a
    /// group, `mul_add(acc[r], q, r, i)` for the rows in order.
    ///
    /// # Safety
    /// AVX2 (the caller's target features), and what `mul_add` reads in bounds.
    #[inline(always)]
    unsafe fn dot4_lanes(
        q: &[f32],
        mul_add: impl Fn(__m256, __m256, usize, usize) -> __m256,
    ) -> [__m256; 4] {
        // SAFETY: loads of `q` stay below its whole groups of 8.
        unsafe {
            let mut acc = [_mm256_setzero_ps(); 4];
            for i in (0..q.len() / 8 * 8).step_by(8) {
                let qv = _mm256_loadu_ps(q.as_ptr().add(i));
                for (r, a) in acc.iter_mut().enumerate() {
                    *a = mul_add(*a, qv, r, i);
                }
            }
            acc
        }
    }

    /// The four-row additions' whole groups of 8 elements: each loaded from `o` once,
    /// `add(acc, w[r], r, i)` for the rows in order, stored; returns where the rest starts.
    ///
    /// # Safety
    /// AVX2 (the caller's target features), and what `add` reads in bounds.
    #[inline(always)]
    unsafe fn axpy4_lanes(
        w: [f32; 4],
        o: &mut [f32],
        add: impl Fn(__m256, __m256, usize, usize) -> __m256,
    ) -> usize {
        let n = o.len() / 8 * 8;
        // SAFETY: loads and stores of `o` stay below n <= o.len().
        unsafe {
            let wv = w.map(|x| _mm256_set1_ps(x));
            for i in (0..n).step_by(8) {
                let p = o.as_mut_ptr().add(i);
                let mut acc = _mm256_loadu_ps(p);
                for (r, &w) in wv.iter().enumerate() {
                    acc = add(acc, w, r, i);
                }
                _mm256_storeu_ps(p, acc);
            }
        }
        n
    }

    /// # Safety
    /// AVX2; each `k[at[r]..at[r] + q.len()]` is in bounds.
    #[target_feature(enable = "avx2")]
    pub(in crate::backend::cpu) unsafe fn dot4_f32(
        q: &[f32],
        k: &[f32],
        at: [usize; 4],
    ) -> [[f32; 8]; 4] {
        // SAFETY: this function's contract.
        unsafe {
            let acc = dot4_lanes(q, |acc, qv, r, i| {
                let kv = _mm256_loadu_ps(k.as_ptr().add(at[r] + i));
                // A product, then a sum: the scalar lanes' rounding (no FMA).
                _mm256_add_ps(acc, _mm256_mul_ps(qv, kv))
            });
            acc.map(|a| {
                let mut l = [0f32; 8];
                _mm256_storeu_ps(l.as_mut_ptr(), a);
                l
            })
        }
    }

    /// # Safety
    /// AVX2; each `v[at[r]..at[r] + o.len()]` is in bounds.
    #[target_feature(enable = "avx2")]
    pub(in crate::backend::cpu) unsafe fn axpy4_f32(
        w: [f32; 4],
        v: &[f32],
        at: [usize; 4],
        o: &mut [f32],
    ) {
        // SAFETY: this function's contract.
        unsafe {
            let n = axpy4_lanes(w, o, |acc, w, r, i| {
                let vv = _mm256_loadu_ps(v.as_ptr().add(at[r] + i));
                _mm256_add_ps(acc, _mm256_mul_ps(w, vv))
            });
            for i in n..o.len() {
                for r in 0..4 {
                    o[i] += w[r] * v[at[r] + i];
                }
            }
        }
    }

    /// # Safety
    /// AVX2, FMA and F16C; `v` and `o` have equal lengths.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(in crate::backend::cpu) unsafe fn axpy_f16(w: f32, v: &[u16], o: &mut [f32]) {
        let n = o.len() / 8 * 8;
        // SAFETY: loads and stores stay below n <= len of both slices.
        unsafe {
            let wv = _mm256_set1_ps(w);
            for i in (0..n).step_by(8) {
                let vv = _mm256_cvtph_ps(_mm_loadu_si128(v.as_ptr().add(i) as *const __m128i));
                let p = o.as_mut_ptr().add(i);
                _mm256_storeu_ps(p, _mm256_fmadd_ps(wv, vv, _mm256_loadu_ps(p)));
            }
            for i in n..o.len() {
                let vv = _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(v[i] as i32)));
                o[i] = w.mul_add(vv, o[i]);
            }
        }
    }

    /// `unpack_q4`'s byte shuffles: byte j (then 8 + j) of each 128-bit half into the low
    /// byte of dword j (indices with the top bit set make zeros).
    const Q4_SPREAD: [[i8; 32]; 2] = {
        let mut t = [[-1i8; 32]; 2];
        let mut j = 0;
        while j < 8 {
            t[0][4 * j] = j as i8;
            t[1][4 * j] = 8 + j as i8;
            j += 1;
        }
        t
    };

    /// The 32 nibbles of a q4 block (16 bytes at `q`) as four vectors of f32: elements
    /// 0..8, 8..16 (low nibbles), 16..24, 24..32 (high nibbles).
    ///
    /// The block is broadcast to both halves of a vector by the load, and two byte
    /// shuffles (`Q4_SPREAD`) put bytes 0..8 and 8..16 in the low byte of eight dwords
    /// each; a mask and a dword shift take the nibbles out. That is two shuffles a block
    /// where widening each quarter (`vpmovzxbd`) and moving the next one down took six.
    ///
    /// # Safety
    /// The CPU supports AVX2; `q` points at 16 readable bytes.
    #[inline(always)]
    unsafe fn unpack_q4(q: *const u8) -> [__m256; 4] {
        // SAFETY: this function's contract, which its caller upholds.
        unsafe {
            let v = _mm256_broadcastsi128_si256(_mm_loadu_si128(q as *const __m128i));
            let idx = |o: &[i8; 32]| _mm256_loadu_si256(o.as_ptr() as *const __m256i);
            let (first, second) = (idx(&Q4_SPREAD[0]), idx(&Q4_SPREAD[1]));
            let (a, b) = (
                _mm256_shuffle_epi8(v, first),
                _mm256_shuffle_epi8(v, second),
            );
            let m4 = _mm256_set1_epi32(0x0F);
            let f = _mm256_cvtepi32_ps;
            [
                f(_mm256_and_si256(a, m4)),
                f(_mm256_and_si256(b, m4)),
                f(_mm256_srli_epi32::<4>(a)),
                f(_mm256_srli_epi32::<4>(b)),
            ]
        }
    }

    /// The 32 signed bytes of a q8_0 block (at `q`) as four vectors of f32, each quarter
    /// sign-extended straight from memory (no shuffle to move it down first).
    ///
    /// # Safety
    /// The CPU supports AVX2; `q` points at 32 readable bytes.
    #[inline(always)]
    unsafe fn unpack_q8(q: *const u8) -> [__m256; 4] {
        // SAFETY: this function's contract, which its caller upholds.
        unsafe {
            let f = |at: usize| {
                let v = _mm_loadl_epi64(q.add(at) as *const __m128i);
                _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v))
            };
            [f(0), f(8), f(16), f(24)]
        }
    }

    /// A q4 block's scale d and offset (q4_0: -8 d; q4_1: its m): the block's first four
    /// bytes widened from f16 in one conversion.
    ///
    /// # Safety
    /// The CPU supports F16C; `blk` points at 4 readable bytes.
    #[inline(always)]
    unsafe fn q4_scales(blk: *const u8, q4_0: bool) -> (f32, f32) {
        // SAFETY: this function's contract, which its caller upholds.
        unsafe {
            let dm = _mm_cvtph_ps(_mm_cvtsi32_si128(std::ptr::read_unaligned(
                blk as *const i32,
            )));
            let d = _mm_cvtss_f32(dm);
            let off = if q4_0 {
                -8.0 * d
            } else {
                _mm_cvtss_f32(_mm_movehdup_ps(dm))
            };
            (d, off)
        }
    }

    /// One activation row against `R` weight rows, their blocks in step: a row's sums
    /// are one chain of dependent FMAs from block to block (and the offset term another),
    /// so a row alone runs at the FMA's latency, not its throughput; `R` rows in step are
    /// `R` independent chains. Per row the arithmetic is exactly `dot4_q4`'s, so a
    /// sequence's results depend neither on `R` nor on how many others share its batch.
    ///
    /// # Safety
    /// The CPU supports AVX2, FMA and F16C; `x.len()` is a multiple of 32, each `w[r]`
    /// holds `x.len() / 32` blocks of `bb` bytes with the 16 quant bytes at `qo`, and
    /// `xsum` one sum per block.
    // The block index addresses raw pointers into w and x and the sums in lockstep.
    #[inline(always)]
    #[allow(clippy::needless_range_loop)]
    unsafe fn dot_q4<const R: usize>(
        w: [&[u8]; R],
        x: &[f32],
        xsum: &[f32],
        bb: usize,
        qo: usize,
        q4_0: bool,
    ) -> [f32; R] {
        // SAFETY: this function's contract, which its caller upholds.
        unsafe {
            let mut acc = [_mm256_setzero_ps(); R];
            let mut moff = [0f32; R];
            let xp = x.as_ptr();
            for b in 0..x.len() / 32 {
                for r in 0..R {
                    let blk = w[r].as_ptr().add(b * bb);
                    let (d, off) = q4_scales(blk, q4_0);
                    let s = dot32(&unpack_q4(blk.add(qo)), xp.add(b * 32));
                    acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d), s, acc[r]);
                    moff[r] = off.mul_add(xsum[b], moff[r]);
                }
            }
            std::array::from_fn(|r| hsum256(acc[r]) + moff[r])
        }
    }

    /// One activation row against `R` q8_0 weight rows in step (as `dot_q4`).
    ///
    /// # Safety
    /// The CPU supports AVX2, FMA and F16C; `x.len()` is a multiple of 32 and each `w[r]`
    /// holds `x.len() / 32` q8_0 blocks of 34 bytes.
    #[inline(always)]
    #[allow(clippy::needless_range_loop)]
    unsafe fn dot_q8_0<const R: usize>(w: [&[u8]; R], x: &[f32]) -> [f32; R] {
        // SAFETY: this function's contract, which its caller upholds.
        unsafe {
            let mut acc = [_mm256_setzero_ps(); R];
            let xp = x.as_ptr();
            for b in 0..x.len() / 32 {
                for r in 0..R {
                    let s = dot32(&unpack_q8(w[r].as_ptr().add(b * 34 + 2)), xp.add(b * 32));
                    let d = _mm256_set1_ps(f16_scalar(w[r], b * 34));
                    acc[r] = _mm256_fmadd_ps(d, s, acc[r]);
                }
            }
            std::array::from_fn(|r| hsum256(acc[r]))
        }
    }

    /// `out[i] = dot(row i of w, x)`, `ROWS_IN_STEP` rows in step through `many` (row i of
    /// each `ROWS_IN_STEP`-th of the rows, so each is read front to back as one
    /// sequential stream), the rows left over through `one`.
    #[inline(always)]
    fn rows_in_step(
        w: &[u8],
        row_bytes: usize,
        out: &mut [f32],
        mut many: impl FnMut([&[u8]; ROWS_IN_STEP]) -> [f32; ROWS_IN_STEP],
        mut one: impl FnMut([&[u8]; 1]) -> [f32; 1],
    ) {
        let q = out.len() / ROWS_IN_STEP;
        for i in 0..q {
            let v = many(std::array::from_fn(|p| {
                let r = p * q + i;
                &w[r * row_bytes..(r + 1) * row_bytes]
            }));
            for (p, v) in v.into_iter().enumerate() {
                out[p * q + i] = v;
            }
        }
        let done = q * ROWS_IN_STEP;
        for (o, row) in out[done..]
            .iter_mut()
            .zip(w[done * row_bytes..].chunks_exact(row_bytes))
        {
            *o = one([row])[0];
        }
    }

    /// Weight rows a one-activation-row GEMV runs in step (`dot_q4`).
    const ROWS_IN_STEP: usize = 2;

    /// Up to four activation rows against one weight row: the block is unpacked once and
    /// used for every row. `xsum[r]` holds row r's per-block sums (for the offset term).
    ///
    /// # Safety
    /// As `dot_q4`, for each of the four rows (all of one length).
    #[inline(always)]
    // As in dot_q4: one index for weights, activations and sums.
    #[allow(clippy::needless_range_loop)]
    unsafe fn dot4_q4(
        w: &[u8],
        xs: &[&[f32]; 4],
        xsum: &[&[f32]; 4],
        bb: usize,
        qo: usize,
        q4_0: bool,
    ) -> [f32; 4] {
        // SAFETY: this function's contract, which its caller upholds.
        unsafe {
            let mut acc = [_mm256_setzero_ps(); 4];
            let mut moff = [0f32; 4];
            let wp = w.as_ptr();
            for b in 0..xs[0].len() / 32 {
                let (d, off) = q4_scales(wp.add(b * bb), q4_0);
                let wv = unpack_q4(wp.add(b * bb + qo));
                let dv = _mm256_set1_ps(d);
                for r in 0..4 {
                    acc[r] = _mm256_fmadd_ps(dv, dot32(&wv, xs[r].as_ptr().add(b * 32)), acc[r]);
                    moff[r] = off.mul_add(xsum[r][b], moff[r]);
                }
            }
            std::array::from_fn(|r| hsum256(acc[r]) + moff[r])
        }
    }

    /// # Safety
    /// As `dot_q8_0`, for each of the four rows (all of one length).
    #[inline(always)]
    unsafe fn dot4_q8_0(w: &[u8], xs: &[&[f32]; 4]) -> [f32; 4] {
        // SAFETY: this function's contract, which its caller upholds.
        unsafe {
            let mut acc = [_mm256_setzero_ps(); 4];
            let wp = w.as_ptr();
            for b in 0..xs[0].len() / 32 {
                let wv = unpack_q8(wp.add(b * 34 + 2));
                let dv = _mm256_set1_ps(f16_scalar(w, b * 34));
                for (a, x) in acc.iter_mut().zip(xs) {
                    *a = _mm256_fmadd_ps(dv, dot32(&wv, x.as_ptr().add(b * 32)), *a);
                }
            }
            std::array::from_fn(|r| hsum256(acc[r]))
        }
    }

    /// # Safety
    /// The CPU supports AVX2, FMA and F16C. Rows are whole blocks (validated shapes).
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn gemv4(
        dtype: DType,
        w: &[u8],
        row_bytes: usize,
        xs: &[&[f32]; 4],
        xsum: &[&[f32]; 4],
        out: &mut [[f32; 4]],
    ) {
        // SAFETY: this function's contract, which its caller upholds.
        unsafe {
            match dtype {
                DType::Q4_0 => out
                    .iter_mut()
                    .zip(w.chunks_exact(row_bytes))
                    .for_each(|(o, r)| *o = dot4_q4(r, xs, xsum, 18, 2, true)),
                DType::Q4_1 => out
                    .iter_mut()
                    .zip(w.chunks_exact(row_bytes))
                    .for_each(|(o, r)| *o = dot4_q4(r, xs, xsum, 20, 4, false)),
                DType::Q8_0 => out
                    .iter_mut()
                    .zip(w.chunks_exact(row_bytes))
                    .for_each(|(o, r)| *o = dot4_q8_0(r, xs)),
                t if kquant::covers(t) => {
                    kquant::gemv_rows(t, w, row_bytes, xs, xsum, out.as_flattened_mut())
                }
                _ => unreachable!("gemv4 is for block formats"),
            }
        }
    }

    /// # Safety
    /// The CPU supports AVX2, FMA and F16C. Rows are whole blocks (validated shapes).
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn gemv(
        dtype: DType,
        w: &[u8],
        row_bytes: usize,
        x: &[f32],
        xsum: &[f32],
        out: &mut [f32],
    ) {
        // SAFETY: this function's contract, which its caller upholds.
        unsafe {
            // The block kernels read whole blocks: rows are whole blocks (validated shapes).
            debug_assert!(!dtype.is_quantized() || x.len().is_multiple_of(32));
            debug_assert!(x.len().is_multiple_of(dtype.block_elems() as usize));
            match dtype {
                DType::Q4_0 | DType::Q4_1 => {
                    let (bb, qo, q4_0) = if dtype == DType::Q4_0 {
                        (18, 2, true)
                    } else {
                        (20, 4, false)
                    };
                    rows_in_step(
                        w,
                        row_bytes,
                        out,
                        |r| dot_q4(r, x, xsum, bb, qo, q4_0),
                        |r| dot_q4(r, x, xsum, bb, qo, q4_0),
                    )
                }
                DType::Q8_0 => {
                    rows_in_step(w, row_bytes, out, |r| dot_q8_0(r, x), |r| dot_q8_0(r, x))
                }
                t if kquant::covers(t) => kquant::gemv_rows(t, w, row_bytes, &[x], &[xsum], out),
                _ => gemv_impl::<true>(dtype, w, row_bytes, x, out),
            }
        }
    }

    /// # Safety
    /// The CPU supports AVX2, FMA and F16C.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn dequant_rows(
        dtype: DType,
        w: &[u8],
        row_bytes: usize,
        cols: usize,
        out: &mut [f32],
    ) {
        dequant_rows_impl(dtype, w, row_bytes, cols, out)
    }
}

#[cfg(target_arch = "x86_64")]
fn has_avx2() -> bool {
    static HAS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *HAS.get_or_init(|| {
        is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c")
    })
}

/// e^x in f32 from plain arithmetic, so a loop of it vectorizes (libm's `expf` is a call
/// an element): x = n ln 2 + r with |r| <= ln 2 / 2 (Cody-Waite's two-part ln 2), e^r by
/// Cephes' degree-6 polynomial (about 1 ulp), times 2^n built in the exponent bits. x is
/// first held to [-87, 88], where 2^n stays a normal float: below, the result is e^-87
/// (1.6e-38) rather than smaller, and above, e^88 (1.7e38) rather than larger, which the
/// softmax and the gates that use this cannot tell from 0 and infinity. Products and sums
/// only (no fused multiply-add), so every build and CPU gives the same bits.
#[inline(always)]
pub fn exp_f32(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // 1.5 * 2^23: adding it rounds to an integer, held in the low mantissa bits.
    const ROUND: f32 = 12_582_912.0;
    let x = x.clamp(-87.0, 88.0);
    let t = x * LOG2E + ROUND;
    let n = t - ROUND;
    let r = x - n * LN2_HI - n * LN2_LO;
    let p = ((((1.987_569_1e-4 * r + 1.398_199_9e-3) * r + 8.333_452e-3) * r + 4.166_579_6e-2) * r
        + 1.666_666_5e-1)
        * r
        + 0.5;
    let e = p * (r * r) + r + 1.0;
    // n + 127 (n in -126..=127 here) as the biased exponent of 2^n.
    let biased = t.to_bits().wrapping_sub(ROUND.to_bits()).wrapping_add(127);
    let scale = f32::from_bits(biased << 23);
    e * scale
}

/// `x[i] = f(x[i], y[i])` for every element, compiled for AVX2 too so that an `f` of
/// plain arithmetic (`exp_f32`) runs eight elements at once; the same bits either way.
pub fn map2(x: &mut [f32], y: &[f32], f: impl Fn(f32, f32) -> f32) {
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: AVX2 present (checked).
        return unsafe { avx2::map2(x, y, f) };
    }
    x.iter_mut().zip(y).for_each(|(a, &b)| *a = f(*a, b));
}

/// `x[i] = f(x[i])` for every element (see `map2`).
pub fn map1(x: &mut [f32], f: impl Fn(f32) -> f32) {
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: AVX2 present (checked).
        return unsafe { avx2::map1(x, f) };
    }
    x.iter_mut().for_each(|a| *a = f(*a));
}

/// out[r] = dot(row r of w, x): rows of `row_bytes` bytes, `x.len()` elements each.
pub fn gemv(dtype: DType, w: &[u8], row_bytes: usize, x: &[f32], out: &mut [f32]) {
    debug_assert_eq!(w.len(), row_bytes * out.len());
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        return XSUM.with(|xsum| {
            let mut xsum = xsum.borrow_mut();
            block_sums_into(x, &mut xsum);
            // SAFETY: the CPU supports avx2, fma and f16c (checked above).
            unsafe { avx2::gemv(dtype, w, row_bytes, x, &xsum, out) }
        });
    }
    gemv_impl::<false>(dtype, w, row_bytes, x, out)
}

/// Sums of each 32-element block of `x`, added in order (the q4 offset terms use them; the
/// one- and four-row kernels must agree on them bit for bit).
pub fn block_sums(x: &[f32]) -> Vec<f32> {
    let mut out = Vec::new();
    block_sums_into(x, &mut out);
    out
}

/// `block_sums` into a reused vector.
pub fn block_sums_into(x: &[f32], out: &mut Vec<f32>) {
    out.clear();
    out.extend(x.chunks_exact(32).map(|c| c.iter().sum::<f32>()));
}

thread_local! {
    /// The block sums of one GEMV's activation row.
    static XSUM: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Gives this thread's GEMV scratch room for rows of `k_max` elements.
pub fn reserve_thread_scratch(k_max: usize) {
    XSUM.with(|x| {
        let mut x = x.borrow_mut();
        let len = x.len();
        x.reserve((k_max / 32).saturating_sub(len));
    });
}

/// The bytes `reserve_thread_scratch` makes room for.
pub fn thread_scratch_bytes(k_max: usize) -> usize {
    k_max / 32 * std::mem::size_of::<f32>()
}

/// Whether `gemv4` has a fast kernel for this dtype on this CPU.
pub fn has_gemv4(dtype: DType) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        dtype.is_quantized() && has_avx2()
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = dtype;
        false
    }
}

/// Four activation rows at once against `out.len()` weight rows (block formats, AVX2; see
/// `has_gemv4`). `xsum[r]` are row r's sums per 32-element block.
pub fn gemv4(
    dtype: DType,
    w: &[u8],
    row_bytes: usize,
    xs: &[&[f32]; 4],
    xsum: &[&[f32]; 4],
    out: &mut [[f32; 4]],
) {
    assert!(has_gemv4(dtype), "gemv4 needs a block format and AVX2");
    #[cfg(target_arch = "x86_64")]
    // SAFETY: AVX2/FMA/F16C present (asserted); rows are whole blocks (validated shapes).
    unsafe {
        avx2::gemv4(dtype, w, row_bytes, xs, xsum, out)
    }
}

/// q . k for an f16 row `k` (an f16 KV cache): eight lanes of products, summed in a fixed
/// order, then the tail; F16C widens the keys where the CPU has it.
pub fn dot_f16(q: &[f32], k: &[u16]) -> f32 {
    debug_assert_eq!(q.len(), k.len());
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: AVX2/FMA/F16C present (checked); the slices have equal lengths.
        return unsafe { avx2::dot_f16(q, k) };
    }
    let mut acc = [0f32; 8];
    for (qc, kc) in q.chunks_exact(8).zip(k.chunks_exact(8)) {
        for l in 0..8 {
            acc[l] = qc[l].mul_add(half::f16::from_bits(kc[l]).to_f32(), acc[l]);
        }
    }
    let s = ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]));
    (q.len() / 8 * 8..q.len()).fold(s, |d, i| d + q[i] * half::f16::from_bits(k[i]).to_f32())
}

/// Whether the grouped f16 attention kernels run here for heads of `hd`.
pub fn has_group_f16(hd: usize) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        hd.is_multiple_of(8) && has_avx2()
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = hd;
        false
    }
}

/// The most query heads the grouped attention kernels take at once (their register
/// budget, and the attention scratch: `GROUP_MAX` rows of scores a thread).
pub const GROUP_MAX: usize = 4;

/// Runs `body` with `g0` and a constant `G` over the heads `0..heads` in groups of at most
/// `GROUP_MAX`; a head's numbers do not depend on its group's size.
macro_rules! by_groups {
    ($heads:expr, |$g0:ident, $G:ident| $body:expr) => {{
        let mut $g0 = 0;
        while $g0 < $heads {
            match ($heads - $g0).min(GROUP_MAX) {
                1 => {
                    const $G: usize = 1;
                    $body
                }
                2 => {
                    const $G: usize = 2;
                    $body
                }
                3 => {
                    const $G: usize = 3;
                    $body
                }
                _ => {
                    const $G: usize = 4;
                    $body
                }
            }
            $g0 += ($heads - $g0).min(GROUP_MAX);
        }
    }};
}

/// Scores of the query heads `q` (rows of `hd`) sharing one KV head against the f16 keys
/// at `ats`: `sc[g * n + j]` (n = ats.len()). Per head: eight lanes over the dimensions,
/// summed in a fixed order, whatever the number of heads (see `has_group_f16`).
pub fn group_scores_f16(q: &[f32], hd: usize, ks: &[u16], ats: &[usize], sc: &mut [f32]) {
    let (heads, n) = (q.len() / hd, ats.len());
    assert!(has_group_f16(hd) && sc.len() >= heads * n && ats.iter().all(|&a| a + hd <= ks.len()));
    #[cfg(target_arch = "x86_64")]
    by_groups!(heads, |g0, G| {
        // SAFETY: AVX2/FMA/F16C present and every key in bounds (asserted); this group's
        // rows of q and sc. Four keys at a time up to three heads, two for four (so the
        // accumulators fit the sixteen registers).
        unsafe {
            avx2::group_scores_f16::<
                G,
                {
                    if G <= 3 {
                        4
                    } else {
                        2
                    }
                },
            >(
                &q[g0 * hd..(g0 + G) * hd],
                hd,
                ks,
                ats,
                &mut sc[g0 * n..(g0 + G) * n],
            )
        }
    });
}

/// `o[g] = sum_j p[g * n + j] * value j` for the heads sharing one KV head (`o`: rows of
/// `hd`, overwritten), f16 values at `ats`, keys in order.
pub fn group_pv_f16(p: &[f32], hd: usize, vs: &[u16], ats: &[usize], o: &mut [f32]) {
    let (heads, n) = (o.len() / hd, ats.len());
    assert!(has_group_f16(hd) && p.len() >= heads * n && ats.iter().all(|&a| a + hd <= vs.len()));
    #[cfg(target_arch = "x86_64")]
    by_groups!(heads, |g0, G| {
        // SAFETY: as group_scores_f16.
        unsafe {
            avx2::group_pv_f16::<G>(
                &p[g0 * n..(g0 + G) * n],
                hd,
                vs,
                ats,
                &mut o[g0 * hd..(g0 + G) * hd],
            )
        }
    });
}

/// The grouped f32 kernels' bounds: `heads` rows of `hd` (a multiple of 8) in a buffer of
/// `len` with rows `stride` apart, each row holding a number per key, every key's row
/// (`hd` from each of `ats`) inside a cache of `cache` elements.
fn check_group_f32(
    heads: usize,
    hd: usize,
    (len, stride): (usize, usize),
    ats: &[usize],
    cache: usize,
) {
    let n = ats.len();
    assert!(
        hd.is_multiple_of(8)
            && n <= stride
            && len >= (heads.max(1) - 1) * stride + n
            && ats.iter().all(|&a| a + hd <= cache)
    );
}

/// Scores of the query heads `q` (rows of `hd`, a multiple of 8) sharing one KV head
/// against the f32 keys at `ats`: `sc[g * stride + j]`, each with `dot_f32`'s bits, each
/// key read once for the heads (`--exact`'s attention).
pub fn group_scores_f32(
    q: &[f32],
    hd: usize,
    ks: &[f32],
    ats: &[usize],
    sc: &mut [f32],
    stride: usize,
) {
    let heads = q.len() / hd;
    check_group_f32(heads, hd, (sc.len(), stride), ats, ks.len());
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        by_groups!(heads, |g0, G| {
            let (q, sc) = (&q[g0 * hd..(g0 + G) * hd], &mut sc[g0 * stride..]);
            // SAFETY: AVX2 present (checked), every key in bounds and room for G rows of
            // scores (asserted). Four keys at a time up to three heads, two for four (the
            // accumulators fit the sixteen registers).
            unsafe {
                if G <= 3 {
                    avx2::group_scores_f32::<G, 4>(q, hd, ks, ats, (sc, stride))
                } else {
                    avx2::group_scores_f32::<G, 2>(q, hd, ks, ats, (sc, stride))
                }
            }
        });
        return;
    }
    for (g, qg) in q.chunks_exact(hd).enumerate() {
        for (j, &a) in ats.iter().enumerate() {
            sc[g * stride + j] = dot_f32(qg, &ks[a..a + hd]);
        }
    }
}

/// `o[g] += sum_j p[g * stride + j] * value j` for the heads sharing one KV head (`o`:
/// rows of `hd`, a multiple of 8), f32 values at `ats`, keys in order: the bits of an
/// `axpy_f32` per key, each value read once for the heads.
pub fn group_pv_f32(p: &[f32], stride: usize, hd: usize, vs: &[f32], ats: &[usize], o: &mut [f32]) {
    let heads = o.len() / hd;
    check_group_f32(heads, hd, (p.len(), stride), ats, vs.len());
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        by_groups!(heads, |g0, G| {
            let (p, o) = (&p[g0 * stride..], &mut o[g0 * hd..(g0 + G) * hd]);
            // SAFETY: AVX2 present (checked), every value in bounds and G rows of
            // weights (asserted).
            unsafe { avx2::group_pv_f32::<G>((p, stride), hd, vs, ats, o) }
        });
        return;
    }
    for (g, og) in o.chunks_exact_mut(hd).enumerate() {
        for (j, &a) in ats.iter().enumerate() {
            axpy_f32(p[g * stride + j], &vs[a..a + hd], og);
        }
    }
}

/// q . k for four f16 rows at once (`k[r]` starts at `at[r]`, `q.len()` long): the same
/// lanes as `dot_f16` per row, q loaded once for the four.
pub fn dot4_f16(q: &[f32], k: &[u16], at: [usize; 4]) -> [f32; 4] {
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        let n = q.len();
        assert!(at.iter().all(|&a| a + n <= k.len()));
        // SAFETY: AVX2/FMA/F16C present (checked); every row is inside `k` (asserted).
        return unsafe { avx2::dot4_f16(q, k, at) };
    }
    at.map(|a| dot_f16(q, &k[a..a + q.len()]))
}

/// o += w[r] v[r] for four f16 rows in order (`v[r]` starts at `at[r]`): bit for bit four
/// `axpy_f16` calls, o loaded and stored once.
pub fn axpy4_f16(w: [f32; 4], v: &[u16], at: [usize; 4], o: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        let n = o.len();
        assert!(at.iter().all(|&a| a + n <= v.len()));
        // SAFETY: AVX2/FMA/F16C present (checked); every row is inside `v` (asserted).
        return unsafe { avx2::axpy4_f16(w, v, at, o) };
    }
    for r in 0..4 {
        axpy_f16(w[r], &v[at[r]..at[r] + o.len()], o);
    }
}

/// q . k for an f32 row (an f32 KV cache, `--exact`): eight lanes over q's whole
/// multiples of 8, each a product then a sum (no FMA), the lanes summed in order, then
/// the rest of the elements in order. The order depends only on q's length.
pub fn dot_f32(q: &[f32], k: &[f32]) -> f32 {
    let n = q.len();
    let mut acc = [0f32; 8];
    for (qc, kc) in q.chunks_exact(8).zip(k.chunks_exact(8)) {
        for l in 0..8 {
            acc[l] += qc[l] * kc[l];
        }
    }
    dot_f32_finish(acc, q, &k[..n])
}

/// `dot_f32`'s eight lanes summed in order.
#[inline(always)]
fn lanes_sum(acc: [f32; 8]) -> f32 {
    acc.iter().sum()
}

/// `dot_f32`'s end: the lanes summed in order, then the elements past the last 8.
fn dot_f32_finish(acc: [f32; 8], q: &[f32], k: &[f32]) -> f32 {
    let n = q.len();
    let mut d = lanes_sum(acc);
    for i in n / 8 * 8..n {
        d += q[i] * k[i];
    }
    d
}

/// `dot_f32` for four rows at once (`k[r]` starts at `at[r]`): the same bits per row,
/// q loaded once for the four and the four rows' sums independent.
pub fn dot4_f32(q: &[f32], k: &[f32], at: [usize; 4]) -> [f32; 4] {
    let n = q.len();
    assert!(at.iter().all(|&a| a + n <= k.len()));
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: AVX2 present (checked); every row is inside `k` (asserted).
        let lanes = unsafe { avx2::dot4_f32(q, k, at) };
        return std::array::from_fn(|r| dot_f32_finish(lanes[r], q, &k[at[r]..at[r] + n]));
    }
    at.map(|a| dot_f32(q, &k[a..a + n]))
}

/// o += w[r] v[r] for four f32 rows in order (`v[r]` starts at `at[r]`), each a product
/// then a sum: bit for bit four `axpy_f32` calls, o loaded and stored once.
pub fn axpy4_f32(w: [f32; 4], v: &[f32], at: [usize; 4], o: &mut [f32]) {
    let n = o.len();
    assert!(at.iter().all(|&a| a + n <= v.len()));
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: AVX2 present (checked); every row is inside `v` (asserted).
        return unsafe { avx2::axpy4_f32(w, v, at, o) };
    }
    for r in 0..4 {
        axpy_f32(w[r], &v[at[r]..at[r] + n], o);
    }
}

/// o += w v (a product then a sum) for an f32 row `v`.
pub fn axpy_f32(w: f32, v: &[f32], o: &mut [f32]) {
    for (ov, &vv) in o.iter_mut().zip(v) {
        *ov += w * vv;
    }
}

/// o += w v for an f16 row `v` (an f16 KV cache).
pub fn axpy_f16(w: f32, v: &[u16], o: &mut [f32]) {
    debug_assert_eq!(v.len(), o.len());
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: AVX2/FMA/F16C present (checked); the slices have equal lengths.
        return unsafe { avx2::axpy_f16(w, v, o) };
    }
    for (ov, &vv) in o.iter_mut().zip(v) {
        *ov = w.mul_add(half::f16::from_bits(vv).to_f32(), *ov);
    }
}

/// Dequantizes rows of `w` into `out` (rows x cols f32).
pub fn dequant_rows(dtype: DType, w: &[u8], row_bytes: usize, cols: usize, out: &mut [f32]) {
    debug_assert_eq!(w.len() / row_bytes * cols, out.len());
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: as above.
        return unsafe { avx2::dequant_rows(dtype, w, row_bytes, cols, out) };
    }
    dequant_rows_impl(dtype, w, row_bytes, cols, out)
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;

    /// Naive f64 references on random inputs, per dtype. (Uniform in [-1, 1), seeded;
    /// `q8.rs`'s tests use it too.)
    pub(in crate::backend::cpu) fn rand_vec(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed;
        (0..n)
            .map(|_| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
            })
            .collect()
    }

    fn quantize(dtype: DType, v: &[f32]) -> Vec<u8> {
        let mut out = Vec::new();
        match dtype {
            DType::F32 => v
                .iter()
                .for_each(|x| out.extend_from_slice(&x.to_le_bytes())),
            DType::F16 => v
                .iter()
                .for_each(|x| out.extend_from_slice(&f16::from_f32(*x).to_le_bytes())),
            DType::BF16 => v
                .iter()
                .for_each(|x| out.extend_from_slice(&bf16::from_f32(*x).to_le_bytes())),
            DType::Q8_0 => {
                for b in v.chunks(32) {
                    let amax = b.iter().fold(0f32, |a, x| a.max(x.abs()));
                    let d = amax / 127.0;
                    out.extend_from_slice(&f16::from_f32(d).to_le_bytes());
                    b.iter().for_each(|x| {
                        out.push((if d > 0.0 { (x / d).round() } else { 0.0 }) as i8 as u8)
                    });
                }
            }
            DType::Q4_0 | DType::Q4_1 => {
                for b in v.chunks(32) {
                    let (mn, mx) = b
                        .iter()
                        .fold((f32::MAX, f32::MIN), |(a, c), x| (a.min(*x), c.max(*x)));
                    let (d, m) = if dtype == DType::Q4_0 {
                        (mx.abs().max(mn.abs()) / 8.0, 0.0)
                    } else {
                        ((mx - mn) / 15.0, mn)
                    };
                    out.extend_from_slice(&f16::from_f32(d).to_le_bytes());
                    if dtype == DType::Q4_1 {
                        out.extend_from_slice(&f16::from_f32(m).to_le_bytes());
                    }
                    let q = |x: f32| -> u8 {
                        let v = if d > 0.0 { ((x - m) / d).round() } else { 0.0 };
                        let v = if dtype == DType::Q4_0 { v + 8.0 } else { v };
                        v.clamp(0.0, 15.0) as u8
                    };
                    for j in 0..16 {
                        out.push(q(b[j]) | (q(b[j + 16]) << 4));
                    }
                }
            }
            // The K-quant-era formats: seeded random blocks (their decoder is checked
            // bit-exactly against gguf-py in tests/tests/quants.rs).
            _ => return ggml::sample_blocks(dtype, v.len() / dtype.block_elems() as usize, 5),
        }
        out
    }

    /// The f64 reference: dequantize each element by the format's definition, sum in f64.
    fn reference_value(dtype: DType, w: &[u8], i: usize) -> f64 {
        let b = i / 32;
        let j = i % 32;
        let f16v = |at: usize| f16::from_bits(u16::from_le_bytes([w[at], w[at + 1]])).to_f64();
        match dtype {
            DType::F32 => f32::from_le_bytes(w[4 * i..4 * i + 4].try_into().unwrap()) as f64,
            DType::F16 => f16v(2 * i),
            DType::BF16 => bf16::from_bits(u16::from_le_bytes([w[2 * i], w[2 * i + 1]])).to_f64(),
            DType::Q8_0 => f16v(34 * b) * (w[34 * b + 2 + j] as i8) as f64,
            DType::Q4_0 | DType::Q4_1 => {
                let (bb, qo) = if dtype == DType::Q4_0 {
                    (18, 2)
                } else {
                    (20, 4)
                };
                let byte = w[bb * b + qo + j % 16];
                let q = if j < 16 { byte & 15 } else { byte >> 4 } as f64;
                if dtype == DType::Q4_0 {
                    f16v(bb * b) * (q - 8.0)
                } else {
                    f16v(bb * b) * q + f16v(bb * b + 2)
                }
            }
            _ => {
                let (be, bb) = (dtype.block_elems() as usize, dtype.block_bytes() as usize);
                let mut y = vec![0f32; be];
                let blk = i / be;
                ggml::dequantize_block(dtype, &w[blk * bb..(blk + 1) * bb], &mut y);
                y[i % be] as f64
            }
        }
    }

    #[test]
    fn gemv_and_dequant_match_f64_references_for_every_dtype() {
        let (rows, cols) = (7, 512);
        let x = rand_vec(cols, 7);
        for dtype in crate::dtype::ALL_DTYPES {
            let w = quantize(dtype, &rand_vec(rows * cols, 11));
            let rb = dtype.row_bytes(cols as u64).unwrap() as usize;
            let mut out = vec![0f32; rows];
            gemv(dtype, &w, rb, &x, &mut out);
            let mut deq = vec![0f32; rows * cols];
            dequant_rows(dtype, &w, rb, cols, &mut deq);
            for r in 0..rows {
                let row = &w[r * rb..(r + 1) * rb];
                // A row alone (the kernels' tail) gives the bits it gives beside others.
                let mut alone = [0f32];
                gemv(dtype, row, rb, &x, &mut alone);
                assert_eq!(
                    alone[0].to_bits(),
                    out[r].to_bits(),
                    "{dtype} row {r} alone"
                );
                let want: f64 = (0..cols)
                    .map(|i| reference_value(dtype, row, i) * x[i] as f64)
                    .sum();
                assert!(
                    (out[r] as f64 - want).abs() <= 1e-5 * (1.0 + want.abs()),
                    "{dtype} row {r}: {} vs {want}",
                    out[r]
                );
                for i in 0..cols {
                    let want = reference_value(dtype, row, i);
                    let got = deq[r * cols + i] as f64;
                    assert!(
                        (got - want).abs() <= 1e-6 * want.abs().max(1e-3),
                        "{dtype} dequant row {r} col {i}: {got} vs {want}"
                    );
                }
            }
        }
    }

    /// The grouped f16 attention kernels: a head's scores and weighted sums are the same
    /// bits whether it runs alone or with up to three other heads, and a score's bits do not
    /// depend on how many keys there are (the last group of keys is padded); both match f64.
    #[test]
    fn grouped_attention_kernels_match_f64_and_do_not_depend_on_the_grouping() {
        if !has_group_f16(64) {
            eprintln!("SKIPPED: no AVX2 on this CPU");
            return;
        }
        let (hd, heads, keys) = (64usize, 4usize, 23usize);
        let f16s = |v: Vec<f32>| -> Vec<u16> {
            v.iter()
                .map(|&x| half::f16::from_f32(x).to_bits())
                .collect()
        };
        let (ks, vs) = (
            f16s(rand_vec(keys * 2 * hd, 21)),
            f16s(rand_vec(keys * 2 * hd, 22)),
        );
        let q = rand_vec(heads * hd, 23);
        // Every other row of a two-head-wide cache, as the KV heads of a layer sit.
        let ats: Vec<usize> = (0..keys).map(|j| j * 2 * hd + hd).collect();
        let mut all = vec![0f32; heads * keys];
        group_scores_f16(&q, hd, &ks, &ats, &mut all);
        let kf = |j: usize, d: usize| half::f16::from_bits(ks[ats[j] + d]).to_f32() as f64;
        for h in 0..heads {
            let mut one = vec![0f32; keys];
            group_scores_f16(&q[h * hd..(h + 1) * hd], hd, &ks, &ats, &mut one);
            for j in 0..keys {
                assert_eq!(
                    one[j].to_bits(),
                    all[h * keys + j].to_bits(),
                    "head {h} key {j}"
                );
                let want: f64 = (0..hd).map(|d| q[h * hd + d] as f64 * kf(j, d)).sum();
                assert!(
                    (one[j] as f64 - want).abs() <= 1e-4,
                    "head {h} key {j}: {} vs {want}",
                    one[j]
                );
            }
            // Fewer keys: the scores of the keys kept are the same bits.
            for n in [1, 2, 5, 22] {
                let mut part = vec![0f32; n];
                group_scores_f16(&q[h * hd..(h + 1) * hd], hd, &ks, &ats[..n], &mut part);
                for j in 0..n {
                    assert_eq!(
                        part[j].to_bits(),
                        one[j].to_bits(),
                        "head {h} key {j} of {n}"
                    );
                }
            }
        }
        let p = rand_vec(heads * keys, 24);
        let mut o = vec![0f32; heads * hd];
        group_pv_f16(&p, hd, &vs, &ats, &mut o);
        for h in 0..heads {
            let mut one = vec![0f32; hd];
            group_pv_f16(&p[h * keys..(h + 1) * keys], hd, &vs, &ats, &mut one);
            for d in 0..hd {
                assert_eq!(
                    one[d].to_bits(),
                    o[h * hd + d].to_bits(),
                    "head {h} dim {d}"
                );
                let want: f64 = (0..keys)
                    .map(|j| {
                        p[h * keys + j] as f64
                            * half::f16::from_bits(vs[ats[j] + d]).to_f32() as f64
                    })
                    .sum();
                assert!(
                    (one[d] as f64 - want).abs() <= 1e-4,
                    "head {h} dim {d}: {} vs {want}",
                    one[d]
                );
            }
        }
    }

    /// `--exact`'s f32 attention kernels: four keys at a time give each key the bits of
    /// the one-key scalar forms (the lanes' products then sums, no FMA, summed in order),
    /// at head dimensions with and without a tail past the last 8; four value rows added
    /// at once are four one-row additions in order.
    #[test]
    fn four_f32_keys_at_once_are_the_bits_of_one_at_a_time() {
        // The scalar forms, written out as the f32 cache's attention had them.
        let dot = |q: &[f32], k: &[f32]| -> f32 {
            let mut acc = [0f32; 8];
            for (qc, kc) in q.chunks_exact(8).zip(k.chunks_exact(8)) {
                for l in 0..8 {
                    acc[l] += qc[l] * kc[l];
                }
            }
            let mut d: f32 = acc.iter().sum();
            for i in q.len() / 8 * 8..q.len() {
                d += q[i] * k[i];
            }
            d
        };
        for hd in [4usize, 8, 64, 72, 128, 100] {
            let q = rand_vec(hd, hd as u64);
            let kv = rand_vec(hd * 9 + 3, 7 + hd as u64);
            let at = [3 * hd + 1, 0, 8 * hd + 3, hd];
            let four = dot4_f32(&q, &kv, at);
            for r in 0..4 {
                let want = dot(&q, &kv[at[r]..at[r] + hd]);
                assert_eq!(four[r].to_bits(), want.to_bits(), "hd {hd} key {r}");
                assert_eq!(
                    dot_f32(&q, &kv[at[r]..at[r] + hd]).to_bits(),
                    want.to_bits()
                );
            }
            let w = [0.25f32, -1.5, 3.0e-3, 0.7];
            let mut o4 = rand_vec(hd, 99);
            let mut o1 = o4.clone();
            axpy4_f32(w, &kv, at, &mut o4);
            for r in 0..4 {
                for (o, &v) in o1.iter_mut().zip(&kv[at[r]..at[r] + hd]) {
                    *o += w[r] * v;
                }
            }
            assert_eq!(
                o4.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                o1.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                "hd {hd}"
            );
        }
    }

    /// The grouped f32 kernels (`--exact`'s attention, a KV head at a time) give every
    /// score `dot_f32`'s bits and every output `axpy_f32`'s key after key, for one to six
    /// heads (across GROUP_MAX), key counts around the four-key step, scattered keys and a
    /// row stride wider than the keys.
    #[test]
    fn grouped_f32_attention_is_the_bits_of_a_head_at_a_time() {
        for hd in [8usize, 64, 128] {
            let kv = rand_vec(hd * 40, hd as u64);
            for heads in 1..=6 {
                let q = rand_vec(heads * hd, 3 + heads as u64);
                for n in [1usize, 3, 4, 5, 9, 17] {
                    let ats: Vec<usize> = (0..n).map(|j| (j * 7 % 37) * hd + j % 3).collect();
                    let stride = n + 5;
                    let mut sc = vec![f32::NAN; heads * stride];
                    group_scores_f32(&q, hd, &kv, &ats, &mut sc, stride);
                    let p = rand_vec(heads * stride, 11 + n as u64);
                    let mut o = rand_vec(heads * hd, 5);
                    let mut want_o = o.clone();
                    group_pv_f32(&p, stride, hd, &kv, &ats, &mut o);
                    for h in 0..heads {
                        for (j, &a) in ats.iter().enumerate() {
                            let want = dot_f32(&q[h * hd..(h + 1) * hd], &kv[a..a + hd]);
                            assert_eq!(
                                sc[h * stride + j].to_bits(),
                                want.to_bits(),
                                "hd {hd} heads {heads} head {h} key {j} of {n}"
                            );
                            axpy_f32(
                                p[h * stride + j],
                                &kv[a..a + hd],
                                &mut want_o[h * hd..(h + 1) * hd],
                            );
                        }
                        assert!(sc[h * stride + n..(h + 1) * stride]
                            .iter()
                            .all(|x| x.is_nan()));
                    }
                    assert_eq!(
                        o.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                        want_o.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                        "hd {hd} heads {heads} n {n}"
                    );
                }
            }
        }
    }

    /// `exp_f32` against f64's exp over the whole range it serves (every 97th float
    /// from -87 to 88, and around 0): within 2 ulp; at and past the ends, the held
    /// values; through `map1`/`map2` (AVX2 where present) the same bits as a plain loop.
    #[test]
    fn exp_f32_is_within_two_ulp_and_the_same_bits_vectorized() {
        let mut xs = Vec::new();
        let mut b = (-87.0f32).to_bits();
        while f32::from_bits(b) < 0.0 {
            xs.push(f32::from_bits(b));
            b -= 97;
        }
        let mut b = 0u32;
        while f32::from_bits(b) < 88.0 {
            xs.push(f32::from_bits(b));
            b += 97;
        }
        xs.extend([0.0, -0.0, 1e-30, -1e-30, 0.5, -0.5, 88.0, -87.0]);
        let mut worst = 0f64;
        for &x in &xs {
            let (got, want) = (exp_f32(x) as f64, (x as f64).exp());
            let ulp = (want as f32).to_bits().abs_diff((got as f32).to_bits());
            assert!(
                ulp <= 2,
                "exp({x:e}) = {got:e}, f64 says {want:e} ({ulp} ulp)"
            );
            worst = worst.max((got - want).abs() / want);
        }
        assert!(worst > 0.0, "an exp that never rounds differs from nothing");
        assert_eq!(exp_f32(-1000.0), exp_f32(-87.0));
        assert_eq!(exp_f32(1000.0), exp_f32(88.0));
        assert!(exp_f32(-87.0) > 0.0 && exp_f32(88.0).is_finite());
        assert!(exp_f32(f32::NAN).is_nan());
        let f = |x: f32| exp_f32(-x) * 0.5 + 1.0;
        let mut v = xs.clone();
        map1(&mut v, f);
        let ys: Vec<f32> = xs.iter().map(|x| x * 0.25).collect();
        let mut w = xs.clone();
        map2(&mut w, &ys, |a, b| exp_f32(a - b));
        for (i, &x) in xs.iter().enumerate() {
            assert_eq!(v[i].to_bits(), f(x).to_bits(), "map1 at {x:e}");
            assert_eq!(
                w[i].to_bits(),
                exp_f32(x - ys[i]).to_bits(),
                "map2 at {x:e}"
            );
        }
    }
}
