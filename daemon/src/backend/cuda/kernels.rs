//! The kernel table: every `extern "C"` kernel of kernels/*.cu with its parameter list,
//! resolved to a loaded function once at start, and one typed launcher per family of
//! kernels that share a signature. A launcher takes exactly the kernel's parameters, in
//! its order and at its widths, so no call site builds a pointer array by hand; the
//! parameter lists here are checked against the kernel sources (`entry_signatures`) by
//! tests/tests/nvrtc.rs.

use super::{entry_signatures, source, DeviceInfo, KERNELS};
use crate::backend::BackendError;
use crate::dtype::DType;
use cudarc::driver::{result, CudaContext, CudaFunction, CudaStream};
use std::ffi::c_void;
use std::sync::Arc;

/// Activation rows one decode-row GEMV block applies each weight chunk to (`GEMV_R` in
/// kernels/common.cuh): a step's B decode rows read every weight ceil(B / GEMV_R) times.
pub const GEMV_R: usize = 8;

/// Weight rows one block of a decode-row GEMV takes (`GEMV_W` in kernels/common.cuh): each
/// activation chunk a thread loads serves that many weight rows.
pub const GEMV_W: usize = 4;

/// Threads of a decode-row GEMV block (`GEMV_THREADS` in kernels/common.cuh: its
/// reduction sums that many threads' partials, so a launch must use exactly this).
pub const GEMV_THREADS: u32 = 128;

/// Weight rows one block of a multi-row GEMV takes for weights of dtype `d` (`W` of its
/// chunk format in kernels/*.cu): GEMV_W, but two for Q6_K (faster so on an H200, where
/// the other formats were slower or mixed).
pub fn gemv_w(d: DType) -> usize {
    match d {
        DType::Q6K => 2,
        _ => GEMV_W,
    }
}

/// Weight rows one block of the one-row GEMV takes (`GEMV1_W` in kernels/common.cuh).
pub const GEMV1_W: usize = 2;

/// Grid, block and dynamic shared memory of one launch.
#[derive(Clone, Copy, Debug)]
pub struct Dims {
    pub grid: (u32, u32, u32),
    pub block: u32,
    pub smem: u32,
}

impl Dims {
    /// One thread per element, 256 to a block.
    pub fn per_element(n: u64) -> Dims {
        Dims {
            grid: (n.div_ceil(256) as u32, 1, 1),
            block: 256,
            smem: 0,
        }
    }

    /// No thread would run: a grid or block dimension is 0.
    pub fn is_empty(&self) -> bool {
        let (x, y, z) = self.grid;
        x == 0 || y == 0 || z == 0 || self.block == 0
    }

    /// A block of 256 threads per row.
    pub fn per_row(rows: usize) -> Dims {
        Dims {
            grid: (rows as u32, 1, 1),
            block: 256,
            smem: 0,
        }
    }

    /// The one-row GEMV of `m` weight rows: blocks of GEMV_THREADS that split each of their
    /// GEMV1_W weight rows.
    pub fn gemv1(m: usize) -> Dims {
        Dims {
            grid: (m.div_ceil(GEMV1_W) as u32, 1, 1),
            block: GEMV_THREADS,
            smem: 0,
        }
    }

    /// `gemv1_grouped` of `m` weight rows for `pairs` pairs: one block row per pair.
    pub fn gemv1_grouped(m: usize, pairs: usize) -> Dims {
        Dims {
            grid: (m.div_ceil(GEMV1_W) as u32, pairs as u32, 1),
            block: GEMV_THREADS,
            smem: 0,
        }
    }

    /// A decode-row GEMV (plain or grouped) of `m` weight rows of dtype `d` against `rows`
    /// activation rows (or pairs): blocks of GEMV_THREADS that split each of their
    /// `gemv_w(d)` weight rows, up to GEMV_R activation rows to a block.
    pub fn gemv(m: usize, rows: usize, d: DType) -> Dims {
        Dims {
            grid: (
                m.div_ceil(gemv_w(d)) as u32,
                rows.div_ceil(GEMV_R) as u32,
                1,
            ),
            block: GEMV_THREADS,
            smem: 0,
        }
    }
}

