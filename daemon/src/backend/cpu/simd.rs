//! The AVX2 helpers the GEMV kernels (`gemv.rs`) and the K-quant kernels (`kquant.rs`)
//! share: a half-precision scalar, a horizontal sum, one block's 32 products. Each is
//! `unsafe` for the CPU features it needs, which its callers check once at dispatch, with
//! `has_avx2` (every kernel file's run-time check).

use std::arch::x86_64::*;

/// Whether this CPU has AVX2, FMA and F16C (the AVX2 kernels' features), checked once.
#[inline]
pub(in crate::backend::cpu) fn has_avx2() -> bool {
    static HAS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *HAS.get_or_init(|| {
        is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c")
    })
}

/// # Safety
/// The CPU supports F16C. (`b[at..at + 2]` is bounds-checked.)
#[inline(always)]
pub(in crate::backend::cpu) unsafe fn f16_scalar(b: &[u8], at: usize) -> f32 {
    // SAFETY: this function's contract, which its caller upholds.
    unsafe {
        _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(
            u16::from_le_bytes([b[at], b[at + 1]]) as i32,
        )))
    }
}

/// # Safety
/// The CPU supports AVX.
#[inline(always)]
pub(in crate::backend::cpu) unsafe fn hsum256(v: __m256) -> f32 {
    // SAFETY: this function's contract, which its caller upholds.
    unsafe {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_movehdup_ps(s));
        _mm_cvtss_f32(s)
    }
}

/// The 32 products of one unpacked block (four vectors of eight weights) with x, in the
/// one order every kernel uses, so one-row and four-row results agree bit for bit.
///
/// # Safety
/// The CPU supports AVX2 and FMA; `xb` points at 32 readable f32.
#[inline(always)]
pub(in crate::backend::cpu) unsafe fn dot32(w: &[__m256; 4], xb: *const f32) -> __m256 {
    // SAFETY: this function's contract, which its caller upholds.
    unsafe {
        let mut s = _mm256_mul_ps(w[0], _mm256_loadu_ps(xb));
        s = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xb.add(8)), s);
        s = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xb.add(16)), s);
        _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xb.add(24)), s)
    }
}
