//! Decode rows with integer activations: each activation row is quantized once per matmul
//! to blocks of 32 (an f32 scale and 32 i8, as llama.cpp's q8_0 but with an f32 scale; or
//! 32 i16 for the output head), and a weight block meets it in integer dot products (AVX2
//! `maddubs`: u8 x i8 pairs summed to i16, then to i32; `madd` of i16 for 16 bits), scaled
//! once per block. This is the default path; `--exact` keeps f32 activations
//! (`gemv.rs`).
//!
//! Covered weight formats: every block format sluice reads (q4_0, q4_1, q8_0, q5_0, q5_1,
//! q2_k..q6_k, iq4_nl, iq4_xs, mxfp4). Each weight piece of 32 is unpacked in registers to
//! 32 integers (u8, or i8 through the sign trick) and meets the activation block in one
//! `maddubs` + `madd`: the eight i32 lanes that come out hold elements 0..16 in lanes 0..4
//! and 16..32 in lanes 4..8, so the formats with 16-weight sub-blocks (q2_k, q3_k, q6_k)
//! apply their two scales as one vector. A row's result does not depend on the other rows
//! of the batch: each kernel is generic over the rows N it applies a weight block to, and
//! every row accumulates in the same order whatever N is.

use crate::dtype::DType;

/// One block of 32 activations: x[i] ~= d * q[i]; `ds` = d * sum(q) (the offset term of
/// formats with a minimum per 32 weights) and `dh` the same per half (q2_k's minimum per
/// 16). `T` is i8 (`Q8Block`, every decode matmul on the fast path) or i16 (`Q16Block`,
/// the output head).
#[derive(Clone, Copy, Debug)]
#[repr(C, align(32))]
pub struct QBlock<T> {
    pub q: [T; 32],
    pub d: f32,
    pub ds: f32,
    pub dh: [f32; 2],
}

/// 8-bit activations: a quantization step of max|x| / 127 per block.
pub type Q8Block = QBlock<i8>;
/// 16-bit activations for the output head, whose logits decide the token: a step of
/// max|x| / 32767, 258 times finer than 8 bits (8-bit activations there flip near-ties:
/// SmolLM2's chat answer to "What is the capital of France?" has a 0.08 top-2 margin).
pub type Q16Block = QBlock<i16>;

/// An activation level type: i8 or i16.
pub trait Level: Copy + Default + Send + Sync + 'static {
    /// The largest level; the scale is max|x| / MAX.
    const MAX: f32;
    /// `v` (within +-MAX) rounded to nearest, ties away from zero.
    fn round(v: f32) -> Self;
    fn int(self) -> i32;
}

impl Level for i8 {
    const MAX: f32 = 127.0;
    fn round(v: f32) -> Self {
        v.round() as i8
    }
    fn int(self) -> i32 {
        self as i32
    }
}

impl Level for i16 {
    const MAX: f32 = 32767.0;
    fn round(v: f32) -> Self {
        v.round() as i16
    }
    fn int(self) -> i32 {
        self as i32
    }
}

impl<T: Level> Default for QBlock<T> {
    fn default() -> Self {
        QBlock {
            q: [T::default(); 32],
            d: 0.0,
            ds: 0.0,
            dh: [0.0; 2],
        }
    }
}

/// Weight formats with an integer-activation kernel on this CPU: every block format, where
/// the CPU has AVX2.
pub fn covers(dtype: DType) -> bool {
    dtype.is_quantized() && super::gemv::has_gemv4(dtype)
}

/// Quantizes `rows` rows of `k` (a multiple of 32) into `out` (k / 32 blocks a row):
/// scale max|x| / MAX, each value rounded to nearest (ties away from zero).
pub fn quantize_rows<T: Level>(xs: &[f32], k: usize, out: &mut Vec<QBlock<T>>) {
    debug_assert!(k.is_multiple_of(32) && xs.len().is_multiple_of(k));
    out.clear();
    out.extend(xs.chunks_exact(32).map(|c| {
        let amax = c.iter().fold(0f32, |m, &v| m.max(v.abs()));
        let d = amax / T::MAX;
        let id = if d > 0.0 { 1.0 / d } else { 0.0 };
        let mut b = QBlock::<T> {
            d,
            ..QBlock::default()
        };
        let mut sums = [0i32; 2];
        for (i, (q, &v)) in b.q.iter_mut().zip(c).enumerate() {
            *q = T::round(v * id);
            sums[i / 16] += q.int();
        }
        b.ds = d * (sums[0] + sums[1]) as f32;
        b.dh = [d * sums[0] as f32, d * sums[1] as f32];
        b
    }));
}

/// Activation rows one pass over a weight block serves at most: B decode rows read each
/// weight ceil(B / 8) times, not B.
pub const ROWS_MAX: usize = 8;

/// An integer GEMV: `(dtype, weight rows, row bytes, activation rows, out)`.
pub type IntKernel<B> = fn(DType, &[u8], usize, &[&[B]], &mut [[f32; ROWS_MAX]]);

/// out[j][r] = weight row j . activation row r, for the N rows of `xq` (1 to ROWS_MAX).
pub fn gemv_rows(
    dtype: DType,
    w: &[u8],
    row_bytes: usize,
    xq: &[&[Q8Block]],
    out: &mut [[f32; ROWS_MAX]],
) {
    gemv_rows_with(true, dtype, w, row_bytes, xq, out)
}