macro_rules! kernels {
    ($(
        $(#[$doc:meta])*
        $family:ident($($arg:ident: $rty:ty = $cty:literal),* $(,)?) {
            $($variant:ident = $name:literal),* $(,)?
        }
    )*) => {
        /// Every kernel in kernels/*.cu.
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        pub enum Kernel {
            $($($variant,)*)*
        }

        /// Each family's parameter list as the kernel sources declare it (types only).
        // The families are named as their launchers, in lower case.
        #[allow(non_upper_case_globals)]
        mod signature {
            $(pub const $family: &[&str] = &[$($cty),*];)*
        }

        impl Kernel {
            pub const ALL: &'static [Kernel] = &[$($(Kernel::$variant,)*)*];

            /// The `extern "C"` name.
            pub fn name(self) -> &'static str {
                match self {
                    $($(Kernel::$variant => $name,)*)*
                }
            }

            /// The parameter types, normalized as `entry_signatures` writes them.
            pub fn signature(self) -> &'static [&'static str] {
                match self {
                    $($(Kernel::$variant => signature::$family,)*)*
                }
            }
        }

        impl KernelTable {
            $(
                $(#[$doc])*
                #[allow(clippy::too_many_arguments)] // exactly the kernel's parameters
                pub fn $family(
                    &self,
                    stream: &CudaStream,
                    kernel: Kernel,
                    dims: Dims,
                    $($arg: $rty),*
                ) -> Result<(), String> {
                    if !matches!(kernel, $(Kernel::$variant)|*) {
                        return Err(format!(
                            "kernel {} does not take the parameters of {}",
                            kernel.name(),
                            stringify!($family)
                        ));
                    }
                    $(let mut $arg = $arg;)*
                    let mut args = [$(&mut $arg as *mut $rty as *mut c_void),*];
                    self.launch(stream, kernel, dims, &mut args)
                }
            )*
        }
    };
}

