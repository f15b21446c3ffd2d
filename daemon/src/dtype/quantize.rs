//! Quantizing f32 rows into GGML block formats, for `sluiced pack --quantize`: the
//! algorithms of ggml's reference quantizers (`quantize_row_*_ref`, what `llama-quantize`
//! runs without an importance matrix), written so that a row's blocks are byte for byte
//! what ggml writes: the same float operations in the same order, the same rounding
//! (`nearest_int`'s magic-number trick, `roundf`, truncation where ggml casts), f16 scales
//! rounded to nearest even. tests/tests/quants.rs checks every type against blocks that
//! ggml itself wrote (tests/fixtures/make_quantize_reference.py).
//!
//! - Q8_0, Q4_0, Q5_0: one scale a 32-block from its largest magnitude (kept signed for the
//!   4- and 5-bit ones, so the extreme value lands exactly on a level).
//! - Q4_1, Q5_1: scale and minimum from the block's range.
//! - Q4_K, Q5_K, Q2_K: per 32- (16-) element sub-block a scale and a minimum fitted by
//!   weighted least squares over a sweep of candidate scales (`make_qkx2`), then both
//!   quantized to 6 (4) bits against the super-block's largest.
//! - Q6_K, Q3_K: symmetric sub-block scales chosen by a sweep (`make_qx`) or by coordinate
//!   descent on the weighted error (`make_q3`), quantized to 8 (6) bits.

use super::DType;
use half::f16;

/// Whether `quantize_row` writes `t`.
pub fn can_quantize(t: DType) -> bool {
    matches!(
        t,
        DType::Q8_0
            | DType::Q4_0
            | DType::Q4_1
            | DType::Q5_0
            | DType::Q5_1
            | DType::Q2K
            | DType::Q3K
            | DType::Q4K
            | DType::Q5K
            | DType::Q6K
    )
}

/// Quantizes `x` (a whole number of `t`'s blocks of elements) into `out` (exactly its
/// blocks' bytes).
///
/// # Panics
/// If `t` is not one `can_quantize` takes, or the lengths do not match.
pub fn quantize_row(t: DType, x: &[f32], out: &mut [u8]) {
    let (be, bb) = (t.block_elems() as usize, t.block_bytes() as usize);
    assert!(can_quantize(t), "no quantizer writes {t}");
    assert!(
        x.len().is_multiple_of(be) && out.len() == x.len() / be * bb,
        "{} elements into {} bytes of {t}",
        x.len(),
        out.len()
    );
    for (xb, yb) in x.chunks_exact(be).zip(out.chunks_exact_mut(bb)) {
        match t {
            DType::Q8_0 => q8_0(xb, yb),
            DType::Q4_0 => q4_0(xb, yb),
            DType::Q5_0 => q5_0(xb, yb),
            DType::Q4_1 => q4_1(xb, yb),
            DType::Q5_1 => q5_1(xb, yb),
            DType::Q2K => q2_k(xb, yb),
            DType::Q3K => q3_k(xb, yb),
            DType::Q4K | DType::Q5K => q4_k_q5_k(t == DType::Q5K, xb, yb),
            DType::Q6K => q6_k(xb, yb),
            _ => unreachable!("checked by can_quantize"),
        }
    }
}

/// Below this largest magnitude a group is all zeros (ggml's GROUP_MAX_EPS).
const GROUP_MAX_EPS: f32 = 1e-15;

/// The integer nearest `v` (ties to even) for |v| < 2^22, by ggml's trick: adding 1.5 x
/// 2^23 puts the integer part in the mantissa's low bits. Outside that range it gives what
/// ggml gives, which its callers then clamp.
fn nearest_int(v: f32) -> i32 {
    let bits = (v + 12_582_912.0f32).to_bits() as i32;
    (bits & 0x007f_ffff) - 0x0040_0000
}

fn put_f16(b: &mut [u8], at: usize, v: f32) {
    b[at..at + 2].copy_from_slice(&f16::from_f32(v).to_le_bytes());
}

/// `v` rounded to f16 and back: a scale as the block stores it.
fn as_f16(v: f32) -> f32 {
    f16::from_f32(v).to_f32()
}

/// The element of largest magnitude, with its sign (the first of equals).
fn signed_max(x: &[f32]) -> f32 {
    let (mut amax, mut max) = (0f32, 0f32);
    for &v in x {
        if amax < v.abs() {
            amax = v.abs();
            max = v;
        }
    }
    max
}

