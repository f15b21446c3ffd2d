//! The attention kernels: q . k and o += w v over KV-cache rows (f32 or f16), a row or
//! four at a time, and the grouped forms that read each key and value once for the query
//! heads of one KV head (up to `GROUP_MAX` at once). Scalar forms, and AVX2 ones (`avx2`,
//! F16C widening the f16 rows) chosen at run time. The f32 forms (`--exact`) keep the bits
//! of the one-key scalar forms `dot_f32` and `axpy_f32` however many rows they take.
//! The ops that use them are in `attention/mod.rs`.

#[cfg(target_arch = "x86_64")]
use crate::backend::cpu::simd::has_avx2;

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

#[cfg(target_arch = "x86_64")]
mod avx2 {
    //! The attention kernels with AVX2 (FMA and F16C for the f16 rows): eight lanes a
    //! vector, each key or value loaded once for the rows or heads that use it.
    use super::lanes_sum;
    use std::arch::x86_64::*;

    /// # Safety
    /// AVX2, FMA and F16C; `q` and `k` have equal lengths.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn dot_f16(q: &[f32], k: &[u16]) -> f32 {
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
    pub(super) unsafe fn group_scores_f16<const G: usize, const KB: usize>(
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
    pub(super) unsafe fn group_pv_f16<const G: usize>(
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
    pub(super) unsafe fn group_scores_f32<const G: usize, const KB: usize>(
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
    pub(super) unsafe fn group_pv_f32<const G: usize>(
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
    pub(super) unsafe fn dot4_f16(q: &[f32], k: &[u16], at: [usize; 4]) -> [f32; 4] {
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
    pub(super) unsafe fn axpy4_f16(w: [f32; 4], v: &[u16], at: [usize; 4], o: &mut [f32]) {
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
    pub(super) unsafe fn dot4_f32(q: &[f32], k: &[f32], at: [usize; 4]) -> [[f32; 8]; 4] {
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
    pub(super) unsafe fn axpy4_f32(w: [f32; 4], v: &[f32], at: [usize; 4], o: &mut [f32]) {
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
    pub(super) unsafe fn axpy_f16(w: f32, v: &[u16], o: &mut [f32]) {
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
}
