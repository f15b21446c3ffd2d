//! Placement across backends (issue 60), its foundation: a model's decoder layers split
//! between two backends — the first layers on the host CPU, the rest on a discrete device
//! (here `CpuBackend::new_discrete`, which emulates one) — each backend's decoder holding
//! the KV cache of its own layers only (`Decoder::new_part`), the hidden state handed
//! across where the place changes. The logits must be those of one decoder over every
//! layer, bit for bit, through a prompt and decode steps (so the KV each side keeps is
//! read back), on every architecture. Then the same through the pipeline
//! (`HostInput::cpu_layers`): the plan puts the first layers on the host, out of the
//! device's budget and into the host's, and the pipeline's outputs are one device's, its
//! units resident or streamed, two sequences and eight, each backend within its budget;
//! and the scheduler serving on such a pipeline (prefix cache and its host tier, token
//! trees, the experts' counts) gives what it gives on one device.

use sluice::backend::cpu::CpuBackend;
use sluice::backend::{Backend, KvDtype};
use sluice::engine::draft::{DraftConfig, DraftKind};
use sluice::engine::draft_model::DraftModel;
use sluice::engine::kv_tiers::TierConfig;
use sluice::engine::replace::Replacer;
use sluice::engine::scheduler::{Scheduler, SchedulerConfig, Status};
use sluice::engine::{cpu_runner_discrete, EngineError};
use sluice::io::IoConfig;
use sluice::model::{Decoder, ModelOptions, SeqStep};
use sluice::pipeline::Pipeline;
use sluice::plan::placement::{choose_among, shapes, ComputeRate, Follow, Rates};
use sluice::plan::{plan, DeviceInput, Placement, PlanInput};
use sluice::store::Store;
use sluice::text::Tokenizer;
use sluice_tests::engine::*;
use sluice_tests::*;
use std::sync::Arc;

fn backend(discrete: bool, opts: &ModelOptions, store: &Store) -> CpuBackend {
    let b = if discrete {
        CpuBackend::new_discrete(1 << 30, 2)
    } else {
        CpuBackend::new(1 << 30, 2)
    }
    .unwrap();
    b.set_int8_activations(!opts.exact);
    b.reserve_scratch(&opts.scratch_shape(&store.manifest().arch));
    b
}

/// One side of a split: a backend, its decoder, and the weights of the units it runs.
struct Side {
    b: CpuBackend,
    model: Decoder<CpuBackend>,
    weights: Vec<Option<<CpuBackend as Backend>::Mem>>,
}

impl Side {
    fn new(
        store: &Store,
        raw: &[Vec<u8>],
        opts: ModelOptions,
        discrete: bool,
        layers: std::ops::Range<usize>,
        runs: impl Fn(usize) -> bool,
    ) -> Side {
        let b = backend(discrete, &opts, store);
        let model = Decoder::new_part(&b, store.manifest(), opts, layers).unwrap();
        let weights = raw
            .iter()
            .enumerate()
            .map(|(u, bytes)| {
                runs(u).then(|| {
                    let mut mem = b.alloc(bytes.len(), "weights").unwrap();
                    b.upload(&mut mem, bytes).unwrap();
                    mem
                })
            })
            .collect();
        Side { b, model, weights }
    }

    fn run(&mut self, u: usize, tied_head: Option<usize>) {
        let w = self.weights[u].as_ref().expect("a unit of this side");
        let lm = tied_head.map(|e| self.weights[e].as_ref().expect("the embedding"));
        self.model.forward_unit(&self.b, u, w, lm);
    }
}

/// Hands the hidden state from `from` to `to`.
fn hand(from: &Side, to: &mut Side) {
    let (x, n) = from.model.hidden();
    let mut h = vec![0f32; n];
    from.b.download_f32(x, 0, &mut h);
    let bytes: Vec<u8> = h.iter().flat_map(|v| v.to_le_bytes()).collect();
    to.b.upload(to.model.hidden_mut(), &bytes).unwrap();
}

/// The logits of each step: by one decoder over every layer (`host_layers` None), or with
/// decoder layers `0..host_layers` on the host and the rest on the device.
fn logits(store: &Store, host_layers: Option<usize>, steps: &[Vec<SeqStep>]) -> Vec<Vec<f32>> {
    let raw = decoded_units(store);
    let m = store.manifest();
    let n_layers = m.arch.n_layers as usize;
    let opts = ModelOptions {
        max_context: 64,
        kv_slots: 2,
        max_batch_tokens: 32,
        kv_dtype: KvDtype::F32,
        exact: false,
        verify_rows: 0,
    };
    let n = raw.len();
    let split = host_layers.unwrap_or(0);
    let on_host = |u: usize| (1..=split).contains(&u);
    let mut dev = Side::new(store, &raw, opts, true, split..n_layers, |u| !on_host(u));
    let mut host = host_layers.map(|_| Side::new(store, &raw, opts, false, 0..split, on_host));
    let tied = m.arch.tied_embeddings.then_some(0);
    let mut out = Vec::new();
    for step in steps {
        dev.model.begin(step).unwrap();
        if let Some(h) = &mut host {
            h.model.begin(step).unwrap();
        }
        for u in 0..n {
            let head = (u == n - 1).then_some(tied).flatten();
            match &mut host {
                Some(h) if on_host(u) => {
                    if u == 1 {
                        hand(&dev, h);
                    }
                    h.run(u, None);
                    if u == split {
                        hand(h, &mut dev);
                    }
                }
                _ => dev.run(u, head),
            }
        }
        let mut l = Vec::new();
        dev.model.logits(&dev.b, &mut l);
        out.push(l);
    }
    out
}