/// Smallest and largest element.
fn range(x: &[f32]) -> (f32, f32) {
    let (mut min, mut max) = (f32::MAX, -f32::MAX);
    for &v in x {
        if v < min {
            min = v;
        }
        if v > max {
            max = v;
        }
    }
    (min, max)
}

fn inverse(d: f32) -> f32 {
    if d != 0.0 {
        1.0 / d
    } else {
        0.0
    }
}

/// Q8_0: f16 d, then 32 x i8.
fn q8_0(x: &[f32], y: &mut [u8]) {
    let amax = x
        .iter()
        .fold(0f32, |a, v| if a > v.abs() { a } else { v.abs() });
    let d = amax / 127.0;
    let id = inverse(d);
    put_f16(y, 0, d);
    for (q, v) in y[2..34].iter_mut().zip(x) {
        *q = (v * id).round() as i8 as u8;
    }
}

/// Q4_0: f16 d, then 16 bytes: element j in the low nibble of byte j, j + 16 in its high.
fn q4_0(x: &[f32], y: &mut [u8]) {
    let d = signed_max(x) / -8.0;
    let id = inverse(d);
    put_f16(y, 0, d);
    let q = |v: f32| ((v * id + 8.5) as i8).min(15) as u8;
    for j in 0..16 {
        y[2 + j] = q(x[j]) | (q(x[16 + j]) << 4);
    }
}

/// Q5_0: f16 d, 32 fifth bits (u32 LE), 16 bytes of low nibbles.
fn q5_0(x: &[f32], y: &mut [u8]) {
    let d = signed_max(x) / -16.0;
    let id = inverse(d);
    put_f16(y, 0, d);
    pack_q5(
        std::array::from_fn(|i| ((x[i] * id + 16.5) as i8).min(31) as u8),
        &mut y[2..22],
    );
}

/// The fifth bits (u32 LE) and nibbles of 32 five-bit values.
fn pack_q5(q: [u8; 32], y: &mut [u8]) {
    let mut qh = 0u32;
    for j in 0..16 {
        let (a, b) = (q[j], q[16 + j]);
        y[4 + j] = (a & 0x0F) | ((b & 0x0F) << 4);
        qh |= u32::from((a & 0x10) >> 4) << j;
        qh |= u32::from((b & 0x10) >> 4) << (j + 16);
    }
    y[..4].copy_from_slice(&qh.to_le_bytes());
}

/// Q4_1: f16 d, f16 min, 16 bytes of nibbles.
fn q4_1(x: &[f32], y: &mut [u8]) {
    let (min, max) = range(x);
    let d = (max - min) / 15.0;
    let id = inverse(d);
    put_f16(y, 0, d);
    put_f16(y, 2, min);
    let q = |v: f32| (((v - min) * id + 0.5) as i8).min(15) as u8;
    for j in 0..16 {
        y[4 + j] = q(x[j]) | (q(x[16 + j]) << 4);
    }
}

/// Q5_1: f16 d, f16 min, fifth bits, nibbles.
fn q5_1(x: &[f32], y: &mut [u8]) {
    let (min, max) = range(x);
    let d = (max - min) / 31.0;
    let id = inverse(d);
    put_f16(y, 0, d);
    put_f16(y, 2, min);
    pack_q5(
        std::array::from_fn(|i| ((x[i] - min) * id + 0.5) as u8),
        &mut y[4..24],
    );
}

/// `diff` as an error term: its magnitude (`mad`) or its square.
fn err(diff: f32, mad: bool) -> f32 {
    if mad {
        diff.abs()
    } else {
        diff * diff
    }
}

