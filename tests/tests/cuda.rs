//! The CUDA backend against the CPU backend. The tests marked `ignore` need an NVIDIA GPU
//! (with driver, NVRTC and cuBLAS); scripts/gpu-check.sh runs them with --include-ignored,
//! where a missing GPU fails them. The others run everywhere: backend selection must say
//! why CUDA is not used, and `--backend cuda` must fail cleanly without one.

use sluice::backend::cpu::CpuBackend;
use sluice::backend::cuda::{self, CudaBackend};
use sluice::backend::{AttnShape, AttnStep, Backend, SeqSpan};
use sluice::dtype::{DType, ALL_DTYPES};
use sluice::engine::{choose_backend, cpu_runner, cuda_runner, cuda_usable, BackendChoice, Chosen};
use sluice::io::IoConfig;
use sluice::model::{Arch, ArchConfig, ModelOptions, SeqStep};
use sluice::pipeline::Pipeline;
use sluice::plan::PlanInput;
use sluice::store::Store;
use sluice_tests::ops::{close, f32_bytes, random_weights, wref, AttnCase, Rng};
use sluice_tests::*;
use std::path::Path;
use std::sync::Arc;

const GPU: &str = "needs an NVIDIA GPU; scripts/gpu-check.sh runs it";

#[test]
fn backend_auto_says_why_not_cuda_and_cuda_fails_cleanly() {
    if cuda::driver_present() {
        // A GPU machine: auto takes CUDA when it is usable; otherwise the reason is given.
        match choose_backend(BackendChoice::Auto, 0).unwrap() {
            Chosen::Cuda(info) => assert!(info.total_bytes > 0),
            Chosen::Cpu { why } => assert!(!why.is_empty()),
        }
        return;
    }
    match choose_backend(BackendChoice::Auto, 0).unwrap() {
        Chosen::Cpu { why } => assert!(why.contains("libcuda.so.1"), "{why}"),
        Chosen::Cuda(_) => panic!("CUDA chosen without a driver library"),
    }
    let e = choose_backend(BackendChoice::Cuda, 0)
        .unwrap_err()
        .to_string();
    assert!(
        e.starts_with("--backend cuda: no NVIDIA driver library"),
        "{e}"
    );
    assert!(matches!(
        choose_backend(BackendChoice::Cpu, 0).unwrap(),
        Chosen::Cpu { .. }
    ));

    // The binary: `--backend cuda` is a clear error, not a panic; auto runs on the CPU
    // and logs why.
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("s");
    pack_store(&fixture("tiny-llama"), &dir, "none", 1 << 20);
    let d = dir.to_str().unwrap();
    let e = sluiced_err(&[
        "run",
        "--temperature",
        "0",
        d,
        "--prompt-ids",
        "1,2,3",
        "--max-tokens",
        "2",
        "--backend",
        "cuda",
    ]);
    assert!(
        e.contains("--backend cuda: no NVIDIA driver library"),
        "{e}"
    );
    assert!(!e.contains("panicked"), "{e}");
    // The kernel benchmark measures CUDA only: it says why it cannot run.
    let e = sluiced_err(&["bench-kernels", "--model", d]);
    assert!(
        e.contains("bench-kernels measures the CUDA kernels and needs a CUDA device: no NVIDIA driver library"),
        "{e}"
    );
    assert!(!e.contains("panicked"), "{e}");
    // The daemon too, from its flag or its config file.
    let e = sluiced_err(&[
        "serve",
        "--model",
        d,
        "--listen",
        "127.0.0.1:0",
        "--backend",
        "cuda",
    ]);
    assert!(
        e.contains("--backend cuda: no NVIDIA driver library"),
        "{e}"
    );
    let conf = tmp.path().join("sluiced.toml");
    std::fs::write(&conf, "backend = \"cuda\"\ndevice = 0\n").unwrap();
    let e = sluiced_err(&[
        "serve",
        "--model",
        d,
        "--listen",
        "127.0.0.1:0",
        "--config",
        conf.to_str().unwrap(),
    ]);
    assert!(
        e.contains("--backend cuda: no NVIDIA driver library"),
        "{e}"
    );
    std::fs::write(&conf, "backend = \"gpu\"\n").unwrap();
    let e = sluiced_err(&["serve", "--model", d, "--config", conf.to_str().unwrap()]);
    assert!(
        e.contains("unknown variant `gpu`") && e.contains("sluiced.toml"),
        "{e}"
    );
    let o = std::process::Command::new(bin("sluiced"))
        .args([
            "run",
            "--temperature",
            "0",
            d,
            "--prompt-ids",
            "1,2,3",
            "--max-tokens",
            "2",
            "--json",
        ])
        .env("RUST_LOG", "info")
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("CPU backend: no NVIDIA driver library"),
        "{}",
        stderr(&o)
    );
    let j: serde_json::Value = serde_json::from_str(&stdout(&o)).unwrap();
    assert_eq!(j["backend"], "cpu");
}

// ---- ops, on random inputs, against the CPU backend ----

fn test_cfg() -> ArchConfig {
    ArchConfig {
        arch: Arch::Llama,
        name: "ops".into(),
        n_layers: 2,
        hidden: 256,
        n_heads: 8,
        n_kv_heads: 2,
        head_dim: 32,
        intermediate: 512,
        vocab: 1000,
        max_context: 64,
        rope_theta: 10000.0,
        rope_scaling: None,
        rms_eps: 1e-5,
        tied_embeddings: false,
        qkv_bias: false,
        // Layer 1 attends through a window of 5 in a ring (Gemma 3 and Mistral layers).
        sliding_window: Some(5),
        ext: sluice::model::ArchExt {
            sliding_layers: vec![1],
            ..Default::default()
        },
        moe: None,
        swiglu: None,
    }
}

const OPS_OPTS: ModelOptions = ModelOptions {
    max_context: 64,
    kv_slots: 4,
    max_batch_tokens: 64,
    kv_dtype: sluice::backend::KvDtype::F32,
    exact: true,
    verify_rows: 0,
};

struct Pair {
    cpu: CpuBackend,
    gpu: CudaBackend,
}

impl Pair {
    fn new() -> Pair {
        Pair::with_shape(OPS_OPTS.scratch_shape(&test_cfg()))
    }

    fn with_shape(shape: sluice::backend::ScratchShape) -> Pair {
        Pair::with_arena(shape, 256 << 20)
    }

