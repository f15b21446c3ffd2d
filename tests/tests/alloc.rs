//! The hot path never allocates: a counting global allocator watches decode steps on the
//! CPU backend, with every unit resident and with most of them streaming through the I/O
//! engine, with one and with two compute threads, under `--exact` and the default
//! numerics (f16 KV cache, 8-bit activations); a control checks the counter counts. After warm-up a step allocates nothing,
//! on any thread (pipeline, model, kernels, I/O loop, workers, the compute team: an op
//! publishes its tasks in one atomic word, with nothing queued).
//!
//! `SLUICE_ALLOC_TRACE=1` prints a backtrace for each allocation in the counted window,
//! to find the one that broke the rule.

use sluice::engine::cpu_runner;
use sluice::io::IoConfig;
use sluice::model::{ModelOptions, SeqStep};
use sluice::pipeline::Pipeline;
use sluice::plan::{plan, PlanInput};
use sluice_tests::*;
use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;

struct Counting;

static COUNTING: AtomicBool = AtomicBool::new(false);
static ALLOCS: AtomicU64 = AtomicU64::new(0);
static TRACE: AtomicBool = AtomicBool::new(false);

thread_local! {
    static IN_TRACE: Cell<bool> = const { Cell::new(false) };
}

fn note() {
    if !COUNTING.load(Ordering::Relaxed) {
        return;
    }
    ALLOCS.fetch_add(1, Ordering::Relaxed);
    if TRACE.load(Ordering::Relaxed) && !IN_TRACE.with(|t| t.replace(true)) {
        let bt = std::backtrace::Backtrace::force_capture();
        eprintln!(
            "allocation on {:?}:\n{bt}",
            std::thread::current().name().unwrap_or("?")
        );
        IN_TRACE.with(|t| t.set(false));
    }
}

// SAFETY: forwards every call to the system allocator unchanged; counting touches only
// atomics (and, when tracing, allocates through the same path with the guard set).
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        note();
        // SAFETY: the caller's contract, passed on.
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        note();
        // SAFETY: as above.
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        note();
        // SAFETY: as above.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: as above.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// One test at a time: the counter is global.
static SERIAL: Mutex<()> = Mutex::new(());

/// `--exact` (f32 KV cache, f32 activations) and the default numerics (f16 KV cache,
/// activations quantized to 8 bits for the quantized GEMVs).
const OPTS: [ModelOptions; 2] = [
    ModelOptions {
        max_context: 64,
        kv_slots: 2,
        max_batch_tokens: 32,
        kv_dtype: sluice::backend::KvDtype::F32,
        exact: true,
        verify_rows: 0,
    },
    ModelOptions {
        max_context: 64,
        kv_slots: 2,
        max_batch_tokens: 32,
        kv_dtype: sluice::backend::KvDtype::F16,
        exact: false,
        verify_rows: 0,
    },
];

fn pipeline(
    store: &std::sync::Arc<sluice::store::Store>,
    opts: ModelOptions,
    budget: Option<u64>,
    threads: usize,
) -> Pipeline<sluice::backend::cpu::CpuBackend> {
    let io = IoConfig {
        queue_depth: 8,
        read_buffers: 8,
        request_bytes: 256 << 10,
        workers: 1,
        ..IoConfig::default()
    };
    let input = PlanInput {
        device_budget: budget,
        host_cache_budget: 0,
        opts,
        prefetch: Some(2),
        expert_cache: None,
        expert_profile: None,
        backend_reserved: 0,
        self_draft_reserved: 0,
        host: Default::default(),
    };
    cpu_runner(store.clone(), &input, threads, io, Default::default()).expect("pipeline")
}