/// A sweep over candidate scales for `nmax`-level values with a minimum (ggml's
/// `make_qkx2_quants`): `l` gets the levels, the result is (scale, -min). Each candidate
/// scale (nmax + rmin + rdelta x step) / range picks levels; weighted least squares then
/// fits scale and minimum to them; the candidate with the smallest weighted error wins.
#[allow(clippy::too_many_arguments)] // ggml's parameters, in its order
fn make_qkx2(
    nmax: i32,
    x: &[f32],
    w: &[f32],
    l: &mut [u8],
    rmin: f32,
    rdelta: f32,
    nstep: i32,
    mad: bool,
) -> (f32, f32) {
    let n = x.len();
    let (mut min, mut max) = (x[0], x[0]);
    let mut sum_w = w[0];
    let mut sum_x = sum_w * x[0];
    for i in 1..n {
        if x[i] < min {
            min = x[i];
        }
        if x[i] > max {
            max = x[i];
        }
        sum_w += w[i];
        sum_x += w[i] * x[i];
    }
    if min > 0.0 {
        min = 0.0;
    }
    if max == min {
        l[..n].fill(0);
        return (0.0, -min);
    }
    let nmaxf = nmax as f32;
    let mut iscale = nmaxf / (max - min);
    let mut scale = 1.0 / iscale;
    let mut best = 0f32;
    for i in 0..n {
        let q = nearest_int(iscale * (x[i] - min)).clamp(0, nmax);
        l[i] = q as u8;
        best += w[i] * err(scale * q as f32 + min - x[i], mad);
    }
    if nstep < 1 {
        return (scale, -min);
    }
    let mut aux = [0u8; 32];
    for is in 0..=nstep {
        iscale = (rmin + rdelta * is as f32 + nmaxf) / (max - min);
        let (mut sum_l, mut sum_l2, mut sum_xl) = (0f32, 0f32, 0f32);
        for i in 0..n {
            let q = nearest_int(iscale * (x[i] - min)).clamp(0, nmax);
            aux[i] = q as u8;
            let qf = q as f32;
            sum_l += w[i] * qf;
            sum_l2 += w[i] * qf * qf;
            sum_xl += w[i] * qf * x[i];
        }
        let det = sum_w * sum_l2 - sum_l * sum_l;
        if det > 0.0 {
            let mut this_scale = (sum_w * sum_xl - sum_x * sum_l) / det;
            let mut this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det;
            if this_min > 0.0 {
                this_min = 0.0;
                this_scale = sum_xl / sum_l2;
            }
            let mut cur = 0f32;
            for i in 0..n {
                cur += w[i] * err(this_scale * aux[i] as f32 + this_min - x[i], mad);
            }
            if cur < best {
                l[..n].copy_from_slice(&aux[..n]);
                best = cur;
                scale = this_scale;
                min = this_min;
            }
        }
    }
    (scale, -min)
}

/// Symmetric levels -nmax..nmax-1 (stored + nmax in `l`) under a scale swept over
/// -(nmax + 0.1 step) / max, weighted by x^2 (ggml's `make_qx_quants`, rmse_type 1, no
/// importance weights); returns the scale.
fn make_qx(nmax: i32, x: &[f32], l: &mut [u8]) -> f32 {
    let max = signed_max(x);
    if max.abs() < GROUP_MAX_EPS {
        l[..x.len()].fill(0);
        return 0.0;
    }
    let level = |iscale: f32, v: f32| nearest_int(iscale * v).clamp(-nmax, nmax - 1);
    let sums = |iscale: f32| {
        let (mut sumlx, mut suml2) = (0f32, 0f32);
        for &v in x {
            let q = level(iscale, v) as f32;
            let w = v * v;
            sumlx += w * v * q;
            suml2 += w * q * q;
        }
        (sumlx, suml2)
    };
    let set = |iscale: f32, l: &mut [u8]| {
        for (o, &v) in l.iter_mut().zip(x) {
            *o = (nmax + level(iscale, v)) as u8;
        }
    };
    let iscale = -(nmax as f32) / max;
    set(iscale, l);
    let (sumlx, suml2) = sums(iscale);
    let mut scale = if suml2 != 0.0 { sumlx / suml2 } else { 0.0 };
    let mut best = scale * sumlx;
    for is in (-9..=9).filter(|&s| s != 0) {
        let iscale = -(nmax as f32 + 0.1 * is as f32) / max;
        let (sumlx, suml2) = sums(iscale);
        if suml2 > 0.0 && sumlx * sumlx > best * suml2 {
            set(iscale, l);
            scale = sumlx / suml2;
            best = scale * sumlx;
        }
    }
    scale
}