/// A prompt of two sequences in chunks, then decode steps of both.
fn steps(vocab: u32) -> Vec<Vec<SeqStep>> {
    let step = |slot: usize, pos: usize, tokens: Vec<u32>, prompt: bool| SeqStep {
        slot,
        pos,
        tokens,
        verify: false,
        prompt,
        parents: Vec::new(),
        kv_moves: Vec::new(),
    };
    let ids = |k: u32, n: u32| (0..n).map(|i| (k * 31 + i * 7) % vocab).collect::<Vec<_>>();
    let mut s = vec![
        vec![step(0, 0, ids(1, 9), true), step(1, 0, ids(2, 5), true)],
        vec![step(0, 9, ids(3, 4), true)],
    ];
    for k in 0..6u32 {
        s.push(vec![
            step(0, 13 + k as usize, vec![(k * 13 + 3) % vocab], false),
            step(1, 5 + k as usize, vec![(k * 17 + 1) % vocab], false),
        ]);
    }
    s
}

#[test]
fn layers_on_the_host_give_the_logits_of_one_backend_on_every_architecture() {
    let tmp = tempfile::tempdir().unwrap();
    for name in TINY_ARCHS {
        let store = pack_store(&fixture(name), &tmp.path().join(name), "zstd", 64 << 10);
        let n_layers = store.manifest().arch.n_layers as usize;
        let s = steps(store.manifest().arch.vocab);
        let one = logits(&store, None, &s);
        for split in [1, n_layers] {
            let got = logits(&store, Some(split), &s);
            for (i, (a, b)) in one.iter().zip(&got).enumerate() {
                assert!(
                    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits()),
                    "{name}: {split} layers on the host: step {i}'s logits differ"
                );
            }
        }
    }
}

const OPTS: ModelOptions = ModelOptions {
    max_context: 64,
    kv_slots: 8,
    max_batch_tokens: 64,
    kv_dtype: KvDtype::F32,
    exact: true,
    verify_rows: 0,
};

fn input(s: &Store, budget: Option<u64>, cpu_layers: usize) -> PlanInput {
    input_with(s, budget, cpu_layers, OPTS)
}

fn input_with(s: &Store, budget: Option<u64>, cpu_layers: usize, opts: ModelOptions) -> PlanInput {
    let mut i = plan_input(opts);
    i.device_budget = budget;
    i.prefetch = Some(3);
    i.host.cpu_layers = cpu_layers;
    i.host.cpu_scratch = CpuBackend::scratch_bytes(&opts.scratch_shape(&s.manifest().arch), 2);
    i
}

fn runner(s: &Arc<Store>, budget: Option<u64>, cpu_layers: usize) -> Pipeline<CpuBackend> {
    runner_with(s, budget, cpu_layers, OPTS)
}

fn runner_with(
    s: &Arc<Store>,
    budget: Option<u64>,
    cpu_layers: usize,
    opts: ModelOptions,
) -> Pipeline<CpuBackend> {
    discrete(s, &input_with(s, budget, cpu_layers, opts)).unwrap()
}

/// The pipeline of `s` for `input` on the emulated device, with two threads each side.
fn discrete(s: &Arc<Store>, input: &PlanInput) -> Result<Pipeline<CpuBackend>, EngineError> {
    let io = IoConfig {
        queue_depth: 8,
        read_buffers: 8,
        request_bytes: 256 << 10,
        ..IoConfig::default()
    };
    let run = sluice::pipeline::PipelineOptions {
        cpu_threads: 2,
        ..Default::default()
    };
    cpu_runner_discrete(s.clone(), input, 2, io, run)
}

/// The logits' bits of eight sequences prefilled in one step (prompts of 1 to 15 tokens),
/// then decoding three steps together.
fn batch_of_eight(r: &mut Pipeline<CpuBackend>, vocab: u32) -> Vec<u32> {
    let mut logits = Vec::new();
    let mut bits = Vec::new();
    let lens: Vec<usize> = (0..8).map(|i| 1 + 2 * i).collect();
    let prompt: Vec<SeqStep> = (0..8)
        .map(|i| SeqStep {
            slot: i,
            pos: 0,
            tokens: (0..lens[i] as u32)
                .map(|t| (t * 29 + i as u32 * 7 + 1) % vocab)
                .collect(),
            ..Default::default()
        })
        .collect();
    r.step(&prompt, &mut logits).unwrap();
    bits.extend(logits.iter().map(|f| f.to_bits()));
    for k in 0..3 {
        let decode: Vec<SeqStep> = (0..8)
            .map(|i| SeqStep {
                slot: i,
                pos: lens[i] + k,
                tokens: vec![(k as u32 * 11 + i as u32 * 3 + 2) % vocab],
                ..Default::default()
            })
            .collect();
        r.step(&decode, &mut logits).unwrap();
        bits.extend(logits.iter().map(|f| f.to_bits()));
    }
    bits
}

