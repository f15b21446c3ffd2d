//! `sluiced bench-kernels`: what the decode kernels get out of the device's memory system.
//! The device's copy bandwidth (a device-to-device copy, timed with events on the compute
//! stream) is the reference; each GEMV kernel's effective bandwidth is the bytes of its
//! weight matrix over its time (the bytes a step must read once), at 1, 8 and 64 decode
//! rows; attention is one decode row at contexts 512, 4096 and 32768 (its time should grow
//! linearly); a mixture's decode step (`Backend::experts`) at 1 and 8 rows, against the
//! bytes of the experts it routes to. Weights and caches hold arbitrary bytes: no kernel's
//! speed depends on values.

use super::device::CudaBackend;
use super::handles::CudaMem;
use crate::backend::experts::{ExpertCall, ExpertScratch, ExpertShape, GatedAct};
use crate::backend::{
    AttnShape, AttnStep, Backend, BackendError, KvDtype, LayerCache, ScratchShape, SeqSpan,
    WeightRef,
};
use crate::dtype::DType;
use cudarc::driver::{result, sys};

/// Weight shapes of a 7B-class layer (Llama 2/3, Mistral): the attention projections and
/// the MLP's gate/up.
pub const GEMV_SHAPES: &[(usize, usize)] = &[(4096, 4096), (14336, 4096)];
pub const GEMV_ROWS: &[usize] = &[1, 8, 64];
pub const GEMV_DTYPES: &[DType] = &[
    DType::F16,
    DType::BF16,
    DType::Q8_0,
    DType::Q4_0,
    DType::Q4_1,
    DType::Q4K,
    DType::Q5K,
    DType::Q6K,
];
pub const ATTENTION_CONTEXTS: &[usize] = &[512, 4096, 32768];
/// A mixture's decode step (Qwen3-30B-A3B's experts: hidden 2048, 768 wide, top-8 of
/// 128): `EXPERT_POOL` experts on the device, each row routed to `EXPERT_TOP_K` of them.
pub const EXPERT_HIDDEN: usize = 2048;
pub const EXPERT_INTER: usize = 768;
pub const EXPERT_TOP_K: usize = 8;
pub const EXPERT_POOL: usize = 32;
pub const EXPERT_ROWS: &[usize] = &[1, 8];
pub const EXPERT_DTYPES: &[DType] = &[DType::Q4K, DType::Q8_0];
/// Calls timed together in one sample of `time_compute`.
const TIMED_CALLS: usize = 20;
/// Bytes of the device-to-device reference copy.
const COPY_BYTES: usize = 256 << 20;

/// A timed call against the weight bytes it must read once.
#[derive(Clone, Debug, serde::Serialize)]
pub struct WeightRate {
    pub weight_bytes: u64,
    pub seconds: f64,
    /// Weight bytes over the time.
    pub gbps: f64,
    /// `gbps` over the device's copy bandwidth.
    pub vs_copy: f64,
}

impl WeightRate {
    fn new(weight_bytes: u64, seconds: f64, copy_gbps: f64) -> WeightRate {
        let gbps = weight_bytes as f64 / seconds / 1e9;
        WeightRate {
            weight_bytes,
            seconds,
            gbps,
            vs_copy: gbps / copy_gbps,
        }
    }
}

#[derive(Clone, Debug, serde::Serialize)]
pub struct GemvFigure {
    pub dtype: String,
    pub m: usize,
    pub k: usize,
    pub rows: usize,
    #[serde(flatten)]
    pub rate: WeightRate,
}

#[derive(Clone, Debug, serde::Serialize)]
pub struct AttentionFigure {
    pub context: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub kv_dtype: String,
    pub seconds: f64,
    /// This context's time over the first (smallest) context's.
    pub vs_first: f64,
    /// K and V bytes read over the time.
    pub kv_gbps: f64,
}

/// `Backend::experts` for one decode step: every row's top-k experts, gate, up, the
/// activation, down and the weighted sum.
#[derive(Clone, Debug, serde::Serialize)]
pub struct ExpertsFigure {
    pub dtype: String,
    pub rows: usize,
    pub top_k: usize,
    /// Experts the step's rows routed to, distinct: the weights it must read.
    pub experts: usize,
    pub hidden: usize,
    pub intermediate: usize,
    /// Against the bytes of those experts' three matrices.
    #[serde(flatten)]
    pub rate: WeightRate,
}