    fn with_arena(shape: sluice::backend::ScratchShape, arena: u64) -> Pair {
        Pair {
            cpu: CpuBackend::new(arena, 2).unwrap(),
            gpu: CudaBackend::new(0, arena, &shape).expect("a CUDA device"),
        }
    }

    fn put(&self, bytes: &[u8]) -> (sluice::backend::cpu::CpuMem, cuda::CudaMem) {
        let mut c = self.cpu.alloc(bytes.len(), "test").unwrap();
        let mut g = self.gpu.alloc(bytes.len(), "test").unwrap();
        self.cpu.upload(&mut c, bytes).unwrap();
        self.gpu.upload(&mut g, bytes).unwrap();
        (c, g)
    }

    fn zeros(&self, n: usize) -> (sluice::backend::cpu::CpuMem, cuda::CudaMem) {
        self.put(&vec![0u8; n * 4])
    }

    fn get(
        &self,
        m: &(sluice::backend::cpu::CpuMem, cuda::CudaMem),
        n: usize,
    ) -> (Vec<f32>, Vec<f32>) {
        let (mut a, mut b) = (vec![0f32; n], vec![0f32; n]);
        self.cpu.download_f32(&m.0, 0, &mut a);
        self.gpu.download_f32(&m.1, 0, &mut b);
        self.gpu.check().expect("no device error");
        (a, b)
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU; scripts/gpu-check.sh runs it"]
fn ops_match_the_cpu_backend() {
    let _ = GPU;
    let p = Pair::new();
    let mut rng = Rng::new(7);
    let (rows, gemv_rows, k, m) = (23usize, 5usize, 256usize, 160usize);
    let x: Vec<f32> = (0..rows * k).map(|_| rng.symmetric_f32()).collect();
    let xm = p.put(&f32_bytes(&x));

    // matmul: decode rows through the GEMV kernels, prefill rows through cuBLAS, with and
    // without a bias, for every weight type, at 1, 3, 17 and 23 rows.
    for dt in ALL_DTYPES {
        let w = random_weights(dt, m, k, &mut rng);
        let wm = p.put(&w);
        let bias = random_weights(DType::F32, 1, m, &mut rng);
        let bm = p.put(&bias);
        for (rows, gemv_rows, with_bias) in [
            (1, 1, false),
            (3, 3, true),
            (17, 0, true),
            (17, 17, false),
            (rows, gemv_rows, false),
            (rows, gemv_rows, true),
            (rows, 8, false),
            (rows, 9, true),
        ] {
            let out = p.zeros(rows * m);
            let (mut oc, mut og) = out;
            p.cpu.matmul(
                &xm.0,
                rows,
                gemv_rows,
                wref(&wm.0, dt, m, k),
                with_bias.then(|| wref(&bm.0, DType::F32, 1, m)),
                &mut oc,
            );
            p.gpu.matmul(
                &xm.1,
                rows,
                gemv_rows,
                wref(&wm.1, dt, m, k),
                with_bias.then(|| wref(&bm.1, DType::F32, 1, m)),
                &mut og,
            );
            let (c, g) = p.get(&(oc, og), rows * m);
            // Decode rows: f32 activations on both sides, only the summation order differs.
            close(
                &format!("matmul {dt:?} decode"),
                &c[..gemv_rows * m],
                &g[..gemv_rows * m],
                m,
                1e-4,
            );
            // Prefill rows: bf16 weights meet bf16 activations in cuBLAS; f16 weights are
            // widened to f32 tiles (f16 activations would saturate), as quantized ones are.
            let tol = if dt == DType::BF16 { 2e-2 } else { 1e-4 };
            close(
                &format!("matmul {dt:?} prefill"),
                &c[gemv_rows * m..],
                &g[gemv_rows * m..],
                m,
                tol,
            );
        }
        // A 16-bit bias (Qwen2 in bf16).
        if dt == DType::BF16 {
            let b16 = random_weights(DType::BF16, 1, m, &mut rng);
            let bm = p.put(&b16);
            let (mut oc, mut og) = p.zeros(rows * m);
            p.cpu.matmul(
                &xm.0,
                rows,
                rows,
                wref(&wm.0, dt, m, k),
                Some(wref(&bm.0, DType::BF16, 1, m)),
                &mut oc,
            );
            p.gpu.matmul(
                &xm.1,
                rows,
                rows,
                wref(&wm.1, dt, m, k),
                Some(wref(&bm.1, DType::BF16, 1, m)),
                &mut og,
            );
            let (c, g) = p.get(&(oc, og), rows * m);
            close("matmul bf16 + bf16 bias", &c, &g, m, 1e-4);
        }

        // Embedding gather of every dtype (rows of the same weights as a table).
        let ids: Vec<u32> = (0..rows as u32).map(|i| (i * 37) % m as u32).collect();
        let (mut oc, mut og) = p.zeros(rows * k);
        p.cpu.embedding(wref(&wm.0, dt, m, k), &ids, &mut oc);
        p.gpu.embedding(wref(&wm.1, dt, m, k), &ids, &mut og);
        let (c, g) = p.get(&(oc, og), rows * k);
        // The K-quant-era decoders round every product and sum as the CPU's do: exact.
        let tol = if dt.is_quantized() && !matches!(dt, DType::Q8_0 | DType::Q4_0 | DType::Q4_1) {
            0.0
        } else {
            1e-6
        };
        close(&format!("embedding {dt:?}"), &c, &g, k, tol);
    }

    // rms_norm with f32 and bf16 weights.
    for dt in [DType::F32, DType::BF16, DType::F16] {
        let w = random_weights(dt, 1, k, &mut rng);
        let wm = p.put(&w);
        let (mut oc, mut og) = p.zeros(rows * k);
        p.cpu
            .rms_norm(&xm.0, wref(&wm.0, dt, 1, k), 1e-5, rows, &mut oc);
        p.gpu
            .rms_norm(&xm.1, wref(&wm.1, dt, 1, k), 1e-5, rows, &mut og);
        let (c, g) = p.get(&(oc, og), rows * k);
        close(&format!("rms_norm {dt:?}"), &c, &g, k, 1e-5);
    }

    // silu_mul, add, copy_row.
    let y: Vec<f32> = (0..rows * k).map(|_| rng.symmetric_f32() * 3.0).collect();
    let ym = p.put(&f32_bytes(&y));
    let (mut gc, mut gg) = p.put(&f32_bytes(&x));
    p.cpu.silu_mul(&mut gc, &ym.0, rows * k);
    p.gpu.silu_mul(&mut gg, &ym.1, rows * k);
    p.cpu.add(&mut gc, &ym.0, rows * k);
    p.gpu.add(&mut gg, &ym.1, rows * k);
    // copy_row copies bits: from an input both backends hold the same, not from their
    // silu_mul outputs (which agree only within the tolerance above).
    let (mut rc, mut rg) = p.zeros(4 * k);
    p.cpu.copy_row(&ym.0, 7, &mut rc, 2, k);
    p.gpu.copy_row(&ym.1, 7, &mut rg, 2, k);
    let (c, g) = p.get(&(gc, gg), rows * k);
    close("silu_mul + add", &c, &g, k, 1e-5);
    let (c, g) = p.get(&(rc, rg), 4 * k);
    close("copy_row", &c, &g, k, 0.0);
    // gpt-oss's clamped SwiGLU, with gates and ups past the limit on both sides.
    let big: Vec<f32> = (0..rows * k).map(|_| rng.symmetric_f32() * 12.0).collect();
    let (mut gc, mut gg) = p.put(&f32_bytes(&big));
    p.cpu.swiglu_clamp_mul(&mut gc, &ym.0, rows * k, 1.702, 2.5);
    p.gpu.swiglu_clamp_mul(&mut gg, &ym.1, rows * k, 1.702, 2.5);
    let (c, g) = p.get(&(gc, gg), rows * k);
    close("swiglu_clamp_mul", &c, &g, k, 1e-5);
    // A mixture's rows: gathered for an expert, its output added back weighted (the same
    // bits: a product, then a sum), and the block output zeroed first.
    let picked = [5u32, 0, 9, 3];
    let weights = [0.25f32, 0.5, 0.125, 0.75];
    let (mut xc, mut xg) = p.zeros(picked.len() * k);
    p.cpu.gather_rows(&ym.0, &picked, k, &mut xc);
    p.gpu.gather_rows(&ym.1, &picked, k, &mut xg);
    let (mut sc, mut sg) = p.put(&f32_bytes(&x));
    p.cpu.zero(&mut sc, 2 * k);
    p.gpu.zero(&mut sg, 2 * k);
    p.cpu.scatter_add_rows(&xc, &picked, &weights, k, &mut sc);
    p.gpu.scatter_add_rows(&xg, &picked, &weights, k, &mut sg);
    let (c, g) = p.get(&(xc, xg), picked.len() * k);
    close("gather_rows", &c, &g, k, 0.0);
    let (c, g) = p.get(&(sc, sg), rows * k);
    close("zero + scatter_add_rows", &c, &g, k, 0.0);
}

/// `rows` decode rows of `x` times `w` (m x k of `dt`) on the GPU alone, downloaded.
#[allow(clippy::too_many_arguments)] // the product's operands
fn gpu_gemv(
    p: &Pair,
    x: &cuda::CudaMem,
    rows: usize,
    w: &cuda::CudaMem,
    dt: DType,
    m: usize,
    k: usize,
) -> Vec<f32> {
    let mut out = p.gpu.alloc(rows.max(1) * m * 4, "test").unwrap();
    p.gpu
        .matmul(x, rows, rows, wref(w, dt, m, k), None, &mut out);
    let mut v = vec![0f32; rows * m];
    p.gpu.download_f32(&out, 0, &mut v);
    p.gpu.check().expect("no device error");
    v
}

fn same_bits(what: &str, a: &[f32], b: &[f32]) {
    assert_eq!(a.len(), b.len(), "{what}: lengths");
    if let Some(i) = (0..a.len()).find(|&i| a[i].to_bits() != b[i].to_bits()) {
        panic!("{what}: element {i} differs: {} vs {}", a[i], b[i]);
    }
}

/// Decode rows share each weight read among up to GEMV_R rows: a row's result must be the
/// same bits alone, in a partial group or as one of 64, wherever in its group it sits.
#[test]
#[ignore = "needs an NVIDIA GPU; scripts/gpu-check.sh runs it"]
fn multi_row_gemv_results_do_not_depend_on_the_batch() {
    let _ = GPU;
    let p = Pair::new();
    let mut rng = Rng::new(21);
    let (rows, k, m) = (64usize, 256usize, 160usize);
    let x: Vec<f32> = (0..rows * k).map(|_| rng.symmetric_f32()).collect();
    let xm = p.put(&f32_bytes(&x));
    for dt in ALL_DTYPES {
        let wm = p.put(&random_weights(dt, m, k, &mut rng));
        let full = gpu_gemv(&p, &xm.1, rows, &wm.1, dt, m, k);
        for n in [1, 2, 7, 8, 9, 17, 63] {
            let part = gpu_gemv(&p, &xm.1, n, &wm.1, dt, m, k);
            same_bits(
                &format!("{dt:?}: the first {n} of 64 rows"),
                &part,
                &full[..n * m],
            );
        }
        for r in [0, 5, 8, 37, 63] {
            let one = p.put(&f32_bytes(&x[r * k..(r + 1) * k]));
            let alone = gpu_gemv(&p, &one.1, 1, &wm.1, dt, m, k);
            same_bits(
                &format!("{dt:?}: row {r} alone"),
                &alone,
                &full[r * m..(r + 1) * m],
            );
        }
        let (mut oc, _) = p.zeros(rows * m);
        p.cpu
            .matmul(&xm.0, rows, rows, wref(&wm.0, dt, m, k), None, &mut oc);
        let mut c = vec![0f32; rows * m];
        p.cpu.download_f32(&oc, 0, &mut c);
        close(&format!("{dt:?}: 64 decode rows"), &c, &full, m, 1e-4);
    }
}

/// The bf16 copy of prefill activations is made once for the products that share them and
/// never reused once anything (an op, or a product's output) has written them; f16 weights
/// take activations past f16's range (65504).
#[test]
#[ignore = "needs an NVIDIA GPU; scripts/gpu-check.sh runs it"]
fn prefill_activations_are_converted_once_and_never_used_stale() {
    let p = Pair::new();
    let mut rng = Rng::new(31);
    let (t, k) = (12usize, 256usize);
    let x: Vec<f32> = (0..t * k).map(|_| rng.symmetric_f32() * 3.0).collect();
    let (mut xc, mut xg) = p.put(&f32_bytes(&x));
    let ws: Vec<Both> = (0..3)
        .map(|_| p.put(&random_weights(DType::BF16, k, k, &mut rng)))
        .collect();
    let wq8 = p.put(&random_weights(DType::Q8_0, k, k, &mut rng));
    let y: Vec<f32> = (0..t * k).map(|_| rng.symmetric_f32()).collect();
    let ym = p.put(&f32_bytes(&y));
    let product = |xc: &sluice::backend::cpu::CpuMem,
                   xg: &cuda::CudaMem,
                   w: &Both,
                   dt: DType,
                   what: &str,
                   tol: f64| {
        let (mut oc, mut og) = p.zeros(t * k);
        p.cpu.matmul(xc, t, 0, wref(&w.0, dt, k, k), None, &mut oc);
        p.gpu.matmul(xg, t, 0, wref(&w.1, dt, k, k), None, &mut og);
        let (c, g) = p.get(&(oc, og), t * k);
        close(what, &c, &g, k, tol);
    };
    // q, k and v of the same activations.
    for (i, w) in ws.iter().enumerate() {
        product(&xc, &xg, w, DType::BF16, &format!("projection {i}"), 2e-2);
    }
    // An op writes the activations: the next product must see the new values.
    p.cpu.add(&mut xc, &ym.0, t * k);
    p.gpu.add(&mut xg, &ym.1, t * k);
    product(&xc, &xg, &ws[0], DType::BF16, "after an add", 2e-2);
    // A product writes them (its output is where they were).
    let (zc, zg) = p.put(&f32_bytes(&y));
    p.cpu
        .matmul(&zc, t, 0, wref(&wq8.0, DType::Q8_0, k, k), None, &mut xc);
    p.gpu
        .matmul(&zg, t, 0, wref(&wq8.1, DType::Q8_0, k, k), None, &mut xg);
    product(
        &xc,
        &xg,
        &ws[1],
        DType::BF16,
        "after a product into them",
        2e-2,
    );
    // f16 weights, activations far past 65504.
    let big: Vec<f32> = (0..t * k).map(|_| rng.symmetric_f32() * 4e5).collect();
    let bm = p.put(&f32_bytes(&big));
    let w16 = p.put(&random_weights(DType::F16, k, k, &mut rng));
    product(
        &bm.0,
        &bm.1,
        &w16,
        DType::F16,
        "f16 weights, activations of 4e5",
        1e-4,
    );
}

/// A launch with nothing to do (no rows, no outputs, no elements) is not an error.
#[test]
#[ignore = "needs an NVIDIA GPU; scripts/gpu-check.sh runs it"]
fn empty_launches_are_no_ops() {
    let p = Pair::new();
    let mut rng = Rng::new(41);
    let (k, m) = (256usize, 160usize);
    let w = p.put(&random_weights(DType::Q4_0, m, k, &mut rng));
    let x = p.put(&f32_bytes(&vec![0.5f32; 4 * k]));
    let (_, mut og) = p.zeros(4 * m);
    p.gpu
        .matmul(&x.1, 0, 0, wref(&w.1, DType::Q4_0, m, k), None, &mut og);
    p.gpu
        .matmul(&x.1, 3, 3, wref(&w.1, DType::Q4_0, 0, k), None, &mut og);
    let (_, mut g) = p.zeros(16);
    p.gpu.silu_mul(&mut g, &x.1, 0);
    p.gpu.add(&mut g, &x.1, 0);
    p.gpu.check().expect("empty launches are no-ops");
}

/// Attention over contexts past what scores in shared memory allowed (58K positions on a
/// 227 KiB block), query-head groups wider than one pass of the kernel (16 heads on one KV
/// head), heads of 256 and of 80 dimensions, a sliding window in a ring; f32 and f16
/// caches filled with random values, against the CPU backend.
#[test]
#[ignore = "needs an NVIDIA GPU; scripts/gpu-check.sh runs it"]
fn attention_over_long_contexts_and_wide_head_groups_matches_the_cpu_backend() {
    use sluice::backend::KvDtype;
    // The backend's attention scratch is sized by the longest context and the most heads.
    let shape = sluice::backend::ScratchShape {
        max_context: 70_000,
        heads: 16,
        q_dim: 16 * 256,
        ..OPS_OPTS.scratch_shape(&test_cfg())
    };
    let p = Pair::with_arena(shape, 512 << 20);
    let mut rng = Rng::new(51);
    for kv in [KvDtype::F32, KvDtype::F16] {
        for (heads, kv_heads, head_dim, ctx, window) in [
            (8usize, 1usize, 64usize, 70_000usize, None),
            (16, 1, 256, 3000, None),
            (12, 4, 80, 2000, Some(700usize)),
            (4, 4, 32, 100, None),
        ] {
            let c = AttnCase::new(kv, (heads, kv_heads, head_dim), ctx, window, &mut rng);
            let (ck, cv, qm) = (p.put(&c.k), p.put(&c.v), p.put(&f32_bytes(&c.q)));
            let (rows, wq) = (c.rows, heads * head_dim);
            let step = AttnStep {
                layer: 0,
                spans: &c.spans,
                shape: c.shape,
                cache: c.cache,
                ancestors: &[],
            };
            let (mut oc, mut og) = p.zeros(rows * wq);
            p.cpu.attention(&qm.0, &ck.0, &cv.0, &step, None, &mut oc);
            p.gpu.attention(&qm.1, &ck.1, &cv.1, &step, None, &mut og);
            let (c, g) = p.get(&(oc, og), rows * wq);
            close(
                &format!("attention {kv:?}, {heads} heads on {kv_heads}, {head_dim} dims, context {ctx}, window {window:?}"),
                &c,
                &g,
                head_dim,
                1e-4,
            );
        }
    }
}

type Both = (sluice::backend::cpu::CpuMem, cuda::CudaMem);

/// The calls of a mixture's routed experts (`routed`: expert, rows, weights) on one side
/// of a pair of backends: weights `ws` (gate, up, down), biases `bs`.
#[allow(clippy::too_many_arguments)] // the experts, their weights and which side
fn expert_calls<'a, M>(
    routed: &[(usize, &'a [u32], &'a [f32])],
    ws: &'a [[Both; 3]],
    bs: &'a [Option<[Both; 3]>],
    side: fn(&Both) -> &M,
    dt: DType,
    bias_dt: Option<DType>,
    dims: [(usize, usize); 3],
) -> Vec<sluice::backend::ExpertCall<'a, M>> {
    routed
        .iter()
        .map(|&(e, rows, weights)| sluice::backend::ExpertCall {
            w: [0, 1, 2].map(|i| wref(side(&ws[e][i]), dt, dims[i].0, dims[i].1)),
            bias: bias_dt.map(|b| {
                let m = bs[e].as_ref().expect("biases");
                [0, 1, 2].map(|i| wref(side(&m[i]), b, 1, dims[i].0))
            }),
            rows,
            weights,
        })
        .collect()
}

