//! AVX2 dot products for the block formats of K-quant GGUFs, dequantizing in registers:
//! fused kernels for Q4_K, Q5_K, Q6_K, Q5_0 and Q5_1 (what Q4_K_M and Q5_K_M files are
//! made of), and for Q2_K, Q3_K, IQ4_NL, IQ4_XS and MXFP4 a block-at-a-time path through
//! the reference decoder (`dtype::ggml`) into a stack buffer, then the same vector dot.
//!
//! Every kernel is generic over the number of activation rows `N` it applies one weight
//! row to, with one fixed order of operations per row: a row's result is the same whether
//! it runs alone (`N = 1`, the one-row GEMV) or beside three others (`N = 4`), so a
//! sequence's output does not depend on what shares its batch. Activations stay f32;
//! results match a dequantize-then-multiply reference to f32 rounding.
//!
//! Layouts are ggml's block structs (`ggml-common.h`), described in `dtype/ggml.rs`.

use super::kernels::avx2::{dot32, f16_scalar, hsum256};
use crate::dtype::{ggml, DType};
use std::arch::x86_64::*;

/// 32 unsigned bytes as four vectors of f32: elements 0..8, 8..16, 16..24, 24..32.
///
/// # Safety
/// The CPU supports AVX2.
#[inline(always)]
unsafe fn u8x32_f32(v: __m256i) -> [__m256; 4] {
    // SAFETY: this function's contract, which its caller upholds.
    unsafe {
        let (lo, hi) = (_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v));
        [
            _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)),
            _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128::<8>(lo))),
            _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)),
            _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128::<8>(hi))),
        ]
    }
}

/// 32 signed bytes as four vectors of f32, in element order.
///
/// # Safety
/// The CPU supports AVX2.
#[inline(always)]
unsafe fn i8x32_f32(v: __m256i) -> [__m256; 4] {
    // SAFETY: this function's contract, which its caller upholds.
    unsafe {
        let (lo, hi) = (_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v));
        [
            _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo)),
            _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128::<8>(lo))),
            _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi)),
            _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128::<8>(hi))),
        ]
    }
}

/// 0x10 in byte i where bit `bit` of byte i of `v` is set (the fifth bit of K-quants).
///
/// # Safety
/// The CPU supports AVX2.
#[inline(always)]
unsafe fn bit_to_0x10(v: __m256i, bit: u32) -> __m256i {
    // SAFETY: this function's contract, which its caller upholds.
    unsafe {
        let mask = _mm256_set1_epi8((1u8 << bit) as i8);
        let set = _mm256_cmpeq_epi8(_mm256_and_si256(v, mask), mask);
        _mm256_and_si256(set, _mm256_set1_epi8(0x10))
    }
}

/// 0x10 in byte i where bit i of `qh` is set (the fifth bits of Q5_0/Q5_1).
///
/// # Safety
/// The CPU supports AVX2.
#[inline(always)]
unsafe fn bits32_to_0x10(qh: u32) -> __m256i {
    // SAFETY: this function's contract, which its caller upholds.
    unsafe {
        // Byte i takes byte i / 8 of qh, then keeps bit i % 8 of it.
        let spread = _mm256_shuffle_epi8(
            _mm256_set1_epi32(qh as i32),
            _mm256_setr_epi64x(
                0,
                0x0101_0101_0101_0101,
                0x0202_0202_0202_0202,
                0x0303_0303_0303_0303,
            ),
        );
        let mask = _mm256_set1_epi64x(0x8040_2010_0804_0201u64 as i64);
        let set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, mask), mask);
        _mm256_and_si256(set, _mm256_set1_epi8(0x10))
    }
}

