//! A mixture of experts on the device: the routing (`router_topk_f32`: k experts and
//! weights a row come back to the host instead of every logit) and the grouped form of a
//! step's decode rows (`Backend::experts`): every (expert, row) pair of the call in one
//! grouped GEMV for gate, one for up, one activation, one grouped GEMV for down and one
//! combine per chunk, where one expert after another costs a gather, two GEMVs, the
//! activation, a GEMV and a scatter each. A pair's arithmetic is the per-expert path's
//! (the same warp dot product, the same rounded product and sum into its row, in
//! ascending expert order), so both give the same bits.

use super::device::CudaBackend;
use super::handles::CudaMem;
use super::kernels::{Dims, Kernel};
use crate::backend::{ExpertCall, ExpertScratch, ExpertShape, GatedAct, RouteGating, WeightRef};
use crate::dtype::DType;
use cudarc::driver::result;

/// The dtype code of `add_bias_grouped_f32` (None: a bias it does not read).
fn bias_code(d: DType) -> Option<i32> {
    match d {
        DType::F32 => Some(0),
        DType::F16 => Some(1),
        DType::BF16 => Some(2),
        _ => None,
    }
}

/// Whether a weight lies inside its allocation, `rows` x `cols` of its dtype.
fn fits(w: &WeightRef<'_, CudaMem>) -> bool {
    w.dtype
        .row_bytes(w.cols as u64)
        .and_then(|rb| (rb as usize).checked_mul(w.rows))
        .and_then(|n| n.checked_add(w.offset))
        .is_some_and(|end| end <= w.mem.len)
}

impl CudaBackend {
    /// The grouped form of `experts` for a decode call; Ok(false) when the call is not one
    /// it takes (prefill rows, experts of different dtypes or shapes, an odd bias), and
    /// the caller runs the experts one after another.
    pub(super) fn experts_grouped(
        &self,
        x: &CudaMem,
        shape: ExpertShape,
        calls: &[ExpertCall<'_, CudaMem>],
        s: &mut ExpertScratch<'_, CudaMem>,
        out: &mut CudaMem,
    ) -> Result<bool, String> {
        let Some(first) = calls.first() else {
            return Ok(true);
        };
        let h = shape.hidden;
        let inter = first.w[0].rows;
        let same = |c: &ExpertCall<'_, CudaMem>| {
            let shapes = c.w[0].rows == inter
                && c.w[0].cols == h
                && c.w[1].rows == inter
                && c.w[1].cols == h
                && c.w[2].rows == h
                && c.w[2].cols == inter
                && (0..3).all(|i| c.w[i].dtype == first.w[i].dtype);
            let bias = match (c.bias, first.bias) {
                (None, None) => true,
                (Some(b), Some(f)) => (0..3).all(|i| {
                    b[i].dtype == f[i].dtype
                        && b[i].rows * b[i].cols == [inter, inter, h][i]
                        && bias_code(b[i].dtype).is_some()
                }),
                _ => false,
            };
            shapes && bias && c.rows.len() == c.weights.len()
        };
        if !shape.decode || inter == 0 || h == 0 || !calls.iter().all(same) {
            return Ok(false);
        }
        for c in calls {
            if !c.w.iter().chain(c.bias.iter().flatten()).all(fits) {
                return Err("an expert's weights lie past their allocation".into());
            }
        }
        let top = calls
            .iter()
            .flat_map(|c| c.rows.iter())
            .map(|&r| r as usize + 1)
            .max()
            .unwrap_or(0);
        if top * h * 4 > x.len || top * h * 4 > out.len {
            return Err("expert rows outside the activations".into());
        }
        // Pairs a chunk holds: what the scratch and the metadata slots have room for.
        let cap = super::meta::grouped_capacity(
            (s.gate.len, s.up.len, s.y.len),
            (inter, h),
            self.layout.rows as usize,
        );
        if cap == 0 {
            return Err("no room for one expert row in the scratch".into());
        }
        self.ctx.bind_to_thread().map_err(|e| e.to_string())?;
        let mut guard = self
            .group
            .lock()
            .map_err(|_| "expert group lock poisoned")?;
        let g = &mut *guard;
        let n: usize = calls.iter().map(|c| c.rows.len()).sum();
        let mut pairs = calls
            .iter()
            .flat_map(|c| c.rows.iter().zip(c.weights).map(move |(&r, &w)| (c, r, w)));
        for chunk in super::meta::grouped_chunks(n, cap) {
            g.clear();
            for (c, r, wt) in pairs.by_ref().take(chunk.len()) {
                for i in 0..3 {
                    g.w[i].push(c.w[i].mem.ptr + c.w[i].offset as u64);
                    if let Some(b) = c.bias {
                        g.bias[i].push(b[i].mem.ptr + b[i].offset as u64);
                    }
                }
                g.x_rows.push(r);
                g.weights.push(wt);
            }
            // Per step row, its pairs ascending: pairs come expert-major, so in ascending
            // expert order.
            g.index();
            let dev = {
                let mut m = self.meta.lock().map_err(|_| "metadata lock poisoned")?;
                m.group(&self.compute, g)?
            };
            self.group_chunk(x, shape, first, g, &dev, s, out)?;
        }
        Ok(true)
    }