#[test]
fn the_pipeline_computes_the_first_layers_on_the_host_with_the_outputs_of_one_device() {
    let tmp = tempfile::tempdir().unwrap();
    let mut streamed_runs = 0;
    for name in [
        "tiny-llama",
        "tiny-qwen2.gguf",
        "tiny-llama-q.gguf",
        "tiny-qwen3",
        "tiny-gemma3",
        "tiny-qwen3moe-mixed",
        "tiny-mixtral.gguf",
        "tiny-gptoss",
    ] {
        let s = pack_store(&fixture(name), &tmp.path().join(name), "zstd:1", 64 << 10);
        let (vocab, n_layers) = (s.manifest().arch.vocab, s.manifest().arch.n_layers as usize);
        let free = plan(s.manifest(), &input(&s, None, 0)).unwrap();
        let want = {
            let mut r = runner(&s, None, 0);
            (outputs(&mut r, vocab), batch_of_eight(&mut r, vocab))
        };
        for cpu_layers in [1, n_layers] {
            let p = plan(s.manifest(), &input(&s, None, cpu_layers)).unwrap();
            // The host layers leave the device: their weights and their KV.
            let host_units: Vec<usize> = (0..s.units().len())
                .filter(|&u| p.placement(u) == Placement::Host)
                .collect();
            assert_eq!(host_units, (1..=cpu_layers).collect::<Vec<_>>(), "{name}");
            let weights: u64 = host_units.iter().map(|&u| s.units()[u].raw_len).sum();
            assert!(p.device_bytes() + weights <= free.device_bytes(), "{name}");
            assert!(p.kv_cache_bytes < free.kv_cache_bytes, "{name}");
            assert_eq!(
                p.kv_cache_bytes + p.cpu_kv_cache_bytes,
                free.kv_cache_bytes,
                "{name}"
            );
            assert!(
                p.host.cpu_layers_bytes >= p.cpu_arena_bytes() && p.cpu_weights_bytes >= weights
            );
            // Resident, and streamed: the least device budget that runs, where that is
            // less than all of what the device holds.
            let least = plan(s.manifest(), &input(&s, Some(4096), cpu_layers))
                .err()
                .map_or(0, |e| e.need());
            let what = format!("{name}: {cpu_layers} layers on the host");
            streamed_runs += as_one_device(
                &what,
                (&want, vocab),
                (least, p.device_bytes(), cpu_layers > 0),
                |budget| runner(&s, budget, cpu_layers),
            );
        }
    }
    // Streamed as well as resident, with layers on the host, on most architectures.
    assert!(streamed_runs >= 6, "{streamed_runs} streamed runs");
}

/// The outputs of one device (`outputs`, `batch_of_eight`).
type Outputs = ((Vec<u32>, Vec<u32>), Vec<u32>);

/// Runs the pipelines `make` builds for a device budget — none (where `resident`), and the
/// `least` that runs where that is below `all` the device holds, so that units stream —
/// each giving `want` and peaking within its budgets. Returns how many streamed.
fn as_one_device(
    what: &str,
    (want, vocab): (&Outputs, u32),
    (least, all, resident): (u64, u64, bool),
    make: impl Fn(Option<u64>) -> Pipeline<CpuBackend>,
) -> usize {
    let streamed = (least > 0 && least < all).then_some(least);
    let mut streamed_runs = 0;
    for budget in [None, streamed]
        .into_iter()
        .filter(|b| b.is_some() || resident)
    {
        let mut r = make(budget);
        if budget.is_some() {
            assert!(r.plan.layers_streamed() > 0, "{what}: nothing streams");
            streamed_runs += 1;
        }
        let got = (outputs(&mut r, vocab), batch_of_eight(&mut r, vocab));
        assert!(got == *want, "{what}, budget {budget:?}: outputs differ");
        within_budgets(what, &r);
    }
    streamed_runs
}

/// Every backend of `r` (the device, the host part's, the other devices') peaked within
/// its budget.
fn within_budgets(name: &str, r: &Pipeline<CpuBackend>) {
    let devices = std::iter::once(&r.backend).chain(r.other_backends());
    for (what, b) in (devices.enumerate())
        .map(|(d, b)| (format!("device {d}"), b))
        .chain(r.host_backend().map(|b| ("host".to_string(), b)))
    {
        let b = b.budget();
        let (peak, limit) = (b.peak(), b.limit());
        assert!(peak <= limit, "{name} {what}: peak {peak} over {limit}");
    }
}

/// What a scheduler serving `r` gives (the daemon's engine, as `sluiced serve` runs it):
/// a conversation's turns, each prompt the last one, its answer and a new message, with
/// another request between turns that takes a slot, so the next turn finds its prefix in
/// a slot or in the host tier; each request decoded `how`. Per request its tokens and the
/// prompt tokens it took from the cache, then the tokens routed to each expert.
/// Per request its tokens and cached prompt tokens; the tokens routed to each expert.
type Served = (Vec<(Vec<u32>, usize)>, Vec<Vec<u64>>);

fn served(r: Pipeline<CpuBackend>, how: Decoding) -> Served {
    served_by(r, (None, None), how).0
}

/// `served`, the placement following the batch with `replacer` where there is one, then
/// two requests at once (both slots decoding); and the status at the end.
fn served_by(
    r: Pipeline<CpuBackend>,
    (draft, replacer): (Option<DraftModel<CpuBackend>>, Option<Replacer<CpuBackend>>),
    how: Decoding,
) -> (Served, Status) {
    let tok = Arc::new(Tokenizer::from_manifest(r.store.manifest()).unwrap());
    let cfg = SchedulerConfig {
        queue_max: 8,
        prefix_cache: true,
        kv_tiers: TierConfig {
            host_bytes: 16 << 20,
            disk: None,
        },
    };
    let (s, engine) = Scheduler::start_following(r, draft, replacer, tok, cfg);
    let mut out = Vec::new();
    let mut prompt: Vec<u32> = (0..40).map(|i| 3 + (i * 37) % 250).collect();
    for turn in 0..5u32 {
        let (answer, cached) = collect(submit(&s, &prompt, 6, how));
        prompt.extend_from_slice(&answer);
        prompt.extend((0..5).map(|i| 100 + 7 * turn + i));
        out.push((answer, cached));
        let other: Vec<u32> = (0..30).map(|i| 200 - i - turn).collect();
        out.push(collect(submit(&s, &other, 3, how)));
    }
    let both: Vec<_> = (0..2u32)
        .map(|k| {
            let p: Vec<u32> = (0..20).map(|i| 50 + 3 * k + i).collect();
            submit(&s, &p, 8, how)
        })
        .collect();
    out.extend(both.into_iter().map(collect));
    s.shutdown(std::time::Duration::from_secs(60));
    engine.join().unwrap();
    let status = s.status();
    ((out, status.expert_tokens.clone()), status)
}

