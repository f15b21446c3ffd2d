//! CUDA: the kernels in kernels/ (one file per op, compiled by NVRTC at start for the
//! device's compute capability and cached), and the backend that runs them (`device`):
//! compute and copy streams, an event per streaming slot, page-locked staging, one device
//! allocation carved into every role (`arena`), cuBLAS for prefill rows. The driver, NVRTC
//! and cuBLAS are loaded at run time: `sluiced` builds and starts without CUDA, and
//! `--backend auto` falls back to the CPU with the reason.

pub mod arena;
mod attend;
pub mod bench;
pub mod device;
mod handles;
pub mod kernels;
mod matmul;
mod meta;
mod moe;
pub mod nvrtc;
mod probe;
mod upload;

pub use device::{scratch_bytes, CudaBackend};
pub use handles::{CudaMem, SEPARATE_ALLOCS_ENV};
pub use meta::{index_pairs, SpanRows};
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
    ("matmul_k", include_str!("../../../../kernels/matmul_k.cu")),
    ("matmul_q", include_str!("../../../../kernels/matmul_q.cu")),
    ("moe", include_str!("../../../../kernels/moe.cu")),
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
/// defines kernels named by its first argument, as is (EMBED_Q, DEQUANT_Q) or pasted
/// into a name (`gemv_##name` in BLOCK_FORMAT), each with its parameter types
/// normalized: the parameter name dropped, `*` against the type (`const float*`, `int`,
/// `unsigned long long`).
pub fn entry_signatures(src: &str) -> Vec<(String, Vec<String>)> {
    const DECL: &str = "extern \"C\" __global__ void ";
    let ident = |s: &str| -> String {
        s.chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_' || *c == '#')
            .collect()
    };
    let joined = strip_launch_bounds(&src.replace("\\\n", " "));
    // Per macro: the kernels of its body, as (name with the first argument's parameter
    // still in it, parameter types), and that parameter.
    type Macro = (String, String, Vec<(String, Vec<String>)>);
    let mut macros: Vec<Macro> = Vec::new();
    let mut plain = String::new();
    for line in joined.lines() {
        match line.trim_start().strip_prefix("#define ") {
            Some(def) => {
                let Some((mac, rest)) = def.split_once('(') else {
                    continue;
                };
                let first_arg = rest.split([',', ')']).next().unwrap_or("").trim();
                let mut kernels = Vec::new();
                let mut body = rest;
                while let Some(at) = body.find(DECL) {
                    let decl = &body[at + DECL.len()..];
                    let name = ident(decl.trim_start());
                    if !first_arg.is_empty() && name.contains(first_arg) {
                        if let Some(params) = param_list(decl) {
                            kernels.push((name, params));
                        }
                    }
                    body = decl;
                }
                if !kernels.is_empty() {
                    macros.push((mac.trim().to_string(), first_arg.to_string(), kernels));
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
        let name = ident(decl);
        if let Some(params) = param_list(decl) {
            out.push((name, params));
        }
        rest = decl;
    }
    for line in plain.lines() {
        let l = line.trim_start();
        for (mac, param, kernels) in &macros {
            if let Some(args) = l
                .strip_prefix(mac.as_str())
                .and_then(|r| r.strip_prefix('('))
            {
                let arg = args.split([',', ')']).next().unwrap_or("").trim();
                if !arg.is_empty() {
                    for (name, params) in kernels {
                        let name = name.replace(param.as_str(), arg).replace("##", "");
                        out.push((name, params.clone()));
                    }
                }
            }
        }
    }
    out
}

/// `src` without its `__launch_bounds__(...)` qualifiers (they stand between `void` and a
/// kernel's name).
fn strip_launch_bounds(src: &str) -> String {
    const LB: &str = "__launch_bounds__(";
    let mut out = String::with_capacity(src.len());
    let mut rest = src;
    while let Some(at) = rest.find(LB) {
        out.push_str(&rest[..at]);
        let after = &rest[at + LB.len()..];
        match after.find(')') {
            Some(close) => rest = after[close + 1..].trim_start(),
            None => {
                rest = after;
                break;
            }
        }
    }
    out.push_str(rest);
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
                // `__restrict__` qualifies the pointer, not its type: the launcher's list
                // does not spell it.
                let p = p
                    .replace("__restrict__", " ")
                    .split_whitespace()
                    .collect::<Vec<_>>()
                    .join(" ");
                // Drop the parameter name (the last identifier), keep any `*` with the type.
                let cut = p
                    .rfind(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                    .map_or(0, |i| i + 1);
                p[..cut].trim_end().replace(" *", "*")
            })
            .collect(),
    )
}