/// Symmetric levels -nmax..nmax-1 (stored + nmax) refined by coordinate descent on the
/// x^2-weighted error, five rounds at most (ggml's `make_q3_quants` with do_rmse);
/// returns the least-squares scale.
fn make_q3(nmax: i32, x: &[f32], l: &mut [u8]) -> f32 {
    let max = signed_max(x);
    if max.abs() < GROUP_MAX_EPS {
        l[..x.len()].fill(0);
        return 0.0;
    }
    let iscale = -(nmax as f32) / max;
    let mut lv = [0i32; 16];
    let (mut sumlx, mut suml2) = (0f32, 0f32);
    for (i, &v) in x.iter().enumerate() {
        let q = nearest_int(iscale * v).clamp(-nmax, nmax - 1);
        lv[i] = q;
        let w = v * v;
        sumlx += w * v * q as f32;
        suml2 += w * q as f32 * q as f32;
    }
    for _ in 0..5 {
        let mut changed = 0;
        for (i, &v) in x.iter().enumerate() {
            let w = v * v;
            let mut slx = sumlx - w * v * lv[i] as f32;
            if slx > 0.0 {
                let mut sl2 = suml2 - w * lv[i] as f32 * lv[i] as f32;
                let q = nearest_int(v * sl2 / slx).clamp(-nmax, nmax - 1);
                if q != lv[i] {
                    slx += w * v * q as f32;
                    sl2 += w * q as f32 * q as f32;
                    if sl2 > 0.0 && slx * slx * suml2 > sumlx * sumlx * sl2 {
                        lv[i] = q;
                        sumlx = slx;
                        suml2 = sl2;
                        changed += 1;
                    }
                }
            }
        }
        if changed == 0 {
            break;
        }
    }
    for (o, q) in l.iter_mut().zip(&lv[..x.len()]) {
        *o = (q + nmax) as u8;
    }
    if suml2 > 0.0 {
        sumlx / suml2
    } else {
        0.0
    }
}

/// Four 2-bit values a byte: for each 128 elements, byte l holds l, l + 32, l + 64, l + 96.
fn pack_2bit(l: &[u8; 256], qs: &mut [u8]) {
    for j in (0..256).step_by(128) {
        for i in 0..32 {
            qs[j / 4 + i] =
                l[j + i] | (l[j + i + 32] << 2) | (l[j + i + 64] << 4) | (l[j + i + 96] << 6);
        }
    }
}

/// Q2_K: scales[16] (low nibble scale, high nibble min), qs[64], f16 d, f16 dmin.
fn q2_k(x: &[f32], y: &mut [u8]) {
    let mut l = [0u8; 256];
    let (mut scales, mut mins) = ([0f32; 16], [0f32; 16]);
    let (mut max_scale, mut max_min) = (0f32, 0f32);
    for j in 0..16 {
        let xs = &x[16 * j..16 * j + 16];
        let w: [f32; 16] = std::array::from_fn(|i| xs[i].abs());
        let (s, m) = make_qkx2(3, xs, &w, &mut l[16 * j..], -0.5, 0.1, 15, true);
        (scales[j], mins[j]) = (s, m);
        if s > max_scale {
            max_scale = s;
        }
        if m > max_min {
            max_min = m;
        }
    }
    let sb = &mut y[..16];
    sb.fill(0);
    let d = if max_scale > 0.0 {
        let iscale = 15.0 / max_scale;
        for (o, s) in sb.iter_mut().zip(&scales) {
            *o = nearest_int(iscale * s) as u8;
        }
        max_scale / 15.0
    } else {
        0.0
    };
    let dmin = if max_min > 0.0 {
        let iscale = 15.0 / max_min;
        for (o, m) in sb.iter_mut().zip(&mins) {
            *o |= (nearest_int(iscale * m) << 4) as u8;
        }
        max_min / 15.0
    } else {
        0.0
    };
    let sb: [u8; 16] = std::array::from_fn(|j| y[j]);
    for j in 0..16 {
        let d = as_f16(d) * (sb[j] & 0x0F) as f32;
        if d == 0.0 {
            continue;
        }
        let dm = as_f16(dmin) * (sb[j] >> 4) as f32;
        for i in 0..16 {
            l[16 * j + i] = nearest_int((x[16 * j + i] + dm) / d).clamp(0, 3) as u8;
        }
    }
    pack_2bit(&l, &mut y[16..80]);
    put_f16(y, 80, d);
    put_f16(y, 82, dmin);
}

