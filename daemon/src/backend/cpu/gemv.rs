//! GEMV and row dequantization for every weight dtype: the f32-activation dot products
//! (`--exact`'s decode rows, and the rows the integer path in `q8.rs` does not take) and
//! the rows of weights that prefill tiles and embeddings turn into f32. The scalar loops
//! are written with fixed 8-lane accumulators so the compiler vectorizes them; each is
//! compiled twice, for baseline x86-64 and for AVX2+FMA, and the AVX2 version is chosen at
//! run time. The block formats q4_0, q4_1 and q8_0 have hand-written AVX2 kernels below
//! (`avx2`), the K-quant-era formats theirs in `kquant.rs`; without AVX2 they, like
//! everything here, go through the scalar loops.
//!
//! GGML block layouts (ggml-common.h): q8_0 = f16 d + 32 x i8, value d*q; q4_0 = f16 d +
//! 16 bytes, value d*(q-8); q4_1 = f16 d + f16 m + 16 bytes, value d*q + m. In both 4-bit
//! formats byte j holds element j in its low nibble and element j+16 in its high nibble.
//! Their decoders and layouts are `dtype/ggml.rs`'s (`ggml::q8_0`, `ggml::q4`,
//! `ggml::quants_at`) and their sizes `DType::block_bytes`; the fused dot kernels here
//! read the blocks in place by those constants.

#[cfg(target_arch = "x86_64")]
use crate::backend::cpu::simd::has_avx2;
use crate::dtype::{ggml, DType};
use half::{bf16, f16};

/// Bytes of a q8_0 block, and where its 32 quants start.
const Q8_0_BYTES: usize = DType::Q8_0.block_bytes() as usize;
const Q8_0_QS: usize = ggml::quants_at(DType::Q8_0);
/// Bytes of a q4_0 and a q4_1 block, and where their 16 bytes of nibbles start.
const Q4_0_BYTES: usize = DType::Q4_0.block_bytes() as usize;
const Q4_0_QS: usize = ggml::quants_at(DType::Q4_0);
const Q4_1_BYTES: usize = DType::Q4_1.block_bytes() as usize;
const Q4_1_QS: usize = ggml::quants_at(DType::Q4_1);

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
    match dtype {
        DType::F32 => dot_row_f32::<FMA>(w, x),
        DType::BF16 => dot_row_bf16::<FMA>(w, x),
        DType::F16 => dot_row_f16::<FMA>(w, x),
        DType::Q8_0 => dot_row_q8_0::<FMA>(w, x),
        DType::Q4_0 | DType::Q4_1 => dot_row_q4::<FMA>(dtype, w, x),
        _ => dot_row_blocks::<FMA>(dtype, w, x),
    }
}

/// `dot_impl` for an f32 row.
#[inline(always)]
fn dot_row_f32<const FMA: bool>(w: &[u8], x: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    for (wc, xc) in w.chunks_exact(32).zip(x.chunks_exact(8)) {
        for l in 0..8 {
            let wv = f32::from_le_bytes([wc[4 * l], wc[4 * l + 1], wc[4 * l + 2], wc[4 * l + 3]]);
            acc[l] = madd::<FMA>(wv, xc[l], acc[l]);
        }
    }
    let tail = x.len() / 8 * 8;
    let mut s = hsum(acc);
    for i in tail..x.len() {
        s += f32::from_le_bytes([w[4 * i], w[4 * i + 1], w[4 * i + 2], w[4 * i + 3]]) * x[i];
    }
    s
}