/// `gemv_rows`, through VNNI only where `allow_vnni` and `vnni()` (the tests compare the
/// two paths).
fn gemv_rows_with(
    allow_vnni: bool,
    dtype: DType,
    w: &[u8],
    row_bytes: usize,
    xq: &[&[Q8Block]],
    out: &mut [[f32; ROWS_MAX]],
) {
    assert!(covers(dtype), "no integer kernel for {dtype:?}");
    #[cfg(target_arch = "x86_64")]
    // SAFETY: AVX2/FMA/F16C present (covers checks), AVX512-VNNI/VL where `vnni()` says;
    // rows are whole blocks (validated shapes) and each xq row has the blocks of one
    // weight row.
    unsafe {
        if allow_vnni && vnni() {
            avx2::gemv_n_vnni(dtype, w, row_bytes, xq, out)
        } else {
            avx2::gemv_n(dtype, w, row_bytes, xq, out)
        }
    }
}

/// The integer dot the decode kernels use on this CPU: "avx512-vnni", "avx2", or "none"
/// (no integer kernels: decode rows take the f32 path).
pub fn dots_name() -> &'static str {
    if !covers(DType::Q8_0) {
        "none"
    } else if vnni() {
        "avx512-vnni"
    } else {
        "avx2"
    }
}

/// Whether the 8-bit kernels take AVX512-VNNI's `vpdpbusd` (u8 x i8 quadruples summed
/// into i32 in one instruction, where AVX2 needs `maddubs` then `madd`): where the CPU
/// has AVX512-VNNI and AVX512-VL, unless `SLUICE_CPU_VNNI=0` (for A/B runs). The two
/// give the same bits: no product pair of any format reaches `maddubs`'s saturation.
pub fn vnni() -> bool {
    static HAS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *HAS.get_or_init(|| {
        let off = std::env::var("SLUICE_CPU_VNNI").is_ok_and(|v| v == "0");
        #[cfg(target_arch = "x86_64")]
        let has = is_x86_feature_detected!("avx512vnni") && is_x86_feature_detected!("avx512vl");
        #[cfg(not(target_arch = "x86_64"))]
        let has = false;
        has && !off
    })
}

/// `gemv_rows` with 16-bit activations (the output head).
pub fn gemv_rows16(
    dtype: DType,
    w: &[u8],
    row_bytes: usize,
    xq: &[&[Q16Block]],
    out: &mut [[f32; ROWS_MAX]],
) {
    assert!(covers(dtype), "no integer kernel for {dtype:?}");
    #[cfg(target_arch = "x86_64")]
    // SAFETY: as gemv_rows.
    unsafe {
        avx2::gemv_n(dtype, w, row_bytes, xq, out)
    }
}

