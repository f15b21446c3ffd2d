//! Element types of stored tensors. Quantized types are GGML block formats: they stay
//! quantized on disk, across PCIe and in device memory.

pub mod ggml;
pub mod quantize;

use serde::{Deserialize, Serialize};
use std::fmt;

#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum DType {
    #[serde(rename = "f32")]
    F32,
    #[serde(rename = "f16")]
    F16,
    #[serde(rename = "bf16")]
    BF16,
    /// 32 weights: f16 scale + 32 x i8. 34 bytes.
    #[serde(rename = "q8_0")]
    Q8_0,
    /// 32 weights: f16 scale + 16 bytes of 4-bit values (offset 8). 18 bytes.
    #[serde(rename = "q4_0")]
    Q4_0,
    /// 32 weights: f16 scale + f16 min + 16 bytes of 4-bit values. 20 bytes.
    #[serde(rename = "q4_1")]
    Q4_1,
    // The formats of K-quant and newer GGUFs (layouts in `ggml.rs`). Appended, never
    // reordered: manifests store the variant index.
    /// 32 weights: f16 scale, 32 fifth bits, 16 bytes of nibbles (offset 16). 22 bytes.
    #[serde(rename = "q5_0")]
    Q5_0,
    /// 32 weights: f16 scale and min, fifth bits, nibbles. 24 bytes.
    #[serde(rename = "q5_1")]
    Q5_1,
    /// 256 weights: 16 four-bit scale/min pairs, 2-bit values, f16 scale and min. 84 bytes.
    #[serde(rename = "q2_k")]
    Q2K,
    /// 256 weights: high-bit mask, 2-bit values, 16 six-bit scales, f16 scale. 110 bytes.
    #[serde(rename = "q3_k")]
    Q3K,
    /// 256 weights: f16 scale and min, 8 six-bit scale/min pairs, nibbles. 144 bytes.
    #[serde(rename = "q4_k")]
    Q4K,
    /// 256 weights: as Q4_K plus a fifth bit per weight. 176 bytes.
    #[serde(rename = "q5_k")]
    Q5K,
    /// 256 weights: 4 + 2 bits per weight, 16 i8 scales, f16 scale. 210 bytes.
    #[serde(rename = "q6_k")]
    Q6K,
    /// 32 weights: f16 scale, nibbles indexing 16 non-linear levels. 18 bytes.
    #[serde(rename = "iq4_nl")]
    Iq4Nl,
    /// 256 weights: f16 scale, 8 six-bit scales, IQ4_NL nibbles. 136 bytes.
    #[serde(rename = "iq4_xs")]
    Iq4Xs,
    /// 32 weights: an E8M0 exponent, 16 bytes of E2M1 nibbles (gpt-oss experts). 17 bytes.
    #[serde(rename = "mxfp4")]
    Mxfp4,
}

pub const ALL_DTYPES: [DType; 16] = [
    DType::F32,
    DType::F16,
    DType::BF16,
    DType::Q8_0,
    DType::Q4_0,
    DType::Q4_1,
    DType::Q5_0,
    DType::Q5_1,
    DType::Q2K,
    DType::Q3K,
    DType::Q4K,
    DType::Q5K,
    DType::Q6K,
    DType::Iq4Nl,
    DType::Iq4Xs,
    DType::Mxfp4,
];

/// Elements per K-quant super-block.
pub const QK_K: u64 = 256;

impl DType {
    /// Elements per block (1 for plain floats).
    pub const fn block_elems(self) -> u64 {
        match self {
            DType::F32 | DType::F16 | DType::BF16 => 1,
            DType::Q8_0
            | DType::Q4_0
            | DType::Q4_1
            | DType::Q5_0
            | DType::Q5_1
            | DType::Iq4Nl
            | DType::Mxfp4 => 32,
            DType::Q2K | DType::Q3K | DType::Q4K | DType::Q5K | DType::Q6K | DType::Iq4Xs => QK_K,
        }
    }

    /// Bytes per block.
    pub const fn block_bytes(self) -> u64 {
        match self {
            DType::F32 => 4,
            DType::F16 | DType::BF16 => 2,
            DType::Q8_0 => 34,
            DType::Q4_0 => 18,
            DType::Q4_1 => 20,
            DType::Q5_0 => 22,
            DType::Q5_1 => 24,
            DType::Q2K => 84,
            DType::Q3K => 110,
            DType::Q4K => 144,
            DType::Q5K => 176,
            DType::Q6K => 210,
            DType::Iq4Nl => 18,
            DType::Iq4Xs => 136,
            DType::Mxfp4 => 17,
        }
    }

