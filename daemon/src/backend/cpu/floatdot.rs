//! Float weights (f32, f16, bf16) on the decode path: dot products of up to four
//! activation rows (eight where the CPU has AVX-512) against each weight row, every weight
//! loaded and widened once for all of them (f16 by F16C's `vcvtph2ps`, bf16 by a 16-bit
//! shift), and their conversion to f32 for the prefill tiles.
//!
//! Groups of eight need 16 accumulators beside the weights, more than AVX2's 16 vector
//! registers hold; AVX-512VL gives 256-bit operations 32. So on such a CPU the same 256-bit
//! kernel is compiled once more with AVX-512VL enabled and takes groups of five to eight:
//! each weight is read and widened once for eight rows instead of twice for two groups of
//! four. The arithmetic is the same instructions in the same order, so the bits are too.
//! (512-bit operations were measured slower on Zen 4 at batch 1, which splits them into
//! halves and stalls on the wider loads, and would change a row's summation order.)
//!
//! A row's number does not depend on the rows beside it: whatever the group, an output is
//! its weight row against its activation row in 16-element steps into two accumulators
//! (elements 0-7 and 8-15 of each step), added, summed across lanes in `hsum256`'s order,
//! then the tail (k not a multiple of 16) added element by element. One row alone and the
//! same row among four give the same bits, as speculative verification needs.
//!
//! Activations stay f32 on the default path and under `--exact` alike: a 16-bit weight is
//! two bytes an element to read whatever the activations, and at batch 1 the read, not the
//! arithmetic, bounds the step.

use super::simd::hsum256;
use crate::dtype::DType;
use std::arch::x86_64::*;

/// How far ahead of the weights being read they are prefetched.
const PREFETCH_BYTES: usize = 512;

/// Activation rows one pass over a weight row serves at most, on any CPU.
pub(super) const ROWS: usize = 8;

/// Activation rows the AVX2 register file serves in one pass.
const ROWS_AVX2: usize = 4;

/// Whether this CPU has AVX-512F and AVX-512VL (32 vector registers for 256-bit
/// operations), checked once.
fn has_avx512vl() -> bool {
    static HAS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *HAS.get_or_init(|| is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512vl"))
}

/// Activation rows one pass over a weight row serves on this CPU: eight with AVX-512VL,
/// four with AVX2 alone.
pub(super) fn rows() -> usize {
    if has_avx512vl() {
        ROWS
    } else {
        ROWS_AVX2
    }
}

/// Whether `dtype` is a float format these kernels take.
pub(super) fn covers(dtype: DType) -> bool {
    matches!(dtype, DType::F32 | DType::F16 | DType::BF16)
}

/// A float weight format: its element size and how eight elements widen to f32.
trait Float {
    const BYTES: usize;
    /// # Safety
    /// The CPU supports AVX2 and F16C; `p` points at `8 * BYTES` readable bytes.
    unsafe fn load8(p: *const u8) -> __m256;
    fn scalar(b: &[u8]) -> f32;
}

struct F32;
struct F16;
struct Bf16;

impl Float for F32 {
    const BYTES: usize = 4;
    #[inline(always)]
    unsafe fn load8(p: *const u8) -> __m256 {
        // SAFETY: this function's contract, which its caller upholds.
        unsafe { _mm256_loadu_ps(p as *const f32) }
    }
    #[inline(always)]
    fn scalar(b: &[u8]) -> f32 {
        f32::from_le_bytes([b[0], b[1], b[2], b[3]])
    }
}

impl Float for F16 {
    const BYTES: usize = 2;
    #[inline(always)]
    unsafe fn load8(p: *const u8) -> __m256 {
        // SAFETY: this function's contract, which its caller upholds.
        unsafe { _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i)) }
    }
    #[inline(always)]
    fn scalar(b: &[u8]) -> f32 {
        half::f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32()
    }
}

impl Float for Bf16 {
    const BYTES: usize = 2;
    #[inline(always)]
    unsafe fn load8(p: *const u8) -> __m256 {
        // SAFETY: this function's contract, which its caller upholds.
        unsafe {
            let h = _mm256_cvtepu16_epi32(_mm_loadu_si128(p as *const __m128i));
            _mm256_castsi256_ps(_mm256_slli_epi32(h, 16))
        }
    }
    #[inline(always)]
    fn scalar(b: &[u8]) -> f32 {
        f32::from_bits((u16::from_le_bytes([b[0], b[1]]) as u32) << 16)
    }
}