/// The reference of one block pair in integers, for tests: sum of w_int * q over the
/// block, and the weight block's (d, m) scale and minimum.
#[cfg(test)]
pub fn reference_dot<T: Level>(dtype: DType, w: &[u8], x: &[QBlock<T>]) -> f64 {
    use crate::dtype::ggml;
    let mut vals = vec![0f32; x.len() * 32];
    ggml::dequantize(dtype, w, &mut vals).expect("whole blocks");
    vals.iter()
        .enumerate()
        .map(|(i, &v)| v as f64 * x[i / 32].d as f64 * x[i / 32].q[i % 32].int() as f64)
        .sum()
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::{Q16Block, Q8Block};
    use crate::backend::cpu::kquant::{
        bits32_to_0x10, lookup_piece, q2k_piece, q3k_piece, q3k_scale, q45k_pair, q6k_piece,
    };
    use crate::backend::cpu::simd::{f16_scalar, hsum256};
    use crate::dtype::{ggml, DType};
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

    /// The integer dot of 32 u8 (`a`) with 32 i8 (`b`) in i32 lanes: lane l sums the
    /// products of elements 4l..4l+4.
    pub trait Dot {
        /// # Safety
        /// AVX2 (and AVX512-VNNI/VL for `Vnni`).
        unsafe fn dot(a: __m256i, b: __m256i) -> __m256i;
    }

    /// AVX2: `maddubs` (pairs to i16, saturating) then `madd` (pairs of those to i32).
    pub struct Madd;
    /// AVX512-VNNI: `vpdpbusd`, the quadruples in one instruction, without the i16 step.
    pub struct Vnni;

    impl Dot for Madd {
        #[inline(always)]
        unsafe fn dot(a: __m256i, b: __m256i) -> __m256i {
            // SAFETY: this function's contract, which its caller upholds.
            unsafe { _mm256_madd_epi16(_mm256_maddubs_epi16(a, b), _mm256_set1_epi16(1)) }
        }
    }

    impl Dot for Vnni {
        #[inline(always)]
        unsafe fn dot(a: __m256i, b: __m256i) -> __m256i {
            // SAFETY: this function's contract, which its caller upholds.
            unsafe { _mm256_dpbusd_epi32(_mm256_setzero_si256(), a, b) }
        }
    }

    /// An activation block the kernels take: how a weight piece of 32 integers is prepared
    /// once for all the rows, and how it meets one row's block.
    pub trait Acts: Sized {
        /// The piece, prepared.
        type W: Copy;
        /// # Safety
        /// AVX2.
        unsafe fn prep<const SIGNED: bool>(wq: __m256i) -> Self::W;
        /// `acc + (scale * d) * dot(w, q)` lane by lane, where the dot's lanes 0..4 sum
        /// elements of 0..16 and lanes 4..8 elements of 16..32 (so `scale` may differ
        /// between the halves).
        ///
        /// # Safety
        /// AVX2 and FMA.
        unsafe fn fma<const SIGNED: bool, D: Dot>(
            w: Self::W,
            scale: __m256,
            x: &Self,
            acc: __m256,
        ) -> __m256;
        fn ds(&self) -> f32;
        fn dh(&self) -> [f32; 2];
    }

    /// 8 bits: `maddubs` (u8 x i8 pairs to i16) then `madd` (pairs of those to i32), so
    /// i32 lane l holds elements 4l..4l+4. Signed weights go through the sign trick (|w|
    /// and x with w's sign). `maddubs` saturates pairs at i16, which no format reaches:
    /// |w| <= 128 (q8_0's -128 through the sign trick) and |x| <= 127 give at most
    /// 2 * 128 * 127 = 32512.
    impl Acts for Q8Block {
        type W = (__m256i, __m256i);
        #[inline(always)]
        unsafe fn prep<const SIGNED: bool>(wq: __m256i) -> Self::W {
            // SAFETY: this function's contract, which its caller upholds.
            unsafe {
                if SIGNED {
                    (_mm256_sign_epi8(wq, wq), wq)
                } else {
                    (wq, wq)
                }
            }
        }
        #[inline(always)]
        unsafe fn fma<const SIGNED: bool, D: Dot>(
            (wa, wq): Self::W,
            scale: __m256,
            x: &Self,
            acc: __m256,
        ) -> __m256 {
            // SAFETY: this function's contract; the quants are 32-aligned.
            unsafe {
                let mut xv = _mm256_load_si256(x.q.as_ptr() as *const __m256i);
                if SIGNED {
                    xv = _mm256_sign_epi8(xv, wq);
                }
                let p = D::dot(wa, xv);
                let s = _mm256_mul_ps(scale, _mm256_set1_ps(x.d));
                _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), s, acc)
            }
        }
        fn ds(&self) -> f32 {
            self.ds
        }
        fn dh(&self) -> [f32; 2] {
            self.dh
        }
    }

    /// 16 bits: the piece widened to two vectors of 16 i16, `madd` against each half of
    /// the activations (every i32 lane of the first within elements 0..16, of the second
    /// within 16..32), each half with its scale. A lane sums two products of at most 128 *
    /// 32767, below 2^24, so its conversion to f32 is exact.
    impl Acts for Q16Block {
        type W = (__m256i, __m256i);
        #[inline(always)]
        unsafe fn prep<const SIGNED: bool>(wq: __m256i) -> Self::W {
            // SAFETY: this function's contract, which its caller upholds.
            unsafe {
                let (lo, hi) = (
                    _mm256_castsi256_si128(wq),
                    _mm256_extracti128_si256::<1>(wq),
                );
                if SIGNED {
                    (_mm256_cvtepi8_epi16(lo), _mm256_cvtepi8_epi16(hi))
                } else {
                    (_mm256_cvtepu8_epi16(lo), _mm256_cvtepu8_epi16(hi))
                }
            }
        }
        #[inline(always)]
        unsafe fn fma<const SIGNED: bool, D: Dot>(
            (wl, wh): Self::W,
            scale: __m256,
            x: &Self,
            acc: __m256,
        ) -> __m256 {
            // SAFETY: this function's contract; the quants are 32-aligned (64 bytes).
            unsafe {
                let xp = x.q.as_ptr() as *const __m256i;
                let pl = _mm256_madd_epi16(wl, _mm256_load_si256(xp));
                let ph = _mm256_madd_epi16(wh, _mm256_load_si256(xp.add(1)));
                let dx = _mm256_set1_ps(x.d);
                let sl = _mm256_mul_ps(_mm256_permute2f128_ps::<0x00>(scale, scale), dx);
                let sh = _mm256_mul_ps(_mm256_permute2f128_ps::<0x11>(scale, scale), dx);
                let acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(pl), sl, acc);
                _mm256_fmadd_ps(_mm256_cvtepi32_ps(ph), sh, acc)
            }
        }
        fn ds(&self) -> f32 {
            self.ds
        }
        fn dh(&self) -> [f32; 2] {
            self.dh
        }
    }

    /// One 32-weight piece `wq` (u8, or i8 when `SIGNED`) against activation block `bi` of
    /// each of the N rows: `acc[r] = A::fma(piece, scale, block, acc[r])`.
    ///
    /// # Safety
    /// AVX2 and FMA; every `xq[r]` has a block `bi`.
    #[inline(always)]
    unsafe fn piece<const N: usize, const SIGNED: bool, A: Acts, D: Dot>(
        acc: &mut [__m256; N],
        wq: __m256i,
        scale: __m256,
        xq: &[&[A]],
        bi: usize,
    ) {
        // SAFETY: this function's contract, which its caller upholds.
        unsafe {
            let w = A::prep::<SIGNED>(wq);
            for (r, a) in acc.iter_mut().enumerate() {
                *a = A::fma::<SIGNED, D>(w, scale, xq.get_unchecked(r).get_unchecked(bi), *a);
            }
        }
    }

    /// A vector of `lo` in lanes 0..4 and `hi` in lanes 4..8 (the scales of two 16-weight
    /// sub-blocks).
    ///
    /// # Safety
    /// AVX.
    #[inline(always)]
    unsafe fn halves(lo: f32, hi: f32) -> __m256 {
        // SAFETY: this function's contract, which its caller upholds.
        unsafe { _mm256_set_m128(_mm_set1_ps(hi), _mm_set1_ps(lo)) }
    }

    /// q4_0 (d * (q - 8)), q4_1 (d * q + m) and q8_0 (d * q): one block per 32 weights.
    ///
    /// # Safety
    /// AVX2, FMA, F16C; `row` is whole blocks, each `xq[r]` has one block per weight block.
    #[inline(always)]
    unsafe fn row_q4_q8<const N: usize, A: Acts, D: Dot>(
        t: DType,
        row: &[u8],
        xq: &[&[A]],
    ) -> [f32; N] {
        // SAFETY: this function's contract; reads stay inside each block.
        unsafe {
            let bb = t.block_bytes() as usize;
            let mut acc = [_mm256_setzero_ps(); N];
            let mut offs = [0f32; N];
            for (b, blk) in row.chunks_exact(bb).enumerate() {
                let d = _mm256_set1_ps(f16_scalar(blk, 0));
                match t {
                    DType::Q4_0 => {
                        let wq = _mm256_sub_epi8(nibbles(blk.as_ptr().add(2)), _mm256_set1_epi8(8));
                        piece::<N, true, A, D>(&mut acc, wq, d, xq, b);
                    }
                    DType::Q4_1 => {
                        let m = f16_scalar(blk, 2);
                        piece::<N, false, A, D>(&mut acc, nibbles(blk.as_ptr().add(4)), d, xq, b);
                        for r in 0..N {
                            offs[r] = m.mul_add(xq[r][b].ds(), offs[r]);
                        }
                    }
                    _ => {
                        let wq = _mm256_loadu_si256(blk.as_ptr().add(2) as *const __m256i);
                        piece::<N, true, A, D>(&mut acc, wq, d, xq, b);
                    }
                }
            }
            std::array::from_fn(|r| hsum256(acc[r]) + offs[r])
        }
    }

    /// q4_0 (d * (q - 8)), q4_1 (d * q + m), q5_0, q5_1 (`row_q5`) and q8_0 (d * q): one
    /// block per 32 weights, for `WR` weight rows in step. A row's blocks are one chain of dependent FMAs (its
    /// accumulator), so one weight row against one activation row runs at the FMA's
    /// latency; `gemv_body` gives a lone activation row weight rows in pairs, two
    /// independent chains. Per row the arithmetic and its order are `row_q4_q8`'s, so the
    /// bits are too. Batches keep `row_q4_q8`: this form at one weight row compiled to a
    /// loop 1.5-2x slower for 4 and 8 activation rows.
    ///
    /// # Safety
    /// AVX2, FMA, F16C; each row is whole blocks, each `xq[r]` has one block per weight
    /// block.
    #[inline(always)]
    #[allow(clippy::needless_range_loop)]
    unsafe fn row_q4_q8_in_step<const WR: usize, const N: usize, A: Acts, D: Dot>(
        t: DType,
        rows: [&[u8]; WR],
        xq: &[&[A]],
    ) -> [[f32; N]; WR] {
        // SAFETY: this function's contract; reads stay inside each block.
        unsafe {
            let bb = t.block_bytes() as usize;
            let mut acc = [[_mm256_setzero_ps(); N]; WR];
            let mut offs = [[0f32; N]; WR];
            for b in 0..rows[0].len() / bb {
                for k in 0..WR {
                    let blk = rows[k].get_unchecked(b * bb..(b + 1) * bb);
                    let d = _mm256_set1_ps(f16_scalar(blk, 0));
                    match t {
                        DType::Q4_0 => {
                            let wq =
                                _mm256_sub_epi8(nibbles(blk.as_ptr().add(2)), _mm256_set1_epi8(8));
                            piece::<N, true, A, D>(&mut acc[k], wq, d, xq, b);
                        }
                        DType::Q4_1 => {
                            let m = f16_scalar(blk, 2);
                            let wq = nibbles(blk.as_ptr().add(4));
                            piece::<N, false, A, D>(&mut acc[k], wq, d, xq, b);
                            for r in 0..N {
                                offs[k][r] = m.mul_add(xq[r][b].ds(), offs[k][r]);
                            }
                        }
                        DType::Q5_0 | DType::Q5_1 => {
                            let q5_1 = t == DType::Q5_1;
                            q5_block::<N, A, D>(&mut acc[k], &mut offs[k], blk, d, xq, b, q5_1);
                        }
                        _ => {
                            let wq = _mm256_loadu_si256(blk.as_ptr().add(2) as *const __m256i);
                            piece::<N, true, A, D>(&mut acc[k], wq, d, xq, b);
                        }
                    }
                }
            }
            std::array::from_fn(|k| std::array::from_fn(|r| hsum256(acc[k][r]) + offs[k][r]))
        }
    }

    /// q5_0 (d * (q - 16)) and q5_1 (d * q + m): four low bits as nibbles, the fifth from
    /// a 32-bit mask.
    ///
    /// # Safety
    /// As `row_q4_q8`.
    #[inline(always)]
    unsafe fn row_q5<const N: usize, A: Acts, D: Dot>(
        row: &[u8],
        xq: &[&[A]],
        q5_1: bool,
    ) -> [f32; N] {
        // SAFETY: this function's contract; reads stay inside each block.
        unsafe {
            let bb = if q5_1 { 24 } else { 22 };
            let mut acc = [_mm256_setzero_ps(); N];
            let mut offs = [0f32; N];
            for (b, blk) in row.chunks_exact(bb).enumerate() {
                let d = _mm256_set1_ps(f16_scalar(blk, 0));
                q5_block::<N, A, D>(&mut acc, &mut offs, blk, d, xq, b, q5_1);
            }
            std::array::from_fn(|r| hsum256(acc[r]) + offs[r])
        }
    }

    /// One q5_0 or q5_1 block (`blk`, scale `d` broadcast) into a weight row's lanes and
    /// offsets: `row_q5`'s step, which the rows in step take too (the same bits).
    ///
    /// # Safety
    /// As `row_q4_q8`; `blk` is one whole block of its format.
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    unsafe fn q5_block<const N: usize, A: Acts, D: Dot>(
        acc: &mut [__m256; N],
        offs: &mut [f32; N],
        blk: &[u8],
        d: __m256,
        xq: &[&[A]],
        b: usize,
        q5_1: bool,
    ) {
        // SAFETY: this function's contract; reads stay inside the block.
        unsafe {
            let at = if q5_1 { 4 } else { 2 };
            let qh = u32::from_le_bytes([blk[at], blk[at + 1], blk[at + 2], blk[at + 3]]);
            let q = _mm256_or_si256(nibbles(blk.as_ptr().add(at + 4)), bits32_to_0x10(qh));
            if q5_1 {
                let m = f16_scalar(blk, 2);
                piece::<N, false, A, D>(acc, q, d, xq, b);
                for r in 0..N {
                    offs[r] = m.mul_add(xq[r][b].ds(), offs[r]);
                }
            } else {
                let wq = _mm256_sub_epi8(q, _mm256_set1_epi8(16));
                piece::<N, true, A, D>(acc, wq, d, xq, b);
            }
        }
    }

    /// q4_k (and q5_k with `q5`): per 32-weight sub-block j, d * sc_j * q - dmin * m_j.
    ///
    /// # Safety
    /// As `row_q4_q8`, with 256-weight super-blocks (eight activation blocks each).
    #[inline(always)]
    unsafe fn row_q45k<const N: usize, A: Acts, D: Dot>(
        row: &[u8],
        xq: &[&[A]],
        q5: bool,
    ) -> [f32; N] {
        // SAFETY: this function's contract; reads stay inside each block.
        unsafe {
            let bb = if q5 { 176 } else { 144 };
            let mut acc = [_mm256_setzero_ps(); N];
            let mut offs = [0f32; N];
            for (b, blk) in row.chunks_exact(bb).enumerate() {
                let (d, dmin) = (f16_scalar(blk, 0), f16_scalar(blk, 2));
                for p in 0..4 {
                    for (half, qv) in q45k_pair(blk, p, q5).into_iter().enumerate() {
                        let j = 2 * p + half;
                        let (sc, m) = ggml::scale_min_k4(&blk[4..16], j);
                        piece::<N, false, A, D>(
                            &mut acc,
                            qv,
                            _mm256_set1_ps(d * sc),
                            xq,
                            8 * b + j,
                        );
                        let dm = dmin * m;
                        for r in 0..N {
                            offs[r] = (-dm).mul_add(xq[r][8 * b + j].ds(), offs[r]);
                        }
                    }
                }
            }
            std::array::from_fn(|r| hsum256(acc[r]) + offs[r])
        }
    }

    /// q6_k: (q - 32) * d * scale, one i8 scale per 16 weights.
    ///
    /// # Safety
    /// As `row_q45k`.
    #[inline(always)]
    unsafe fn row_q6k<const N: usize, A: Acts, D: Dot>(row: &[u8], xq: &[&[A]]) -> [f32; N] {
        // SAFETY: this function's contract; reads stay inside each block.
        unsafe {
            let mut acc = [_mm256_setzero_ps(); N];
            for (b, blk) in row.chunks_exact(210).enumerate() {
                let d = f16_scalar(blk, 208);
                for h in 0..2 {
                    for t4 in 0..4 {
                        let q = q6k_piece(blk, h, t4);
                        let s = 192 + 8 * h + 2 * t4;
                        let scale = halves(d * blk[s] as i8 as f32, d * blk[s + 1] as i8 as f32);
                        piece::<N, true, A, D>(&mut acc, q, scale, xq, 8 * b + 4 * h + t4);
                    }
                }
            }
            std::array::from_fn(|r| hsum256(acc[r]))
        }
    }

    /// `row_q6k` for `WR` weight rows in step (as `row_q4_q8_in_step`).
    ///
    /// # Safety
    /// As `row_q45k`.
    #[inline(always)]
    #[allow(clippy::needless_range_loop)]
    unsafe fn row_q6k_in_step<const WR: usize, const N: usize, A: Acts, D: Dot>(
        rows: [&[u8]; WR],
        xq: &[&[A]],
    ) -> [[f32; N]; WR] {
        // SAFETY: this function's contract; reads stay inside each block.
        unsafe {
            let mut acc = [[_mm256_setzero_ps(); N]; WR];
            for b in 0..rows[0].len() / 210 {
                let blks: [&[u8]; WR] =
                    std::array::from_fn(|k| rows[k].get_unchecked(b * 210..(b + 1) * 210));
                let d: [f32; WR] = std::array::from_fn(|k| f16_scalar(blks[k], 208));
                for h in 0..2 {
                    for t4 in 0..4 {
                        for k in 0..WR {
                            let (blk, d) = (blks[k], d[k]);
                            let q = q6k_piece(blk, h, t4);
                            let s = 192 + 8 * h + 2 * t4;
                            let scale =
                                halves(d * blk[s] as i8 as f32, d * blk[s + 1] as i8 as f32);
                            let bi = 8 * b + 4 * h + t4;
                            piece::<N, true, A, D>(&mut acc[k], q, scale, xq, bi);
                        }
                    }
                }
            }
            std::array::from_fn(|k| std::array::from_fn(|r| hsum256(acc[k][r])))
        }
    }

    /// q2_k: per 16 weights, d * (scale & 15) * q - dmin * (scale >> 4).
    ///
    /// # Safety
    /// As `row_q45k`.
    #[inline(always)]
    unsafe fn row_q2k<const N: usize, A: Acts, D: Dot>(row: &[u8], xq: &[&[A]]) -> [f32; N] {
        // SAFETY: this function's contract; reads stay inside each block.
        unsafe {
            let mut acc = [_mm256_setzero_ps(); N];
            let mut offs = [0f32; N];
            for (b, blk) in row.chunks_exact(84).enumerate() {
                let (d, dmin) = (f16_scalar(blk, 80), f16_scalar(blk, 82));
                for h in 0..2 {
                    for j in 0..4 {
                        let q = q2k_piece(blk, h, j);
                        let c = 4 * h + j;
                        let (sa, sb) = (blk[2 * c], blk[2 * c + 1]);
                        let scale = halves(d * (sa & 15) as f32, d * (sb & 15) as f32);
                        piece::<N, false, A, D>(&mut acc, q, scale, xq, 8 * b + c);
                        let (ma, mb) = (dmin * (sa >> 4) as f32, dmin * (sb >> 4) as f32);
                        for r in 0..N {
                            let x = &xq[r][8 * b + c];
                            let dh = x.dh();
                            offs[r] = (-mb).mul_add(dh[1], (-ma).mul_add(dh[0], offs[r]));
                        }
                    }
                }
            }
            std::array::from_fn(|r| hsum256(acc[r]) + offs[r])
        }
    }

    /// q3_k: per 16 weights, d * (six-bit scale - 32) * (two bits - 4 unless the high bit).
    ///
    /// # Safety
    /// As `row_q45k`.
    #[inline(always)]
    unsafe fn row_q3k<const N: usize, A: Acts, D: Dot>(row: &[u8], xq: &[&[A]]) -> [f32; N] {
        // SAFETY: this function's contract; reads stay inside each block.
        unsafe {
            let mut acc = [_mm256_setzero_ps(); N];
            for (b, blk) in row.chunks_exact(110).enumerate() {
                let d = f16_scalar(blk, 108);
                let scale = |sub: usize| q3k_scale(blk, d, sub);
                for h in 0..2 {
                    for j in 0..4 {
                        let c = 4 * h + j;
                        let q = q3k_piece(blk, h, j);
                        let sc = halves(scale(2 * c), scale(2 * c + 1));
                        piece::<N, true, A, D>(&mut acc, q, sc, xq, 8 * b + c);
                    }
                }
            }
            std::array::from_fn(|r| hsum256(acc[r]))
        }
    }

    /// iq4_nl (d, 16 levels), mxfp4 (an E8M0 exponent, E2M1 levels) and iq4_xs (d times a
    /// six-bit scale per 32, iq4_nl's levels): the levels are i8, looked up by a byte
    /// shuffle.
    ///
    /// # Safety
    /// As `row_q4_q8`.
    #[inline(always)]
    unsafe fn row_lookup<const N: usize, A: Acts, D: Dot>(
        t: DType,
        row: &[u8],
        xq: &[&[A]],
    ) -> [f32; N] {
        // SAFETY: this function's contract; reads stay inside each block.
        unsafe {
            let table = if t == DType::Mxfp4 {
                &ggml::KVALUES_MXFP4
            } else {
                &ggml::KVALUES_IQ4NL
            };
            let lut =
                _mm256_broadcastsi128_si256(_mm_loadu_si128(table.as_ptr() as *const __m128i));
            let (be, bb) = (t.block_elems() as usize, t.block_bytes() as usize);
            let mut acc = [_mm256_setzero_ps(); N];
            for (b, blk) in row.chunks_exact(bb).enumerate() {
                for ib in 0..be / 32 {
                    let (d, qs) = lookup_piece(t, blk, ib);
                    let q = _mm256_shuffle_epi8(lut, nibbles(qs.as_ptr()));
                    piece::<N, true, A, D>(&mut acc, q, _mm256_set1_ps(d), xq, be / 32 * b + ib);
                }
            }
            std::array::from_fn(|r| hsum256(acc[r]))
        }
    }

    /// `gemv` for the 1 to ROWS_MAX rows of `xq`, with a macro so each row count gets
    /// its own instance.
    macro_rules! by_rows {
        ($kernel:ident, $dtype:expr, $w:expr, $rb:expr, $xq:expr, $out:expr) => {
            match $xq.len() {
                1 => $kernel::<1, A>($dtype, $w, $rb, $xq, $out),
                2 => $kernel::<2, A>($dtype, $w, $rb, $xq, $out),
                3 => $kernel::<3, A>($dtype, $w, $rb, $xq, $out),
                4 => $kernel::<4, A>($dtype, $w, $rb, $xq, $out),
                5 => $kernel::<5, A>($dtype, $w, $rb, $xq, $out),
                6 => $kernel::<6, A>($dtype, $w, $rb, $xq, $out),
                7 => $kernel::<7, A>($dtype, $w, $rb, $xq, $out),
                8 => $kernel::<8, A>($dtype, $w, $rb, $xq, $out),
                n => panic!("{n} rows: 1 to {} at a time", super::ROWS_MAX),
            }
        };
    }

    /// An entry for 1 to ROWS_MAX rows (`$entry`) and its kernel compiled with
    /// `$features` for the dot `$dot`.
    macro_rules! gemv_with {
        ($entry:ident, $kernel:ident, $dot:ty, $features:literal) => {
            /// `gemv_body` with this dot for the rows of `xq`.
            ///
            /// # Safety
            /// As `gemv_body`, and the CPU has the kernel's features.
            pub(super) unsafe fn $entry<A: Acts>(
                dtype: DType,
                w: &[u8],
                row_bytes: usize,
                xq: &[&[A]],
                out: &mut [[f32; super::ROWS_MAX]],
            ) {
                // SAFETY: this function's contract, which its caller upholds.
                unsafe { by_rows!($kernel, dtype, w, row_bytes, xq, out) }
            }

            /// # Safety
            /// As `gemv_body`, and the CPU has these features.
            #[target_feature(enable = $features)]
            unsafe fn $kernel<const N: usize, A: Acts>(
                dtype: DType,
                w: &[u8],
                row_bytes: usize,
                xq: &[&[A]],
                out: &mut [[f32; super::ROWS_MAX]],
            ) {
                // SAFETY: this function's contract, which its caller upholds.
                unsafe { gemv_body::<N, A, $dot>(dtype, w, row_bytes, xq, out) }
            }
        };
    }

    gemv_with!(gemv_n, gemv, Madd, "avx2,fma,f16c");
    gemv_with!(
        gemv_n_vnni,
        gemv_vnni,
        Vnni,
        "avx2,fma,f16c,avx512vnni,avx512vl"
    );

    /// Weight rows a lone activation row takes in step (`gemv_body`).
    const STEP: usize = 2;

    /// The formats whose kernels take several weight rows in step: q4_0, q4_1, q5_0, q5_1,
    /// q8_0 and q6_k. (q4_k and q5_k ran 1.5x slower in step: their per-piece scale decoding
    /// leaves their lone row nothing to wait on.)
    fn in_step(dtype: DType) -> bool {
        matches!(
            dtype,
            DType::Q4_0 | DType::Q4_1 | DType::Q5_0 | DType::Q5_1 | DType::Q8_0 | DType::Q6K
        )
    }

    /// `WR` weight rows in step against the N rows of `xq` (a format `in_step` names).
    ///
    /// # Safety
    /// As `row_q4_q8`.
    #[inline(always)]
    unsafe fn rows_in_step<const WR: usize, const N: usize, A: Acts, D: Dot>(
        dtype: DType,
        rows: [&[u8]; WR],
        xq: &[&[A]],
    ) -> [[f32; N]; WR] {
        // SAFETY: this function's contract, which its caller upholds.
        unsafe {
            match dtype {
                DType::Q6K => row_q6k_in_step::<WR, N, A, D>(rows, xq),
                _ => row_q4_q8_in_step::<WR, N, A, D>(dtype, rows, xq),
            }
        }
    }

    /// # Safety
    /// AVX2, FMA and F16C (and what `D` needs); `w` holds whole rows of `row_bytes`; each
    /// `xq[r]` (N of them) has one block per 32 weights of a row; `out` has a slot per
    /// weight row.
    #[inline(always)]
    unsafe fn gemv_body<const N: usize, A: Acts, D: Dot>(
        dtype: DType,
        w: &[u8],
        row_bytes: usize,
        xq: &[&[A]],
        out: &mut [[f32; super::ROWS_MAX]],
    ) {
        let nb = row_bytes / dtype.block_bytes() as usize * dtype.block_elems() as usize / 32;
        assert!(xq.len() == N && xq.iter().all(|x| x.len() >= nb));
        // SAFETY: this function's contract: each row function reads inside its row and
        // the first `nb` blocks of each activation row.
        unsafe {
            // A lone activation row takes STEP weight rows in step (`in_step`): row i of
            // each STEP-th of the rows, so each is read front to back as one sequential
            // stream (adjacent rows in step make short strided runs the prefetchers do
            // not follow: 1.9x slower on SmolLM2's 30 MB output head).
            let q = if N == 1 && in_step(dtype) {
                out.len() / STEP
            } else {
                0
            };
            for i in 0..q {
                let rows: [&[u8]; STEP] = std::array::from_fn(|p| {
                    let r = p * q + i;
                    &w[r * row_bytes..(r + 1) * row_bytes]
                });
                let v = rows_in_step::<STEP, N, A, D>(dtype, rows, xq);
                for (p, v) in v.iter().enumerate() {
                    out[p * q + i][..N].copy_from_slice(v);
                }
            }
            let done = q * STEP;
            let (out, w) = (&mut out[done..], &w[done * row_bytes..]);
            for (o, row) in out.iter_mut().zip(w.chunks_exact(row_bytes)) {
                let v: [f32; N] = match dtype {
                    DType::Q4_0 | DType::Q4_1 | DType::Q8_0 => row_q4_q8::<N, A, D>(dtype, row, xq),
                    DType::Q6K => row_q6k::<N, A, D>(row, xq),
                    DType::Q5_0 => row_q5::<N, A, D>(row, xq, false),
                    DType::Q5_1 => row_q5::<N, A, D>(row, xq, true),
                    DType::Q4K => row_q45k::<N, A, D>(row, xq, false),
                    DType::Q5K => row_q45k::<N, A, D>(row, xq, true),
                    DType::Q2K => row_q2k::<N, A, D>(row, xq),
                    DType::Q3K => row_q3k::<N, A, D>(row, xq),
                    DType::Iq4Nl | DType::Iq4Xs | DType::Mxfp4 => {
                        row_lookup::<N, A, D>(dtype, row, xq)
                    }
                    _ => unreachable!("covers() checked: {dtype:?} is not a block format"),
                };
                o[..N].copy_from_slice(&v);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::tests::rand_vec;
    use crate::dtype::ggml;

    fn round_trip<T: Level>() {
        let x = rand_vec(256, 1);
        let mut q: Vec<QBlock<T>> = Vec::new();
        quantize_rows(&x, 256, &mut q);
        assert_eq!(q.len(), 8);
        for (i, &v) in x.iter().enumerate() {
            let b = &q[i / 32];
            assert!((b.q[i % 32].int() as f32 * b.d - v).abs() <= b.d * 0.5 + 1e-7);
        }
        for (b, c) in q.iter().zip(x.chunks_exact(32)) {
            assert_eq!(b.d, c.iter().fold(0f32, |m, v| m.max(v.abs())) / T::MAX);
        }
        for b in &q {
            let s: [i32; 2] =
                std::array::from_fn(|h| b.q[16 * h..16 * h + 16].iter().map(|v| v.int()).sum());
            assert_eq!(b.dh, [b.d * s[0] as f32, b.d * s[1] as f32]);
            assert_eq!(b.ds, b.d * (s[0] + s[1]) as f32);
        }
        // A zero block has a zero scale and no NaN.
        quantize_rows(&[0.0; 32], 32, &mut q);
        assert_eq!((q[0].d, q[0].ds, q[0].dh), (0.0, 0.0, [0.0; 2]));
        assert!(q[0].q.iter().all(|v| v.int() == 0));
    }

    #[test]
    fn quantized_rows_round_trip_within_half_a_step() {
        round_trip::<i8>();
        round_trip::<i16>();
    }

    /// Every covered format, with 8- and 16-bit activations: the integer kernel equals the
    /// f64 dot of the decoded weights with the dequantized activations (up to f32
    /// rounding), and a row's result is the same bits at every batch size.
    #[test]
    fn integer_dots_match_the_reference_and_do_not_depend_on_the_batch() {
        integer_dots::<i8>(gemv_rows);
        integer_dots::<i16>(gemv_rows16);
    }

    /// Where the 8-bit kernels take VNNI, the AVX2 pair gives the same bits (for 16-bit
    /// activations both are the same code).
    fn same_bits_without_vnni<T: Level>(
        dtype: DType,
        w: &[u8],
        rb: usize,
        xq: &[QBlock<T>],
        k: usize,
        all: &[[f32; ROWS_MAX]],
    ) {
        if !vnni() || T::MAX > 1000.0 {
            return;
        }
        // The blocks are i8 here (T is i8 whenever T::MAX is 127).
        // SAFETY: QBlock<i8> is QBlock<T> for T = i8: same layout.
        let x8: &[Q8Block] =
            unsafe { std::slice::from_raw_parts(xq.as_ptr() as *const Q8Block, xq.len()) };
        let rows: Vec<&[Q8Block]> = x8.chunks_exact(k / 32).collect();
        let mut plain = vec![[0f32; ROWS_MAX]; all.len()];
        gemv_rows_with(false, dtype, w, rb, &rows, &mut plain);
        for (j, (a, b)) in all.iter().zip(&plain).enumerate() {
            assert_eq!(
                a.map(f32::to_bits),
                b.map(f32::to_bits),
                "{dtype:?} row {j}: VNNI vs AVX2"
            );
        }
    }

    /// The largest products any format makes (q8_0's -128 against activations of +-127)
    /// are exact through both dots: no saturation in `maddubs`, so VNNI agrees with it.
    #[test]
    fn the_largest_products_are_exact_with_and_without_vnni() {
        if !covers(DType::Q8_0) {
            eprintln!("SKIPPED: no AVX2 on this CPU");
            return;
        }
        let k = 64;
        let mut w = Vec::new();
        for _ in 0..k / 32 {
            w.extend_from_slice(&half::f16::from_f32(1.0).to_le_bytes());
            w.extend_from_slice(&[0x80u8; 32]);
        }
        for sign in [1i8, -1] {
            let mut b = Q8Block {
                d: 1.0,
                ..Q8Block::default()
            };
            b.q = [127 * sign; 32];
            let x = vec![b; k / 32];
            let want = -128.0 * 127.0 * sign as f32 * k as f32;
            for vnni in [true, false] {
                let mut out = vec![[0f32; ROWS_MAX]; 1];
                gemv_rows_with(vnni, DType::Q8_0, &w, w.len(), &[&x], &mut out);
                assert_eq!(out[0][0], want);
            }
        }
        eprintln!("VNNI on this CPU: {}", vnni());
    }

    fn integer_dots<T: Level>(kernel: IntKernel<QBlock<T>>) {
        for dtype in crate::dtype::ALL_DTYPES
            .into_iter()
            .filter(|t| t.is_quantized())
        {
            if !covers(dtype) {
                eprintln!("SKIPPED {dtype:?}: no AVX2 on this CPU");
                continue;
            }
            let (k, m) = (256usize, 7usize);
            let rb = dtype.row_bytes(k as u64).unwrap() as usize;
            let random = &mut crate::util::rng::Rng::new(5).into_fn();
            let w = ggml::sample_blocks(dtype, m * k / dtype.block_elems() as usize, random);
            let xs = rand_vec(ROWS_MAX * k, 9);
            let mut xq: Vec<QBlock<T>> = Vec::new();
            quantize_rows(&xs, k, &mut xq);
            let rows: Vec<&[QBlock<T>]> = xq.chunks_exact(k / 32).collect();
            let mut all = vec![[0f32; ROWS_MAX]; m];
            kernel(dtype, &w, rb, &rows, &mut all);
            same_bits_without_vnni(dtype, &w, rb, &xq, k, &all);
            for n in 1..=ROWS_MAX {
                for r0 in 0..=(ROWS_MAX - n) {
                    let mut part = vec![[0f32; ROWS_MAX]; m];
                    kernel(dtype, &w, rb, &rows[r0..r0 + n], &mut part);
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
            let mut worst = 0f64;
            for j in 0..m {
                for r in 0..ROWS_MAX {
                    let want = reference_dot(dtype, &w[j * rb..(j + 1) * rb], rows[r]);
                    let got = all[j][r] as f64;
                    worst = worst.max((got - want).abs() / (1.0 + want.abs()));
                    assert!(
                        (got - want).abs() <= 1e-4 * (1.0 + want.abs()),
                        "{dtype:?} row {j} x {r}: {got} vs {want}"
                    );
                }
            }
            // And the quantization error itself, against f32 activations: 16 bits are
            // much closer than 8.
            let mut err = 0f64;
            let mut vals = vec![0f32; k];
            for j in 0..m {
                ggml::dequantize(dtype, &w[j * rb..(j + 1) * rb], &mut vals).unwrap();
                for r in 0..ROWS_MAX {
                    let exact: f64 = vals
                        .iter()
                        .zip(&xs[r * k..])
                        .map(|(&a, &b)| a as f64 * b as f64)
                        .sum();
                    let scale: f64 = vals
                        .iter()
                        .zip(&xs[r * k..])
                        .map(|(&a, &b)| (a as f64 * b as f64).abs())
                        .sum();
                    err = err.max((all[j][r] as f64 - exact).abs() / scale.max(1e-30));
                }
            }
            let bound = if T::MAX > 1000.0 { 3e-5 } else { 5e-3 };
            assert!(
                err <= bound,
                "{dtype:?} {}-bit: error {err:e} of the absolute sum (bound {bound:e})",
                if T::MAX > 1000.0 { 16 } else { 8 }
            );
            eprintln!(
                "{dtype:?} {:>2}-bit: kernel vs f64 {worst:.1e}, quantization error {err:.1e}",
                if T::MAX > 1000.0 { 16 } else { 8 }
            );
        }
    }
}