/// Q3_K: hmask[32] (third bits), qs[64] (low 2 bits), scales[12] (16 six-bit), f16 d.
fn q3_k(x: &[f32], y: &mut [u8]) {
    let mut l = [0u8; 256];
    let mut scales = [0f32; 16];
    let (mut amax, mut max_scale) = (0f32, 0f32);
    for j in 0..16 {
        scales[j] = make_q3(4, &x[16 * j..16 * j + 16], &mut l[16 * j..]);
        if scales[j].abs() > amax {
            amax = scales[j].abs();
            max_scale = scales[j];
        }
    }
    let mut sc = [0u8; 12];
    let d = if max_scale != 0.0 {
        let iscale = -32.0 / max_scale;
        for (j, s) in scales.iter().enumerate() {
            let q = ((nearest_int(iscale * s) as i8).clamp(-32, 31) + 32) as u8;
            if j < 8 {
                sc[j] = q & 0x0F;
            } else {
                sc[j - 8] |= (q & 0x0F) << 4;
            }
            sc[j % 4 + 8] |= (q >> 4) << (2 * (j / 4));
        }
        1.0 / iscale
    } else {
        0.0
    };
    for j in 0..16 {
        let low = if j < 8 { sc[j] & 0x0F } else { sc[j - 8] >> 4 };
        let s = (low | (((sc[8 + j % 4] >> (2 * (j / 4))) & 3) << 4)) as i32 - 32;
        let dl = as_f16(d) * s as f32;
        if dl == 0.0 {
            continue;
        }
        for i in 0..16 {
            l[16 * j + i] = (nearest_int(x[16 * j + i] / dl).clamp(-4, 3) + 4) as u8;
        }
    }
    let hmask = &mut y[..32];
    hmask.fill(0);
    for (j, v) in l.iter_mut().enumerate() {
        if *v > 3 {
            hmask[j % 32] |= 1 << (j / 32);
            *v -= 4;
        }
    }
    pack_2bit(&l, &mut y[32..96]);
    y[96..108].copy_from_slice(&sc);
    put_f16(y, 108, d);
}

/// Q4_K / Q5_K: f16 d, f16 dmin, scales[12] (8 six-bit scale/min pairs), then for Q5_K
/// qh[32] (fifth bits), then qs[128] (nibbles: for each 64 elements, byte l holds l and
/// l + 32).
fn q4_k_q5_k(five: bool, x: &[f32], y: &mut [u8]) {
    let (nmax, rmin, nstep) = if five { (31, -0.5, 15) } else { (15, -1.0, 20) };
    let mut l = [0u8; 256];
    let (mut scales, mut mins) = ([0f32; 8], [0f32; 8]);
    let (mut max_scale, mut max_min) = (0f32, 0f32);
    for j in 0..8 {
        let xs = &x[32 * j..32 * j + 32];
        let mut sum_x2 = 0f32;
        for v in xs {
            sum_x2 += v * v;
        }
        let av_x = (sum_x2 / 32.0).sqrt();
        let w: [f32; 32] = std::array::from_fn(|i| av_x + xs[i].abs());
        let (s, m) = make_qkx2(nmax, xs, &w, &mut l[32 * j..], rmin, 0.1, nstep, false);
        (scales[j], mins[j]) = (s, m);
        if s > max_scale {
            max_scale = s;
        }
        if m > max_min {
            max_min = m;
        }
    }
    let inv_scale = if max_scale > 0.0 {
        63.0 / max_scale
    } else {
        0.0
    };
    let inv_min = if max_min > 0.0 { 63.0 / max_min } else { 0.0 };
    let mut sc = [0u8; 12];
    for j in 0..8 {
        let ls = (nearest_int(inv_scale * scales[j]) as u8).min(63);
        let lm = (nearest_int(inv_min * mins[j]) as u8).min(63);
        if j < 4 {
            sc[j] = ls;
            sc[j + 4] = lm;
        } else {
            sc[j + 4] = (ls & 0x0F) | ((lm & 0x0F) << 4);
            sc[j - 4] |= (ls >> 4) << 6;
            sc[j] |= (lm >> 4) << 6;
        }
    }
    let (d, dmin) = (max_scale / 63.0, max_min / 63.0);
    for j in 0..8 {
        let (s, m) = super::ggml::scale_min_k4(&sc, j);
        let dl = as_f16(d) * s;
        if dl == 0.0 {
            continue;
        }
        let dm = as_f16(dmin) * m;
        for i in 0..32 {
            l[32 * j + i] = nearest_int((x[32 * j + i] + dm) / dl).clamp(0, nmax) as u8;
        }
    }
    put_f16(y, 0, d);
    put_f16(y, 2, dmin);
    y[4..16].copy_from_slice(&sc);
    let qs_at = if five { 48 } else { 16 };
    if five {
        let qh = &mut y[16..48];
        qh.fill(0);
        for (k, n) in (0..256).step_by(64).enumerate() {
            for j in 0..32 {
                for (half, bit) in [(0, 2 * k), (32, 2 * k + 1)] {
                    if l[n + j + half] > 15 {
                        l[n + j + half] -= 16;
                        qh[j] |= 1 << bit;
                    }
                }
            }
        }
    }
    for (k, n) in (0..256).step_by(64).enumerate() {
        for j in 0..32 {
            y[qs_at + 32 * k + j] = l[n + j] | (l[n + j + 32] << 4);
        }
    }
}