/// Allocations and thread-pool submissions during the counted decode steps of a batch of
/// two (after warm-up), and the number of steps counted.
fn allocations_per_step(r: &mut Pipeline<sluice::backend::cpu::CpuBackend>) -> (u64, u64) {
    let vocab = r.store.manifest().arch.vocab;
    let mut logits = Vec::new();
    let prompt: Vec<u32> = (1..9).map(|t| t * 7 % vocab).collect();
    let mut steps = vec![
        SeqStep {
            slot: 0,
            pos: 0,
            tokens: prompt.clone(),
            verify: false,
            ..Default::default()
        },
        SeqStep {
            slot: 1,
            pos: 0,
            tokens: prompt,
            verify: false,
            ..Default::default()
        },
    ];
    r.step(&steps, &mut logits).expect("prefill");
    for s in &mut steps {
        s.pos = s.tokens.len();
        s.tokens.clear();
        s.tokens.push(3);
    }
    let (warm, counted) = (4, 12);
    for i in 0..warm + counted {
        if i == warm {
            // Threads spawned at start (I/O, decompression, compute) may not have run
            // their start-up yet on a busy machine; their one-time allocations are not
            // the hot path's.
            std::thread::sleep(std::time::Duration::from_millis(100));
            ALLOCS.store(0, Ordering::SeqCst);
            TRACE.store(
                std::env::var_os("SLUICE_ALLOC_TRACE").is_some(),
                Ordering::SeqCst,
            );
            COUNTING.store(true, Ordering::SeqCst);
        }
        r.step(&steps, &mut logits).expect("decode step");
        for s in &mut steps {
            s.pos += 1;
            s.tokens[0] = (s.tokens[0] * 31 + 7) % vocab;
        }
    }
    COUNTING.store(false, Ordering::SeqCst);
    TRACE.store(false, Ordering::SeqCst);
    (ALLOCS.load(Ordering::SeqCst), counted)
}

fn check(src: &std::path::Path, name: &str) {
    let _one = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let tmp = tempfile::tempdir().expect("tempdir");
    let store = pack_store(src, &tmp.path().join("s"), "zstd:1", 64 << 10);
    for opts in OPTS {
        let input = |device_budget| PlanInput {
            device_budget,
            host_cache_budget: 0,
            opts,
            prefetch: Some(2),
            expert_cache: None,
            expert_profile: None,
            backend_reserved: 0,
            self_draft_reserved: 0,
            host: Default::default(),
        };
        let full = plan(store.manifest(), &input(None)).expect("plan");
        // The least budget that runs streams nearly every unit.
        let least = plan(store.manifest(), &input(Some(4096)))
            .expect_err("4 KiB is too small")
            .need();
        let numerics = if opts.exact {
            "--exact"
        } else {
            "default numerics"
        };
        for threads in [1, 2] {
            for (what, budget) in [("all resident", None), ("streamed", Some(least))] {
                let mut r = pipeline(&store, opts, budget, threads);
                if budget.is_some() {
                    assert!(r.plan.layers_streamed() > 0, "{name}: nothing streams");
                } else {
                    assert_eq!(r.plan.device_budget, full.device_budget);
                }
                let (allocs, steps) = allocations_per_step(&mut r);
                let at = format!("{name}, {numerics}, {what}, {threads} threads");
                assert_eq!(
                    allocs, 0,
                    "{at}: {allocs} allocations in {steps} decode steps (run with SLUICE_ALLOC_TRACE=1 to see where)"
                );
                eprintln!("{at}: {allocs} allocations in {steps} decode steps");
            }
        }
    }
}

/// The control: the counter sees allocations made while it counts, on this thread and on
/// another, and none once it stops (else a zero above would prove nothing).
#[test]
fn the_counter_sees_allocations_while_counting() {
    let _one = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    ALLOCS.store(0, Ordering::SeqCst);
    COUNTING.store(true, Ordering::SeqCst);
    let here = std::hint::black_box(vec![1u8; 100]);
    let there = std::thread::spawn(|| std::hint::black_box(vec![2u8; 100]).len())
        .join()
        .expect("thread");
    COUNTING.store(false, Ordering::SeqCst);
    let seen = ALLOCS.load(Ordering::SeqCst);
    assert!(
        seen >= 2,
        "{seen} allocations counted for at least two ({} + {there} bytes)",
        here.len()
    );
    drop(std::hint::black_box(vec![3u8; 100]));
    assert_eq!(
        ALLOCS.load(Ordering::SeqCst),
        seen,
        "counted while not counting"
    );
}

#[test]
fn decode_steps_allocate_nothing_on_f32_weights() {
    check(&fixture("tiny-llama"), "tiny-llama (f32 safetensors)");
}

#[test]
fn decode_steps_allocate_nothing_on_16_bit_weights() {
    check(
        &fixture("tiny-llama.gguf"),
        "tiny-llama (f16, bf16 and f32 gguf)",
    );
}

#[test]
fn decode_steps_allocate_nothing_on_quantized_weights() {
    check(&fixture("tiny-llama-q.gguf"), "tiny-llama-q (q8_0/q4 gguf)");
}

#[test]
fn decode_steps_allocate_nothing_on_a_mixture_of_experts() {
    check(
        &fixture("tiny-qwen3moe"),
        "tiny-qwen3moe (bf16 safetensors)",
    );
    check(
        &fixture("tiny-gptoss-mxfp4.gguf"),
        "tiny-gptoss (MXFP4 experts, sinks, biases)",
    );
}