#[test]
#[ignore = "needs an NVIDIA GPU; scripts/gpu-check.sh runs it"]
fn a_mixture_s_routing_and_grouped_experts_match_one_expert_at_a_time() {
    use sluice::backend::experts::experts_each;
    use sluice::backend::{ExpertScratch, ExpertShape, GatedAct};
    use sluice::model::moe::Routes;
    use sluice::store::arch::{Gating, MoeConfig};
    let _ = GPU;
    let mut shape = OPS_OPTS.scratch_shape(&test_cfg());
    shape.top_k = 4;
    let p = Pair::with_shape(shape);
    let mut rng = Rng::new(11);
    let (rows, h, inter, n_exp, k) = (9usize, 256usize, 256usize, 6usize, 3usize);

    // Routing: the same experts as the host's, weights to a few ulp, for both gatings, with
    // and without renormalization, on rows with ties, a NaN row and an infinity.
    let mut logits: Vec<f32> = (0..rows * n_exp)
        .map(|_| rng.symmetric_f32() * 4.0)
        .collect();
    logits[6..12].fill(0.5);
    logits[12..18].fill(f32::NAN);
    logits[20] = f32::INFINITY;
    let lm = p.put(&f32_bytes(&logits));
    for (gating, norm) in [
        (Gating::SoftmaxTopK, true),
        (Gating::SoftmaxTopK, false),
        (Gating::TopKSoftmax, false),
    ] {
        let moe = MoeConfig {
            n_experts: n_exp as u32,
            top_k: k as u32,
            intermediate: inter as u32,
            norm_topk_prob: norm,
            dense_layers: Vec::new(),
        };
        let mut host = Routes::with_capacity(&moe, rows);
        host.route(&moe, gating, &logits, rows);
        let mut dev = Routes::with_capacity(&moe, rows);
        let on_device = match gating {
            Gating::SoftmaxTopK => sluice::backend::RouteGating::SoftmaxTopK { norm },
            Gating::TopKSoftmax => sluice::backend::RouteGating::TopKSoftmax,
        };
        assert!(
            p.gpu
                .route_top_k(&lm.1, (rows, n_exp, k), on_device, dev.chosen_mut()),
            "{gating:?}: routed on the device"
        );
        p.gpu.check().expect("no device error");
        dev.group(&moe);
        for r in 0..rows {
            let (a, b) = (host.chosen(r, k), dev.chosen(r, k));
            for (x, y) in a.iter().zip(b) {
                assert_eq!(x.0, y.0, "{gating:?} norm {norm}: row {r}: {a:?} vs {b:?}");
                let ok = (x.1.is_nan() && y.1.is_nan()) || (x.1 - y.1).abs() <= 1e-6;
                assert!(ok, "{gating:?} norm {norm}: row {r}: {a:?} vs {b:?}");
            }
        }
        assert_eq!(host.starts, dev.starts);
        assert_eq!(host.rows, dev.rows);
    }

    // Experts: the grouped kernels against one expert after another on the device (the
    // same bits) and against the CPU, for a quantized and a bf16 model with biases, with
    // scratch for only 8 pairs so the 27 pairs go in chunks.
    let moe = MoeConfig {
        n_experts: n_exp as u32,
        top_k: k as u32,
        intermediate: inter as u32,
        norm_topk_prob: true,
        dense_layers: Vec::new(),
    };
    let clean: Vec<f32> = (0..rows * n_exp)
        .map(|_| rng.symmetric_f32() * 4.0)
        .collect();
    let mut routes = Routes::with_capacity(&moe, rows);
    routes.route(&moe, Gating::SoftmaxTopK, &clean, rows);
    let x: Vec<f32> = (0..rows * h).map(|_| rng.symmetric_f32()).collect();
    let xm = p.put(&f32_bytes(&x));
    let base: Vec<f32> = (0..rows * h).map(|_| rng.symmetric_f32()).collect();
    for (dt, bias_dt, act) in [
        (DType::Q8_0, None, GatedAct::Silu),
        (DType::Q4K, None, GatedAct::GeluTanh),
        (
            DType::BF16,
            Some(DType::BF16),
            GatedAct::SwigluClamp {
                alpha: 1.702,
                limit: 7.0,
            },
        ),
        (
            DType::Mxfp4,
            Some(DType::F32),
            GatedAct::SwigluClamp {
                alpha: 1.702,
                limit: 7.0,
            },
        ),
    ] {
        let ws: Vec<_> = (0..n_exp)
            .map(|_| {
                [
                    p.put(&random_weights(dt, inter, h, &mut rng)),
                    p.put(&random_weights(dt, inter, h, &mut rng)),
                    p.put(&random_weights(dt, h, inter, &mut rng)),
                ]
            })
            .collect();
        let bs: Vec<_> = (0..n_exp)
            .map(|_| {
                bias_dt.map(|b| {
                    [
                        p.put(&random_weights(b, 1, inter, &mut rng)),
                        p.put(&random_weights(b, 1, inter, &mut rng)),
                        p.put(&random_weights(b, 1, h, &mut rng)),
                    ]
                })
            })
            .collect();
        let dims = [(inter, h), (inter, h), (h, inter)];
        let routed: Vec<(usize, &[u32], &[f32])> = (0..n_exp)
            .map(|e| (e, routes.of(e)))
            .filter(|(_, (r, _))| !r.is_empty())
            .map(|(e, (r, w))| (e, r, w))
            .collect();
        let shape = ExpertShape {
            hidden: h,
            act,
            decode: true,
        };
        let pairs: usize = routed.iter().map(|c| c.1.len()).sum();
        assert_eq!(pairs, rows * k);
        let cpu_calls = expert_calls(&routed, &ws, &bs, |m| &m.0, dt, bias_dt, dims);
        let gpu_calls = expert_calls(&routed, &ws, &bs, |m| &m.1, dt, bias_dt, dims);
        // Scratch for every row (one expert at a time), and on the device for 8 pairs.
        let (mut bx, mut bg, mut bu, mut by) = (
            p.zeros(rows * h),
            p.zeros(rows * inter),
            p.zeros(rows * inter),
            p.zeros(rows * h),
        );
        let (mut sx, mut sg, mut su, mut sy) = (
            p.zeros(rows * h),
            p.zeros(8 * inter),
            p.zeros(8 * inter),
            p.zeros(8 * h),
        );
        let (mut oc, mut og) = p.put(&f32_bytes(&base));
        experts_each(
            &p.cpu,
            &xm.0,
            shape,
            &cpu_calls,
            ExpertScratch {
                x: &mut bx.0,
                gate: &mut bg.0,
                up: &mut bu.0,
                y: &mut by.0,
            },
            &mut oc,
        );
        p.gpu.experts(
            &xm.1,
            shape,
            &gpu_calls,
            ExpertScratch {
                x: &mut sx.1,
                gate: &mut sg.1,
                up: &mut su.1,
                y: &mut sy.1,
            },
            &mut og,
        );
        // The device one expert after another.
        let (ec, mut eg) = p.put(&f32_bytes(&base));
        experts_each(
            &p.gpu,
            &xm.1,
            shape,
            &gpu_calls,
            ExpertScratch {
                x: &mut bx.1,
                gate: &mut bg.1,
                up: &mut bu.1,
                y: &mut by.1,
            },
            &mut eg,
        );
        let (c, g) = p.get(&(oc, og), rows * h);
        close(&format!("experts {dt:?} grouped vs CPU"), &c, &g, h, 1e-4);
        let (_, each) = p.get(&(ec, eg), rows * h);
        close(
            &format!("experts {dt:?} grouped vs one at a time"),
            &each,
            &g,
            h,
            0.0,
        );
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU; scripts/gpu-check.sh runs it"]
fn rope_kv_cache_and_attention_match_the_cpu_backend() {
    for kv in [sluice::backend::KvDtype::F32, sluice::backend::KvDtype::F16] {
        rope_kv_cache_and_attention(kv);
    }
}

/// Both backends round K and V to f16 the same way (nearest even) in an f16 cache.
fn rope_kv_cache_and_attention(kv: sluice::backend::KvDtype) {
    let p = Pair::new();
    let cfg = test_cfg();
    let mut rng = Rng::new(11);
    let shape = AttnShape {
        kv,
        heads: cfg.n_heads as usize,
        kv_heads: cfg.n_kv_heads as usize,
        head_dim: cfg.head_dim as usize,
        max_context: OPS_OPTS.max_context,
        slots: OPS_OPTS.kv_slots,
        scale: 1.0 / (cfg.head_dim as f32).sqrt(),
    };
    // Steps of at most 16 tokens: layer 1's ring holds 5 + 15 positions of the 64.
    let ring_opts = ModelOptions {
        max_batch_tokens: 16,
        kv_dtype: kv,
        exact: true,
        ..OPS_OPTS
    };
    let (layout, cache_elems) = sluice::model::decoder::kv_layout(&cfg, &ring_opts);
    assert!(layout[1].cap < OPS_OPTS.max_context, "layer 1 is a ring");
    let (wq, wkv) = (
        shape.heads * shape.head_dim,
        shape.kv_heads * shape.head_dim,
    );
    let table = sluice::model::rope_table(&cfg, OPS_OPTS.max_context);
    let tm = p.put(&f32_bytes(&table));
    let cache_bytes = cache_elems * kv.bytes();
    let (mut ckc, mut ckg) = p.put(&vec![0u8; cache_bytes]);
    let (mut cvc, mut cvg) = p.put(&vec![0u8; cache_bytes]);
    // Step 1: a prefill chunk of slot 3; step 2: two prefill spans (slots 2 and 0); step 3:
    // two decode rows and slot 3's next chunk, whose positions 16..29 wrap layer 1's ring
    // of 20 (never more than the 16 tokens a step may hold).
    let span = |row, n, pos, slot| SeqSpan { row, n, pos, slot };
    let steps: [Vec<SeqSpan>; 3] = [
        vec![span(0, 16, 0, 3)],
        vec![span(0, 9, 0, 2), span(9, 5, 0, 0)],
        vec![span(0, 1, 9, 2), span(1, 1, 5, 0), span(2, 14, 16, 3)],
    ];
    for spans in &steps {
        let rows: usize = spans.iter().map(|s| s.n).sum();
        assert!(rows <= ring_opts.max_batch_tokens);
    }
    for layer in [0usize, 1] {
        for spans in &steps {
            let rows: usize = spans.iter().map(|s| s.n).sum();
            let positions: Vec<u32> = spans
                .iter()
                .flat_map(|s| (s.pos..s.pos + s.n).map(|x| x as u32))
                .collect();
            let q: Vec<f32> = (0..rows * wq).map(|_| rng.symmetric_f32()).collect();
            let k: Vec<f32> = (0..rows * wkv).map(|_| rng.symmetric_f32()).collect();
            let v: Vec<f32> = (0..rows * wkv).map(|_| rng.symmetric_f32()).collect();
            let (mut qc, mut qg) = p.put(&f32_bytes(&q));
            let (mut kc, mut kg) = p.put(&f32_bytes(&k));
            let vm = p.put(&f32_bytes(&v));
            p.cpu.rope(
                &mut qc,
                rows,
                shape.heads,
                shape.head_dim,
                &positions,
                &tm.0,
            );
            p.gpu.rope(
                &mut qg,
                rows,
                shape.heads,
                shape.head_dim,
                &positions,
                &tm.1,
            );
            p.cpu.rope(
                &mut kc,
                rows,
                shape.kv_heads,
                shape.head_dim,
                &positions,
                &tm.0,
            );
            p.gpu.rope(
                &mut kg,
                rows,
                shape.kv_heads,
                shape.head_dim,
                &positions,
                &tm.1,
            );
            let step = AttnStep {
                layer,
                spans,
                shape,
                cache: layout[layer],
                ancestors: &[],
            };
            p.cpu.kv_store(&kc, &vm.0, &mut ckc, &mut cvc, &step);
            p.gpu.kv_store(&kg, &vm.1, &mut ckg, &mut cvg, &step);
            // Without and with attention sinks (gpt-oss: one f32 logit per query head).
            let sinks: Vec<f32> = (0..shape.heads)
                .map(|_| 2.0 * rng.symmetric_f32())
                .collect();
            let sm = p.put(&f32_bytes(&sinks));
            for with_sinks in [false, true] {
                let (mut oc, mut og) = p.zeros(rows * wq);
                let (sc, sg) = (
                    with_sinks.then(|| wref(&sm.0, DType::F32, 1, shape.heads)),
                    with_sinks.then(|| wref(&sm.1, DType::F32, 1, shape.heads)),
                );
                p.cpu.attention(&qc, &ckc, &cvc, &step, sc, &mut oc);
                p.gpu.attention(&qg, &ckg, &cvg, &step, sg, &mut og);
                let (c, g) = p.get(&(oc, og), rows * wq);
                close(
                    &format!("attention layer {layer}, sinks {with_sinks}"),
                    &c,
                    &g,
                    shape.head_dim,
                    1e-4,
                );
            }
            let (c, g) = p.get(&(qc, qg), rows * wq);
            close("rope", &c, &g, wq, 1e-5);
        }
    }
    let n = cache_bytes / 4;
    let (c, g) = p.get(&(ckc, ckg), n);
    close("K cache", &c, &g, n, 1e-5);
}

#[test]
#[ignore = "needs an NVIDIA GPU; scripts/gpu-check.sh runs it"]
fn async_uploads_wait_for_the_slot_s_previous_reader() {
    // Upload A into a slot, enqueue a read of it, upload B into the same slot at once:
    // the read must see A (the copy waits for `release_after`), a read after sees B.
    let p = Pair::new();
    let n = 1 << 20;
    let a: Vec<f32> = (0..n).map(|i| i as f32).collect();
    let b: Vec<f32> = (0..n).map(|i| -(i as f32)).collect();
    let (ab, bb) = (f32_bytes(&a), f32_bytes(&b));
    let mut slot = p.gpu.alloc(n * 4, "slot").unwrap();
    let mut acc = p.gpu.alloc(n * 4, "acc").unwrap();
    p.gpu.upload(&mut acc, &vec![0u8; n * 4]).unwrap();
    for _ in 0..3 {
        p.gpu.upload_async(&mut slot, &ab).unwrap();
        p.gpu.add(&mut acc, &slot, n);
        p.gpu.release_after(&slot);
        p.gpu.upload_async(&mut slot, &bb).unwrap();
        p.gpu.add(&mut acc, &slot, n);
        p.gpu.add(&mut acc, &slot, n);
        p.gpu.release_after(&slot);
        p.gpu.upload_wait(&slot).unwrap();
    }
    let mut out = vec![0f32; n];
    p.gpu.download_f32(&acc, 0, &mut out);
    p.gpu.check().unwrap();
    // 3 x (a + 2b) = -3i.
    for (i, o) in out.iter().enumerate().step_by(997) {
        assert_eq!(*o, -3.0 * i as f32, "element {i}");
    }
    let c = p.gpu.copy_stats();
    assert_eq!(c.uploads, 6);
    assert_eq!(c.bytes, 6 * n as u64 * 4);
    assert!(c.seconds > 0.0);
}

// ---- whole models ----

fn io() -> IoConfig {
    IoConfig {
        queue_depth: 8,
        read_buffers: 8,
        request_bytes: 1 << 20,
        ..IoConfig::default()
    }
}

fn input(budget: Option<u64>, opts: ModelOptions) -> PlanInput {
    PlanInput {
        device_budget: budget,
        ..sluice_tests::plan_input(opts)
    }
}

/// What `run` saw: each step's logits, each sequence's greedy tokens, and after each step
/// the tokens routed to every expert so far (a mixture's; empty for a dense model).
struct Ran {
    logits: Vec<Vec<f32>>,
    tokens: Vec<Vec<u32>>,
    routed: Vec<Vec<Vec<u64>>>,
}

/// Logits of a prefill step of two sequences, then `decode` greedy steps of both (feeding
/// `forced` tokens instead when given, so two backends see the same inputs).
fn run<B: Backend>(
    r: &mut Pipeline<B>,
    vocab: u32,
    prompt: usize,
    decode: usize,
    forced: Option<&[Vec<u32>]>,
) -> Ran {
    let seqs: Vec<Vec<u32>> = (0..2u32)
        .map(|s| {
            (0..prompt as u32)
                .map(|i| (i * 37 + 11 * s + 5) % vocab)
                .collect()
        })
        .collect();
    let mut logits = Vec::new();
    let mut all = Vec::new();
    let steps: Vec<SeqStep> = seqs
        .iter()
        .enumerate()
        .map(|(s, t)| SeqStep {
            slot: s,
            pos: 0,
            tokens: t.clone(),
            verify: false,
            ..Default::default()
        })
        .collect();
    r.step(&steps, &mut logits).unwrap();
    all.push(logits.clone());
    let mut routed = vec![Vec::new()];
    r.expert_tokens_into(&mut routed[0]);
    let v = vocab as usize;
    let mut tokens: Vec<Vec<u32>> = vec![Vec::new(); 2];
    for d in 0..decode {
        for s in 0..2 {
            tokens[s].push(sluice::text::sampler::argmax(&logits[s * v..(s + 1) * v]));
        }
        let feed = |s: usize| forced.map_or(tokens[s][d], |f| f[s][d]);
        let steps: Vec<SeqStep> = (0..2)
            .map(|s| SeqStep {
                slot: s,
                pos: prompt + d,
                tokens: vec![feed(s)],
                verify: false,
                ..Default::default()
            })
            .collect();
        r.step(&steps, &mut logits).unwrap();
        all.push(logits.clone());
        let mut counts = Vec::new();
        r.expert_tokens_into(&mut counts);
        routed.push(counts);
    }
    Ran {
        logits: all,
        tokens,
        routed,
    }
}

fn compare_model(src: &Path, tol: f64, decode: usize) {
    let tmp = tempfile::tempdir().unwrap();
    let store: Arc<Store> = pack_store(src, &tmp.path().join("s"), "zstd:1", 1 << 20);
    let m = store.manifest().clone();
    let vocab = m.arch.vocab;
    let opts = ModelOptions {
        max_context: 128,
        kv_slots: 2,
        max_batch_tokens: 64,
        kv_dtype: sluice::backend::KvDtype::F32,
        exact: true,
        verify_rows: 0,
    };
    let mut cpu = cpu_runner(
        store.clone(),
        &input(None, opts),
        2,
        io(),
        Default::default(),
    )
    .unwrap();
    let Ran {
        logits: lc,
        tokens: tc,
        routed: rc,
    } = run(&mut cpu, vocab, 24, decode, None);
    drop(cpu);
    let dev = cuda_usable(0).expect("a usable CUDA device");
    let mut gpu = cuda_runner(
        store.clone(),
        &input(None, opts),
        &dev,
        io(),
        Default::default(),
    )
    .unwrap();
    assert_eq!(gpu.plan.layers_streamed(), 0);
    // The GPU is fed the CPU's greedy tokens, so every step compares like with like.
    let Ran {
        logits: lg,
        tokens: tg,
        routed: rg,
    } = run(&mut gpu, vocab, 24, decode, Some(&tc));
    let v = vocab as usize;
    // A mixture's router on the GPU (its logits from fast-math GEMVs) may break a near-tie
    // between two experts the other way than the CPU: from the first step whose routing
    // differs, the logits are of other computations and are not compared. The router's own
    // kernels are checked exactly by the op tests; here the prefill must route alike.
    let same_routes = rc.iter().zip(&rg).take_while(|(c, g)| c == g).count();
    assert!(
        same_routes > 0,
        "{}: the prefill step routed tokens to other experts on the GPU: {:?} against the CPU's {:?}",
        src.display(),
        rg[0],
        rc[0]
    );
    if same_routes < rc.len() {
        eprintln!(
            "{}: routing differs from step {same_routes} on (a near-tie between experts); steps from there are not compared",
            src.display()
        );
    }
    let mut decided = 0;
    for (i, (c, g)) in lc.iter().zip(&lg).enumerate().take(same_routes) {
        close(
            &format!("{} logits of step {i}", src.display()),
            c,
            g,
            v,
            tol,
        );
        // Greedy choices agree wherever the CPU's top two are further apart than twice the
        // largest difference between the backends' logits in that row (no logit moved
        // more than that, so the order of those two cannot have changed).
        for s in 0..2 {
            if i == lc.len() - 1 {
                break;
            }
            let (row, grow) = (&c[s * v..(s + 1) * v], &g[s * v..(s + 1) * v]);
            let diff = row
                .iter()
                .zip(grow)
                .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
            let mut sorted = row.to_vec();
            sorted.sort_by(|a, b| b.total_cmp(a));
            if sorted[0] - sorted[1] > 2.0 * diff {
                assert_eq!(
                    tc[s][i],
                    tg[s][i],
                    "{}: greedy token {i} of sequence {s}",
                    src.display()
                );
                decided += 1;
            }
        }
    }
    assert!(
        decided > 0,
        "{}: no greedy step was clear enough to compare",
        src.display()
    );
    // Streamed on the GPU (the least budget: two slots of the largest unit) against the
    // GPU all resident: the same kernels on the same data, so bit-identical.
    drop(gpu);
    // The least budget that runs, as the planner states it when asked for too little.
    let budget = match cuda_runner(
        store.clone(),
        &input(Some(4096), opts),
        &dev,
        io(),
        Default::default(),
    ) {
        Err(sluice::engine::EngineError::Plan(e)) => e.need(),
        Err(e) => panic!("{}: {e}", src.display()),
        Ok(_) => panic!("{}: 4 KiB of device memory cannot run it", src.display()),
    };
    let mut streamed = cuda_runner(
        store.clone(),
        &input(Some(budget), opts),
        &dev,
        io(),
        Default::default(),
    )
    .unwrap();
    assert!(
        streamed.plan.layers_streamed() > 0,
        "the budget must make layers stream"
    );
    let mut resident = cuda_runner(
        store.clone(),
        &input(None, opts),
        &dev,
        io(),
        Default::default(),
    )
    .unwrap();
    let s = run(&mut streamed, vocab, 24, decode, None);
    let r = run(&mut resident, vocab, 24, decode, None);
    assert_eq!(
        s.tokens,
        r.tokens,
        "{}: streamed vs resident tokens",
        src.display()
    );
    assert_eq!(
        s.routed,
        r.routed,
        "{}: streamed vs resident routing",
        src.display()
    );
    for (i, (a, b)) in s.logits.iter().zip(&r.logits).enumerate() {
        assert!(
            a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits()),
            "{}: streamed logits of step {i} differ from resident",
            src.display()
        );
    }
    assert!(streamed.total().bytes_uploaded > 0);
    assert!(streamed.total().copy_device_s > 0.0);
}

#[test]
#[ignore = "needs an NVIDIA GPU; scripts/gpu-check.sh runs it"]
fn tiny_models_on_cuda_match_the_cpu_backend() {
    for f in [
        "tiny-llama",
        "tiny-llama.gguf",
        "tiny-llama-q.gguf",
        "tiny-qwen2",
        "tiny-qwen2.gguf",
        "tiny-qwen3",
        "tiny-qwen3.gguf",
        "tiny-mistral",
        // Sliding-window layers (the ring), GeGLU, two RoPE bases.
        "tiny-gemma3",
        "tiny-gemma3.gguf",
    ] {
        compare_model(&fixture(f), 3e-2, 8);
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU; scripts/gpu-check.sh runs it"]
fn tiny_mixtures_on_cuda_match_the_cpu_backend() {
    for f in [
        "tiny-qwen3moe",
        "tiny-qwen3moe.gguf",
        "tiny-qwen3moe-mixed",
        "tiny-mixtral",
        "tiny-mixtral.gguf",
        // Attention sinks, MXFP4 experts, the clamped SwiGLU.
        "tiny-gptoss",
        "tiny-gptoss-mxfp4.gguf",
    ] {
        compare_model(&fixture(f), 3e-2, 8);
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU and the Gemma 3 270M GGUF; scripts/gpu-check.sh runs it"]
fn gemma3_270m_on_cuda_matches_the_cpu_backend() {
    compare_model(&gemma3_gguf(), 1e-2, 8);
}

#[test]
#[ignore = "needs an NVIDIA GPU; scripts/gpu-check.sh runs it"]
fn smollm2_on_cuda_matches_the_cpu_backend() {
    compare_model(&smollm2_gguf(), 1e-2, 8);
}