/// Weight row `w` (k elements of `W`) against the `N` activation rows `xs`.
///
/// # Safety
/// The CPU supports AVX2, FMA and F16C; `w` holds k elements and each `xs[r]` k f32.
#[inline(always)]
unsafe fn dot<W: Float, const N: usize>(w: &[u8], xs: &[&[f32]; N], k: usize) -> [f32; N] {
    // SAFETY: this function's contract, which its caller upholds; every pointer below stays
    // inside `w` (k * BYTES bytes) or an `xs[r]` (k f32), as the loop bound k16 <= k keeps.
    unsafe {
        debug_assert!(w.len() >= k * W::BYTES && xs.iter().all(|x| x.len() >= k));
        let k16 = k / 16 * 16;
        let mut acc = [[_mm256_setzero_ps(); 2]; N];
        let wp = w.as_ptr();
        let mut i = 0;
        while i < k16 {
            // The weights stream from memory once: ask for them a few lines ahead.
            _mm_prefetch::<_MM_HINT_T0>(wp.add(i * W::BYTES + PREFETCH_BYTES) as *const i8);
            let w0 = W::load8(wp.add(i * W::BYTES));
            let w1 = W::load8(wp.add((i + 8) * W::BYTES));
            for r in 0..N {
                let x = xs[r].as_ptr().add(i);
                acc[r][0] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x), acc[r][0]);
                acc[r][1] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x.add(8)), acc[r][1]);
            }
            i += 16;
        }
        // A loop, not `array::from_fn`: a closure would not inherit the caller's target
        // features, and the intrinsics in it would become calls.
        let mut out = [0f32; N];
        for r in 0..N {
            let mut s = hsum256(_mm256_add_ps(acc[r][0], acc[r][1]));
            for j in k16..k {
                s = W::scalar(&w[j * W::BYTES..]).mul_add(xs[r][j], s);
            }
            out[r] = s;
        }
        out
    }
}

/// `res[j][r] = dot(weight row j, xs[r])` for the weight rows of `w` (`rb` bytes each).
///
/// # Safety
/// The CPU supports AVX2, FMA and F16C; as `dot`.
#[inline(always)]
unsafe fn rows_of<W: Float, const N: usize, const R: usize>(
    w: &[u8],
    rb: usize,
    xs: &[&[f32]; N],
    res: &mut [[f32; R]],
) {
    let k = rb / W::BYTES;
    for (row, o) in w.chunks_exact(rb).zip(res.iter_mut()) {
        // SAFETY: this function's contract; a row holds k elements.
        o[..N].copy_from_slice(&unsafe { dot::<W, N>(row, xs, k) });
    }
}

/// `rows_of` for `dtype`'s element type, inlined into each caller's target features.
///
/// # Safety
/// As `rows_of`.
#[inline(always)]
unsafe fn rows_typed<const N: usize, const R: usize>(
    dtype: DType,
    w: &[u8],
    rb: usize,
    xs: &[&[f32]; N],
    res: &mut [[f32; R]],
) {
    // SAFETY: this function's contract, which its caller upholds.
    unsafe {
        match dtype {
            DType::F32 => rows_of::<F32, N, R>(w, rb, xs, res),
            DType::F16 => rows_of::<F16, N, R>(w, rb, xs, res),
            DType::BF16 => rows_of::<Bf16, N, R>(w, rb, xs, res),
            _ => unreachable!("float weights only (covers)"),
        }
    }
}

/// # Safety
/// The CPU supports AVX2, FMA and F16C; each `xs[r]` holds a weight row's elements.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn rows_n<const N: usize, const R: usize>(
    dtype: DType,
    w: &[u8],
    rb: usize,
    xs: &[&[f32]; N],
    res: &mut [[f32; R]],
) {
    // SAFETY: this function's contract, which its caller upholds.
    unsafe { rows_typed::<N, R>(dtype, w, rb, xs, res) }
}