/// Q4_K (and Q5_K with `q5`): per 32-weight sub-block j, d*sc_j * dot(q, x) - dmin*m_j *
/// sum(x); `xsum` holds each row's sums per 32 elements.
///
/// # Safety
/// AVX2, FMA, F16C; every row of `xs` has the length of `w`'s row (whole super-blocks).
#[inline(always)]
unsafe fn dot_q45k<const N: usize>(
    w: &[u8],
    xs: &[&[f32]; N],
    xsum: &[&[f32]; N],
    q5: bool,
) -> [f32; N] {
    // SAFETY: this function's contract, which its caller upholds.
    unsafe {
        let bb = if q5 { 176 } else { 144 };
        let m4 = _mm256_set1_epi8(0x0F);
        let mut acc = [_mm256_setzero_ps(); N];
        let mut moff = [0f32; N];
        for b in 0..xs[0].len() / 256 {
            let blk = &w[b * bb..(b + 1) * bb];
            let (d, dmin) = (f16_scalar(blk, 0), f16_scalar(blk, 2));
            let (qh, qs) = if q5 {
                (
                    _mm256_loadu_si256(blk[16..48].as_ptr() as *const __m256i),
                    &blk[48..176],
                )
            } else {
                (_mm256_setzero_si256(), &blk[16..144])
            };
            for p in 0..4 {
                let v = _mm256_loadu_si256(qs[32 * p..32 * p + 32].as_ptr() as *const __m256i);
                let mut q = [
                    _mm256_and_si256(v, m4),
                    _mm256_and_si256(_mm256_srli_epi16::<4>(v), m4),
                ];
                if q5 {
                    q[0] = _mm256_or_si256(q[0], bit_to_0x10(qh, 2 * p as u32));
                    q[1] = _mm256_or_si256(q[1], bit_to_0x10(qh, 2 * p as u32 + 1));
                }
                for (half, qv) in q.into_iter().enumerate() {
                    let j = 2 * p + half;
                    let (sc, m) = ggml::scale_min_k4(&blk[4..16], j);
                    let (ds, dm) = (_mm256_set1_ps(d * sc), dmin * m);
                    let wv = u8x32_f32(qv);
                    for r in 0..N {
                        let xp = xs[r].as_ptr().add(256 * b + 32 * j);
                        acc[r] = _mm256_fmadd_ps(ds, dot32(&wv, xp), acc[r]);
                        moff[r] = (-dm).mul_add(xsum[r][8 * b + j], moff[r]);
                    }
                }
            }
        }
        std::array::from_fn(|r| hsum256(acc[r]) + moff[r])
    }
}

/// Q6_K: (q - 32) * d * scale, one i8 scale per 16 weights.
///
/// # Safety
/// As `dot_q45k`.
#[inline(always)]
unsafe fn dot_q6k<const N: usize>(w: &[u8], xs: &[&[f32]; N]) -> [f32; N] {
    // SAFETY: this function's contract, which its caller upholds.
    unsafe {
        let (m4, m3, k32) = (
            _mm256_set1_epi8(0x0F),
            _mm256_set1_epi8(0x03),
            _mm256_set1_epi8(32),
        );
        let mut acc = [_mm256_setzero_ps(); N];
        for b in 0..xs[0].len() / 256 {
            let blk = &w[b * 210..(b + 1) * 210];
            let d = f16_scalar(blk, 208);
            for h in 0..2 {
                let qh = _mm256_loadu_si256(blk[128 + 32 * h..].as_ptr() as *const __m256i);
                for t4 in 0..4 {
                    let at = 64 * h + 32 * (t4 % 2);
                    let ql = _mm256_loadu_si256(blk[at..at + 32].as_ptr() as *const __m256i);
                    let lo = _mm256_and_si256(
                        _mm256_srl_epi16(ql, _mm_cvtsi32_si128(4 * (t4 / 2) as i32)),
                        m4,
                    );
                    let hi = _mm256_and_si256(
                        _mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * t4 as i32)),
                        m3,
                    );
                    let q = _mm256_sub_epi8(_mm256_or_si256(lo, _mm256_slli_epi16::<4>(hi)), k32);
                    let wv = i8x32_f32(q);
                    let s = 192 + 8 * h + 2 * t4;
                    let (sa, sb) = (
                        _mm256_set1_ps(d * blk[s] as i8 as f32),
                        _mm256_set1_ps(d * blk[s + 1] as i8 as f32),
                    );
                    for r in 0..N {
                        let xp = xs[r].as_ptr().add(256 * b + 128 * h + 32 * t4);
                        let pa = _mm256_fmadd_ps(
                            wv[1],
                            _mm256_loadu_ps(xp.add(8)),
                            _mm256_mul_ps(wv[0], _mm256_loadu_ps(xp)),
                        );
                        let pb = _mm256_fmadd_ps(
                            wv[3],
                            _mm256_loadu_ps(xp.add(24)),
                            _mm256_mul_ps(wv[2], _mm256_loadu_ps(xp.add(16))),
                        );
                        acc[r] = _mm256_fmadd_ps(sb, pb, _mm256_fmadd_ps(sa, pa, acc[r]));
                    }
                }
            }
        }
        std::array::from_fn(|r| hsum256(acc[r]))
    }
}

