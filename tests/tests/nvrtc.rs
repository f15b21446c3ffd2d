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
    // 29 kernels today (add 2, argmax 1, attention 1, convert 2, embedding 6, kv_store 1,
    // matmul_q 11, rms_norm 3, rope 1, silu_mul 1), each for two architectures.
    assert!(count >= 2 * 29, "only {count} kernel entries compiled");
}

/// What the CUDA backend loads: machine code for the device (no PTX JIT in the driver).
#[test]
fn every_kernel_compiles_to_a_cubin_for_sm90() {
    if let Err(e) = nvrtc::library_present() {
        panic!("{e}");
    }
    for (name, src) in KERNELS {
        let (bin, log) =
            nvrtc::compile_cubin(name, &source(src), "sm_90").unwrap_or_else(|e| panic!("{e}"));
        assert!(log.is_empty(), "{name}: NVRTC printed:\n{log}");
        // An ELF image, as cuModuleLoadData expects for a CUBIN.
        assert_eq!(&bin[..4], b"\x7fELF", "{name}: not an ELF CUBIN");
        for e in entry_points(src) {
            assert!(
                bin.windows(e.len()).any(|w| w == e.as_bytes()),
                "{name}: CUBIN lacks kernel {e}"
            );
        }
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
