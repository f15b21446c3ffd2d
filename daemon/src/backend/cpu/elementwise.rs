//! Element-wise ops: `exp_f32` from plain arithmetic (so a loop of it vectorizes), `map1`
//! and `map2` (compiled for AVX2 too, with the same bits), the activations built on them
//! (`silu`, `gelu_tanh`), and `CpuBackend::elementwise`, which runs a gate's product
//! across the team at prefill sizes.

#[cfg(target_arch = "x86_64")]
use crate::backend::cpu::simd::has_avx2;
use crate::backend::cpu::{CpuBackend, CpuMem, SharedPtr};

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

/// GELU with the tanh approximation, as transformers' `gelu_pytorch_tanh`:
/// 0.5 x (1 + tanh(u)), u = sqrt(2 / pi) (x + 0.044715 x^3), written as the equal
/// x / (1 + e^(-2u)), which loses nothing where tanh(u) nears -1 and vectorizes
/// (`exp_f32`).
#[inline(always)]
pub fn gelu_tanh(x: f32) -> f32 {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    x / (1.0 + exp_f32(-2.0 * SQRT_2_OVER_PI * (x + 0.044715 * x * x * x)))
}

/// SiLU: x / (1 + e^-x).
#[inline(always)]
pub fn silu(x: f32) -> f32 {
    x / (1.0 + exp_f32(-x))
}

impl CpuBackend {
    /// `x[i] = f(x[i], y[i])` for the first `n` elements, in pieces across the pool where
    /// `n` is a prefill's worth (an activation's exp or tanh costs more than its memory
    /// traffic); element by element, so the split does not change a bit.
    pub(super) fn elementwise(
        &self,
        x: &mut CpuMem,
        y: &CpuMem,
        n: usize,
        f: impl Fn(f32, f32) -> f32 + Sync,
    ) {
        const PIECE: usize = 16 * 1024;
        let (xs, ys) = (&mut x.f32s_mut()[..n], &y.f32s()[..n]);
        if n < 2 * PIECE || self.threads == 1 {
            map2(xs, ys, f);
            return;
        }
        let xp = SharedPtr(xs.as_mut_ptr());
        self.run(|par| {
            par.for_each(n.div_ceil(PIECE), |c| {
                let (i0, i1) = (c * PIECE, ((c + 1) * PIECE).min(n));
                // SAFETY: piece c is elements i0..i1 only; pieces are disjoint.
                let xc = unsafe { xp.slice(i0, i1 - i0) };
                map2(xc, &ys[i0..i1], &f);
            });
        });
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    /// `map2`'s loop with AVX2 enabled, `f` inlined into it.
    ///
    /// # Safety
    /// AVX2.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn map2(x: &mut [f32], y: &[f32], f: impl Fn(f32, f32) -> f32) {
        x.iter_mut().zip(y).for_each(|(a, &b)| *a = f(*a, b));
    }

    /// `map1`'s loop with AVX2 enabled.
    ///
    /// # Safety
    /// AVX2.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn map1(x: &mut [f32], f: impl Fn(f32) -> f32) {
        x.iter_mut().for_each(|a| *a = f(*a));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
