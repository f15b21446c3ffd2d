//! CUDA: the kernels in kernels/ (one file per op, compiled by NVRTC for the device's
//! compute capability). What exists today is the kernel sources and their NVRTC
//! compilation, checked in CI for sm_80 and sm_90; the device side of the backend
//! (streams, events, pinned staging, cuBLAS, the `Backend` impl) is not built yet.

pub mod nvrtc;

/// Included by every kernel file.
pub const COMMON: &str = include_str!("../../../../kernels/common.cuh");

/// (op, source) for every kernel file.
pub const KERNELS: &[(&str, &str)] = &[
    ("add", include_str!("../../../../kernels/add.cu")),
    ("argmax", include_str!("../../../../kernels/argmax.cu")),
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
