//! Dequantization of the GGML block formats that K-quant and newer GGUFs carry: Q5_0,
//! Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS and MXFP4, written from ggml's block
//! structs (`ggml-common.h`). Each value is computed with the same f32 operations in the
//! same order as `gguf.quants.dequantize`, so the results are bit-identical to it
//! (tests/tests/quants.rs checks every type against its output, extreme scales included).
//!
//! These are the reference (scalar) decoders. The CPU matmul kernels use them for the
//! formats without a fused kernel of their own and for prefill tiles; `sample_blocks`
//! makes well-formed random blocks for kernel tests and synthetic models.

use super::DType;
use half::f16;

const QK_K: usize = super::QK_K as usize;

/// The 16 non-linear levels of IQ4_NL and IQ4_XS.
pub(crate) const KVALUES_IQ4NL: [i8; 16] = [
    -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
];

/// MXFP4's E2M1 values, doubled (the scale is halved to match).
pub(crate) const KVALUES_MXFP4: [i8; 16] =
    [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];

#[inline(always)]
fn f16_at(b: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// Where the quants of a Q8_0, Q4_0 or Q4_1 block start: after its f16 scale d (and, in
/// Q4_1, its f16 minimum m). The CPU's fused dot kernels read the blocks in place by it.
pub(crate) const fn quants_at(t: DType) -> usize {
    if matches!(t, DType::Q4_1) {
        4
    } else {
        2
    }
}

/// An E8M0 exponent as the f32 2^(e - 128) (half the scale: the values are doubled).
pub(crate) fn e8m0_to_f32_half(e: u8) -> f32 {
    let bits = if e < 2 {
        0x0020_0000u32 << e
    } else {
        (e as u32 - 1) << 23
    };
    f32::from_bits(bits)
}

/// The 6-bit scale and min of sub-block `j` (0..8) of a Q4_K/Q5_K block's 12 scale bytes.
pub(crate) fn scale_min_k4(s: &[u8], j: usize) -> (f32, f32) {
    if j < 4 {
        ((s[j] & 0x3F) as f32, (s[j + 4] & 0x3F) as f32)
    } else {
        let i = j - 4;
        (
            ((s[8 + i] & 0x0F) | ((s[i] >> 2) & 0x30)) as f32,
            ((s[8 + i] >> 4) | ((s[4 + i] >> 2) & 0x30)) as f32,
        )
    }
}

/// Why `dequantize` refused its input.
#[derive(Debug, thiserror::Error)]
pub enum DequantError {
    #[error("{}: {bytes} bytes are not whole blocks of {} for {values} values ({} per block)", dtype.ggml_name(), dtype.block_bytes(), dtype.block_elems())]
    NotWholeBlocks {
        dtype: DType,
        bytes: usize,
        values: usize,
    },
    #[error("{}: not a block format", .0.ggml_name())]
    NotBlocks(DType),
}

/// Dequantizes whole blocks of `t` from `src` into `out`; the lengths must agree.
pub fn dequantize(t: DType, src: &[u8], out: &mut [f32]) -> Result<(), DequantError> {
    let (be, bb) = (t.block_elems() as usize, t.block_bytes() as usize);
    if !src.len().is_multiple_of(bb) || src.len() / bb * be != out.len() {
        return Err(DequantError::NotWholeBlocks {
            dtype: t,
            bytes: src.len(),
            values: out.len(),
        });
    }
    if !t.is_quantized() {
        return Err(DequantError::NotBlocks(t));
    }
    for (b, y) in src.chunks_exact(bb).zip(out.chunks_exact_mut(be)) {
        dequantize_block(t, b, y);
    }
    Ok(())
}

/// One block (`t.block_bytes()` bytes) of a block format into `t.block_elems()` values.
#[inline]
pub fn dequantize_block(t: DType, b: &[u8], y: &mut [f32]) {
    match t {
        DType::Q8_0 => q8_0(b, y),
        DType::Q4_0 | DType::Q4_1 => q4(t, b, y),
        DType::Q5_0 | DType::Q5_1 => q5(t, b, y),
        DType::Q2K => q2_k(b, y),
        DType::Q3K => q3_k(b, y),
        DType::Q4K | DType::Q5K => q4_k_q5_k(t, b, y),
        DType::Q6K => q6_k(b, y),
        DType::Iq4Nl => iq4_nl(b, y),
        DType::Iq4Xs => iq4_xs(b, y),
        DType::Mxfp4 => mxfp4(b, y),
        DType::F32 | DType::F16 | DType::BF16 => unreachable!("{t} is not a block format"),
    }
}

/// Q8_0 (d, qs[32]: d * q). Inlined into the CPU's row dequantization (its hot loop).
#[inline(always)]
pub(crate) fn q8_0(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    for (o, &q) in y.iter_mut().zip(&b[quants_at(DType::Q8_0)..][..32]) {
        *o = d * q as i8 as f32;
    }
}

/// Q4_0 (d, qs[16]: q - 8) and Q4_1 (d, m, qs: q * d + m); byte j holds element j in its
/// low nibble and j + 16 in its high one. Inlined as `q8_0` is.
#[inline(always)]
pub(crate) fn q4(t: DType, b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let (m, at) = if t == DType::Q4_1 {
        (f16_at(b, 2), quants_at(DType::Q4_1))
    } else {
        (-8.0 * d, quants_at(DType::Q4_0))
    };
    for j in 0..16 {
        let q = b[at + j];
        y[j] = (q & 15) as f32 * d + m;
        y[j + 16] = (q >> 4) as f32 * d + m;
    }
}

/// Q5_0 (d f16, qh u32, qs[16]: q - 16) and Q5_1 (d, m f16, qh, qs: q * d + m): the fifth
/// bit of element i is bit i of qh.
fn q5(t: DType, b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let (m, at) = if t == DType::Q5_1 {
        (Some(f16_at(b, 2)), 4)
    } else {
        (None, 2)
    };
    let qh = u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]]);
    let qs = &b[at + 4..at + 20];
    for (i, out) in y.iter_mut().enumerate().take(32) {
        let lo = if i < 16 {
            qs[i] & 0x0F
        } else {
            qs[i - 16] >> 4
        };
        let q = lo | ((((qh >> i) & 1) as u8) << 4);
        *out = match m {
            None => d * (q as i8 - 16) as f32,
            Some(m) => d * q as f32 + m,
        };
    }
}