/// `rows_n` with AVX-512VL's 32 registers, for groups of five to eight rows: the same
/// instructions in the same order.
///
/// # Safety
/// The CPU supports AVX2, FMA, F16C, AVX-512F and AVX-512VL; as `rows_n`.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl")]
unsafe fn rows_wide<const N: usize, const R: usize>(
    dtype: DType,
    w: &[u8],
    rb: usize,
    xs: &[&[f32]; N],
    res: &mut [[f32; R]],
) {
    // SAFETY: this function's contract, which its caller upholds.
    unsafe { rows_typed::<N, R>(dtype, w, rb, xs, res) }
}

/// `res[j][r]` = weight row j of `w` (`rb` bytes each, float `dtype`) against activation
/// row `xs[r]`, for the 1 to `rows()` rows of `xs` (`res` rows at least that wide). Needs
/// AVX2, FMA and F16C (`has_avx2`), and AVX-512VL for more than four rows.
pub(super) fn gemv_rows<const R: usize>(
    dtype: DType,
    w: &[u8],
    rb: usize,
    xs: &[&[f32]],
    res: &mut [[f32; R]],
) {
    assert!(
        xs.len() <= R,
        "result rows of {R} for {} activation rows",
        xs.len()
    );
    assert!(
        covers(dtype) && super::simd::has_avx2(),
        "float weights on AVX2"
    );
    let k = rb / dtype.block_bytes() as usize;
    assert!(xs.iter().all(|x| x.len() >= k), "activation rows of {k}");
    assert!(
        (1..=rows()).contains(&xs.len()),
        "1 to {} activation rows on this CPU, not {}",
        rows(),
        xs.len()
    );
    // SAFETY: AVX2, FMA and F16C present (asserted), AVX-512VL for more than four rows
    // (rows() is four without it, asserted); rows of k elements (asserted).
    unsafe {
        match *xs {
            [a] => rows_n::<1, R>(dtype, w, rb, &[a], res),
            [a, b] => rows_n::<2, R>(dtype, w, rb, &[a, b], res),
            [a, b, c] => rows_n::<3, R>(dtype, w, rb, &[a, b, c], res),
            [a, b, c, d] => rows_n::<4, R>(dtype, w, rb, &[a, b, c, d], res),
            [a, b, c, d, e] => rows_wide::<5, R>(dtype, w, rb, &[a, b, c, d, e], res),
            [a, b, c, d, e, f] => rows_wide::<6, R>(dtype, w, rb, &[a, b, c, d, e, f], res),
            [a, b, c, d, e, f, g] => rows_wide::<7, R>(dtype, w, rb, &[a, b, c, d, e, f, g], res),
            [a, b, c, d, e, f, g, h] => {
                rows_wide::<8, R>(dtype, w, rb, &[a, b, c, d, e, f, g, h], res)
            }
            _ => unreachable!("1 to {ROWS} rows (asserted)"),
        }
    }
}

/// `out[j]` = weight row j of `w` against the one activation row `x`: the arithmetic of
/// `gemv_rows` for one row.
///
/// # Safety
/// The CPU supports AVX2, FMA and F16C; `x` holds a weight row's elements.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn gemv(dtype: DType, w: &[u8], rb: usize, x: &[f32], out: &mut [f32]) {
    #[inline(always)]
    unsafe fn each<W: Float>(w: &[u8], rb: usize, x: &[f32], out: &mut [f32]) {
        let k = rb / W::BYTES;
        for (row, o) in w.chunks_exact(rb).zip(out.iter_mut()) {
            // SAFETY: the caller's contract; a row holds k elements.
            *o = unsafe { dot::<W, 1>(row, &[x], k) }[0];
        }
    }
    // SAFETY: this function's contract, which its caller upholds.
    unsafe {
        match dtype {
            DType::F32 => each::<F32>(w, rb, x, out),
            DType::F16 => each::<F16>(w, rb, x, out),
            DType::BF16 => each::<Bf16>(w, rb, x, out),
            _ => unreachable!("float weights only (covers)"),
        }
    }
}

/// Token rows and weight rows one prefill micro-kernel call covers (12 accumulators).
const MR: usize = 4;
const NR: usize = 3;