kernels! {
    /// `x[i] op= y[i]` for `n` elements.
    elementwise(x: u64 = "float*", y: u64 = "const float*", n: i32 = "int") {
        AddF32 = "add_f32",
        SiluMulF32 = "silu_mul_f32",
        GeluMulF32 = "gelu_mul_f32",
    }
    /// gpt-oss's clamped SwiGLU: `x[i] = act(x[i], y[i])` for `n` elements.
    swiglu_clamp(x: u64 = "float*", y: u64 = "const float*", n: i32 = "int", alpha: f32 = "float", limit: f32 = "float") {
        SwigluClampMulF32 = "swiglu_clamp_mul_f32",
    }
    /// A mixture's rows routed to one expert, gathered.
    gather_rows(src: u64 = "const float*", rows: u64 = "const u32*", dst: u64 = "float*", cols: i32 = "int") {
        GatherRowsF32 = "gather_rows_f32",
    }
    /// An expert's output rows added back to theirs with their routing weights.
    scatter_add_rows(
        src: u64 = "const float*",
        rows: u64 = "const u32*",
        weights: u64 = "const float*",
        dst: u64 = "float*",
        cols: i32 = "int",
    ) {
        ScatterAddRowsF32 = "scatter_add_rows_f32",
    }
    /// Pair p's output row += its expert's bias (`bias[p]`, of dtype 0 f32, 1 f16, 2 bf16).
    add_bias_grouped(out: u64 = "float*", bias: u64 = "const unsigned long long*", dtype: i32 = "int", cols: i32 = "int") {
        AddBiasGroupedF32 = "add_bias_grouped_f32",
    }
    /// Each row of a grouped expert chunk += its pairs' outputs, weighted, in pair order.
    combine_rows(
        y: u64 = "const float*",
        row_ids: u64 = "const u32*",
        starts: u64 = "const u32*",
        pair_ids: u64 = "const u32*",
        weights: u64 = "const float*",
        dst: u64 = "float*",
        cols: i32 = "int",
    ) {
        CombineRowsF32 = "combine_rows_f32",
    }
    /// A mixture's routing: each row's top-k experts and weights.
    router_topk(
        logits: u64 = "const float*",
        experts: u64 = "u32*",
        weights: u64 = "float*",
        n: i32 = "int",
        k: i32 = "int",
        gating: i32 = "int",
        norm: i32 = "int",
    ) {
        RouterTopkF32 = "router_topk_f32",
    }
    /// `x[i] *= s` for `n` elements.
    scale(x: u64 = "float*", s: f32 = "float", n: i32 = "int") {
        ScaleF32 = "scale_f32",
    }
    /// `out[r][c] += bias[c]`.
    add_bias(out: u64 = "float*", bias: u64 = "const float*", rows: i32 = "int", cols: i32 = "int") {
        AddBiasF32 = "add_bias_f32",
    }
    /// Causal grouped-query attention of each row over its sequence's cache (f32, or f16
    /// as u16), one split of positions per block: each split's max, sum and weighted V per
    /// head.
    attention_part(
        q: u64 = "const float*",
        cache_k: u64 = "const void*",
        cache_v: u64 = "const void*",
        part: u64 = "float*",
        pos: u64 = "const u32*",
        base: u64 = "const unsigned long long*",
        anc: u64 = "const unsigned long long*",
        heads: i32 = "int",
        kv_heads: i32 = "int",
        head_dim: i32 = "int",
        scale: f32 = "float",
        cap: i32 = "int",
        window: i32 = "int",
        split: i32 = "int",
        s_max: i32 = "int",
    ) {
        AttentionPartF32 = "attention_part_f32",
        AttentionPartF16 = "attention_part_f16",
    }
    /// Each row's attention output from its splits' partials (and the sinks).
    attention_combine(
        part: u64 = "const float*",
        out: u64 = "float*",
        pos: u64 = "const u32*",
        heads: i32 = "int",
        head_dim: i32 = "int",
        window: i32 = "int",
        split: i32 = "int",
        s_max: i32 = "int",
        sinks: u64 = "const float*",
    ) {
        AttentionCombineF32 = "attention_combine_f32",
    }
    /// f32 activations to bf16 for cuBLAS GemmEx on bf16 weights.
    convert(x: u64 = "const float*", out: u64 = "u16*", n: u64 = "unsigned long long") {
        F32ToBf16 = "f32_to_bf16",
    }
    /// Gathers embedding rows, dequantized to f32.
    embedding(table: u64 = "const u8*", ids: u64 = "const u32*", out: u64 = "float*", cols: i32 = "int") {
        EmbeddingF32 = "embedding_f32",
        EmbeddingF16 = "embedding_f16",
        EmbeddingBf16 = "embedding_bf16",
        EmbeddingQ8_0 = "embedding_q8_0",
        EmbeddingQ4_0 = "embedding_q4_0",
        EmbeddingQ4_1 = "embedding_q4_1",
        EmbeddingQ5_0 = "embedding_q5_0",
        EmbeddingQ5_1 = "embedding_q5_1",
        EmbeddingQ2K = "embedding_q2_k",
        EmbeddingQ3K = "embedding_q3_k",
        EmbeddingQ4K = "embedding_q4_k",
        EmbeddingQ5K = "embedding_q5_k",
        EmbeddingQ6K = "embedding_q6_k",
        EmbeddingIq4Nl = "embedding_iq4_nl",
        EmbeddingIq4Xs = "embedding_iq4_xs",
        EmbeddingMxfp4 = "embedding_mxfp4",
    }
    /// Writes each row's K and V into the cache at its destination.
    kv_store(
        k: u64 = "const float*",
        v: u64 = "const float*",
        cache_k: u64 = "float*",
        cache_v: u64 = "float*",
        dst: u64 = "const unsigned long long*",
        width: i32 = "int",
    ) {
        KvStoreF32 = "kv_store_f32",
    }
    /// `kv_store` into an f16 cache (rounded to nearest even).
    kv_store_h(
        k: u64 = "const float*",
        v: u64 = "const float*",
        cache_k: u64 = "u16*",
        cache_v: u64 = "u16*",
        dst: u64 = "const unsigned long long*",
        width: i32 = "int",
    ) {
        KvStoreF16 = "kv_store_f16",
    }
    /// Decode rows: blocks of GEMV_W weight rows split across their 128 threads, each
    /// chunk dequantized in registers once for up to `GEMV_R` activation rows.
    gemv(w: u64 = "const u8*", x: u64 = "const float*", out: u64 = "float*", m: i32 = "int", k: i32 = "int", rows: i32 = "int") {
        GemvF32 = "gemv_f32",
        GemvF16 = "gemv_f16",
        GemvBf16 = "gemv_bf16",
        GemvQ8_0 = "gemv_q8_0",
        GemvQ4_0 = "gemv_q4_0",
        GemvQ4_1 = "gemv_q4_1",
        GemvQ5_0 = "gemv_q5_0",
        GemvQ5_1 = "gemv_q5_1",
        GemvQ2K = "gemv_q2_k",
        GemvQ3K = "gemv_q3_k",
        GemvQ4K = "gemv_q4_k",
        GemvQ5K = "gemv_q5_k",
        GemvQ6K = "gemv_q6_k",
        GemvIq4Nl = "gemv_iq4_nl",
        GemvIq4Xs = "gemv_iq4_xs",
        GemvMxfp4 = "gemv_mxfp4",
    }
    /// One decode row (batch-1 decode): `gemv`'s arithmetic in a kernel of its own, so the
    /// multi-row path's registers do not limit how many of its warps an SM holds.
    gemv1(w: u64 = "const u8*", x: u64 = "const float*", out: u64 = "float*", m: i32 = "int", k: i32 = "int") {
        Gemv1F32 = "gemv1_f32",
        Gemv1F16 = "gemv1_f16",
        Gemv1Bf16 = "gemv1_bf16",
        Gemv1Q8_0 = "gemv1_q8_0",
        Gemv1Q4_0 = "gemv1_q4_0",
        Gemv1Q4_1 = "gemv1_q4_1",
        Gemv1Q5_0 = "gemv1_q5_0",
        Gemv1Q5_1 = "gemv1_q5_1",
        Gemv1Q2K = "gemv1_q2_k",
        Gemv1Q3K = "gemv1_q3_k",
        Gemv1Q4K = "gemv1_q4_k",
        Gemv1Q5K = "gemv1_q5_k",
        Gemv1Q6K = "gemv1_q6_k",
        Gemv1Iq4Nl = "gemv1_iq4_nl",
        Gemv1Iq4Xs = "gemv1_iq4_xs",
        Gemv1Mxfp4 = "gemv1_mxfp4",
    }
    /// A mixture's decode rows: each (expert, row) pair's own weights and activation row;
    /// a run of pairs on one expert reads its weights once (`gemv_grouped_*`), or, where no
    /// two neighbouring pairs share an expert, each pair alone at the one-row kernel's
    /// registers (`gemv1_grouped_*`).
    gemv_grouped(
        w: u64 = "const unsigned long long*",
        x_rows: u64 = "const u32*",
        x: u64 = "const float*",
        out: u64 = "float*",
        m: i32 = "int",
        k: i32 = "int",
        pairs: i32 = "int",
    ) {
        GemvGroupedF32 = "gemv_grouped_f32",
        GemvGroupedF16 = "gemv_grouped_f16",
        GemvGroupedBf16 = "gemv_grouped_bf16",
        GemvGroupedQ8_0 = "gemv_grouped_q8_0",
        GemvGroupedQ4_0 = "gemv_grouped_q4_0",
        GemvGroupedQ4_1 = "gemv_grouped_q4_1",
        GemvGroupedQ5_0 = "gemv_grouped_q5_0",
        GemvGroupedQ5_1 = "gemv_grouped_q5_1",
        GemvGroupedQ2K = "gemv_grouped_q2_k",
        GemvGroupedQ3K = "gemv_grouped_q3_k",
        GemvGroupedQ4K = "gemv_grouped_q4_k",
        GemvGroupedQ5K = "gemv_grouped_q5_k",
        GemvGroupedQ6K = "gemv_grouped_q6_k",
        GemvGroupedIq4Nl = "gemv_grouped_iq4_nl",
        GemvGroupedIq4Xs = "gemv_grouped_iq4_xs",
        GemvGroupedMxfp4 = "gemv_grouped_mxfp4",
        Gemv1GroupedF32 = "gemv1_grouped_f32",
        Gemv1GroupedF16 = "gemv1_grouped_f16",
        Gemv1GroupedBf16 = "gemv1_grouped_bf16",
        Gemv1GroupedQ8_0 = "gemv1_grouped_q8_0",
        Gemv1GroupedQ4_0 = "gemv1_grouped_q4_0",
        Gemv1GroupedQ4_1 = "gemv1_grouped_q4_1",
        Gemv1GroupedQ5_0 = "gemv1_grouped_q5_0",
        Gemv1GroupedQ5_1 = "gemv1_grouped_q5_1",
        Gemv1GroupedQ2K = "gemv1_grouped_q2_k",
        Gemv1GroupedQ3K = "gemv1_grouped_q3_k",
        Gemv1GroupedQ4K = "gemv1_grouped_q4_k",
        Gemv1GroupedQ5K = "gemv1_grouped_q5_k",
        Gemv1GroupedQ6K = "gemv1_grouped_q6_k",
        Gemv1GroupedIq4Nl = "gemv1_grouped_iq4_nl",
        Gemv1GroupedIq4Xs = "gemv1_grouped_iq4_xs",
        Gemv1GroupedMxfp4 = "gemv1_grouped_mxfp4",
    }
    /// A weight tile (or a bias) to f32, for the cuBLAS path.
    dequant(w: u64 = "const u8*", out: u64 = "float*", n: u64 = "unsigned long long") {
        DequantF16 = "dequant_f16",
        DequantBf16 = "dequant_bf16",
        DequantQ8_0 = "dequant_q8_0",
        DequantQ4_0 = "dequant_q4_0",
        DequantQ4_1 = "dequant_q4_1",
        DequantQ5_0 = "dequant_q5_0",
        DequantQ5_1 = "dequant_q5_1",
        DequantQ2K = "dequant_q2_k",
        DequantQ3K = "dequant_q3_k",
        DequantQ4K = "dequant_q4_k",
        DequantQ5K = "dequant_q5_k",
        DequantQ6K = "dequant_q6_k",
        DequantIq4Nl = "dequant_iq4_nl",
        DequantIq4Xs = "dequant_iq4_xs",
        DequantMxfp4 = "dequant_mxfp4",
    }
    /// RMS norm of each row times the norm weight.
    rms_norm(x: u64 = "const float*", w: u64 = "const u8*", out: u64 = "float*", cols: i32 = "int", eps: f32 = "float") {
        RmsNormF32 = "rms_norm_f32",
        RmsNormF16 = "rms_norm_f16",
        RmsNormBf16 = "rms_norm_bf16",
    }
    /// Rotates each head's pairs by its row's position (rotate-half layout).
    rope(x: u64 = "float*", table: u64 = "const float*", pos: u64 = "const u32*", heads: i32 = "int", head_dim: i32 = "int") {
        RopeF32 = "rope_f32",
    }
}