/// The options `served` runs with: two slots, a ring shorter than the conversation.
const SERVED: ModelOptions = ModelOptions {
    max_context: 128,
    kv_slots: 2,
    max_batch_tokens: 64,
    kv_dtype: KvDtype::F16,
    exact: false,
    verify_rows: 16,
};

/// Greedy with ngram token trees of a fixed shape.
fn ngram_trees() -> Decoding {
    Decoding {
        draft: Some(DraftConfig {
            kind: DraftKind::Ngram,
            max: 6,
            fixed: true,
            branches: 2,
        }),
        ..greedy()
    }
}

#[test]
fn the_scheduler_serves_with_layers_on_the_host_as_with_one_device() {
    // What `sluiced serve --cpu-layers` (and `--devices`) runs: the prefix cache (reuse in place, copies
    // across slots, blocks out to the host tier and back across both parts), ngram token
    // trees verified in one pass, and the experts' counts the status reports, each the
    // same as one device's.
    let tmp = tempfile::tempdir().unwrap();
    let (opts, trees) = (SERVED, ngram_trees());
    for name in ["tiny-llama", "tiny-gemma3", "tiny-qwen3moe-mixed"] {
        let s = pack_store(&fixture(name), &tmp.path().join(name), "zstd:1", 64 << 10);
        for how in [greedy(), trees] {
            let one = served(runner_with(&s, None, 0, opts), how);
            let split = served(runner_with(&s, None, 1, opts), how);
            assert_eq!(split.0, one.0, "{name}: tokens and cached tokens");
            // And over two devices.
            let two = runner_split_with(&s, (None, 0), (&[1 << 30], &[1.0, 1.0]), opts);
            let two = served(two.unwrap(), how);
            assert_eq!(two, one, "{name}: two devices");
            assert!(
                one.0[..10].iter().skip(2).step_by(2).all(|o| o.1 >= 32),
                "{name}: the conversation's prefix was not reused: {:?}",
                one.0
            );
            assert_eq!(split.1, one.1, "{name}: tokens routed to each expert");
            let routed: u64 = split.1.iter().flatten().sum();
            assert_eq!(routed > 0, name.contains("moe"), "{name}: {routed} routed");
        }
    }
}

/// Made-up rates under which one or two rows a pass want host layers and a prompt's rows
/// want none: streaming a byte costs a second, the host's arithmetic a quarter second a
/// row, everything else nothing.
fn one_row_wants_the_host() -> Rates {
    let free = ComputeRate {
        weight_bytes_per_s: 1e15,
        row_bytes_per_s: 1e15,
    };
    Rates {
        stream_bytes_per_s: 1.0,
        device: free,
        cpu: ComputeRate {
            row_bytes_per_s: 4.0,
            ..free
        },
        overlap: 0.0,
    }
}

#[test]
fn the_placement_follows_the_batch_and_the_text_is_one_devices() {
    // `sluiced serve --placement auto` on the emulated device: the rates are made up so
    // that at one or two rows a pass the host takes layers and at a prompt's rows it
    // takes none, and a change costs nothing to begin with, so the placement changes
    // back and forth between prefills and decode steps, running sequences and kept
    // prefix slots carried across each time (a ring's KV too). The text, the prompt
    // tokens the prefix cache gave and the experts' counts are one device's; beside a
    // draft model too (its own pipeline, which a change leaves alone).
    let tmp = tempfile::tempdir().unwrap();
    let (opts, trees) = (SERVED, ngram_trees());
    let rates = one_row_wants_the_host();
    let drafted = Decoding {
        draft: Some(DraftConfig {
            kind: DraftKind::Model,
            max: 4,
            fixed: true,
            branches: 2,
        }),
        ..greedy()
    };
    let cases = [
        ("tiny-llama", false),
        ("tiny-gemma3", false),
        ("tiny-qwen3moe-mixed", false),
        ("tiny-llama", true),
    ];
    for (name, with_draft) in cases {
        let dir = tmp.path().join(format!("{name}-{with_draft}"));
        let s = pack_store(&fixture(name), &dir.join("t"), "zstd:1", 64 << 10);
        // A draft model: the same model quantized, resident on the device beside it.
        let draft = with_draft.then(|| {
            let d = dir.join("d");
            let (src, out) = (fixture(name), d.to_str().unwrap().to_string());
            let src = src.to_str().unwrap();
            sluiced_ok(&["pack", src, "-o", &out, "--quantize", "q8_0"]);
            let store = Arc::new(Store::open(&d).unwrap());
            let opts = ModelOptions {
                verify_rows: 0,
                ..opts
            };
            move || Some(DraftModel::new(runner_with(&store, None, 0, opts)))
        });
        let draft = || draft.as_ref().and_then(|d| d());
        let least = plan(s.manifest(), &input_with(&s, Some(4096), 0, opts))
            .unwrap_err()
            .need();
        let i = input_with(&s, Some(least), 0, opts);
        let shapes = shapes(s.manifest(), &i).unwrap();
        assert!(choose_among(&shapes, &rates, 1).cpu_layers > 0, "{name}");
        assert_eq!(choose_among(&shapes, &rates, 30).cpu_layers, 0, "{name}");
        let hows = if with_draft {
            vec![drafted]
        } else {
            vec![greedy(), trees]
        };
        for how in hows {
            let one = runner_with(&s, None, 0, opts);
            let (one, alone) = served_by(one, (draft(), None), how);
            let follow = Follow::new(shapes.clone(), rates, 0, 0.0);
            let s2 = s.clone();
            let rebuild: sluice::engine::replace::Rebuild<CpuBackend> =
                Box::new(move |i: &PlanInput| discrete(&s2, i));
            let replacer = Replacer::new(follow, i.clone(), rebuild);
            let r = runner_with(&s, Some(least), 0, opts);
            assert!(r.plan.layers_streamed() > 0, "{name}: nothing streams");
            let (got, status) = served_by(r, (draft(), Some(replacer)), how);
            assert_eq!(got, one, "{name}: tokens, cached tokens, experts' counts");
            let f = status.following.unwrap();
            assert!(f.changes >= 4, "{name}: {} changes", f.changes);
            assert_eq!(f.failed, 0, "{name}");
            if with_draft {
                let spec = status.speculative;
                assert!(
                    spec.accepted_tokens > 0,
                    "{name}: nothing drafted: {spec:?}"
                );
            }
            // What Status reports is the plan in use.
            let p = f.plan.unwrap();
            assert_eq!(p.cpu_layers, f.cpu_layers, "{name}");
            // The passes of every pipeline count (two requests at once may be admitted
            // a step apart, or not).
            let (a, b) = (status.totals.passes, alone.totals.passes);
            assert!(
                a + 4 >= b && a <= b + 4,
                "{name}: {a} passes, {b} on one device"
            );
        }
    }
}

