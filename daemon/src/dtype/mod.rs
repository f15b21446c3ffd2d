//! Element types of stored tensors. Quantized types are GGML block formats: they stay
//! quantized on disk, across PCIe and in device memory.

pub mod ggml;

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
}

pub const ALL_DTYPES: [DType; 6] = [
    DType::F32,
    DType::F16,
    DType::BF16,
    DType::Q8_0,
    DType::Q4_0,
    DType::Q4_1,
];

impl DType {
    /// Elements per block (1 for plain floats).
    pub const fn block_elems(self) -> u64 {
        match self {
            DType::F32 | DType::F16 | DType::BF16 => 1,
            DType::Q8_0 | DType::Q4_0 | DType::Q4_1 => 32,
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
        }
    }

    /// Byte width of one float element, for the byte-split filter; 1 (no split) for
    /// block formats, whose bytes do not line up as planes.
    pub const fn split_width(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F16 | DType::BF16 => 2,
            DType::Q8_0 | DType::Q4_0 | DType::Q4_1 => 1,
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
            8 => DType::Q8_0,
            30 => DType::BF16,
            _ => return None,
        })
    }

    pub const fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::Q8_0 => "q8_0",
            DType::Q4_0 => "q4_0",
            DType::Q4_1 => "q4_1",
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
        16..=23 => "IQ (i-quant)",
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
    }
}
