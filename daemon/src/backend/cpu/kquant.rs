//! AVX2 dot products for the block formats of K-quant GGUFs, dequantizing in registers:
//! Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, Q5_0, Q5_1, and the look-up formats IQ4_NL, IQ4_XS and
//! MXFP4 (a byte shuffle through their 16 levels).
//!
//! Every kernel is generic over the number of activation rows `N` it applies one weight
//! row to, with one fixed order of operations per row: a row's result is the same whether
//! it runs alone (`N = 1`, the one-row GEMV) or beside three others (`N = 4`), so a
//! sequence's output does not depend on what shares its batch. Activations stay f32;
//! results match a dequantize-then-multiply reference to f32 rounding.
//!
//! Layouts are ggml's block structs (`ggml-common.h`), described in `dtype/ggml.rs`.

use super::simd::{dot32, f16_scalar, hsum256};
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
pub(super) unsafe fn bits32_to_0x10(qh: u32) -> __m256i {
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

/// The pieces of a K-quant super-block as 32 integers each, in element order: shared by
/// these f32 kernels and the integer ones (`q8.rs`).
///
/// Q4_K / Q5_K: sub-blocks 2p and 2p + 1 (u8, 0..16 or 0..32).
///
/// # Safety
/// The CPU supports AVX2; `blk` is one whole block (144 or 176 bytes).
#[inline(always)]
pub(super) unsafe fn q45k_pair(blk: &[u8], p: usize, q5: bool) -> [__m256i; 2] {
    // SAFETY: this function's contract; loads stay inside the block.
    unsafe {
        let m4 = _mm256_set1_epi8(0x0F);
        let qs = if q5 { &blk[48..176] } else { &blk[16..144] };
        let v = _mm256_loadu_si256(qs[32 * p..32 * p + 32].as_ptr() as *const __m256i);
        let mut q = [
            _mm256_and_si256(v, m4),
            _mm256_and_si256(_mm256_srli_epi16::<4>(v), m4),
        ];
        if q5 {
            let qh = _mm256_loadu_si256(blk[16..48].as_ptr() as *const __m256i);
            q[0] = _mm256_or_si256(q[0], bit_to_0x10(qh, 2 * p as u32));
            q[1] = _mm256_or_si256(q[1], bit_to_0x10(qh, 2 * p as u32 + 1));
        }
        q
    }
}

/// Q6_K: piece t4 of half h (elements 128h + 32 t4 ..), q - 32 as i8; its two 16-weight
/// scales are bytes `192 + 8h + 2 t4` and the next.
///
/// # Safety
/// The CPU supports AVX2; `blk` is one whole block (210 bytes).
#[inline(always)]
pub(super) unsafe fn q6k_piece(blk: &[u8], h: usize, t4: usize) -> __m256i {
    // SAFETY: this function's contract; loads stay inside the block.
    unsafe {
        let qh = _mm256_loadu_si256(blk[128 + 32 * h..160 + 32 * h].as_ptr() as *const __m256i);
        let at = 64 * h + 32 * (t4 % 2);
        let ql = _mm256_loadu_si256(blk[at..at + 32].as_ptr() as *const __m256i);
        let lo = _mm256_and_si256(
            _mm256_srl_epi16(ql, _mm_cvtsi32_si128(4 * (t4 / 2) as i32)),
            _mm256_set1_epi8(0x0F),
        );
        let hi = _mm256_and_si256(
            _mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * t4 as i32)),
            _mm256_set1_epi8(0x03),
        );
        _mm256_sub_epi8(
            _mm256_or_si256(lo, _mm256_slli_epi16::<4>(hi)),
            _mm256_set1_epi8(32),
        )
    }
}