/// The `M` x `N` block of `out` (row stride `ldo`) at token rows `x` and tile rows `w`,
/// k f32 each (rows k apart): one 8-lane accumulator per output, summed
/// across lanes in `hsum256`'s order, then the tail element by element. An output's
/// arithmetic does not depend on the block it is computed in.
///
/// # Safety
/// The CPU supports AVX2 and FMA; the rows hold k f32 and `out` the block.
#[inline(always)]
#[allow(clippy::needless_range_loop)] // register arrays indexed by constant bounds
unsafe fn block<const M: usize, const N: usize>(
    x: *const f32,
    w: *const f32,
    k: usize,
    out: *mut f32,
    ldo: usize,
) {
    // SAFETY: this function's contract; p + 8 <= k8 <= k inside every row.
    unsafe {
        let k8 = k / 8 * 8;
        let mut acc = [[_mm256_setzero_ps(); N]; M];
        let mut p = 0;
        while p < k8 {
            let mut wv = [_mm256_setzero_ps(); N];
            for j in 0..N {
                wv[j] = _mm256_loadu_ps(w.add(j * k + p));
            }
            for i in 0..M {
                let xv = _mm256_loadu_ps(x.add(i * k + p));
                for j in 0..N {
                    acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);
                }
            }
            p += 8;
        }
        for i in 0..M {
            for j in 0..N {
                let mut s = hsum256(acc[i][j]);
                for q in k8..k {
                    s = (*x.add(i * k + q)).mul_add(*w.add(j * k + q), s);
                }
                *out.add(i * ldo + j) = s;
            }
        }
    }
}

/// `block` for the `m` x `n` (at most MR x NR) left at an edge.
///
/// # Safety
/// As `block`.
#[inline(always)]
unsafe fn edge_block(
    (m, n): (usize, usize),
    x: *const f32,
    w: *const f32,
    k: usize,
    out: *mut f32,
    ldo: usize,
) {
    // SAFETY: the caller's contract.
    unsafe {
        macro_rules! go {
            ($($mm:literal, $nn:literal);*) => {
                match (m, n) {
                    $(($mm, $nn) => block::<$mm, $nn>(x, w, k, out, ldo),)*
                    _ => unreachable!("blocks of at most {MR} x {NR}"),
                }
            };
        }
        go!(1, 1; 1, 2; 1, 3; 2, 1; 2, 2; 2, 3; 3, 1; 3, 2; 3, 3; 4, 1; 4, 2; 4, 3)
    }
}

/// # Safety
/// The CPU supports AVX2 and FMA; as `tile_product`'s asserts.
#[target_feature(enable = "avx2,fma")]
unsafe fn tile_product_avx2(
    x: &[f32],
    (t, k): (usize, usize),
    tile: &[f32],
    nb: usize,
    out: *mut f32,
    ldo: usize,
) {
    // SAFETY: this function's contract: every block lies inside x, the tile and out.
    unsafe {
        for i0 in (0..t).step_by(MR) {
            let m = (t - i0).min(MR);
            for j0 in (0..nb).step_by(NR) {
                let n = (nb - j0).min(NR);
                let (xp, wp, op) = (
                    x.as_ptr().add(i0 * k),
                    tile.as_ptr().add(j0 * k),
                    out.add(i0 * ldo + j0),
                );
                if (m, n) == (MR, NR) {
                    block::<MR, NR>(xp, wp, k, op, ldo);
                } else {
                    edge_block((m, n), xp, wp, k, op, ldo);
                }
            }
        }
    }
}

/// Prefill rows against a tile of weights already in f32: `out[i * ldo + j]` = token row
/// i of `x` (t rows of k) against tile row j (nb rows of k), for every i and j. Each
/// output's arithmetic is the same whatever t, nb or the block it falls in. Needs AVX2
/// and FMA (`has_avx2`).
///
/// # Safety
/// `out` points at t rows of stride `ldo` with room for nb outputs each, which no one else
/// writes meanwhile.
pub(super) unsafe fn tile_product(
    x: &[f32],
    (t, k): (usize, usize),
    tile: &[f32],
    nb: usize,
    out: *mut f32,
    ldo: usize,
) {
    assert!(super::simd::has_avx2(), "tile_product needs AVX2 and FMA");
    assert!(
        x.len() >= t * k && tile.len() >= nb * k && nb <= ldo,
        "tile product shapes"
    );
    // SAFETY: AVX2 and FMA present, shapes asserted; `out` is the caller's contract.
    unsafe { tile_product_avx2(x, (t, k), tile, nb, out, ldo) }
}

