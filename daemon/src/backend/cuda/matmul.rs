//! Matrix products on the device: decode rows through the GEMV kernels (dequantizing in
//! registers, each weight read once for up to GEMV_R rows), prefill rows through cuBLAS
//! (f32 SGEMM; GemmEx on bf16 weights; f16 and quantized weights dequantized tile by tile
//! into f32 first), then the bias.

use super::device::CudaBackend;
use super::handles::CudaMem;
use super::kernels::{Dims, Kernel};
use crate::backend::WeightRef;
use crate::dtype::DType;
use cudarc::cublas::{result as blas, sys as bsys};
use std::ffi::c_void;

impl CudaBackend {
    pub(super) fn matmul_inner(
        &self,
        x: &CudaMem,
        rows: usize,
        g: usize,
        w: WeightRef<'_, CudaMem>,
        bias: Option<WeightRef<'_, CudaMem>>,
        out: &mut CudaMem,
    ) -> Result<(), String> {
        let (m, k) = (w.rows, w.cols);
        if x.len < rows * k * 4 || out.len < rows * m * 4 || g > rows {
            return Err(format!(
                "shapes: x {} bytes, out {} bytes for [{rows}, {k}] x [{m}, {k}]^T",
                x.len, out.len
            ));
        }
        let rb = w.dtype.row_bytes(k as u64).ok_or("row size")? as usize;
        let wptr = w.mem.ptr + w.offset as u64;
        if w.offset + rb * m > w.mem.len {
            return Err(format!("weight of {} bytes past its allocation", rb * m));
        }
        let (mi, ki) = (m as i32, k as i32);
        if g > 0 && !wptr.is_multiple_of(2) {
            // The GEMVs load the GGML blocks (2-byte aligned by their layout) 16 bits at a time.
            return Err(format!(
                "a {} weight at the odd device address {wptr:#x}",
                w.dtype
            ));
        }
        if g == 1 {
            // One decode row (batch-1 decode): the same arithmetic in a kernel with the
            // one-row path's registers only.
            self.kernels.gemv1(
                &self.compute,
                Kernel::gemv1(w.dtype),
                Dims::gemv1(m),
                wptr,
                x.ptr,
                out.ptr,
                mi,
                ki,
            )?;
        } else if g > 1 {
            // Decode rows: the format's weight rows (`gemv_w`: GEMV_W, 2 for Q6_K) to a
            // block of 128 threads, dequantized in registers once for up to GEMV_R rows; a
            // row's result never depends on the other rows.
            let dims = Dims::gemv(m, g, w.dtype);
            let gemv = Kernel::gemv(w.dtype);
            self.kernels.gemv(
                &self.compute,
                gemv,
                dims,
                wptr,
                x.ptr,
                out.ptr,
                mi,
                ki,
                g as i32,
            )?;
        }
        let t = rows - g;
        if t > 0 {
            let xp = x.ptr + (g * k * 4) as u64;
            let op = out.ptr + (g * m * 4) as u64;
            self.prefill_rows(&w, wptr, rb, t, xp, op)?;
        }
        if let Some(b) = bias {
            self.add_bias(&b, m, rows, out.ptr)?;
        }
        // The output may be where the converted activations came from.
        if let Ok(mut held) = self.half_src.lock() {
            if held.is_some_and(|(src, n)| overlaps(src, n * 4, out.ptr, rows * m * 4)) {
                *held = None;
            }
        }
        Ok(())
    }