/// Q2_K: piece c = 4h + j (elements 32c ..), two bits as u8; its scale/min bytes are
/// 2c and 2c + 1 (one a 16 weights).
///
/// # Safety
/// The CPU supports AVX2; `blk` is one whole block (84 bytes).
#[inline(always)]
pub(super) unsafe fn q2k_piece(blk: &[u8], h: usize, j: usize) -> __m256i {
    // SAFETY: this function's contract; loads stay inside the block.
    unsafe {
        let qs = _mm256_loadu_si256(blk[16 + 32 * h..48 + 32 * h].as_ptr() as *const __m256i);
        _mm256_and_si256(
            _mm256_srl_epi16(qs, _mm_cvtsi32_si128(2 * j as i32)),
            _mm256_set1_epi8(0x03),
        )
    }
}

/// Q3_K: piece c = 4h + j (elements 32c ..), two bits - 4 unless the high bit, as i8.
///
/// # Safety
/// The CPU supports AVX2; `blk` is one whole block (110 bytes).
#[inline(always)]
pub(super) unsafe fn q3k_piece(blk: &[u8], h: usize, j: usize) -> __m256i {
    // SAFETY: this function's contract; loads stay inside the block.
    unsafe {
        let c = 4 * h + j;
        let hmask = _mm256_loadu_si256(blk[0..32].as_ptr() as *const __m256i);
        let qs = _mm256_loadu_si256(blk[32 + 32 * h..64 + 32 * h].as_ptr() as *const __m256i);
        let ql = _mm256_and_si256(
            _mm256_srl_epi16(qs, _mm_cvtsi32_si128(2 * j as i32)),
            _mm256_set1_epi8(0x03),
        );
        let bit = _mm256_set1_epi8((1u8 << c) as i8);
        let set = _mm256_cmpeq_epi8(_mm256_and_si256(hmask, bit), bit);
        _mm256_sub_epi8(ql, _mm256_andnot_si256(set, _mm256_set1_epi8(4)))
    }
}

/// Q3_K: the six-bit scale of 16-weight sub-block `sub`, times d.
pub(super) fn q3k_scale(blk: &[u8], d: f32, sub: usize) -> f32 {
    let s = &blk[96..108];
    let lo = (s[sub % 8] >> (4 * (sub / 8))) & 0x0F;
    let hi = (s[8 + sub % 4] >> (2 * (sub / 4))) & 0x03;
    d * ((lo | (hi << 4)) as i8 - 32) as f32
}