/// Whether this CPU has AVX-512 with the bf16 dot product (`vdpbf16ps`), checked once.
pub(super) fn has_avx512_bf16() -> bool {
    static HAS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *HAS.get_or_init(|| {
        is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512bw")
            && is_x86_feature_detected!("avx512bf16")
    })
}

/// Token rows `tile_product_bf16` converts to bf16 at a time.
const BF16_ROWS: usize = 32;

/// The f32 of scratch `tile_product_bf16` needs for rows of k.
pub(super) fn bf16_scratch_f32s(k: usize) -> usize {
    BF16_ROWS * k.div_ceil(32) * 32 / 2
}

/// The `M` x `N` block of `out` (row stride `ldo`) at bf16 token rows `x` (`kp` apart,
/// zero past k) and bf16 weight rows `w` (`rb` bytes apart, k each): one 16-lane
/// accumulator per output over 32-element steps of `vdpbf16ps` (the last step's weights
/// masked to k), summed by `_mm512_reduce_add_ps`. An output's arithmetic does not
/// depend on its block.
///
/// # Safety
/// The CPU supports AVX-512F/BW/BF16; the rows hold what is said above.
#[inline(always)]
#[allow(clippy::needless_range_loop)] // register arrays indexed by constant bounds
unsafe fn block_bf16<const M: usize, const N: usize>(
    x: *const u16,
    kp: usize,
    w: *const u8,
    rb: usize,
    k: usize,
    out: *mut f32,
    ldo: usize,
) {
    // SAFETY: this function's contract: full steps stay inside every row (p + 32 <= k for
    // weights; activations are padded to kp), the last weight step is masked to k.
    unsafe {
        let mut acc = [[_mm512_setzero_ps(); N]; M];
        let mut p = 0;
        while p < kp {
            let left = k - p;
            let mask: __mmask32 = if left >= 32 { !0 } else { (1u32 << left) - 1 };
            let zero: __m512bh = std::mem::transmute(_mm512_setzero_si512());
            let mut wv = [zero; N];
            for j in 0..N {
                let v = _mm512_maskz_loadu_epi16(mask, w.add(j * rb + 2 * p) as *const i16);
                wv[j] = std::mem::transmute::<__m512i, __m512bh>(v);
            }
            for i in 0..M {
                let xv: __m512bh =
                    std::mem::transmute(_mm512_loadu_si512(x.add(i * kp + p) as *const _));
                for j in 0..N {
                    acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv, wv[j]);
                }
            }
            p += 32;
        }
        for i in 0..M {
            for j in 0..N {
                *out.add(i * ldo + j) = _mm512_reduce_add_ps(acc[i][j]);
            }
        }
    }
}