#[derive(Clone, Debug, serde::Serialize)]
pub struct KernelBench {
    pub device: String,
    pub compute_capability: (i32, i32),
    /// A device-to-device copy: bytes read plus bytes written, over its time.
    pub copy_gbps: f64,
    pub gemv: Vec<GemvFigure>,
    pub attention: Vec<AttentionFigure>,
    pub experts: Vec<ExpertsFigure>,
    /// Why the mixture step's figures are missing, where they are.
    pub experts_error: Option<String>,
}

/// Runs every figure on CUDA device `ordinal`, each the median of `reps` timed launches
/// after a warm-up.
pub fn run(ordinal: usize, reps: usize) -> Result<KernelBench, BackendError> {
    let (kmax, mmax) = (4096usize, 14336usize);
    let rows_max = *GEMV_ROWS.iter().max().unwrap_or(&1);
    let weight_max = GEMV_SHAPES
        .iter()
        .flat_map(|&(m, k)| {
            GEMV_DTYPES
                .iter()
                .filter_map(move |d| d.row_bytes(k as u64).map(|r| r * m as u64))
        })
        .max()
        .unwrap_or(0);
    let attn = AttnShape {
        kv: KvDtype::F16,
        heads: 32,
        kv_heads: 8,
        head_dim: 128,
        max_context: *ATTENTION_CONTEXTS.iter().max().unwrap_or(&512),
        slots: 1,
        scale: 1.0 / (128f32).sqrt(),
    };
    let cache = LayerCache {
        base: 0,
        cap: attn.max_context,
        window: None,
    };
    let kv_bytes = (cache.elems(&attn) * attn.kv.bytes()) as u64;
    let q_bytes = (attn.heads * attn.head_dim * 4) as u64;
    let shape = ScratchShape {
        rows: rows_max as u64,
        hidden: kmax as u64,
        q_dim: kmax as u64,
        heads: attn.heads as u64,
        intermediate: mmax as u64,
        vocab: mmax as u64,
        max_context: attn.max_context,
        top_k: 0,
    };
    let acts = (rows_max * kmax * 4 + rows_max * mmax * 4) as u64;
    let page = |b: u64| b.div_ceil(1 << 20) << 20;
    let arena = super::scratch_bytes(&shape)
        + page(weight_max)
        + page(acts)
        + 2 * page(kv_bytes)
        + 2 * page(q_bytes)
        + 2 * COPY_BYTES as u64
        + (64 << 20);
    let b = CudaBackend::new(ordinal, arena, &shape)?;
    let info = b.info().clone();
    let reps = reps.max(3);

    // The reference: a device-to-device copy.
    let src = b.alloc(COPY_BYTES, "copy source")?;
    let dst = b.alloc(COPY_BYTES, "copy destination")?;
    let copy_s = b.time_compute(reps, || {
        // SAFETY: both ranges are arena allocations of COPY_BYTES.
        unsafe { result::memcpy_dtod_async(dst.ptr, src.ptr, COPY_BYTES, b.compute.cu_stream()) }
            .map_err(|e| BackendError::device("device-to-device copy", &info.name, e))
    })?;
    drop((src, dst));
    let copy_gbps = 2.0 * COPY_BYTES as f64 / copy_s / 1e9;

    let fill = |mem: &mut CudaMem, bytes: usize, seed: u64| -> Result<(), BackendError> {
        let mut rng = crate::util::rng::Rng::new(seed);
        let data: Vec<u8> = (0..bytes).map(|_| (rng.next_u64() >> 24) as u8).collect();
        b.upload(mem, &data)
    };
    let mut x = b.alloc(rows_max * kmax * 4, "activations")?;
    b.upload(&mut x, &activations(rows_max * kmax))?;
    let mut out = b.alloc(rows_max * mmax * 4, "outputs")?;
    let mut gemv = Vec::new();
    for &dt in GEMV_DTYPES {
        for &(m, k) in GEMV_SHAPES {
            let Some(rb) = dt.row_bytes(k as u64) else {
                continue;
            };
            let bytes = rb as usize * m;
            let mut w = b.alloc(bytes, "weights")?;
            fill(&mut w, bytes, 0x9e37_79b9 ^ bytes as u64)?;
            for &rows in GEMV_ROWS {
                let s = b.time_compute(reps, || {
                    let wr = WeightRef {
                        mem: &w,
                        offset: 0,
                        dtype: dt,
                        rows: m,
                        cols: k,
                    };
                    b.matmul(&x, rows, rows, wr, None, &mut out);
                    Ok(())
                })?;
                gemv.push(GemvFigure {
                    dtype: dt.to_string(),
                    m,
                    k,
                    rows,
                    rate: WeightRate::new(bytes as u64, s, copy_gbps),
                });
            }
        }
    }
    drop((x, out));
    // New in this benchmark and not yet run on a GPU: its failure leaves the other figures.
    let (experts, experts_error) = match experts_figures(&b, reps, copy_gbps, &fill) {
        Ok(f) => (f, None),
        Err(e) => (Vec::new(), Some(e.to_string())),
    };

    let kv_len = cache.elems(&attn) * attn.kv.bytes();
    let mut ck = b.alloc(kv_len, "K cache")?;
    let mut cv = b.alloc(kv_len, "V cache")?;
    b.zero(&mut ck, kv_len / 4);
    b.zero(&mut cv, kv_len / 4);
    let mut q = b.alloc(q_bytes as usize, "queries")?;
    b.zero(&mut q, q_bytes as usize / 4);
    let mut o = b.alloc(q_bytes as usize, "attention output")?;
    let mut attention = Vec::new();
    for &ctx in ATTENTION_CONTEXTS {
        let spans = [decode_row(ctx - 1)];
        let step = AttnStep {
            layer: 0,
            spans: &spans,
            shape: attn,
            cache,
            ancestors: &[],
        };
        let s = b.time_compute(reps, || {
            b.attention(&q, &ck, &cv, &step, None, &mut o);
            Ok(())
        })?;
        let first = attention.first().map_or(s, |f: &AttentionFigure| f.seconds);
        let read = 2 * ctx * attn.kv_heads * attn.head_dim * attn.kv.bytes();
        attention.push(AttentionFigure {
            context: ctx,
            heads: attn.heads,
            kv_heads: attn.kv_heads,
            head_dim: attn.head_dim,
            kv_dtype: attn.kv.to_string(),
            seconds: s,
            vs_first: s / first,
            kv_gbps: read as f64 / s / 1e9,
        });
    }
    Ok(KernelBench {
        device: info.name.clone(),
        compute_capability: info.compute_capability,
        copy_gbps,
        gemv,
        attention,
        experts,
        experts_error,
    })
}