impl Kernel {
    pub fn by_name(name: &str) -> Option<Kernel> {
        Kernel::ALL.iter().copied().find(|k| k.name() == name)
    }

    /// The GEMV for a weight dtype.
    pub fn gemv(d: DType) -> Kernel {
        match d {
            DType::F32 => Kernel::GemvF32,
            DType::F16 => Kernel::GemvF16,
            DType::BF16 => Kernel::GemvBf16,
            DType::Q8_0 => Kernel::GemvQ8_0,
            DType::Q4_0 => Kernel::GemvQ4_0,
            DType::Q4_1 => Kernel::GemvQ4_1,
            DType::Q5_0 => Kernel::GemvQ5_0,
            DType::Q5_1 => Kernel::GemvQ5_1,
            DType::Q2K => Kernel::GemvQ2K,
            DType::Q3K => Kernel::GemvQ3K,
            DType::Q4K => Kernel::GemvQ4K,
            DType::Q5K => Kernel::GemvQ5K,
            DType::Q6K => Kernel::GemvQ6K,
            DType::Iq4Nl => Kernel::GemvIq4Nl,
            DType::Iq4Xs => Kernel::GemvIq4Xs,
            DType::Mxfp4 => Kernel::GemvMxfp4,
        }
    }

    /// The one-row GEMV for a weight dtype.
    pub fn gemv1(d: DType) -> Kernel {
        match d {
            DType::F32 => Kernel::Gemv1F32,
            DType::F16 => Kernel::Gemv1F16,
            DType::BF16 => Kernel::Gemv1Bf16,
            DType::Q8_0 => Kernel::Gemv1Q8_0,
            DType::Q4_0 => Kernel::Gemv1Q4_0,
            DType::Q4_1 => Kernel::Gemv1Q4_1,
            DType::Q5_0 => Kernel::Gemv1Q5_0,
            DType::Q5_1 => Kernel::Gemv1Q5_1,
            DType::Q2K => Kernel::Gemv1Q2K,
            DType::Q3K => Kernel::Gemv1Q3K,
            DType::Q4K => Kernel::Gemv1Q4K,
            DType::Q5K => Kernel::Gemv1Q5K,
            DType::Q6K => Kernel::Gemv1Q6K,
            DType::Iq4Nl => Kernel::Gemv1Iq4Nl,
            DType::Iq4Xs => Kernel::Gemv1Iq4Xs,
            DType::Mxfp4 => Kernel::Gemv1Mxfp4,
        }
    }