    /// `t` prefill rows (activations at `xp`, outputs at `op`, row stride m) through cuBLAS:
    /// f32 weights by SGEMM, bf16 by GemmEx on activations converted to bf16 (bf16 has
    /// f32's range), f16 and quantized ones dequantized a tile of rows at a time into f32
    /// first.
    fn prefill_rows(
        &self,
        w: &WeightRef<'_, CudaMem>,
        wptr: u64,
        rb: usize,
        t: usize,
        xp: u64,
        op: u64,
    ) -> Result<(), String> {
        let (m, k) = (w.rows, w.cols);
        let (mi, ki) = (m as i32, k as i32);
        let blas_h = self.blas.lock().map_err(|_| "cuBLAS lock poisoned")?;
        match w.dtype {
            DType::F32 => sgemm(blas_h.0, m, t, k, wptr, xp, op, m)?,
            DType::BF16 => {
                if (t * k * 2) as u64 > self.layout.half {
                    return Err(format!(
                        "{t} prefill rows exceed the half-precision scratch"
                    ));
                }
                // The q, k and v projections (and gate and up) multiply the same
                // activations: converted once, reused while nothing has written them.
                let n = t * k;
                let mut held = self.half_src.lock().map_err(|_| "scratch lock poisoned")?;
                if *held != Some((xp, n)) {
                    let dims = Dims::per_element(n as u64);
                    self.kernels.convert(
                        &self.compute,
                        Kernel::F32ToBf16,
                        dims,
                        xp,
                        self.half.ptr,
                        n as u64,
                    )?;
                    *held = Some((xp, n));
                }
                let ty = bsys::cudaDataType::CUDA_R_16BF;
                let (alpha, beta) = (1f32, 0f32);
                // out^T[m, t] = W[m, k] . X^T[k, t] in cuBLAS's column-major terms:
                // W row-major is W^T column-major (ld k), X row-major is X^T (ld k).
                // SAFETY: pointers inside the arena with the sizes checked above.
                unsafe {
                    blas::gemm_ex(
                        blas_h.0,
                        bsys::cublasOperation_t::CUBLAS_OP_T,
                        bsys::cublasOperation_t::CUBLAS_OP_N,
                        mi,
                        t as i32,
                        ki,
                        &alpha as *const f32 as *const c_void,
                        wptr as *const c_void,
                        ty,
                        ki,
                        self.half.ptr as *const c_void,
                        ty,
                        ki,
                        &beta as *const f32 as *const c_void,
                        op as *mut c_void,
                        bsys::cudaDataType::CUDA_R_32F,
                        mi,
                        bsys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                        bsys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
                    )
                }
                .map_err(|e| format!("cublasGemmEx: {e:?}"))?;
            }
            _ => {
                // Quantized, and f16 (whose activations would saturate at 65504 as f16):
                // dequantize a tile of weight rows to f32, then sgemm it.
                let tile_rows = (self.layout.tile as usize / (k * 4)).max(1).min(m);
                let dequant =
                    Kernel::dequant(w.dtype).ok_or("an f32 weight has no dequantization")?;
                let mut j0 = 0;
                while j0 < m {
                    let nb = tile_rows.min(m - j0);
                    let n = (nb * k) as u64;
                    let rows_at = wptr + (j0 * rb) as u64;
                    self.kernels.dequant(
                        &self.compute,
                        dequant,
                        Dims::per_element(n),
                        rows_at,
                        self.tile.ptr,
                        n,
                    )?;
                    sgemm(
                        blas_h.0,
                        nb,
                        t,
                        k,
                        self.tile.ptr,
                        xp,
                        op + (j0 * 4) as u64,
                        m,
                    )?;
                    j0 += nb;
                }
            }
        }
        Ok(())
    }

    /// out[r][c] += bias[c] for `rows` rows of `m` (a 16-bit bias is converted first).
    fn add_bias(
        &self,
        b: &WeightRef<'_, CudaMem>,
        m: usize,
        rows: usize,
        out: u64,
    ) -> Result<(), String> {
        let mi = m as i32;
        let n = b.rows * b.cols;
        if n != m {
            return Err(format!("bias of {n} values for {m} outputs"));
        }
        let bptr = match b.dtype {
            DType::F32 => b.mem.ptr + b.offset as u64,
            DType::F16 | DType::BF16 => {
                let dequant = if b.dtype == DType::F16 {
                    Kernel::DequantF16
                } else {
                    Kernel::DequantBf16
                };
                let n = n as u64;
                let src = b.mem.ptr + b.offset as u64;
                let dims = Dims::per_element(n);
                self.kernels
                    .dequant(&self.compute, dequant, dims, src, self.bias.ptr, n)?;
                self.bias.ptr
            }
            d => return Err(format!("a {d:?} bias")),
        };
        let dims = Dims::per_element((rows * m) as u64);
        self.kernels.add_bias(
            &self.compute,
            Kernel::AddBiasF32,
            dims,
            out,
            bptr,
            rows as i32,
            mi,
        )?;
        Ok(())
    }
}

/// out[t, m] (row stride ldo) = X[t, k] . W[m, k]^T, all f32, through cuBLAS (full f32
/// math: the default math mode does not use TF32).
// The operands of one GEMM, as cuBLAS takes them.
#[allow(clippy::too_many_arguments)]
fn sgemm(
    h: bsys::cublasHandle_t,
    m: usize,
    t: usize,
    k: usize,
    w: u64,
    x: u64,
    out: u64,
    ldo: usize,
) -> Result<(), String> {
    let (alpha, beta) = (1f32, 0f32);
    // SAFETY: pointers inside the arena; sizes checked by the caller.
    unsafe {
        blas::sgemm(
            h,
            bsys::cublasOperation_t::CUBLAS_OP_T,
            bsys::cublasOperation_t::CUBLAS_OP_N,
            m as i32,
            t as i32,
            k as i32,
            &alpha,
            w as *const f32,
            k as i32,
            x as *const f32,
            k as i32,
            &beta,
            out as *mut f32,
            ldo as i32,
        )
    }
    .map_err(|e| format!("cublasSgemm: {e:?}"))
}

/// Whether byte ranges [a, a + a_len) and [b, b + b_len) share a byte.
fn overlaps(a: u64, a_len: usize, b: u64, b_len: usize) -> bool {
    a < b + b_len as u64 && b < a + a_len as u64
}