/// Q2_K: scales[16] (4-bit scale, 4-bit min per 16 values), qs[64] (2 bits), d, dmin.
fn q2_k(b: &[u8], y: &mut [f32]) {
    let (scales, qs) = (&b[0..16], &b[16..80]);
    let (d, dmin) = (f16_at(b, 80), f16_at(b, 82));
    for (i, out) in y.iter_mut().enumerate().take(QK_K) {
        let (h, j, l) = (i / 128, (i / 32) % 4, i % 32);
        let q = (qs[32 * h + l] >> (2 * j)) & 3;
        let sc = scales[i / 16];
        let dl = d * (sc & 0x0F) as f32;
        let ml = dmin * (sc >> 4) as f32;
        *out = dl * q as f32 - ml;
    }
}

/// Q3_K: hmask[32] (the third bit, inverted), qs[64] (2 bits), scales[12] (16 signed 6-bit
/// scales), d.
fn q3_k(b: &[u8], y: &mut [f32]) {
    let (hmask, qs, s) = (&b[0..32], &b[32..96], &b[96..108]);
    let d = f16_at(b, 108);
    for (i, out) in y.iter_mut().enumerate().take(QK_K) {
        let sub = i / 16;
        let lo = (s[sub % 8] >> (4 * (sub / 8))) & 0x0F;
        let hi = (s[8 + sub % 4] >> (2 * (sub / 4))) & 0x03;
        let scale = ((lo | (hi << 4)) as i8).wrapping_sub(32) as f32;
        let dl = d * scale;
        let (h, j, l) = (i / 128, (i / 32) % 4, i % 32);
        let ql = ((qs[32 * h + l] >> (2 * j)) & 3) as i8;
        let hbit = (hmask[i % 32] >> (i / 32)) & 1;
        let q = ql - (((hbit ^ 1) << 2) as i8);
        *out = dl * q as f32;
    }
}

/// Q4_K: d, dmin, scales[12] (8 six-bit scale/min pairs), qs[128] (4 bits); Q5_K adds
/// qh[32] (the fifth bit) before qs.
fn q4_k_q5_k(t: DType, b: &[u8], y: &mut [f32]) {
    let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
    let s = &b[4..16];
    let (qh, qs) = if t == DType::Q5K {
        (Some(&b[16..48]), &b[48..176])
    } else {
        (None, &b[16..144])
    };
    for (i, out) in y.iter_mut().enumerate().take(QK_K) {
        let (sub, l) = (i / 32, i % 32);
        let (sc, m) = scale_min_k4(s, sub);
        let dl = d * sc;
        let dm = dmin * m;
        let mut q = (qs[32 * (sub / 2) + l] >> (4 * (sub % 2))) & 0x0F;
        if let Some(qh) = qh {
            q |= ((qh[l] >> sub) & 1) << 4;
        }
        *out = dl * q as f32 - dm;
    }
}

/// Q6_K: ql[128] (low 4 bits), qh[64] (high 2 bits), scales[16] (i8), d: q - 32.
fn q6_k(b: &[u8], y: &mut [f32]) {
    let (ql, qh, scales) = (&b[0..128], &b[128..192], &b[192..208]);
    let d = f16_at(b, 208);
    for (i, out) in y.iter_mut().enumerate().take(QK_K) {
        let (h, t4, l) = (i / 128, (i / 32) % 4, i % 32);
        let lo = (ql[64 * h + 32 * (t4 % 2) + l] >> (4 * (t4 / 2))) & 0x0F;
        let hi = (qh[32 * h + l] >> (2 * t4)) & 0x03;
        let q = ((lo | (hi << 4)) as i8).wrapping_sub(32);
        let dl = d * (scales[i / 16] as i8) as f32;
        *out = dl * q as f32;
    }
}