    /// The grouped GEMV of a mixture's decode rows for a weight dtype.
    pub fn gemv_grouped(d: DType) -> Kernel {
        match d {
            DType::F32 => Kernel::GemvGroupedF32,
            DType::F16 => Kernel::GemvGroupedF16,
            DType::BF16 => Kernel::GemvGroupedBf16,
            DType::Q8_0 => Kernel::GemvGroupedQ8_0,
            DType::Q4_0 => Kernel::GemvGroupedQ4_0,
            DType::Q4_1 => Kernel::GemvGroupedQ4_1,
            DType::Q5_0 => Kernel::GemvGroupedQ5_0,
            DType::Q5_1 => Kernel::GemvGroupedQ5_1,
            DType::Q2K => Kernel::GemvGroupedQ2K,
            DType::Q3K => Kernel::GemvGroupedQ3K,
            DType::Q4K => Kernel::GemvGroupedQ4K,
            DType::Q5K => Kernel::GemvGroupedQ5K,
            DType::Q6K => Kernel::GemvGroupedQ6K,
            DType::Iq4Nl => Kernel::GemvGroupedIq4Nl,
            DType::Iq4Xs => Kernel::GemvGroupedIq4Xs,
            DType::Mxfp4 => Kernel::GemvGroupedMxfp4,
        }
    }

    /// The grouped GEMV of pairs no two neighbours of which share an expert.
    pub fn gemv1_grouped(d: DType) -> Kernel {
        match d {
            DType::F32 => Kernel::Gemv1GroupedF32,
            DType::F16 => Kernel::Gemv1GroupedF16,
            DType::BF16 => Kernel::Gemv1GroupedBf16,
            DType::Q8_0 => Kernel::Gemv1GroupedQ8_0,
            DType::Q4_0 => Kernel::Gemv1GroupedQ4_0,
            DType::Q4_1 => Kernel::Gemv1GroupedQ4_1,
            DType::Q5_0 => Kernel::Gemv1GroupedQ5_0,
            DType::Q5_1 => Kernel::Gemv1GroupedQ5_1,
            DType::Q2K => Kernel::Gemv1GroupedQ2K,
            DType::Q3K => Kernel::Gemv1GroupedQ3K,
            DType::Q4K => Kernel::Gemv1GroupedQ4K,
            DType::Q5K => Kernel::Gemv1GroupedQ5K,
            DType::Q6K => Kernel::Gemv1GroupedQ6K,
            DType::Iq4Nl => Kernel::Gemv1GroupedIq4Nl,
            DType::Iq4Xs => Kernel::Gemv1GroupedIq4Xs,
            DType::Mxfp4 => Kernel::Gemv1GroupedMxfp4,
        }
    }