#[test]
fn a_placement_that_cannot_be_built_leaves_the_old_one_and_is_not_tried_again() {
    // The rates want host layers at one row, but no pipeline with host layers can be
    // built (as when another process took the memory): each change is given up, the old
    // placement built again with the KV carried back, and that count never tried again;
    // the text is one device's.
    let tmp = tempfile::tempdir().unwrap();
    let opts = SERVED;
    let s = pack_store(
        &fixture("tiny-llama"),
        &tmp.path().join("t"),
        "zstd:1",
        64 << 10,
    );
    let least = plan(s.manifest(), &input_with(&s, Some(4096), 0, opts))
        .unwrap_err()
        .need();
    let i = input_with(&s, Some(least), 0, opts);
    let shapes = shapes(s.manifest(), &i).unwrap();
    let rates = one_row_wants_the_host();
    let wanted = choose_among(&shapes, &rates, 1).cpu_layers;
    assert!(wanted > 0);
    let (one, _) = served_by(runner_with(&s, None, 0, opts), (None, None), greedy());
    let s2 = s.clone();
    let rebuild: sluice::engine::replace::Rebuild<CpuBackend> =
        Box::new(move |i: &PlanInput| match i.host.cpu_layers {
            0 => discrete(&s2, i),
            n => Err(EngineError::Invalid(format!("{n} host layers: no room"))),
        });
    let follow = Follow::new(shapes.clone(), rates, 0, 0.0);
    let replacer = Replacer::new(follow, i.clone(), rebuild);
    let r = runner_with(&s, Some(least), 0, opts);
    let (got, status) = served_by(r, (None, Some(replacer)), greedy());
    assert_eq!(got, one, "tokens and cached tokens");
    let f = status.following.unwrap();
    assert_eq!((f.changes, f.cpu_layers), (0, 0), "{f:?}");
    // Every count with host layers fails once at most.
    let counts = shapes.iter().filter(|s| s.cpu_layers > 0).count() as u64;
    assert!(
        f.failed >= 1 && f.failed <= counts,
        "{} failed of {counts}",
        f.failed
    );
}

#[test]
fn a_draft_model_drafts_for_a_model_with_layers_on_the_host_and_the_text_is_the_text_without() {
    // The draft is its own pipeline, resident on the device; the target's first layer
    // runs on the host (or its layers over two devices) and verifies chains and trees as
    // one device does. The draft is planned without the target's placement.
    use sluice::engine::generate::generate_with;
    let mut i = plan_input(OPTS);
    i.host.cpu_layers = 1;
    i.host.devices = vec![DeviceInput::default()];
    i.host.split = vec![1.0, 1.0];
    let di = sluice::engine::draft_model::draft_input(&i);
    assert!(di.host.cpu_layers == 0 && di.host.devices.is_empty() && di.host.split.is_empty());
    let tmp = tempfile::tempdir().unwrap();
    let opts = ModelOptions {
        max_context: 128,
        kv_slots: 3,
        max_batch_tokens: 64,
        kv_dtype: KvDtype::F16,
        exact: false,
        verify_rows: 3 * 8,
    };
    for name in ["tiny-llama", "tiny-qwen3moe-mixed"] {
        let dir = tmp.path().join(name);
        let s = pack_store(&fixture(name), &dir.join("t"), "zstd:1", 64 << 10);
        let draft_dir = dir.join("d");
        sluiced_ok(&[
            "pack",
            fixture(name).to_str().unwrap(),
            "-o",
            draft_dir.to_str().unwrap(),
            "--quantize",
            "q8_0",
        ]);
        let draft_store = Arc::new(Store::open(&draft_dir).unwrap());
        let tok = Tokenizer::from_manifest(s.manifest()).unwrap();
        let prompt = tok.encode("one two three four five six", false).unwrap();
        for branches in [0, 2] {
            let how = Decoding {
                draft: Some(DraftConfig {
                    kind: DraftKind::Model,
                    max: 5,
                    fixed: true,
                    branches,
                }),
                ..greedy()
            };
            let p = params(12, how);
            let mut outs = Vec::new();
            // One device, the first layer on the host, and two devices.
            for cpu_layers in [0, 1, 2] {
                let mut target = match cpu_layers {
                    2 => runner_split_with(&s, (None, 0), (&[1 << 30], &[1.0, 1.0]), opts).unwrap(),
                    n => runner_with(&s, None, n, opts),
                };
                let draft_opts = ModelOptions {
                    verify_rows: 0,
                    ..opts
                };
                let mut dm = DraftModel::new(runner_with(&draft_store, None, 0, draft_opts));
                let o = generate_with(&mut target, Some(&mut dm), &tok, &prompt, &p, 3, |_| {})
                    .unwrap();
                let accepted: u64 = o.iter().map(|o| o.speculative.accepted_tokens).sum();
                assert!(
                    accepted > 0,
                    "{name}: {cpu_layers} host layers: none accepted"
                );
                outs.push(
                    o.into_iter()
                        .map(|o| o.generated_token_ids)
                        .collect::<Vec<_>>(),
                );
            }
            assert_eq!(outs[1], outs[0], "{name}, {branches} branches");
            assert_eq!(outs[2], outs[0], "{name}, {branches} branches: two devices");
            // And the text without a draft.
            let mut plain = runner_with(&s, None, 1, opts);
            let o = generate_with(
                &mut plain,
                None,
                &tok,
                &prompt,
                &params(12, greedy()),
                3,
                |_| {},
            )
            .unwrap();
            let o: Vec<_> = o.into_iter().map(|o| o.generated_token_ids).collect();
            assert_eq!(o, outs[0], "{name}, {branches} branches: without a draft");
        }
    }
}