/// IQ4_NL: d, qs[16]: 4-bit indices into the non-linear levels.
fn iq4_nl(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let qs = &b[2..18];
    for (i, out) in y.iter_mut().enumerate().take(32) {
        let n = if i < 16 {
            qs[i] & 0x0F
        } else {
            qs[i - 16] >> 4
        };
        *out = d * KVALUES_IQ4NL[n as usize] as f32;
    }
}

/// IQ4_XS: d, scales_h u16, scales_l[4] (8 six-bit scales - 32), qs[128]: IQ4_NL levels.
fn iq4_xs(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let scales_h = u16::from_le_bytes([b[2], b[3]]);
    let (scales_l, qs) = (&b[4..8], &b[8..136]);
    for (i, out) in y.iter_mut().enumerate().take(QK_K) {
        let (ib, j) = (i / 32, i % 32);
        let lo = (scales_l[ib / 2] >> (4 * (ib % 2))) & 0x0F;
        let hi = ((scales_h >> (2 * ib)) & 0x03) as u8;
        let ls = ((lo | (hi << 4)) as i8).wrapping_sub(32);
        let dl = d * ls as f32;
        let byte = qs[16 * ib + j % 16];
        let n = if j < 16 { byte & 0x0F } else { byte >> 4 };
        *out = dl * KVALUES_IQ4NL[n as usize] as f32;
    }
}

/// MXFP4: an E8M0 exponent, qs[16]: 4-bit E2M1 values.
fn mxfp4(b: &[u8], y: &mut [f32]) {
    let d = e8m0_to_f32_half(b[0]);
    let qs = &b[1..17];
    for (i, out) in y.iter_mut().enumerate().take(32) {
        let n = if i < 16 {
            qs[i] & 0x0F
        } else {
            qs[i - 16] >> 4
        };
        *out = d * KVALUES_MXFP4[n as usize] as f32;
    }
}

/// `n` well-formed blocks of `t` from `random` (the caller's seeded generator,
/// `util::rng::Rng`: this module knows no other): random quant bits, and scales
/// that are moderate random f16 (or E8M0 exponents near 1), so dot products stay in range.
/// For kernel tests and synthetic models; plain floats get uniform values in [-1, 1).
pub fn sample_blocks(t: DType, n: usize, random: &mut dyn FnMut() -> u64) -> Vec<u8> {
    // 31 bits (`unit` below maps them to [-1, 1)).
    let mut next = move || (random() >> 33) as u32;
    let bb = t.block_bytes() as usize;
    let mut out: Vec<u8> = (0..n * bb).map(|_| next() as u8).collect();
    let unit = |r: u32| (r as f32 / (1u64 << 31) as f32) * 2.0 - 1.0;
    let put_f16 = |blk: &mut [u8], at: usize, v: f32| {
        blk[at..at + 2].copy_from_slice(&f16::from_f32(v).to_le_bytes());
    };
    for blk in out.chunks_exact_mut(bb) {
        let (a, b) = (unit(next()), unit(next()));
        match t {
            DType::F32 => blk.copy_from_slice(&a.to_le_bytes()),
            DType::F16 => put_f16(blk, 0, a),
            DType::BF16 => blk.copy_from_slice(&half::bf16::from_f32(a).to_le_bytes()),
            // Scales for weights of at most about 1 in magnitude.
            DType::Q4_0 | DType::Q5_0 => put_f16(blk, 0, 0.05 * a),
            DType::Q8_0 | DType::Iq4Nl => put_f16(blk, 0, 0.005 * a),
            DType::Iq4Xs => put_f16(blk, 0, 0.0003 * a),
            DType::Q4_1 | DType::Q5_1 => {
                put_f16(blk, 0, 0.05 * a);
                put_f16(blk, 2, 0.5 * b);
            }
            DType::Q4K | DType::Q5K => {
                put_f16(blk, 0, 0.001 * a);
                put_f16(blk, 2, 0.001 * b);
            }
            DType::Q2K => {
                put_f16(blk, 80, 0.02 * a);
                put_f16(blk, 82, 0.02 * b);
            }
            DType::Q3K => put_f16(blk, 108, 0.01 * a),
            DType::Q6K => put_f16(blk, 208, 0.0003 * a),
            // Exponents near 1, and one block in eight at 0, 1 or 2: scales of 2^-128 and
            // 2^-127 are denormal, which the GPU's fast math flushes to zero (their weights
            // are below 2^-124 either way: the kernel tests' tolerances, relative to a row,
            // cover it), and 2 is the first normal one.
            DType::Mxfp4 => {
                let r = next();
                blk[0] = if r % 8 == 0 {
                    (r / 8 % 3) as u8
                } else {
                    120 + (r / 8 % 8) as u8
                }
            }
        }
    }
    out
}
