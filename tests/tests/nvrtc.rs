//! Every CUDA kernel compiles with NVRTC for sm_80 and sm_90, with no error and no warning,
//! and exports every kernel its source declares. Runs without a GPU (CI installs the
//! nvidia-cuda-nvrtc-cu12 wheel; scripts/test.sh puts its library on LD_LIBRARY_PATH).

use sluice::backend::cuda::{entry_points, nvrtc, source, KERNELS};

#[test]
fn every_kernel_compiles_cleanly_for_sm80_and_sm90() {
    if let Err(e) = nvrtc::library_present() {
        panic!("{e}");
    }
    let mut count = 0;
    for (name, src) in KERNELS {
        let full = source(src);
        let entries = entry_points(src);
        assert!(
            !entries.is_empty(),
            "{name}: no kernels found in the source"
        );
        for arch in ["compute_80", "compute_90"] {
            let c = nvrtc::compile(name, &full, arch).unwrap_or_else(|e| panic!("{e}"));
            assert!(
                c.log.is_empty(),
                "{name} for {arch}: NVRTC printed:\n{}",
                c.log
            );
            for e in &entries {
                assert!(
                    c.ptx.contains(&format!(".entry {e}(")),
                    "{name} for {arch}: PTX lacks kernel {e}"
                );
            }
            count += entries.len();
        }
    }
    // 84 kernels today (add, attention, convert, embedding, kv_store, matmul_q, matmul_k,
    // moe, rms_norm, rope, silu_mul), each for two architectures.
    assert!(count >= 2 * 84, "only {count} kernel entries compiled");
}

/// What the CUDA backend loads: machine code for the device (no PTX JIT in the driver).
/// ptxas runs only here: limits such as 48 KiB of static shared memory per block fail
/// the CUBIN, not the PTX.
#[test]
fn every_kernel_compiles_to_a_cubin_for_sm80_and_sm90() {
    if let Err(e) = nvrtc::library_present() {
        panic!("{e}");
    }
    for (name, src) in KERNELS {
        for sm in ["sm_80", "sm_90"] {
            cubin_of(name, src, sm);
        }
    }
}

fn cubin_of(name: &str, src: &str, sm: &str) {
    let (bin, log) = nvrtc::compile_cubin(name, &source(src), sm).unwrap_or_else(|e| panic!("{e}"));
    assert!(log.is_empty(), "{name} for {sm}: NVRTC printed:\n{log}");
    // An ELF image, as cuModuleLoadData expects for a CUBIN.
    assert_eq!(&bin[..4], b"\x7fELF", "{name} for {sm}: not an ELF CUBIN");
    for e in entry_points(src) {
        assert!(
            bin.windows(e.len()).any(|w| w == e.as_bytes()),
            "{name} for {sm}: CUBIN lacks kernel {e}"
        );
    }
}

#[test]
fn a_broken_kernel_fails_with_its_log() {
    if let Err(e) = nvrtc::library_present() {
        panic!("{e}");
    }
    let e = nvrtc::compile(
        "broken",
        "extern \"C\" __global__ void k(float* x) { x[0] = undefined_name; }",
        "compute_80",
    )
    .err()
    .expect("must not compile");
    assert!(e.contains("undefined_name"), "{e}");
    // And a warning shows in the log, so the clean-compile check above can see one.
    let c = nvrtc::compile(
        "warn",
        "extern \"C\" __global__ void k(float* x) { int unused = 3; x[0] = 1.0f; }",
        "compute_80",
    )
    .unwrap();
    assert!(
        c.log.contains("unused"),
        "NVRTC did not report the unused variable: {:?}",
        c.log
    );
}

/// The typed launchers pass exactly what each kernel declares: every kernel a source
/// defines is in the kernel table with the same parameter types, in order, and every
/// entry of the table is defined by some source. Needs no NVRTC.
#[test]
fn the_kernel_table_matches_every_kernel_signature_in_the_sources() {
    use sluice::backend::cuda::entry_signatures;
    use sluice::backend::cuda::kernels::Kernel;
    let mut seen = std::collections::BTreeSet::new();
    for (file, src) in KERNELS {
        for (name, params) in entry_signatures(src) {
            let k = Kernel::by_name(&name).unwrap_or_else(|| {
                panic!("kernels/{file}.cu defines {name}, which the table lacks")
            });
            assert_eq!(
                k.signature(),
                params.as_slice(),
                "kernels/{file}.cu: {name} takes ({}), the launcher passes ({})",
                params.join(", "),
                k.signature().join(", ")
            );
            assert!(seen.insert(name.clone()), "{name} is defined twice");
        }
    }
    for k in Kernel::ALL {
        assert!(
            seen.contains(k.name()),
            "the table has {}, which no source defines",
            k.name()
        );
    }
    // 32 for the first six dtypes and the other ops (gelu_mul, scale, and the f16 KV
    // cache's kv_store and attention among them, attention in two kernels, partials and
    // their combination; no argmax, never launched, and no f32 to f16 conversion, f16
    // prefill going through f32 tiles), three for each of the ten
    // K-quant-era block formats, gpt-oss's clamped SwiGLU, a mixture's row gather and
    // weighted scatter, the grouped GEMV of its decode rows for each of the 16 weight
    // dtypes, its grouped bias and combine, its routing, and the one-row GEMV and its
    // one-pair-a-block grouped form for each of the 16 weight dtypes.
    assert_eq!(
        seen.len(),
        32 + 3 * 10 + 1 + 2 + 16 + 2 + 1 + 2 * 16,
        "kernels: {seen:?}"
    );
    // The parser sees through parameter names, spacing, `__restrict__`,
    // `__launch_bounds__` and macros.
    let sigs = entry_signatures(
        "extern \"C\" __global__ void a(float *__restrict__ x,\n   const unsigned long long* d, int n) {}\n\
         extern \"C\" __global__ void __launch_bounds__(256, 2) lb(const float* p) {}\n\
         #define MK(name, b) \\\n  extern \"C\" __global__ void name(const u8* w, float s) { }\n\
         MK(mk_one, 1)\n\
         #define PAIR(t, b) \\\n  extern \"C\" __global__ void gemv_##t(int m) { } \\\n  extern \"C\" __global__ void t##_x(float s) { }\n\
         PAIR(q9, 3)\n",
    );
    assert_eq!(
        sigs,
        vec![
            (
                "a".to_string(),
                vec![
                    "float*".to_string(),
                    "const unsigned long long*".to_string(),
                    "int".to_string()
                ]
            ),
            ("lb".to_string(), vec!["const float*".to_string()]),
            (
                "mk_one".to_string(),
                vec!["const u8*".to_string(), "float".to_string()]
            ),
            ("gemv_q9".to_string(), vec!["int".to_string()]),
            ("q9_x".to_string(), vec!["float".to_string()]),
        ]
    );
}