    /// The embedding gather for a table dtype.
    pub fn embedding(d: DType) -> Kernel {
        match d {
            DType::F32 => Kernel::EmbeddingF32,
            DType::F16 => Kernel::EmbeddingF16,
            DType::BF16 => Kernel::EmbeddingBf16,
            DType::Q8_0 => Kernel::EmbeddingQ8_0,
            DType::Q4_0 => Kernel::EmbeddingQ4_0,
            DType::Q4_1 => Kernel::EmbeddingQ4_1,
            DType::Q5_0 => Kernel::EmbeddingQ5_0,
            DType::Q5_1 => Kernel::EmbeddingQ5_1,
            DType::Q2K => Kernel::EmbeddingQ2K,
            DType::Q3K => Kernel::EmbeddingQ3K,
            DType::Q4K => Kernel::EmbeddingQ4K,
            DType::Q5K => Kernel::EmbeddingQ5K,
            DType::Q6K => Kernel::EmbeddingQ6K,
            DType::Iq4Nl => Kernel::EmbeddingIq4Nl,
            DType::Iq4Xs => Kernel::EmbeddingIq4Xs,
            DType::Mxfp4 => Kernel::EmbeddingMxfp4,
        }
    }

    /// The dequantization to f32 for a dtype (None for f32 itself).
    pub fn dequant(d: DType) -> Option<Kernel> {
        match d {
            DType::F32 => None,
            DType::F16 => Some(Kernel::DequantF16),
            DType::BF16 => Some(Kernel::DequantBf16),
            DType::Q8_0 => Some(Kernel::DequantQ8_0),
            DType::Q4_0 => Some(Kernel::DequantQ4_0),
            DType::Q4_1 => Some(Kernel::DequantQ4_1),
            DType::Q5_0 => Some(Kernel::DequantQ5_0),
            DType::Q5_1 => Some(Kernel::DequantQ5_1),
            DType::Q2K => Some(Kernel::DequantQ2K),
            DType::Q3K => Some(Kernel::DequantQ3K),
            DType::Q4K => Some(Kernel::DequantQ4K),
            DType::Q5K => Some(Kernel::DequantQ5K),
            DType::Q6K => Some(Kernel::DequantQ6K),
            DType::Iq4Nl => Some(Kernel::DequantIq4Nl),
            DType::Iq4Xs => Some(Kernel::DequantIq4Xs),
            DType::Mxfp4 => Some(Kernel::DequantMxfp4),
        }
    }

    /// The RMS norm for a norm-weight dtype (norm weights are floats).
    pub fn rms_norm(d: DType) -> Option<Kernel> {
        match d {
            DType::F32 => Some(Kernel::RmsNormF32),
            DType::F16 => Some(Kernel::RmsNormF16),
            DType::BF16 => Some(Kernel::RmsNormBf16),
            _ => None,
        }
    }
}

/// Every kernel's loaded function, indexed by `Kernel as usize`: resolved once at start,
/// so a launch is an index, not a name lookup.
pub struct KernelTable {
    funcs: Vec<CudaFunction>,
}

impl KernelTable {
    pub fn get(&self, k: Kernel) -> &CudaFunction {
        &self.funcs[k as usize]
    }

    fn launch(
        &self,
        stream: &CudaStream,
        kernel: Kernel,
        dims: Dims,
        args: &mut [*mut c_void],
    ) -> Result<(), String> {
        if dims.is_empty() {
            // Nothing to do (no rows, or no outputs): CUDA refuses a zero-sized grid with
            // CUDA_ERROR_INVALID_VALUE.
            return Ok(());
        }
        let f = self.get(kernel);
        // SAFETY: `args` are exactly the kernel's parameters, in order and at their widths
        // (the family launchers are generated from the signature that tests/tests/nvrtc.rs
        // checks against the source); every pointer argument is a device address inside
        // the backend's arena (callers check sizes); the values live until the launch
        // returns (the driver copies them).
        unsafe {
            result::launch_kernel(
                f.cu_function(),
                dims.grid,
                (dims.block, 1, 1),
                dims.smem,
                stream.cu_stream(),
                args,
            )
        }
        .map_err(|e| format!("launching {}: {e}", kernel.name()))
    }