    /// One chunk of `experts_grouped`, its metadata on the device (`dev`).
    #[allow(clippy::too_many_arguments)] // the chunk, its metadata and the call's buffers
    fn group_chunk(
        &self,
        x: &CudaMem,
        shape: ExpertShape,
        first: &ExpertCall<'_, CudaMem>,
        g: &super::meta::GroupHost,
        dev: &super::meta::GroupDev,
        s: &mut ExpertScratch<'_, CudaMem>,
        out: &mut CudaMem,
    ) -> Result<(), String> {
        let (n, h, inter) = (g.pairs(), shape.hidden, first.w[0].rows);
        // No run of pairs on one expert (a batch-1 step's top-k): each pair alone, at the
        // one-row kernel's registers; else blocks of GEMV_R pairs, a run of them on one
        // expert reading its weights once. Either way a pair's bits are its row's.
        let singles = g.w.iter().all(|w| w.windows(2).all(|p| p[0] != p[1]));
        let gemv = |i: usize, x_rows: u64, xp: u64, outp: u64, m: usize, k: usize| {
            let (dims, kernel) = if singles {
                (
                    Dims::gemv1_grouped(m, n),
                    Kernel::gemv1_grouped(first.w[i].dtype),
                )
            } else {
                (
                    Dims::gemv(m, n, first.w[i].dtype),
                    Kernel::gemv_grouped(first.w[i].dtype),
                )
            };
            self.kernels.gemv_grouped(
                &self.compute,
                kernel,
                dims,
                dev.w[i],
                x_rows,
                xp,
                outp,
                m as i32,
                k as i32,
                n as i32,
            )
        };
        let bias = |i: usize, outp: u64, cols: usize| -> Result<(), String> {
            let Some(b) = first.bias else {
                return Ok(());
            };
            let code = bias_code(b[i].dtype).ok_or("an expert bias of a dtype without a kernel")?;
            let dims = Dims::per_row(n);
            self.kernels.add_bias_grouped(
                &self.compute,
                Kernel::AddBiasGroupedF32,
                dims,
                outp,
                dev.bias[i],
                code,
                cols as i32,
            )
        };
        gemv(0, dev.x_rows, x.ptr, s.gate.ptr, inter, h)?;
        bias(0, s.gate.ptr, inter)?;
        gemv(1, dev.x_rows, x.ptr, s.up.ptr, inter, h)?;
        bias(1, s.up.ptr, inter)?;
        let cells = n * inter;
        match shape.act {
            GatedAct::Silu => self.elementwise(Kernel::SiluMulF32, s.gate, s.up, cells)?,
            GatedAct::GeluTanh => self.elementwise(Kernel::GeluMulF32, s.gate, s.up, cells)?,
            GatedAct::SwigluClamp { alpha, limit } => self.kernels.swiglu_clamp(
                &self.compute,
                Kernel::SwigluClampMulF32,
                Dims::per_element(cells as u64),
                s.gate.ptr,
                s.up.ptr,
                cells as i32,
                alpha,
                limit,
            )?,
        }
        // Down reads pair p's own activation row (x_rows null: row p).
        gemv(2, 0, s.gate.ptr, s.y.ptr, h, inter)?;
        bias(2, s.y.ptr, h)?;
        self.kernels.combine_rows(
            &self.compute,
            Kernel::CombineRowsF32,
            Dims::per_row(g.row_ids.len()),
            s.y.ptr,
            dev.row_ids,
            dev.starts,
            dev.pair_ids,
            dev.weights,
            out.ptr,
            h as i32,
        )
    }

    /// `route_top_k` on the device: Ok(false) where the kernel does not take the shape.
    pub(super) fn route_on_device(
        &self,
        logits: &CudaMem,
        (rows, n, k): (usize, usize, usize),
        gating: RouteGating,
        chosen: &mut Vec<(u32, f32)>,
    ) -> Result<bool, String> {
        let smem = n * 5;
        let room = (self.layout.route_bytes as usize) / 8;
        if k == 0 || k > n || rows * k > room || smem > 48 << 10 || rows == 0 {
            return Ok(rows == 0 && k > 0 && k <= n);
        }
        if logits.len < rows * n * 4 {
            return Err(format!(
                "{rows} rows of {n} router logits past an allocation of {} bytes",
                logits.len
            ));
        }
        self.ctx.bind_to_thread().map_err(|e| e.to_string())?;
        let experts = self.meta_dev.ptr + self.layout.route_off;
        let weights = experts + (rows * k * 4) as u64;
        let dims = Dims {
            grid: (rows as u32, 1, 1),
            block: 32,
            smem: smem as u32,
        };
        let (gate, norm) = match gating {
            RouteGating::SoftmaxTopK { norm } => (0, norm),
            RouteGating::TopKSoftmax => (1, false),
        };
        self.kernels.router_topk(
            &self.compute,
            Kernel::RouterTopkF32,
            dims,
            logits.ptr,
            experts,
            weights,
            n as i32,
            k as i32,
            gate,
            norm as i32,
        )?;
        let mut guard = self
            .group
            .lock()
            .map_err(|_| "expert group lock poisoned")?;
        let g = &mut *guard;
        let (e, w) = (&mut g.route_experts, &mut g.route_weights);
        e.clear();
        e.resize(rows * k, 0);
        w.clear();
        w.resize(rows * k, 0.0);
        // SAFETY: both ranges lie inside the metadata allocation's routing part (rows * k
        // * 8 <= route_bytes, checked); the stream is synchronized before they are read.
        unsafe {
            result::memcpy_dtoh_async(&mut e[..], experts, self.compute.cu_stream())
                .map_err(|e| e.to_string())?;
            result::memcpy_dtoh_async(&mut w[..], weights, self.compute.cu_stream())
                .map_err(|e| e.to_string())?;
        }
        self.compute.synchronize().map_err(|e| e.to_string())?;
        if let Some(bad) = e.iter().find(|&&x| x as usize >= n) {
            return Err(format!("the routing kernel chose expert {bad} of {n}"));
        }
        chosen.extend(e.iter().copied().zip(w.iter().copied()));
        Ok(true)
    }
}
