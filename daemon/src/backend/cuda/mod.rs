//! CUDA: the kernels in kernels/ (one file per op, compiled by NVRTC at start for the
//! device's compute capability and cached), and the backend that runs them (`device`):
//! compute and copy streams, an event per streaming slot, page-locked staging, one device
//! allocation carved into every role (`arena`), cuBLAS for prefill rows. The driver, NVRTC
//! and cuBLAS are loaded at run time: `sluiced` builds and starts without CUDA, and
//! `--backend auto` falls back to the CPU with the reason.

pub mod arena;
pub mod device;
mod handles;
pub mod kernels;
mod matmul;
mod meta;
pub mod nvrtc;
mod probe;
mod upload;

pub use device::{scratch_bytes, CudaBackend};
pub use handles::CudaMem;
pub use probe::{driver_present, probe};

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

/// Names of the `extern "C"` kernels a source defines, which the compiled PTX must export.
pub fn entry_points(src: &str) -> Vec<String> {
    entry_signatures(src).into_iter().map(|(n, _)| n).collect()
}

/// The `extern "C"` kernels a source defines, directly or through a macro whose body
/// defines the kernel named by its first argument (EMBED_Q, DEQUANT_Q), each with its
/// parameter types normalized: the parameter name dropped, `*` against the type
/// (`const float*`, `int`, `unsigned long long`).
pub fn entry_signatures(src: &str) -> Vec<(String, Vec<String>)> {
    const DECL: &str = "extern \"C\" __global__ void ";
    let joined = src.replace("\\\n", " ");
    let mut macros: Vec<(String, Vec<String>)> = Vec::new();
    let mut plain = String::new();
    for line in joined.lines() {
        match line.trim_start().strip_prefix("#define ") {
            Some(def) => {
                let Some((mac, rest)) = def.split_once('(') else {
                    continue;
                };
                let first_arg = rest.split([',', ')']).next().unwrap_or("").trim();
                if let Some(at) = rest.find(DECL) {
                    let decl = &rest[at + DECL.len()..];
                    if decl.trim_start().starts_with(first_arg) {
                        if let Some(params) = param_list(decl) {
                            macros.push((mac.trim().to_string(), params));
                        }
                    }
                }
            }
            None => {
                plain.push_str(line);
                plain.push('\n');
            }
        }
    }
    let mut out = Vec::new();
    let mut rest = plain.as_str();
    while let Some(at) = rest.find(DECL) {
        let decl = &rest[at + DECL.len()..];
        let name: String = decl
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect();
        if let Some(params) = param_list(decl) {
            out.push((name, params));
        }
        rest = decl;
    }
    for line in plain.lines() {
        let l = line.trim_start();
        for (mac, params) in &macros {
            if let Some(args) = l
                .strip_prefix(mac.as_str())
                .and_then(|r| r.strip_prefix('('))
            {
                let name = args.split([',', ')']).next().unwrap_or("").trim();
                if !name.is_empty() {
                    out.push((name.to_string(), params.clone()));
                }
            }
        }
    }
    out
}

/// The normalized parameter types of `name(type a, type b, ...)` at the start of `decl`.
fn param_list(decl: &str) -> Option<Vec<String>> {
    let open = decl.find('(')?;
    let close = open + decl[open..].find(')')?;
    let inner = &decl[open + 1..close];
    if inner.trim().is_empty() {
        return Some(Vec::new());
    }
    Some(
        inner
            .split(',')
            .map(|p| {
                let p = p.split_whitespace().collect::<Vec<_>>().join(" ");
                // Drop the parameter name (the last identifier), keep any `*` with the type.
                let cut = p
                    .rfind(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                    .map_or(0, |i| i + 1);
                p[..cut].trim_end().replace(" *", "*")
            })
            .collect(),
    )
}