    /// Compiles every kernel file for the device (a CUBIN for sm_XY, so the driver needs no
    /// PTX JIT), caching the result by source, NVRTC version and architecture, and resolves
    /// every kernel of the table.
    pub fn load(ctx: &Arc<CudaContext>, info: &DeviceInfo) -> Result<KernelTable, BackendError> {
        let (major, minor) = info.compute_capability;
        let sm = format!("sm_{major}{minor}");
        let dev = info.name.as_str();
        let nv = super::nvrtc::version()
            .map_err(|e| BackendError::device("reading the NVRTC version", dev, e))?;
        let dir = cache_dir();
        let mut found: Vec<Option<CudaFunction>> = vec![None; Kernel::ALL.len()];
        for (op, src) in KERNELS {
            let full = source(src);
            let key = cache_key(&full, &sm, nv, &super::nvrtc::options(&sm, op));
            let path = dir
                .as_ref()
                .map(|d| d.join(format!("{op}-{sm}-{key:016x}.cubin")));
            let module = load_module(ctx, dev, op, &full, &sm, path.as_deref())?;
            for (name, _) in entry_signatures(src) {
                let k = Kernel::by_name(&name).ok_or_else(|| {
                    BackendError::device(
                        format!("loading kernels/{op}.cu"),
                        dev,
                        format!("it defines {name}, which the kernel table does not know"),
                    )
                })?;
                let f = module
                    .load_function(&name)
                    .map_err(|e| BackendError::device(format!("loading kernel {name}"), dev, e))?;
                found[k as usize] = Some(f);
            }
        }
        let funcs = Kernel::ALL
            .iter()
            .zip(found)
            .map(|(k, f)| {
                f.ok_or_else(|| {
                    BackendError::device(
                        format!("loading kernel {}", k.name()),
                        dev,
                        "no kernels/*.cu defines it",
                    )
                })
            })
            .collect::<Result<_, _>>()?;
        Ok(KernelTable { funcs })
    }
}

/// The cache key of a compiled kernel file: its full source, the architecture, the NVRTC
/// version and the compile options, so changing any of them compiles it again.
pub fn cache_key(full: &str, sm: &str, nvrtc: (i32, i32), options: &[String]) -> u64 {
    crate::util::xxh3(
        format!(
            "{full}\n{sm}\nnvrtc {}.{}\n{}",
            nvrtc.0,
            nvrtc.1,
            options.join("\n")
        )
        .as_bytes(),
    )
}

/// One kernel file's module: the cached CUBIN when the driver takes it, else compiled
/// (and the cache replaced).
fn load_module(
    ctx: &Arc<CudaContext>,
    dev: &str,
    op: &str,
    full: &str,
    sm: &str,
    path: Option<&std::path::Path>,
) -> Result<Arc<cudarc::driver::CudaModule>, BackendError> {
    let compile = || -> Result<Vec<u8>, BackendError> {
        let (bin, log) = super::nvrtc::compile_cubin(op, full, sm).map_err(|e| {
            BackendError::device(format!("compiling kernels/{op}.cu for {sm}"), dev, e)
        })?;
        if !log.is_empty() {
            tracing::warn!("NVRTC on kernels/{op}.cu: {log}");
        }
        if let Some(p) = path {
            if let Err(e) = crate::util::write_atomic(p, &bin) {
                tracing::warn!("kernel cache {}: {e}", p.display());
            }
        }
        Ok(bin)
    };
    let load = |bin: Vec<u8>| ctx.load_module(cudarc::nvrtc::Ptx::from_binary(bin));
    let loaded = |r: Result<_, _>| {
        r.map_err(|e| BackendError::device(format!("loading kernels/{op}.cu for {sm}"), dev, e))
    };
    match path.and_then(|p| std::fs::read(p).ok()) {
        Some(cached) => match load(cached) {
            Ok(m) => Ok(m),
            Err(e) => {
                // A cache file the driver refuses (damaged, or another driver's): compile
                // again and replace it.
                tracing::warn!("cached kernels/{op}.cu for {sm} refused ({e}); recompiling");
                loaded(load(compile()?))
            }
        },
        None => loaded(load(compile()?)),
    }
}