/// IQ4_NL, MXFP4, IQ4_XS: piece ib's scale and its 16 bytes of four-bit indices.
pub(super) fn lookup_piece(t: DType, blk: &[u8], ib: usize) -> (f32, &[u8]) {
    match t {
        // SAFETY (of the f16 reads): whole blocks; AVX2/F16C is every caller's contract.
        DType::Iq4Nl => (unsafe { f16_scalar(blk, 0) }, &blk[2..18]),
        DType::Mxfp4 => (ggml::e8m0_to_f32_half(blk[0]), &blk[1..17]),
        _ => {
            let lo = (blk[4 + ib / 2] >> (4 * (ib % 2))) & 0x0F;
            let hi = ((u16::from_le_bytes([blk[2], blk[3]]) >> (2 * ib)) & 3) as u8;
            let ls = (lo | (hi << 4)) as i8 - 32;
            // SAFETY: as above.
            let d = unsafe { f16_scalar(blk, 0) };
            (d * ls as f32, &blk[8 + 16 * ib..24 + 16 * ib])
        }
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
        let mut acc = [_mm256_setzero_ps(); N];
        let mut moff = [0f32; N];
        for b in 0..xs[0].len() / 256 {
            let blk = &w[b * bb..(b + 1) * bb];
            let (d, dmin) = (f16_scalar(blk, 0), f16_scalar(blk, 2));
            for p in 0..4 {
                for (half, qv) in q45k_pair(blk, p, q5).into_iter().enumerate() {
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
        let mut acc = [_mm256_setzero_ps(); N];
        for b in 0..xs[0].len() / 256 {
            let blk = &w[b * 210..(b + 1) * 210];
            let d = f16_scalar(blk, 208);
            for h in 0..2 {
                for t4 in 0..4 {
                    let wv = i8x32_f32(q6k_piece(blk, h, t4));
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

/// Sixteen-weight halves of a 32-weight piece with their own scales: adds
/// `sa * dot(w[0..16], x) + sb * dot(w[16..32], x)` (minus `ma * sum(x[0..16]) + mb *
/// sum(x[16..32])` when `mins`) to `acc`, all in vectors.
///
/// # Safety
/// AVX2 and FMA; `xp` points at 32 readable f32.
#[inline(always)]
unsafe fn halves(
    acc: __m256,
    wv: &[__m256; 4],
    xp: *const f32,
    (sa, sb): (__m256, __m256),
    mins: Option<(__m256, __m256)>,
) -> __m256 {
    // SAFETY: this function's contract, which its caller upholds.
    unsafe {
        let x = [
            _mm256_loadu_ps(xp),
            _mm256_loadu_ps(xp.add(8)),
            _mm256_loadu_ps(xp.add(16)),
            _mm256_loadu_ps(xp.add(24)),
        ];
        let pa = _mm256_fmadd_ps(wv[1], x[1], _mm256_mul_ps(wv[0], x[0]));
        let pb = _mm256_fmadd_ps(wv[3], x[3], _mm256_mul_ps(wv[2], x[2]));
        let mut acc = _mm256_fmadd_ps(sb, pb, _mm256_fmadd_ps(sa, pa, acc));
        if let Some((ma, mb)) = mins {
            acc = _mm256_fnmadd_ps(ma, _mm256_add_ps(x[0], x[1]), acc);
            acc = _mm256_fnmadd_ps(mb, _mm256_add_ps(x[2], x[3]), acc);
        }
        acc
    }
}

/// Q2_K: per 16 weights, d * (scale & 15) * q - dmin * (scale >> 4).
///
/// # Safety
/// As `dot_q45k`.
#[inline(always)]
unsafe fn dot_q2k<const N: usize>(w: &[u8], xs: &[&[f32]; N]) -> [f32; N] {
    // SAFETY: this function's contract, which its caller upholds.
    unsafe {
        let mut acc = [_mm256_setzero_ps(); N];
        for b in 0..xs[0].len() / 256 {
            let blk = &w[b * 84..(b + 1) * 84];
            let (d, dmin) = (f16_scalar(blk, 80), f16_scalar(blk, 82));
            for h in 0..2 {
                for j in 0..4 {
                    let wv = u8x32_f32(q2k_piece(blk, h, j));
                    let c = 4 * h + j;
                    let (sa, sb) = (blk[2 * c], blk[2 * c + 1]);
                    let scales = (
                        _mm256_set1_ps(d * (sa & 15) as f32),
                        _mm256_set1_ps(d * (sb & 15) as f32),
                    );
                    let mins = (
                        _mm256_set1_ps(dmin * (sa >> 4) as f32),
                        _mm256_set1_ps(dmin * (sb >> 4) as f32),
                    );
                    for r in 0..N {
                        let xp = xs[r].as_ptr().add(256 * b + 32 * c);
                        acc[r] = halves(acc[r], &wv, xp, scales, Some(mins));
                    }
                }
            }
        }
        std::array::from_fn(|r| hsum256(acc[r]))
    }
}

/// Q3_K: per 16 weights, d * (six-bit scale - 32) * (two bits - 4 unless the high bit).
///
/// # Safety
/// As `dot_q45k`.
#[inline(always)]
unsafe fn dot_q3k<const N: usize>(w: &[u8], xs: &[&[f32]; N]) -> [f32; N] {
    // SAFETY: this function's contract, which its caller upholds.
    unsafe {
        let mut acc = [_mm256_setzero_ps(); N];
        for b in 0..xs[0].len() / 256 {
            let blk = &w[b * 110..(b + 1) * 110];
            let d = f16_scalar(blk, 108);
            let scale = |sub: usize| _mm256_set1_ps(q3k_scale(blk, d, sub));
            for h in 0..2 {
                for j in 0..4 {
                    let c = 4 * h + j;
                    let wv = i8x32_f32(q3k_piece(blk, h, j));
                    let scales = (scale(2 * c), scale(2 * c + 1));
                    for r in 0..N {
                        let xp = xs[r].as_ptr().add(256 * b + 32 * c);
                        acc[r] = halves(acc[r], &wv, xp, scales, None);
                    }
                }
            }
        }
        std::array::from_fn(|r| hsum256(acc[r]))
    }
}

/// 32 four-bit indices (16 bytes: low nibbles are elements 0..16, high ones 16..32)
/// through a table of 16 signed levels.
///
/// # Safety
/// The CPU supports AVX2; `q` points at 16 readable bytes.
#[inline(always)]
unsafe fn lookup32(lut: __m128i, q: *const u8) -> [__m256; 4] {
    // SAFETY: this function's contract, which its caller upholds.
    unsafe {
        let m4 = _mm_set1_epi8(0x0F);
        let v = _mm_loadu_si128(q as *const __m128i);
        let lo = _mm_shuffle_epi8(lut, _mm_and_si128(v, m4));
        let hi = _mm_shuffle_epi8(lut, _mm_and_si128(_mm_srli_epi16::<4>(v), m4));
        i8x32_f32(_mm256_set_m128i(hi, lo))
    }
}

/// IQ4_NL (d, 16 levels), MXFP4 (an E8M0 exponent, E2M1 levels) and IQ4_XS (d times a
/// six-bit scale per 32, IQ4_NL levels): level * scale per weight.
///
/// # Safety
/// AVX2, FMA, F16C; rows are whole blocks of `t`.
#[inline(always)]
unsafe fn dot_lookup<const N: usize>(t: DType, w: &[u8], xs: &[&[f32]; N]) -> [f32; N] {
    // SAFETY: this function's contract, which its caller upholds.
    unsafe {
        let table = if t == DType::Mxfp4 {
            &ggml::KVALUES_MXFP4
        } else {
            &ggml::KVALUES_IQ4NL
        };
        let lut = _mm_loadu_si128(table.as_ptr() as *const __m128i);
        let (be, bb) = (t.block_elems() as usize, t.block_bytes() as usize);
        let mut acc = [_mm256_setzero_ps(); N];
        for b in 0..xs[0].len() / be {
            let blk = &w[b * bb..(b + 1) * bb];
            // Each 32-weight piece: its scale and its 16 bytes of indices.
            for ib in 0..be / 32 {
                let (d, qs) = lookup_piece(t, blk, ib);
                let wv = lookup32(lut, qs.as_ptr());
                let dv = _mm256_set1_ps(d);
                for r in 0..N {
                    let xp = xs[r].as_ptr().add(be * b + 32 * ib);
                    acc[r] = _mm256_fmadd_ps(dv, dot32(&wv, xp), acc[r]);
                }
            }
        }
        std::array::from_fn(|r| hsum256(acc[r]))
    }
}

/// `out[j * N + r] = dot(row j of w, xs[r])` for the K-quant-era formats (not F32/F16/
/// BF16/Q8_0/Q4_0/Q4_1, which `kernels` handles; `covers` says which). `xsum[r]` are row r's 32-element sums.
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
                DType::Q2K => dot_q2k(row, xs),
                DType::Q3K => dot_q3k(row, xs),
                _ => dot_lookup(t, row, xs),
            };
            o.copy_from_slice(&v);
        }
    }
}

/// Whether `gemv_rows` is the kernel for `t`.
pub(super) fn covers(t: DType) -> bool {
    t.is_quantized() && !matches!(t, DType::Q8_0 | DType::Q4_0 | DType::Q4_1)
}
