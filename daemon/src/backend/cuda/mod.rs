//! CUDA: the kernels in kernels/ (one file per op, compiled by NVRTC at start for the
//! device's compute capability and cached), and the backend that runs them (`device`):
//! compute and copy streams, an event per streaming slot, page-locked staging, one device
//! allocation carved into every role (`arena`), cuBLAS for prefill rows. The driver, NVRTC
//! and cuBLAS are loaded at run time: `sluiced` builds and starts without CUDA, and
//! `--backend auto` falls back to the CPU with the reason.

pub mod arena;
pub mod device;
pub mod nvrtc;

pub use device::{driver_present, probe, scratch_bytes, CudaBackend, CudaMem};

/// What `probe` found.
#[derive(Clone, Debug, serde::Serialize)]
pub struct DeviceInfo {
    pub ordinal: usize,
    pub name: String,
    pub compute_capability: (i32, i32),
    pub total_bytes: u64,
    pub free_bytes: u64,
    /// As cuDriverGetVersion reports it (12040 = 12.4).
    pub driver_version: i32,
    /// Shared memory one block may opt into.
    pub max_shared_per_block: usize,
}

/// Included by every kernel file.
pub const COMMON: &str = include_str!("../../../../kernels/common.cuh");

/// (op, source) for every kernel file.
pub const KERNELS: &[(&str, &str)] = &[
    ("add", include_str!("../../../../kernels/add.cu")),
    ("argmax", include_str!("../../../../kernels/argmax.cu")),
    ("convert", include_str!("../../../../kernels/convert.cu")),
    (
        "attention",
        include_str!("../../../../kernels/attention.cu"),
    ),
    (
        "embedding",
        include_str!("../../../../kernels/embedding.cu"),
    ),
    ("kv_store", include_str!("../../../../kernels/kv_store.cu")),
    ("matmul_q", include_str!("../../../../kernels/matmul_q.cu")),
    ("rms_norm", include_str!("../../../../kernels/rms_norm.cu")),
    ("rope", include_str!("../../../../kernels/rope.cu")),
    ("silu_mul", include_str!("../../../../kernels/silu_mul.cu")),
];

/// The source NVRTC compiles: the kernel file with common.cuh pasted in (NVRTC has no
/// include path to the kernels directory at run time).
pub fn source(kernel: &str) -> String {
    kernel.replace("#include \"common.cuh\"", COMMON)
}

/// Names of the `extern "C"` kernels a source defines (directly or through the
/// EMBED_Q / DEQUANT_Q macros), which the compiled PTX must export.
pub fn entry_points(src: &str) -> Vec<String> {
    let mut names = Vec::new();
    for line in src.lines() {
        let l = line.trim_start();
        // Macro bodies (continued lines) declare the generic name, not a kernel.
        if l.trim_end().ends_with('\\') {
            continue;
        }
        if let Some(rest) = l.strip_prefix("extern \"C\" __global__ void ") {
            if let Some(name) = rest.split('(').next() {
                names.push(name.trim().to_string());
            }
        }
        for mac in ["EMBED_Q(", "DEQUANT_Q("] {
            if let Some(rest) = l.strip_prefix(mac) {
                if let Some(name) = rest.split(',').next() {
                    if !name.contains(' ') {
                        names.push(name.to_string());
                    }
                }
            }
        }
    }
    names
}