/// Where compiled kernels are cached: $SLUICE_CACHE/kernels or ~/.cache/sluice/kernels.
fn cache_dir() -> Option<std::path::PathBuf> {
    Some(crate::util::cache_root()?.join("kernels"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zero_sized_launches_are_empty_and_others_are_not() {
        assert!(Dims::per_element(0).is_empty());
        assert!(Dims::per_row(0).is_empty());
        assert!(!Dims::per_element(1).is_empty());
        assert!(Dims::gemv(0, 3, DType::Q8_0).is_empty());
        assert!(Dims::gemv(160, 0, DType::Q8_0).is_empty());
        assert!(!Dims::gemv(160, 9, DType::Q8_0).is_empty());
        assert_eq!(Dims::gemv(160, 9, DType::Q8_0).grid, (40, 2, 1));
        assert_eq!(Dims::gemv(161, 1, DType::Q8_0).grid, (41, 1, 1));
        assert_eq!(Dims::gemv(161, 9, DType::Q6K).grid, (81, 2, 1));
        assert_eq!(
            Dims::gemv1(161).grid,
            (161usize.div_ceil(GEMV1_W) as u32, 1, 1)
        );
        assert!(Dims::gemv1(0).is_empty());
    }

    #[test]
    fn the_kernel_cache_key_changes_with_the_source_arch_nvrtc_and_options() {
        let opts = crate::backend::cuda::nvrtc::options("sm_90", "add");
        let k = cache_key("src", "sm_90", (13, 0), &opts);
        assert_eq!(k, cache_key("src", "sm_90", (13, 0), &opts));
        assert_ne!(k, cache_key("src2", "sm_90", (13, 0), &opts));
        assert_ne!(k, cache_key("src", "sm_80", (13, 0), &opts));
        assert_ne!(k, cache_key("src", "sm_90", (12, 9), &opts));
        let mut other = opts.clone();
        other.retain(|o| o != "--use_fast_math");
        assert_ne!(k, cache_key("src", "sm_90", (13, 0), &other));
        // The policy: the router, the norms and RoPE exact, the rest fast; every name is
        // a kernel file.
        let fast = |name: &str| {
            crate::backend::cuda::nvrtc::options("sm_90", name)
                .iter()
                .any(|o| o == "--use_fast_math")
        };
        let files: Vec<&str> = crate::backend::cuda::KERNELS
            .iter()
            .map(|(n, _)| *n)
            .collect();
        for name in crate::backend::cuda::nvrtc::EXACT_MATH {
            assert!(files.contains(&name) && !fast(name), "{name}");
        }
        for name in ["matmul_q", "matmul_k", "attention", "add", "convert"] {
            assert!(fast(name), "{name}");
        }
        assert_eq!(other, crate::backend::cuda::nvrtc::options("sm_90", "rope"));
    }

    /// Every weight dtype's multi-row GEMV launches with its chunk format's `W`: the
    /// format named in its GEMV_FORMAT / BLOCK_FORMAT line, its `static constexpr int W`
    /// (its own or its base struct's) read from the source.
    #[test]
    fn each_format_s_weight_rows_a_block_match_the_kernels() {
        let src: String = crate::backend::cuda::KERNELS
            .iter()
            .map(|(_, s)| *s)
            .collect();
        // `W` of struct `name` (template arguments dropped), else of its base.
        let w_of = |name: &str| -> Option<String> {
            let mut name = name.to_string();
            for _ in 0..4 {
                let at = src.find(&format!("struct {name} "))?;
                let body = &src[at..at + src[at..].find("\n};")?];
                if let Some(w) = body.find("static constexpr int W = ") {
                    let v = &body[w + "static constexpr int W = ".len()..];
                    return Some(v[..v.find(';')?].to_string());
                }
                let head = &body[..body.find('{')?];
                name = head.split(':').nth(1)?.trim().to_string();
            }
            None
        };
        for d in crate::dtype::ALL_DTYPES {
            let kernel = Kernel::gemv(d).name();
            let suffix = &kernel["gemv_".len()..];
            let line = src
                .lines()
                .find(|l| {
                    (l.starts_with("GEMV_FORMAT(") || l.starts_with("BLOCK_FORMAT("))
                        && l.split(['(', ',']).nth(1) == Some(suffix)
                })
                .unwrap_or_else(|| panic!("no GEMV_FORMAT or BLOCK_FORMAT line for {suffix}"));
            let fmt = line.trim_end_matches(')').rsplit(", ").next().unwrap_or("");
            let fmt = fmt.split('<').next().unwrap_or(fmt);
            let w = w_of(fmt).unwrap_or_else(|| panic!("no W for {fmt} ({suffix})"));
            let w = if w == "GEMV_W" { GEMV_W.to_string() } else { w };
            assert_eq!(
                w,
                gemv_w(d).to_string(),
                "{suffix}: {fmt}'s W against gemv_w"
            );
        }
    }

    #[test]
    fn the_gemv_row_group_matches_the_kernels() {
        let common = crate::backend::cuda::COMMON;
        for (name, value) in [
            ("GEMV_R", GEMV_R),
            ("GEMV_W", GEMV_W),
            ("GEMV1_W", GEMV1_W),
            ("GEMV_THREADS", GEMV_THREADS as usize),
        ] {
            assert!(
                common.contains(&format!("#define {name} {value}\n")),
                "kernels/common.cuh must define {name} as {value}"
            );
        }
    }
}