/// `n` f32 activations of moderate size, as bytes (random f32 bits could be NaN; speed
/// does not care, but the figures should come from ordinary numbers).
fn activations(n: usize) -> Vec<u8> {
    (0..n)
        .flat_map(|i| (((i * 7919) % 2001) as f32 / 1000.0 - 1.0).to_le_bytes())
        .collect()
}

/// Row r's experts: EXPERT_TOP_K distinct ones of the pool, spread as a router's would be.
fn routed(r: usize) -> Vec<usize> {
    let mut chosen = Vec::with_capacity(EXPERT_TOP_K);
    let mut h = (r as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    while chosen.len() < EXPERT_TOP_K.min(EXPERT_POOL) {
        h ^= h >> 29;
        h = h.wrapping_mul(0xbf58_476d_1ce4_e5b9);
        let e = (h >> 32) as usize % EXPERT_POOL;
        if !chosen.contains(&e) {
            chosen.push(e);
        }
    }
    chosen
}

/// A mixture's decode step at each of EXPERT_ROWS rows, for each of EXPERT_DTYPES.
fn experts_figures(
    b: &CudaBackend,
    reps: usize,
    copy_gbps: f64,
    fill: &dyn Fn(&mut CudaMem, usize, u64) -> Result<(), BackendError>,
) -> Result<Vec<ExpertsFigure>, BackendError> {
    let (h, inter) = (EXPERT_HIDDEN, EXPERT_INTER);
    let rows_max = EXPERT_ROWS.iter().copied().max().unwrap_or(1);
    let pairs_max = rows_max * EXPERT_TOP_K;
    let mut x = b.alloc(rows_max * h * 4, "expert activations")?;
    b.upload(&mut x, &activations(rows_max * h))?;
    let mut out = b.alloc(rows_max * h * 4, "expert outputs")?;
    let mut sx = b.alloc(pairs_max * h * 4, "expert scratch x")?;
    let mut gate = b.alloc(pairs_max * inter * 4, "expert scratch gate")?;
    let mut up = b.alloc(pairs_max * inter * 4, "expert scratch up")?;
    let mut y = b.alloc(pairs_max * h * 4, "expert scratch y")?;
    let mut figures = Vec::new();
    for &dt in EXPERT_DTYPES {
        let (Some(rb_h), Some(rb_i)) = (dt.row_bytes(h as u64), dt.row_bytes(inter as u64)) else {
            continue;
        };
        // Gate and up: inter rows of h; down: h rows of inter.
        let sizes = [
            rb_h as usize * inter,
            rb_h as usize * inter,
            rb_i as usize * h,
        ];
        let per_expert: usize = sizes.iter().sum();
        let mut mats = Vec::with_capacity(EXPERT_POOL * 3);
        for e in 0..EXPERT_POOL {
            for (i, &n) in sizes.iter().enumerate() {
                let mut m = b.alloc(n, "expert weights")?;
                fill(&mut m, n, 0x5eed ^ (e * 3 + i) as u64)?;
                mats.push(m);
            }
        }
        for &rows in EXPERT_ROWS {
            // Expert-major, as the decoder makes them: each expert with its rows ascending.
            let mut by_expert: Vec<(Vec<u32>, Vec<f32>)> =
                vec![(Vec::new(), Vec::new()); EXPERT_POOL];
            for r in 0..rows {
                for e in routed(r) {
                    by_expert[e].0.push(r as u32);
                    by_expert[e].1.push(1.0 / EXPERT_TOP_K as f32);
                }
            }
            let used: Vec<usize> = (0..EXPERT_POOL)
                .filter(|&e| !by_expert[e].0.is_empty())
                .collect();
            let wref = |e: usize, i: usize| WeightRef {
                mem: &mats[e * 3 + i],
                offset: 0,
                dtype: dt,
                rows: if i == 2 { h } else { inter },
                cols: if i == 2 { inter } else { h },
            };
            let calls: Vec<ExpertCall<'_, CudaMem>> = used
                .iter()
                .map(|&e| ExpertCall {
                    w: [wref(e, 0), wref(e, 1), wref(e, 2)],
                    bias: None,
                    rows: &by_expert[e].0,
                    weights: &by_expert[e].1,
                })
                .collect();
            let shape = ExpertShape {
                hidden: h,
                act: GatedAct::Silu,
                decode: true,
            };
            let s = b.time_compute(reps, || {
                let scratch = ExpertScratch {
                    x: &mut sx,
                    gate: &mut gate,
                    up: &mut up,
                    y: &mut y,
                };
                b.experts(&x, shape, &calls, scratch, &mut out);
                Ok(())
            })?;
            let bytes = (used.len() * per_expert) as u64;
            figures.push(ExpertsFigure {
                dtype: dt.to_string(),
                rows,
                top_k: EXPERT_TOP_K,
                experts: used.len(),
                hidden: h,
                intermediate: inter,
                rate: WeightRate::new(bytes, s, copy_gbps),
            });
        }
    }
    Ok(figures)
}

impl CudaBackend {
    /// Seconds one call of `f` (which enqueues work on the compute stream) takes on the
    /// device: the median over `reps` samples, each `TIMED_CALLS` calls in a row between
    /// two events (so the device is not left idle waiting for the next launch), after one
    /// warm-up call. Fails with the first error of the enqueued work.
    pub(super) fn time_compute(
        &self,
        reps: usize,
        mut f: impl FnMut() -> Result<(), BackendError>,
    ) -> Result<f64, BackendError> {
        let dev = self.info.name.as_str();
        let err = |what: &'static str| move |e| BackendError::device(what, dev, e);
        self.ctx.bind_to_thread().map_err(err("bind"))?;
        let ev = || {
            self.ctx
                .new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
                .map_err(err("event"))
        };
        let (start, end) = (ev()?, ev()?);
        f()?;
        self.compute.synchronize().map_err(err("synchronize"))?;
        self.check()?;
        let mut times = Vec::with_capacity(reps);
        for _ in 0..reps {
            start.record(&self.compute).map_err(err("event"))?;
            for _ in 0..TIMED_CALLS {
                f()?;
            }
            end.record(&self.compute).map_err(err("event"))?;
            let ms = start.elapsed_ms(&end).map_err(err("timing"))?;
            times.push(ms as f64 / 1e3 / TIMED_CALLS as f64);
        }
        self.check()?;
        times.sort_by(|a, b| a.total_cmp(b));
        Ok(times[times.len() / 2])
    }
}

/// One decode row at position `pos` of slot 0.
fn decode_row(pos: usize) -> SeqSpan {
    SeqSpan {
        row: 0,
        n: 1,
        pos,
        slot: 0,
    }
}