/// Q6_K: ql[128] (low nibbles), qh[64] (high 2 bits), scales[16] (i8), f16 d.
fn q6_k(x: &[f32], y: &mut [u8]) {
    let mut l = [0u8; 256];
    let mut scales = [0f32; 16];
    let (mut max_abs, mut max_scale) = (0f32, 0f32);
    for ib in 0..16 {
        let s = make_qx(32, &x[16 * ib..16 * ib + 16], &mut l[16 * ib..]);
        scales[ib] = s;
        if s.abs() > max_abs {
            max_abs = s.abs();
            max_scale = s;
        }
    }
    if max_abs < GROUP_MAX_EPS {
        y.fill(0);
        return;
    }
    let iscale = -128.0 / max_scale;
    let d = 1.0 / iscale;
    let mut sc = [0i8; 16];
    for (o, s) in sc.iter_mut().zip(&scales) {
        *o = nearest_int(iscale * s).min(127) as i8;
    }
    for j in 0..16 {
        let dl = as_f16(d) * sc[j] as f32;
        if dl == 0.0 {
            continue;
        }
        for i in 0..16 {
            l[16 * j + i] = (nearest_int(x[16 * j + i] / dl).clamp(-32, 31) + 32) as u8;
        }
    }
    let (ql, rest) = y.split_at_mut(128);
    let (qh, rest) = rest.split_at_mut(64);
    for (k, j) in (0..256).step_by(128).enumerate() {
        for i in 0..32 {
            let v = |o: usize| l[j + i + o];
            ql[64 * k + i] = (v(0) & 0x0F) | ((v(64) & 0x0F) << 4);
            ql[64 * k + i + 32] = (v(32) & 0x0F) | ((v(96) & 0x0F) << 4);
            qh[32 * k + i] =
                (v(0) >> 4) | ((v(32) >> 4) << 2) | ((v(64) >> 4) << 4) | ((v(96) >> 4) << 6);
        }
    }
    for (o, s) in rest[..16].iter_mut().zip(&sc) {
        *o = *s as u8;
    }
    put_f16(rest, 16, d);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_int_rounds_ties_to_even_as_ggml_does() {
        for (v, want) in [
            (0.5f32, 0),
            (1.5, 2),
            (2.5, 2),
            (-0.5, 0),
            (-1.5, -2),
            (3.49, 3),
            (-7.7, -8),
        ] {
            assert_eq!(nearest_int(v), want, "{v}");
        }
    }

    /// Every type round-trips through ggml.rs's dequantizer to within its step.
    #[test]
    fn every_type_dequantizes_back_to_within_a_step() {
        // Spread over [-0.1, 0.1) by a multiplicative hash (dtype uses no other module).
        let x: Vec<f32> = (0..512u32)
            .map(|i| (i.wrapping_mul(2_654_435_761) as f32 / u32::MAX as f32 - 0.5) * 0.2)
            .collect();
        for t in crate::dtype::ALL_DTYPES
            .into_iter()
            .filter(|&t| can_quantize(t))
        {
            let mut q = vec![0u8; 512 / t.block_elems() as usize * t.block_bytes() as usize];
            quantize_row(t, &x, &mut q);
            let mut back = vec![0f32; 512];
            crate::dtype::ggml::dequantize(t, &q, &mut back).expect("dequantize");
            let bits = match t {
                DType::Q8_0 => 8.0,
                DType::Q6K => 6.0,
                DType::Q5_0 | DType::Q5_1 | DType::Q5K => 5.0,
                DType::Q4_0 | DType::Q4_1 | DType::Q4K => 4.0,
                DType::Q3K => 3.0,
                _ => 2.0,
            };
            let step = 0.2 / (2f32.powf(bits) - 1.0);
            for (i, (a, b)) in x.iter().zip(&back).enumerate() {
                assert!(
                    (a - b).abs() <= 1.5 * step,
                    "{t} [{i}]: {a} -> {b} (step {step})"
                );
            }
        }
    }
}