/// # Safety
/// As `tile_product_bf16`, and the CPU supports AVX-512F/BW/BF16.
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
unsafe fn bf16_avx512(
    x: &[f32],
    (t, k): (usize, usize),
    (w, rb, nb): (&[u8], usize, usize),
    scratch: &mut [f32],
    out: *mut f32,
    ldo: usize,
) {
    let kp = k.div_ceil(32) * 32;
    // SAFETY: `scratch` holds BF16_ROWS * kp / 2 f32 (asserted by the caller), viewed as
    // twice as many u16 (a narrower alignment); the blocks below stay inside x, w and out.
    unsafe {
        let xb = std::slice::from_raw_parts_mut(scratch.as_mut_ptr() as *mut u16, BF16_ROWS * kp);
        for i0 in (0..t).step_by(BF16_ROWS) {
            let tb = (t - i0).min(BF16_ROWS);
            // The rows to bf16 (round to nearest even), zero past k.
            for i in 0..tb {
                let src = x.as_ptr().add((i0 + i) * k);
                for p in (0..kp).step_by(32) {
                    let m = |q: usize| -> __mmask16 {
                        let left = k.saturating_sub(p + q);
                        if left >= 16 {
                            !0
                        } else {
                            (1u16 << left) - 1
                        }
                    };
                    let lo = _mm512_maskz_loadu_ps(m(0), src.add(p.min(k)));
                    let hi = _mm512_maskz_loadu_ps(m(16), src.add((p + 16).min(k)));
                    let v: __m512i = std::mem::transmute(_mm512_cvtne2ps_pbh(hi, lo));
                    _mm512_storeu_si512(xb.as_mut_ptr().add(i * kp + p) as *mut _, v);
                }
            }
            for i in (0..tb).step_by(4) {
                let mr = (tb - i).min(4);
                for j0 in (0..nb).step_by(3) {
                    let nr = (nb - j0).min(3);
                    let (xp, wp, op) = (
                        xb.as_ptr().add(i * kp),
                        w.as_ptr().add(j0 * rb),
                        out.add((i0 + i) * ldo + j0),
                    );
                    macro_rules! go {
                        ($($mm:literal, $nn:literal);*) => {
                            match (mr, nr) {
                                $(($mm, $nn) => block_bf16::<$mm, $nn>(xp, kp, wp, rb, k, op, ldo),)*
                                _ => unreachable!("blocks of at most 4 x 3"),
                            }
                        };
                    }
                    go!(1, 1; 1, 2; 1, 3; 2, 1; 2, 2; 2, 3; 3, 1; 3, 2; 3, 3; 4, 1; 4, 2; 4, 3)
                }
            }
        }
    }
}

/// Prefill rows against bf16 weight rows, the activations rounded to bf16 (the default
/// path for bf16 weights; `--exact` keeps `tile_product`'s f32): `out[i * ldo + j]` =
/// token row i of `x` (t rows of k) against weight row j of `w` (nb rows of `rb` bytes),
/// by `vdpbf16ps`, two products a lane an instruction. Each output's arithmetic is the
/// same whatever t, nb or the block. `scratch` holds `bf16_scratch_f32s(k)` f32. Needs
/// `has_avx512_bf16`.
///
/// # Safety
/// `out` points at t rows of stride `ldo` with room for nb outputs each, which no one else
/// writes meanwhile.
pub(super) unsafe fn tile_product_bf16(
    x: &[f32],
    (t, k): (usize, usize),
    (w, rb, nb): (&[u8], usize, usize),
    scratch: &mut [f32],
    out: *mut f32,
    ldo: usize,
) {
    assert!(has_avx512_bf16(), "tile_product_bf16 needs AVX-512 BF16");
    assert!(
        x.len() >= t * k && rb >= 2 * k && w.len() >= nb * rb && nb <= ldo,
        "bf16 tile product shapes"
    );
    assert!(scratch.len() >= bf16_scratch_f32s(k), "bf16 scratch");
    // SAFETY: the features and shapes asserted; `out` is the caller's contract.
    unsafe { bf16_avx512(x, (t, k), (w, rb, nb), scratch, out, ldo) }
}

/// Widens f16 `src` into `out` (as many elements as `out` holds).
///
/// # Safety
/// The CPU supports AVX2 and F16C; `src` holds `2 * out.len()` bytes.
#[target_feature(enable = "avx2,f16c")]
unsafe fn widen_f16(src: &[u8], out: &mut [f32]) {
    let n8 = out.len() / 8 * 8;
    // SAFETY: this function's contract; i + 8 <= n8 <= out.len(), 2 bytes an element.
    unsafe {
        for i in (0..n8).step_by(8) {
            let v = F16::load8(src.as_ptr().add(2 * i));
            _mm256_storeu_ps(out.as_mut_ptr().add(i), v);
        }
    }
    for (i, o) in out.iter_mut().enumerate().skip(n8) {
        *o = F16::scalar(&src[2 * i..]);
    }
}