#[test]
fn placement_auto_measures_rates_and_predicts_every_placement_it_measures() {
    // `sluiced bench-placement`'s library on the emulated device: the rates from passes
    // of the model, then every placement at one row and at four, predicted and measured,
    // one chosen at each row count. The figures themselves are the benchmark's to report
    // (a shared machine's timings are not a test's); here they must be sane.
    let tmp = tempfile::tempdir().unwrap();
    let s = pack_store(
        &fixture("tiny-llama"),
        &tmp.path().join("l"),
        "zstd:1",
        64 << 10,
    );
    let n = s.manifest().arch.n_layers as usize;
    let least = plan(s.manifest(), &input(&s, Some(4096), 0))
        .unwrap_err()
        .need();
    let i = input(&s, Some(least), 0);
    let io = small_io();
    let run = sluice::pipeline::PipelineOptions {
        cpu_threads: 2,
        ..Default::default()
    };
    let make = |i: &PlanInput| cpu_runner_discrete(s.clone(), i, 2, io.clone(), run);
    let r = sluice::engine::placement::bench(&make, s.manifest(), &i, &[1, 4], n, 2).unwrap();
    let positive = |x: f64| x.is_finite() && x > 0.0;
    let rates = &r.rates;
    assert!(positive(rates.stream_bytes_per_s), "{rates:?}");
    for c in [rates.device, rates.cpu] {
        assert!(
            positive(c.weight_bytes_per_s) && positive(c.row_bytes_per_s),
            "{rates:?}"
        );
    }
    assert_eq!(
        r.runs.len(),
        2 * (n + 1),
        "every placement at both row counts"
    );
    for rows in [1, 4] {
        let at: Vec<_> = r.runs.iter().filter(|m| m.rows == rows).collect();
        assert_eq!(at.iter().filter(|m| m.chosen).count(), 1, "{at:?}");
        let layers: Vec<usize> = at.iter().map(|m| m.predicted.cpu_layers).collect();
        assert_eq!(layers, (0..=n).collect::<Vec<_>>());
        for m in at {
            assert!(positive(m.measured_pass_s) && positive(m.ratio), "{m:?}");
            // The whole model streams with none on the host, nothing with all of it.
            let p = &m.predicted;
            assert_eq!(p.cpu_s == 0.0, p.cpu_layers == 0, "{m:?}");
            // At least the compute, at most the compute and the streaming one after the
            // other (to rounding).
            let (least, most) = (p.cpu_s + p.device_s, p.cpu_s + p.device_s + p.stream_s);
            assert!(
                p.pass_s >= least * (1.0 - 1e-9) && p.pass_s <= most * (1.0 + 1e-9),
                "{m:?}"
            );
        }
    }
    let all = r.runs.iter().find(|m| m.predicted.cpu_layers == n).unwrap();
    let none = r.runs.iter().find(|m| m.predicted.cpu_layers == 0).unwrap();
    assert!(all.predicted.stream_s < none.predicted.stream_s, "{r:?}");
    // The rates are kept: measured once, read back the same; a damaged file is measured
    // again and replaced.
    use sluice::engine::placement::cached_rates;
    let cache = tmp.path().join("cache");
    let (first, now) = cached_rates(Some(&cache), "k", &make, &i, 4).unwrap();
    assert!(now);
    let (kept, now) = cached_rates(Some(&cache), "k", &make, &i, 4).unwrap();
    // (JSON's decimal digits give the floats back to their last bit or so.)
    let close = |a: f64, b: f64| (a - b).abs() <= 1e-9 * a.abs().max(b.abs());
    let same = |a: &sluice::plan::placement::Rates, b: &sluice::plan::placement::Rates| {
        close(a.stream_bytes_per_s, b.stream_bytes_per_s)
            && [(a.device, b.device), (a.cpu, b.cpu)].iter().all(|(x, y)| {
                close(x.weight_bytes_per_s, y.weight_bytes_per_s)
                    && close(x.row_bytes_per_s, y.row_bytes_per_s)
            })
    };
    assert!(!now && same(&kept, &first), "{kept:?} {first:?}");
    std::fs::write(cache.join("placement/k.json"), "{").unwrap();
    assert!(cached_rates(Some(&cache), "k", &make, &i, 4).unwrap().1);
    assert!(!cached_rates(Some(&cache), "k", &make, &i, 4).unwrap().1);
    // The run's flag: a GPU's choice, refused where there is no GPU to place beside.
    let store = tmp.path().join("l");
    let store = store.to_str().unwrap();
    let e = sluiced_err(&[
        "run",
        store,
        "--prompt",
        "hi",
        "--backend",
        "cpu",
        "--placement",
        "auto",
    ]);
    assert!(
        e.contains("--placement auto") && e.contains("CPU backend"),
        "{e}"
    );
    let e = sluiced_err(&[
        "run",
        store,
        "--prompt",
        "hi",
        "--placement",
        "auto",
        "--cpu-layers",
        "1",
    ]);
    assert!(e.contains("leave out --cpu-layers 1"), "{e}");
    let e = sluiced_err(&[
        "serve",
        "--model",
        store,
        "--backend",
        "cpu",
        "--placement",
        "auto",
        "--listen",
        "127.0.0.1:0",
        "--http-listen",
        "off",
    ]);
    assert!(
        e.contains("placement \"auto\"") && e.contains("CPU backend"),
        "{e}"
    );
}

