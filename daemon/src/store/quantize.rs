//! `sluiced pack --quantize TYPE`: a `PackSource` that hands `pack` a model's float
//! weight matrices as TYPE blocks, quantized while packing by `dtype::quantize` (ggml's
//! reference quantizers, so the blocks are what `llama-quantize --pure` writes).
//!
//! Which tensors: every f32, f16 or bf16 tensor of two or more dimensions (matrices, the
//! embedding, the output head, each expert's matrices) except a mixture's router, which
//! llama.cpp also keeps in float (its logits pick the experts). Vectors (norms, biases)
//! stay as they are, and so do tensors already in a block format: quantizing those again
//! would add a second rounding to the first. A K-quant needs rows of a multiple of 256
//! elements; a matrix whose rows are not takes the fallback llama.cpp's quantizer writes
//! (Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0, Q2_K and Q3_K -> Q4_0: what llama-cpp-python
//! 0.3.36's `llama_model_quantize` wrote for SmolLM2's 576-wide rows, scripts/
//! check_quantize.py). A row that no fallback fits stays float.

use super::writer::{ModelHeader, PackSource, TensorLayout};
use crate::dtype::quantize::{can_quantize, quantize_row};
use crate::dtype::DType;
use std::path::PathBuf;

/// The source `src` with its weight matrices quantized to `to` (`can_quantize`) by
/// `threads` threads a tensor.
pub struct Quantized<'a, S: PackSource> {
    src: &'a S,
    to: DType,
    threads: usize,
}

impl<'a, S: PackSource> Quantized<'a, S> {
    /// Refuses a type no quantizer writes, naming the ones there are.
    pub fn new(src: &'a S, to: DType, threads: usize) -> Result<Self, String> {
        if !can_quantize(to) {
            return Err(format!(
                "--quantize {}: sluice quantizes to {}",
                to.name(),
                quantizable().join(", ")
            ));
        }
        Ok(Quantized {
            src,
            to,
            threads: threads.max(1),
        })
    }
}

/// The types `--quantize` takes, by name.
pub fn quantizable() -> Vec<&'static str> {
    crate::dtype::ALL_DTYPES
        .into_iter()
        .filter(|&t| can_quantize(t))
        .map(DType::name)
        .collect()
}

/// What tensor `name` of layout `l` becomes under `--quantize to` (None: kept as it is).
pub fn target(to: DType, name: &str, l: &TensorLayout) -> Option<DType> {
    let float = matches!(l.dtype, DType::F32 | DType::F16 | DType::BF16);
    if !float || l.shape.len() < 2 || name.ends_with(".mlp.gate.weight") {
        return None;
    }
    let cols = *l.shape.last()?;
    let t = if cols.is_multiple_of(to.block_elems()) {
        to
    } else {
        match to {
            DType::Q4K => DType::Q5_0,
            DType::Q5K => DType::Q5_1,
            DType::Q6K => DType::Q8_0,
            DType::Q2K | DType::Q3K => DType::Q4_0,
            _ => return None,
        }
    };
    cols.is_multiple_of(t.block_elems()).then_some(t)
}

/// Bytes of a tensor of `shape` in `t`.
fn bytes_of(t: DType, shape: &[u64]) -> u64 {
    shape.iter().product::<u64>() / t.block_elems() * t.block_bytes()
}

/// Widens one row of float `t` elements to f32.
fn widen(t: DType, row: &[u8], out: &mut [f32]) {
    match t {
        DType::F32 => {
            for (o, c) in out.iter_mut().zip(row.chunks_exact(4)) {
                *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
        DType::F16 => {
            for (o, c) in out.iter_mut().zip(row.chunks_exact(2)) {
                *o = half::f16::from_le_bytes([c[0], c[1]]).to_f32();
            }
        }
        DType::BF16 => {
            for (o, c) in out.iter_mut().zip(row.chunks_exact(2)) {
                *o = half::bf16::from_le_bytes([c[0], c[1]]).to_f32();
            }
        }
        _ => unreachable!("target() takes float tensors only"),
    }
}

impl<S: PackSource> PackSource for Quantized<'_, S> {
    fn header(&self) -> ModelHeader {
        let mut h = self.src.header();
        h.meta.file_type = Some(self.to.ggml_name());
        h
    }

    fn tensor(&self, name: &str) -> Option<TensorLayout> {
        let l = self.src.tensor(name)?;
        Some(match target(self.to, name, &l) {
            Some(t) => TensorLayout {
                dtype: t,
                len: bytes_of(t, &l.shape),
                shape: l.shape,
            },
            None => l,
        })
    }

    fn copy_tensor(&self, name: &str, dst: &mut [u8]) {
        // `pack` asks `tensor` for every name before copying it.
        let Some(l) = self.src.tensor(name) else {
            return self.src.copy_tensor(name, dst);
        };
        let (Some(t), Some(&cols)) = (target(self.to, name, &l), l.shape.last()) else {
            return self.src.copy_tensor(name, dst);
        };
        let mut raw = vec![0u8; l.len as usize];
        self.src.copy_tensor(name, &mut raw);
        let cols = cols as usize;
        let row_in = cols * l.dtype.block_bytes() as usize;
        let row_out = cols / t.block_elems() as usize * t.block_bytes() as usize;
        let rows = raw.len() / row_in;
        let per = rows.div_ceil(self.threads).max(1);
        let from = l.dtype;
        std::thread::scope(|s| {
            for (src, out) in raw.chunks(per * row_in).zip(dst.chunks_mut(per * row_out)) {
                s.spawn(move || {
                    let mut x = vec![0f32; cols];
                    for (r, o) in src.chunks_exact(row_in).zip(out.chunks_exact_mut(row_out)) {
                        widen(from, r, &mut x);
                        quantize_row(t, &x, o);
                    }
                });
            }
        });
    }

    fn link_file(&self) -> Result<PathBuf, String> {
        Err(
            "a quantized store holds its own weights (--quantize and --link exclude each other)"
                .into(),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout(dtype: DType, shape: &[u64]) -> TensorLayout {
        TensorLayout {
            dtype,
            shape: shape.to_vec(),
            len: bytes_of(dtype, shape),
        }
    }

    #[test]
    fn matrices_are_quantized_with_llama_cpp_fallbacks_and_the_rest_kept() {
        let m = |cols| layout(DType::F16, &[8, cols]);
        let w = "model.layers.0.self_attn.q_proj.weight";
        assert_eq!(target(DType::Q4K, w, &m(512)), Some(DType::Q4K));
        assert_eq!(target(DType::Q4K, w, &m(576)), Some(DType::Q5_0));
        assert_eq!(target(DType::Q5K, w, &m(576)), Some(DType::Q5_1));
        assert_eq!(target(DType::Q6K, w, &m(576)), Some(DType::Q8_0));
        assert_eq!(target(DType::Q3K, w, &m(576)), Some(DType::Q4_0));
        assert_eq!(
            target(DType::Q8_0, w, &m(48)),
            None,
            "48 is not whole 32-blocks"
        );
        assert_eq!(
            target(DType::Q8_0, w, &layout(DType::BF16, &[2, 4, 64])),
            Some(DType::Q8_0)
        );
        assert_eq!(
            target(DType::Q8_0, "model.norm.weight", &layout(DType::F32, &[64])),
            None
        );
        assert_eq!(target(DType::Q8_0, w, &layout(DType::Q4K, &[8, 256])), None);
        assert_eq!(
            target(DType::Q8_0, "model.layers.0.mlp.gate.weight", &m(64)),
            None
        );
    }
}