/// Q5_0 (d * (q - 16)) and Q5_1 (d * q + m, with the offset through `xsum`).
///
/// # Safety
/// AVX2, FMA, F16C; rows are whole 32-weight blocks.
#[inline(always)]
unsafe fn dot_q5<const N: usize>(
    w: &[u8],
    xs: &[&[f32]; N],
    xsum: &[&[f32]; N],
    q5_1: bool,
) -> [f32; N] {
    // SAFETY: this function's contract, which its caller upholds.
    unsafe {
        let (bb, at) = if q5_1 { (24, 4) } else { (22, 2) };
        let m4 = _mm_set1_epi8(0x0F);
        let mut acc = [_mm256_setzero_ps(); N];
        let mut moff = [0f32; N];
        for b in 0..xs[0].len() / 32 {
            let blk = &w[b * bb..(b + 1) * bb];
            let d = f16_scalar(blk, 0);
            let qh = u32::from_le_bytes([blk[at], blk[at + 1], blk[at + 2], blk[at + 3]]);
            let v = _mm_loadu_si128(blk[at + 4..at + 20].as_ptr() as *const __m128i);
            let nib = _mm256_set_m128i(
                _mm_and_si128(_mm_srli_epi16::<4>(v), m4),
                _mm_and_si128(v, m4),
            );
            let q = _mm256_or_si256(nib, bits32_to_0x10(qh));
            let dv = _mm256_set1_ps(d);
            if q5_1 {
                let (wv, m) = (u8x32_f32(q), f16_scalar(blk, 2));
                for r in 0..N {
                    let xp = xs[r].as_ptr().add(32 * b);
                    acc[r] = _mm256_fmadd_ps(dv, dot32(&wv, xp), acc[r]);
                    moff[r] = m.mul_add(xsum[r][b], moff[r]);
                }
            } else {
                let wv = i8x32_f32(_mm256_sub_epi8(q, _mm256_set1_epi8(16)));
                for r in 0..N {
                    let xp = xs[r].as_ptr().add(32 * b);
                    acc[r] = _mm256_fmadd_ps(dv, dot32(&wv, xp), acc[r]);
                }
            }
        }
        std::array::from_fn(|r| hsum256(acc[r]) + moff[r])
    }
}

/// Any block format: each block through the reference decoder into a stack buffer, then
/// the vector dot of its 32-weight pieces.
///
/// # Safety
/// AVX2 and FMA; rows are whole blocks of `t`.
#[inline(always)]
unsafe fn dot_decoded<const N: usize>(t: DType, w: &[u8], xs: &[&[f32]; N]) -> [f32; N] {
    // SAFETY: this function's contract, which its caller upholds.
    unsafe {
        let (be, bb) = (t.block_elems() as usize, t.block_bytes() as usize);
        let mut tmp = [0f32; 256];
        let mut acc = [_mm256_setzero_ps(); N];
        for b in 0..xs[0].len() / be {
            ggml::dequantize_block(t, &w[b * bb..(b + 1) * bb], &mut tmp[..be]);
            for c in 0..be / 32 {
                let tp = tmp[32 * c..32 * c + 32].as_ptr();
                let wv = [
                    _mm256_loadu_ps(tp),
                    _mm256_loadu_ps(tp.add(8)),
                    _mm256_loadu_ps(tp.add(16)),
                    _mm256_loadu_ps(tp.add(24)),
                ];
                for r in 0..N {
                    let xp = xs[r].as_ptr().add(be * b + 32 * c);
                    acc[r] = _mm256_add_ps(acc[r], dot32(&wv, xp));
                }
            }
        }
        std::array::from_fn(|r| hsum256(acc[r]))
    }
}

/// `out[j * N + r] = dot(row j of w, xs[r])` for the K-quant-era formats (not F32/F16/
/// BF16/Q8_0/Q4_0/Q4_1, which `kernels` handles). `xsum[r]` are row r's 32-element sums.
///
/// # Safety
/// The CPU supports AVX2, FMA and F16C; `w` is whole rows of `row_bytes`, each row whole
/// blocks of `t` covering `xs[r].len()` elements (validated shapes); `out` has N per row.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn gemv_rows<const N: usize>(
    t: DType,
    w: &[u8],
    row_bytes: usize,
    xs: &[&[f32]; N],
    xsum: &[&[f32]; N],
    out: &mut [f32],
) {
    // SAFETY: this function's contract, which its caller upholds.
    unsafe {
        for (o, row) in out.chunks_exact_mut(N).zip(w.chunks_exact(row_bytes)) {
            let v = match t {
                DType::Q4K => dot_q45k(row, xs, xsum, false),
                DType::Q5K => dot_q45k(row, xs, xsum, true),
                DType::Q6K => dot_q6k(row, xs),
                DType::Q5_0 => dot_q5(row, xs, xsum, false),
                DType::Q5_1 => dot_q5(row, xs, xsum, true),
                _ => dot_decoded(t, row, xs),
            };
            o.copy_from_slice(&v);
        }
    }
}

/// Whether `gemv_rows` is the kernel for `t`.
pub(super) fn covers(t: DType) -> bool {
    t.is_quantized() && !matches!(t, DType::Q8_0 | DType::Q4_0 | DType::Q4_1)
}