/// Converts rows of float `dtype` weights (`rb` bytes each, `cols` elements) into `out`,
/// f16 with F16C (the prefill tiles; bf16 and f32 the compiler vectorizes as they are).
/// Returns false for a format it does not convert (the caller's general path then does).
pub(super) fn widen_rows(dtype: DType, w: &[u8], rb: usize, cols: usize, out: &mut [f32]) -> bool {
    if dtype != DType::F16 || !super::simd::has_avx2() {
        return false;
    }
    for (row, o) in w.chunks_exact(rb).zip(out.chunks_exact_mut(cols)) {
        assert!(row.len() >= 2 * cols, "f16 rows of {cols}");
        // SAFETY: AVX2 and F16C present (checked); the row holds `cols` f16 (asserted).
        unsafe { widen_f16(row, o) };
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::tests::rand_vec;
    use half::{bf16, f16};

    fn encode(dtype: DType, v: &[f32]) -> (Vec<u8>, Vec<f64>) {
        match dtype {
            DType::F32 => (
                v.iter().flat_map(|x| x.to_le_bytes()).collect(),
                v.iter().map(|&x| x as f64).collect(),
            ),
            DType::F16 => (
                v.iter()
                    .flat_map(|&x| f16::from_f32(x).to_le_bytes())
                    .collect(),
                v.iter().map(|&x| f16::from_f32(x).to_f64()).collect(),
            ),
            _ => (
                v.iter()
                    .flat_map(|&x| bf16::from_f32(x).to_le_bytes())
                    .collect(),
                v.iter().map(|&x| bf16::from_f32(x).to_f64()).collect(),
            ),
        }
    }

    /// Every float format at 1, 3, 5 and 17 activation rows (groups of up to `rows()`, and
    /// rows past a multiple of 16 elements) against an f64 reference, and every row the
    /// same bits in its group as alone and through the one-row `gemv`.
    #[test]
    fn rows_match_f64_and_each_row_is_the_same_bits_alone() {
        if !crate::backend::cpu::simd::has_avx2() {
            eprintln!("SKIPPED: no AVX2/FMA/F16C on this CPU");
            return;
        }
        let m = 9;
        for (seed, k) in [(1u64, 64usize), (2, 37), (3, 576)] {
            for dtype in [DType::F32, DType::F16, DType::BF16] {
                let (w, wx) = encode(dtype, &rand_vec(m * k, seed));
                let rb = k * dtype.block_bytes() as usize;
                for n in [1usize, 3, 5, 17] {
                    let x = rand_vec(n * k, seed + 10);
                    let xr: Vec<&[f32]> = x.chunks_exact(k).collect();
                    let mut res = vec![[0f32; ROWS]; m];
                    let mut alone = vec![0f32; m];
                    for (g, group) in xr.chunks(rows()).enumerate() {
                        gemv_rows(dtype, &w, rb, group, &mut res);
                        for (i, xi) in group.iter().enumerate() {
                            let r = g * rows() + i;
                            // SAFETY: AVX2, FMA and F16C present (checked above).
                            unsafe { gemv(dtype, &w, rb, xi, &mut alone) };
                            for j in 0..m {
                                let want: f64 = (0..k).map(|c| xi[c] as f64 * wx[j * k + c]).sum();
                                let got = res[j][i];
                                assert!(
                                    (got as f64 - want).abs() <= 1e-5 * (1.0 + want.abs()),
                                    "{dtype} k {k} rows {n} [{r},{j}]: {got} vs {want}"
                                );
                                assert_eq!(
                                    got.to_bits(),
                                    alone[j].to_bits(),
                                    "{dtype} k {k}: row {r} in a group of {} vs alone",
                                    group.len()
                                );
                            }
                        }
                    }
                }
            }
        }
    }

    /// The prefill tile product against f64 at 1, 3, 5 and 17 token rows and tiles of 1
    /// to 7 rows (every edge block), k with and without a tail; each output the same bits
    /// computed alone.
    #[test]
    fn tile_products_match_f64_and_each_output_is_the_same_bits_alone() {
        if !crate::backend::cpu::simd::has_avx2() {
            eprintln!("SKIPPED: no AVX2/FMA/F16C on this CPU");
            return;
        }
        for k in [37usize, 64, 200] {
            let tile = rand_vec(7 * k, k as u64);
            for t in [1usize, 3, 5, 17] {
                let x = rand_vec(t * k, 100 + t as u64);
                for nb in 1..=7 {
                    let ldo = nb + 2;
                    let mut out = vec![f32::NAN; t * ldo];
                    // SAFETY: out holds t rows of ldo >= nb.
                    unsafe { tile_product(&x, (t, k), &tile, nb, out.as_mut_ptr(), ldo) };
                    for i in 0..t {
                        for j in 0..nb {
                            let want: f64 = (0..k)
                                .map(|c| x[i * k + c] as f64 * tile[j * k + c] as f64)
                                .sum();
                            let got = out[i * ldo + j];
                            assert!(
                                (got as f64 - want).abs() <= 1e-5 * (1.0 + want.abs()),
                                "k {k} t {t} nb {nb} [{i},{j}]: {got} vs {want}"
                            );
                            let mut one = [0f32];
                            let (xi, tj) = (&x[i * k..(i + 1) * k], &tile[j * k..(j + 1) * k]);
                            // SAFETY: one output.
                            unsafe { tile_product(xi, (1, k), tj, 1, one.as_mut_ptr(), 1) };
                            assert_eq!(one[0].to_bits(), got.to_bits(), "k {k} t {t} nb {nb}");
                        }
                    }
                }
            }
        }
    }

    /// The bf16 prefill product against f64 over bf16-rounded activations at 1, 3, 5, 17
    /// and 40 token rows (past a conversion block) and 1 to 7 weight rows, k with and
    /// without a tail; each output the same bits alone.
    #[test]
    fn bf16_tile_products_match_f64_and_each_output_is_the_same_bits_alone() {
        if !has_avx512_bf16() {
            eprintln!("SKIPPED: no AVX-512 BF16 on this CPU");
            return;
        }
        for k in [37usize, 64, 200] {
            let (w, wx) = encode(DType::BF16, &rand_vec(7 * k, k as u64));
            let rb = 2 * k;
            let mut scratch = vec![0f32; bf16_scratch_f32s(k)];
            for t in [1usize, 3, 5, 17, 40] {
                let x = rand_vec(t * k, 100 + t as u64);
                let xr: Vec<f64> = x.iter().map(|&v| bf16::from_f32(v).to_f64()).collect();
                for nb in 1..=7 {
                    let ldo = nb + 1;
                    let mut out = vec![f32::NAN; t * ldo];
                    // SAFETY: out holds t rows of ldo >= nb.
                    unsafe {
                        let o = out.as_mut_ptr();
                        tile_product_bf16(&x, (t, k), (&w, rb, nb), &mut scratch, o, ldo)
                    };
                    for i in 0..t {
                        for j in 0..nb {
                            let want: f64 = (0..k).map(|c| xr[i * k + c] * wx[j * k + c]).sum();
                            let got = out[i * ldo + j];
                            assert!(
                                (got as f64 - want).abs() <= 1e-5 * (1.0 + want.abs()),
                                "k {k} t {t} nb {nb} [{i},{j}]: {got} vs {want}"
                            );
                            let mut one = [0f32];
                            let (xi, wj) = (&x[i * k..(i + 1) * k], &w[j * rb..(j + 1) * rb]);
                            // SAFETY: one output.
                            unsafe {
                                let o = one.as_mut_ptr();
                                tile_product_bf16(xi, (1, k), (wj, rb, 1), &mut scratch, o, 1)
                            };
                            assert_eq!(one[0].to_bits(), got.to_bits(), "k {k} t {t} nb {nb}");
                        }
                    }
                }
            }
        }
    }

    /// f16 rows widen to the values the `half` crate gives, tails included.
    #[test]
    fn f16_rows_widen_exactly() {
        if !crate::backend::cpu::simd::has_avx2() {
            eprintln!("SKIPPED: no AVX2/FMA/F16C on this CPU");
            return;
        }
        let (rows, cols) = (3, 21);
        let (w, wx) = encode(DType::F16, &rand_vec(rows * cols, 7));
        let mut out = vec![0f32; rows * cols];
        assert!(widen_rows(DType::F16, &w, 2 * cols, cols, &mut out));
        for (o, x) in out.iter().zip(&wx) {
            assert_eq!(*o as f64, *x);
        }
        assert!(!widen_rows(DType::BF16, &w, 2 * cols, cols, &mut out));
    }
}
