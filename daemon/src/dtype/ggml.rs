//! Dequantization of the GGML block formats that K-quant and newer GGUFs carry: Q5_0,
//! Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS and MXFP4, written from ggml's block
//! structs (`ggml-common.h`). Each value is computed with the same f32 operations in the
//! same order as `gguf.quants.dequantize`, so the results are bit-identical to it
//! (tests/tests/quants.rs checks every type against its output, extreme scales included).
//!
//! These are the reference (scalar) decoders: the matmul kernels that consume the blocks
//! in place are built on them.

use half::f16;

/// Elements per K-quant super-block.
pub const QK_K: usize = 256;

/// A GGML block format beyond the ones `DType` carries today.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BlockType {
    Q5_0,
    Q5_1,
    Q2K,
    Q3K,
    Q4K,
    Q5K,
    Q6K,
    Iq4Nl,
    Iq4Xs,
    Mxfp4,
}

impl BlockType {
    pub const ALL: [BlockType; 10] = [
        BlockType::Q5_0,
        BlockType::Q5_1,
        BlockType::Q2K,
        BlockType::Q3K,
        BlockType::Q4K,
        BlockType::Q5K,
        BlockType::Q6K,
        BlockType::Iq4Nl,
        BlockType::Iq4Xs,
        BlockType::Mxfp4,
    ];

    /// The GGML type id (`ggml_type`) of the format.
    pub fn ggml_type(self) -> u32 {
        match self {
            BlockType::Q5_0 => 6,
            BlockType::Q5_1 => 7,
            BlockType::Q2K => 10,
            BlockType::Q3K => 11,
            BlockType::Q4K => 12,
            BlockType::Q5K => 13,
            BlockType::Q6K => 14,
            BlockType::Iq4Nl => 20,
            BlockType::Iq4Xs => 23,
            BlockType::Mxfp4 => 39,
        }
    }

    pub fn from_ggml(t: u32) -> Option<BlockType> {
        BlockType::ALL.into_iter().find(|b| b.ggml_type() == t)
    }

    /// The name GGUF tools print (`Q4_K`, `IQ4_XS`, ...).
    pub fn name(self) -> &'static str {
        match self {
            BlockType::Q5_0 => "Q5_0",
            BlockType::Q5_1 => "Q5_1",
            BlockType::Q2K => "Q2_K",
            BlockType::Q3K => "Q3_K",
            BlockType::Q4K => "Q4_K",
            BlockType::Q5K => "Q5_K",
            BlockType::Q6K => "Q6_K",
            BlockType::Iq4Nl => "IQ4_NL",
            BlockType::Iq4Xs => "IQ4_XS",
            BlockType::Mxfp4 => "MXFP4",
        }
    }

    /// Elements per block.
    pub fn block_elems(self) -> usize {
        match self {
            BlockType::Q5_0 | BlockType::Q5_1 | BlockType::Iq4Nl | BlockType::Mxfp4 => 32,
            _ => QK_K,
        }
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> usize {
        match self {
            BlockType::Q5_0 => 22,
            BlockType::Q5_1 => 24,
            BlockType::Q2K => 84,
            BlockType::Q3K => 110,
            BlockType::Q4K => 144,
            BlockType::Q5K => 176,
            BlockType::Q6K => 210,
            BlockType::Iq4Nl => 18,
            BlockType::Iq4Xs => 136,
            BlockType::Mxfp4 => 17,
        }
    }
}

/// The 16 non-linear levels of IQ4_NL and IQ4_XS.
const KVALUES_IQ4NL: [i8; 16] = [
    -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
];

/// MXFP4's E2M1 values, doubled (the scale is halved to match).
const KVALUES_MXFP4: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];

fn f16_at(b: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// An E8M0 exponent as the f32 2^(e - 128) (half the scale: the values are doubled).
fn e8m0_to_f32_half(e: u8) -> f32 {
    let bits = if e < 2 {
        0x0020_0000u32 << e
    } else {
        (e as u32 - 1) << 23
    };
    f32::from_bits(bits)
}

/// The 6-bit scale and min of sub-block `j` (0..8) of a Q4_K/Q5_K block's 12 scale bytes.
fn scale_min_k4(s: &[u8], j: usize) -> (f32, f32) {
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

/// Dequantizes whole blocks of `t` from `src` into `out`; the lengths must agree.
pub fn dequantize(t: BlockType, src: &[u8], out: &mut [f32]) -> Result<(), String> {
    let (be, bb) = (t.block_elems(), t.block_bytes());
    if !src.len().is_multiple_of(bb) || src.len() / bb * be != out.len() {
        return Err(format!(
            "{}: {} bytes are not whole blocks of {bb} for {} values ({be} per block)",
            t.name(),
            src.len(),
            out.len()
        ));
    }
    for (b, y) in src.chunks_exact(bb).zip(out.chunks_exact_mut(be)) {
        dequantize_block(t, b, y);
    }
    Ok(())
}

/// One block (`t.block_bytes()` bytes) into `t.block_elems()` values.
pub fn dequantize_block(t: BlockType, b: &[u8], y: &mut [f32]) {
    match t {
        BlockType::Q5_0 | BlockType::Q5_1 => q5(t, b, y),
        BlockType::Q2K => q2_k(b, y),
        BlockType::Q3K => q3_k(b, y),
        BlockType::Q4K | BlockType::Q5K => q4_k_q5_k(t, b, y),
        BlockType::Q6K => q6_k(b, y),
        BlockType::Iq4Nl => iq4_nl(b, y),
        BlockType::Iq4Xs => iq4_xs(b, y),
        BlockType::Mxfp4 => mxfp4(b, y),
    }
}

/// Q5_0 (d f16, qh u32, qs[16]: q - 16) and Q5_1 (d, m f16, qh, qs: q * d + m): the fifth
/// bit of element i is bit i of qh.
fn q5(t: BlockType, b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let (m, at) = if t == BlockType::Q5_1 {
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
fn q4_k_q5_k(t: BlockType, b: &[u8], y: &mut [f32]) {
    let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
    let s = &b[4..16];
    let (qh, qs) = if t == BlockType::Q5K {
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