/// `runner` with the devices beside the first that `devices` budgets, and `split`.
fn runner_split(
    s: &Arc<Store>,
    (budget, cpu_layers): (Option<u64>, usize),
    devices: &[u64],
    split: &[f64],
) -> Result<Pipeline<CpuBackend>, sluice::engine::EngineError> {
    runner_split_with(s, (budget, cpu_layers), (devices, split), OPTS)
}

fn runner_split_with(
    s: &Arc<Store>,
    (budget, cpu_layers): (Option<u64>, usize),
    (devices, split): (&[u64], &[f64]),
    opts: ModelOptions,
) -> Result<Pipeline<CpuBackend>, sluice::engine::EngineError> {
    let mut i = input_with(s, budget, cpu_layers, opts);
    i.host.devices = (devices.iter().enumerate())
        .map(|(k, &budget)| DeviceInput {
            name: format!("emulated:{}", k + 1),
            ordinal: k + 1,
            budget,
            reserved: 0,
        })
        .collect();
    i.host.split = split.to_vec();
    let io = small_io();
    let run = sluice::pipeline::PipelineOptions {
        cpu_threads: 2,
        ..Default::default()
    };
    cpu_runner_discrete(s.clone(), &i, 2, io, run)
}

#[test]
fn a_model_split_over_two_devices_and_the_host_gives_the_outputs_of_one_device() {
    // Three emulated devices (the first streams where its budget is short) and the host:
    // the spans' logits are one device's, bit for bit, through prompts, decode steps and a
    // batch of eight, on every architecture; every device within its own budget, given
    // exactly what its span needs.
    let tmp = tempfile::tempdir().unwrap();
    let mut streamed_runs = 0;
    for name in TINY_ARCHS {
        let s = pack_store(&fixture(name), &tmp.path().join(name), "zstd:1", 64 << 10);
        let (vocab, n) = (s.manifest().arch.vocab, s.manifest().arch.n_layers as usize);
        let want = {
            let mut r = runner(&s, None, 0);
            (outputs(&mut r, vocab), batch_of_eight(&mut r, vocab))
        };
        for (cpu_layers, split) in [(0, vec![1.0, 1.0]), (1, vec![2.0, 1.0, 1.0])] {
            if n < split.len() + cpu_layers {
                continue;
            }
            let big = vec![1 << 30; split.len() - 1];
            let p = runner_split(&s, (None, cpu_layers), &big, &split)
                .unwrap()
                .plan;
            let needs: Vec<u64> = p.devices.iter().map(|d| d.total()).collect();
            // Each unit is computed in one place, the other devices' layers last.
            let others: Vec<usize> = (0..s.units().len())
                .filter(|&u| p.placement(u) == Placement::OtherDevice)
                .collect();
            let first = p.devices[0].layers.start;
            assert_eq!(others, (first + 1..=n).collect::<Vec<_>>(), "{name}");
            let least = runner_split(&s, (Some(4096), cpu_layers), &needs, &split)
                .err()
                .map_or(0, |e| match e {
                    sluice::engine::EngineError::Plan(e) => e.need(),
                    e => panic!("{name}: {e}"),
                });
            let what = format!("{name}: split {split:?}, {cpu_layers} on the host");
            streamed_runs += as_one_device(
                &what,
                (&want, vocab),
                (least, p.device_bytes(), true),
                |budget| runner_split(&s, (budget, cpu_layers), &needs, &split).unwrap(),
            );
        }
    }
    assert!(streamed_runs >= 6, "{streamed_runs} streamed runs");
}

#[test]
fn a_device_that_cannot_hold_its_span_is_refused_with_its_numbers() {
    let tmp = tempfile::tempdir().unwrap();
    let s = pack_store(
        &fixture("tiny-llama"),
        &tmp.path().join("l"),
        "zstd:1",
        64 << 10,
    );
    let p = runner_split(&s, (None, 0), &[1 << 30], &[1.0, 1.0])
        .unwrap()
        .plan;
    let need = p.devices[0].total();
    let e = runner_split(&s, (None, 0), &[need - 1], &[1.0, 1.0])
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.contains("emulated:1 cannot hold its layers")
            && e.contains("weights")
            && e.contains("KV cache")
            && e.contains("--split"),
        "{e}"
    );
    let e = runner_split(&s, (None, 0), &[1 << 30], &[1.0])
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("give 2 shares"), "{e}");
    let e = runner_split(&s, (None, 0), &[1 << 30], &[1.0, 0.0])
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("gives emulated:1 no layer"), "{e}");
    // The flags: GPUs named as CUDA names them, several only on the CUDA backend.
    let store = tmp.path().join("l");
    let run = |extra: &[&str]| {
        let mut args = vec!["run", store.to_str().unwrap(), "--prompt", "hi"];
        args.extend(extra);
        sluiced_err(&args)
    };
    let e = run(&["--backend", "cpu", "--devices", "cuda:0,cuda:1"]);
    assert!(
        e.contains("--devices: the CPU backend is one device"),
        "{e}"
    );
    let e = run(&["--devices", "gpu1,gpu2"]);
    assert!(e.contains("\"gpu1\" is not a device"), "{e}");
    let e = run(&["--backend", "cpu", "--split", "1,1"]);
    assert!(e.contains("give the devices too"), "{e}");
}