    /// Byte width of one float element, for the byte-split filter; 1 (no split) for
    /// block formats, whose bytes do not line up as planes.
    pub const fn split_width(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F16 | DType::BF16 => 2,
            _ => 1,
        }
    }

    pub const fn is_quantized(self) -> bool {
        self.block_elems() > 1
    }

    /// Bytes of one row of `n` elements, or None when `n` is not a whole number of blocks.
    pub fn row_bytes(self, n: u64) -> Option<u64> {
        if !n.is_multiple_of(self.block_elems()) {
            return None;
        }
        (n / self.block_elems()).checked_mul(self.block_bytes())
    }

    /// Bytes of a row-major tensor of this shape (last dimension contiguous), or None when
    /// the row length is not a whole number of blocks or the size overflows.
    pub fn tensor_bytes(self, shape: &[u64]) -> Option<u64> {
        let (&row, rest) = shape.split_last()?;
        let rows = rest.iter().try_fold(1u64, |acc, &d| acc.checked_mul(d))?;
        rows.checked_mul(self.row_bytes(row)?)
    }

    /// The GGML type id (ggml.h `enum ggml_type`).
    pub fn from_ggml(id: u32) -> Option<Self> {
        Some(match id {
            0 => DType::F32,
            1 => DType::F16,
            2 => DType::Q4_0,
            3 => DType::Q4_1,
            6 => DType::Q5_0,
            7 => DType::Q5_1,
            8 => DType::Q8_0,
            10 => DType::Q2K,
            11 => DType::Q3K,
            12 => DType::Q4K,
            13 => DType::Q5K,
            14 => DType::Q6K,
            20 => DType::Iq4Nl,
            23 => DType::Iq4Xs,
            30 => DType::BF16,
            39 => DType::Mxfp4,
            _ => return None,
        })
    }

    /// The name GGUF tools print (`Q4_K`, `IQ4_XS`, `BF16`, ...).
    pub fn ggml_name(self) -> String {
        self.name().to_ascii_uppercase()
    }

    pub const fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::Q8_0 => "q8_0",
            DType::Q4_0 => "q4_0",
            DType::Q4_1 => "q4_1",
            DType::Q5_0 => "q5_0",
            DType::Q5_1 => "q5_1",
            DType::Q2K => "q2_k",
            DType::Q3K => "q3_k",
            DType::Q4K => "q4_k",
            DType::Q5K => "q5_k",
            DType::Q6K => "q6_k",
            DType::Iq4Nl => "iq4_nl",
            DType::Iq4Xs => "iq4_xs",
            DType::Mxfp4 => "mxfp4",
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Name of a GGML type id we do not support, for error messages.
pub fn ggml_type_name(id: u32) -> &'static str {
    match id {
        0 => "F32",
        1 => "F16",
        2 => "Q4_0",
        3 => "Q4_1",
        6 => "Q5_0",
        7 => "Q5_1",
        8 => "Q8_0",
        9 => "Q8_1",
        10 => "Q2_K",
        11 => "Q3_K",
        12 => "Q4_K",
        13 => "Q5_K",
        14 => "Q6_K",
        15 => "Q8_K",
        16 => "IQ2_XXS",
        17 => "IQ2_XS",
        18 => "IQ3_XXS",
        19 => "IQ1_S",
        20 => "IQ4_NL",
        21 => "IQ3_S",
        22 => "IQ2_S",
        23 => "IQ4_XS",
        24 => "I8",
        25 => "I16",
        26 => "I32",
        27 => "I64",
        28 => "F64",
        29 => "IQ1_M",
        30 => "BF16",
        34 => "TQ1_0",
        35 => "TQ2_0",
        39 => "MXFP4",
        _ => "unknown",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tensor_bytes_counts_blocks_per_row() {
        // A [3, 64] q4_1 tensor is 3 rows of 2 blocks of 20 bytes.
        assert_eq!(DType::Q4_1.tensor_bytes(&[3, 64]), Some(120));
        assert_eq!(DType::F32.tensor_bytes(&[576]), Some(2304));
        // A row that is not a whole number of blocks has no size.
        assert_eq!(DType::Q8_0.tensor_bytes(&[2, 33]), None);
        assert_eq!(DType::BF16.tensor_bytes(&[]), None);
        // K-quant rows are whole super-blocks of 256.
        assert_eq!(DType::Q4K.tensor_bytes(&[2, 512]), Some(2 * 2 * 144));
        assert_eq!(DType::Q6K.row_bytes(640), None);
    }

    #[test]
    fn every_dtype_round_trips_its_ggml_id_and_manifest_index() {
        for (i, dt) in ALL_DTYPES.into_iter().enumerate() {
            let id = (0..64).find(|&id| DType::from_ggml(id) == Some(dt));
            let id = id.unwrap_or_else(|| panic!("{dt} has no GGML id"));
            assert_eq!(ggml_type_name(id), dt.ggml_name(), "{dt}");
            // postcard writes the variant index: the order of ALL_DTYPES is the enum's.
            assert_eq!(postcard::to_allocvec(&dt).unwrap(), vec![i as u8], "{dt}");
        }
    }
}