/// `dot_impl` for a bf16 row.
#[inline(always)]
fn dot_row_bf16<const FMA: bool>(w: &[u8], x: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    for (wc, xc) in w.chunks_exact(16).zip(x.chunks_exact(8)) {
        for l in 0..8 {
            let wv = f32::from_bits((u16::from_le_bytes([wc[2 * l], wc[2 * l + 1]]) as u32) << 16);
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

/// `dot_impl` for an f16 row: 64 elements at a time widened, then the 8 lanes.
#[inline(always)]
fn dot_row_f16<const FMA: bool>(w: &[u8], x: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
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

/// `dot_impl` for a q8_0 row: per block the 8 lanes of q * x, then d times them.
#[inline(always)]
fn dot_row_q8_0<const FMA: bool>(w: &[u8], x: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    for (blk, xs) in w.chunks_exact(Q8_0_BYTES).zip(x.chunks_exact(32)) {
        let d = f16_at(blk, 0);
        let mut s = [0f32; 8];
        for c in 0..4 {
            for l in 0..8 {
                s[l] = madd::<FMA>(blk[Q8_0_QS + c * 8 + l] as i8 as f32, xs[c * 8 + l], s[l]);
            }
        }
        for l in 0..8 {
            acc[l] = madd::<FMA>(d, s[l], acc[l]);
        }
    }
    hsum(acc)
}

/// `dot_impl` for a q4_0 or q4_1 row: per block the 8 lanes of q * x, then d times them,
/// and the offset term apart.
#[inline(always)]
fn dot_row_q4<const FMA: bool>(dtype: DType, w: &[u8], x: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (bb, qo) = if dtype == DType::Q4_0 {
        (Q4_0_BYTES, Q4_0_QS)
    } else {
        (Q4_1_BYTES, Q4_1_QS)
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

/// `dot_impl` for the other block formats: each block through the reference decoder, then
/// the same 8-lane sums.
#[inline(always)]
fn dot_row_blocks<const FMA: bool>(dtype: DType, w: &[u8], x: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
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

/// Dequantizes (or converts) one row into f32. The block formats go through `ggml.rs`'s
/// decoders, a block at a time (q8_0, q4_0 and q4_1 inlined here, their loops compiled
/// with this function's target features).
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
            for (blk, o) in w.chunks_exact(Q8_0_BYTES).zip(out.chunks_exact_mut(32)) {
                ggml::q8_0(blk, o);
            }
        }
        DType::Q4_0 | DType::Q4_1 => {
            let bb = if dtype == DType::Q4_0 {
                Q4_0_BYTES
            } else {
                Q4_1_BYTES
            };
            for (blk, o) in w.chunks_exact(bb).zip(out.chunks_exact_mut(32)) {
                ggml::q4(dtype, blk, o);
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
mod avx2 {
    //! Hand-written AVX2 dot products for the block formats (the loops the compiler does
    //! not vectorize well: nibble and byte unpacking to f32). Activations stay f32, so the
    //! results match a dequantize-then-multiply reference to f32 rounding.
    use super::*;
    use crate::backend::cpu::simd::{dot32, f16_scalar, hsum256};
    use crate::backend::cpu::{floatdot, kquant};
    use std::arch::x86_64::*;

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

    /// The 32 signed bytes of block `b` of the q8_0 row at `row` as four vectors of f32,
    /// each quarter sign-extended straight from memory (no shuffle to move it down first).
    ///
    /// # Safety
    /// The CPU supports AVX2; `row` points at a row of more than `b` q8_0 blocks.
    #[inline(always)]
    unsafe fn unpack_q8(row: *const u8, b: usize) -> [__m256; 4] {
        // SAFETY: this function's contract, which its caller upholds.
        unsafe {
            let f = |at: usize| {
                let v = _mm_loadl_epi64(row.add(b * Q8_0_BYTES + Q8_0_QS + at) as *const __m128i);
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
                    let s = dot32(&unpack_q8(w[r].as_ptr(), b), xp.add(b * 32));
                    let d = _mm256_set1_ps(f16_scalar(w[r], b * Q8_0_BYTES));
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
                let wv = unpack_q8(wp, b);
                let dv = _mm256_set1_ps(f16_scalar(w, b * Q8_0_BYTES));
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
                    .for_each(|(o, r)| *o = dot4_q4(r, xs, xsum, Q4_0_BYTES, Q4_0_QS, true)),
                DType::Q4_1 => out
                    .iter_mut()
                    .zip(w.chunks_exact(row_bytes))
                    .for_each(|(o, r)| *o = dot4_q4(r, xs, xsum, Q4_1_BYTES, Q4_1_QS, false)),
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
                        (Q4_0_BYTES, Q4_0_QS, true)
                    } else {
                        (Q4_1_BYTES, Q4_1_QS, false)
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
                t if floatdot::covers(t) => floatdot::gemv(t, w, row_bytes, x, out),
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
        if !floatdot::widen_rows(dtype, w, row_bytes, cols, out) {
            dequant_rows_impl(dtype, w, row_bytes, cols, out)
        }
    }
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

/// Sums of each 32-element block of `x`, added in order, into a reused vector (the q4
/// offset terms use them; the one- and four-row kernels must agree on them bit for bit).
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

/// Dequantizes rows of `w` into `out` (rows x cols f32).
pub fn dequant_rows(dtype: DType, w: &[u8], row_bytes: usize, cols: usize, out: &mut [f32]) {
    debug_assert_eq!(w.len() / row_bytes * cols, out.len());
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: AVX2/FMA/F16C present (checked).
        return unsafe { avx2::dequant_rows(dtype, w, row_bytes, cols, out) };
    }
    dequant_rows_impl(dtype, w, row_bytes, cols, out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::tests::rand_vec;

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
            _ => {
                let blocks = v.len() / dtype.block_elems() as usize;
                let random = &mut crate::util::rng::Rng::new(5).into_fn();
                return ggml::sample_blocks(dtype, blocks, random);
            }
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
}