#[test]
fn a_placement_that_cannot_be_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let s = pack_store(
        &fixture("tiny-llama"),
        &tmp.path().join("l"),
        "zstd:1",
        64 << 10,
    );
    let n = s.manifest().arch.n_layers as usize;
    let e = plan(s.manifest(), &input(&s, None, n + 1))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains(&format!("--cpu-layers {}", n + 1))
            && e.contains(&format!("{n} decoder layers")),
        "{e}"
    );
    let mut unified = input(&s, None, 1);
    unified.host.unified = true;
    let e = plan(s.manifest(), &unified).unwrap_err().to_string();
    assert!(
        e.contains("already computes every layer on the host"),
        "{e}"
    );
    // The least host budget of the whole model on the device does not hold the layers
    // computed on the host as well: refused, naming them.
    let least = |cpu_layers: usize| {
        let mut i = input(&s, None, cpu_layers);
        i.host.budget = Some(1);
        plan(s.manifest(), &i).unwrap_err()
    };
    let need = least(0).need();
    let mut tight = input(&s, None, n);
    tight.host.budget = Some(need);
    let e = plan(s.manifest(), &tight).unwrap_err();
    assert!(e.need() > need, "{e}");
    assert!(
        e.to_string().contains("layers computed on the CPU")
            && e.to_string().contains("--cpu-layers"),
        "{e}"
    );
}

#[test]
fn status_says_where_each_layer_runs_and_what_auto_weighed() {
    use sluice::plan::placement::{choose, ComputeRate, Rates};
    use sluice::server::service::{layers_of, placement_of};
    let tmp = tempfile::tempdir().unwrap();
    let s = pack_store(
        &fixture("tiny-gemma3"),
        &tmp.path().join("g"),
        "zstd:1",
        64 << 10,
    );
    let n = s.manifest().arch.n_layers as usize;
    // One layer on the host, the last ones on a second device.
    let p = runner_split(&s, (None, 1), &[1 << 30], &[1.0, 1.0])
        .unwrap()
        .plan;
    let st = placement_of(&p, None, None);
    assert_eq!((st.mode.as_str(), st.cpu_layers), ("device", 1));
    let span = &p.devices[0].layers;
    assert_eq!(st.devices.len(), 1);
    let d = &st.devices[0];
    assert_eq!(
        (d.device.as_str(), d.first_layer as usize, d.layers as usize),
        ("emulated:1", span.start, span.len())
    );
    assert!(span.start > 1 && span.end == n, "{span:?}");
    assert!(st.candidates.is_empty() && st.rows == 0);
    // Each unit: the embedding and the layers between on the device, layer 0 on the host,
    // the span's layers on the other device named, the head on the device.
    let layers = layers_of(&p);
    assert_eq!(layers.len(), s.units().len());
    for (u, l) in layers.iter().enumerate() {
        let want = match u {
            1 => "cpu".to_string(),
            u if u >= 1 && span.contains(&(u - 1)) => "device:emulated:1".to_string(),
            _ => "resident".to_string(),
        };
        assert_eq!(l.placement, want, "unit {u} ({})", l.layer);
    }
    // "auto": the choice the planner made on made-up rates (a CPU as fast at these sizes
    // as the device's stream), every placement it weighed, the chosen one's prediction.
    let whole = runner(&s, None, 0).plan.device_bytes();
    let i = input(&s, Some(whole * 3 / 4), 0);
    let rates = Rates {
        stream_bytes_per_s: 1e8,
        device: ComputeRate {
            weight_bytes_per_s: 1e12,
            row_bytes_per_s: 1e12,
        },
        cpu: ComputeRate {
            weight_bytes_per_s: 1e10,
            row_bytes_per_s: 1e10,
        },
        overlap: 1.0,
    };
    let c = choose(s.manifest(), &i, &rates, 1).unwrap();
    let st = placement_of(&p, Some(&c), None);
    assert_eq!((st.mode.as_str(), st.rows), ("auto", 1));
    assert_eq!(st.candidates.len(), c.candidates.len());
    assert!(st.candidates.len() > 1, "{:?}", st.candidates);
    let chosen = c.chosen().unwrap();
    assert_eq!(st.predicted_pass_s, chosen.pass_s);
    assert!(st
        .candidates
        .iter()
        .all(|x| x.predicted_pass_s >= chosen.pass_s));
    // Following the batch: the changes and what the last one took.
    let f = sluice::engine::replace::Following {
        cpu_layers: c.cpu_layers,
        changes: 3,
        failed: 1,
        last_change_s: 0.25,
        last_change_kv_bytes: 4096,
        ..Default::default()
    };
    let st = placement_of(&p, Some(&c), Some(&f));
    assert_eq!(
        (
            st.changes,
            st.changes_failed,
            st.last_change_s,
            st.last_change_kv_bytes
        ),
        (3, 1, 0.25, 4096)
    );
}
