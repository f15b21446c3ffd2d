//! Layer streaming: any device budget gives bit-identical outputs to the all-resident run,
//! the arena never exceeds its budget, an impossible budget is refused with its numbers,
//! and a corrupted streamed layer fails only the step that needed it.

use sluice::backend::cpu::CpuBackend;
use sluice::backend::Backend;
use sluice::engine::cpu_runner;
use sluice::io::IoConfig;
use sluice::model::{ModelOptions, SeqStep};
use sluice::pipeline::{Pipeline, PipelineOptions};
use sluice::plan::{plan, PlanInput};
use sluice::store::Store;
use sluice_tests::*;
use std::path::Path;
use std::sync::Arc;

const OPTS: ModelOptions = ModelOptions {
    max_context: 96,
    kv_slots: 2,
    max_batch_tokens: 64,
    kv_dtype: sluice::backend::KvDtype::F32,
    exact: true,
    verify_rows: 0,
};

fn store(src: &Path, dir: &Path) -> Arc<Store> {
    pack_store(src, dir, "zstd:1", 64 << 10)
}

fn io() -> IoConfig {
    IoConfig {
        queue_depth: 8,
        read_buffers: 8,
        request_bytes: 256 << 10,
        ..IoConfig::default()
    }
}

/// A pipeline on the CPU as it runs (unified: streamed units computed in their staging
/// slots), or acting as a discrete device (copied into arena slots, as on a GPU).
fn runner_as(
    s: &Arc<Store>,
    budget: Option<u64>,
    host_cache: u64,
    unified: bool,
) -> Pipeline<CpuBackend> {
    runner_with(s, budget, host_cache, unified, None)
}

/// `runner_as` with `expert_cache` slots for a mixture's streamed experts.
fn runner_with(
    s: &Arc<Store>,
    budget: Option<u64>,
    host_cache: u64,
    unified: bool,
    expert_cache: Option<usize>,
) -> Pipeline<CpuBackend> {
    runner_run(
        s,
        budget,
        host_cache,
        unified,
        expert_cache,
        Default::default(),
    )
}

/// `runner_with` running with the pipeline options `run`.
fn runner_run(
    s: &Arc<Store>,
    budget: Option<u64>,
    host_cache: u64,
    unified: bool,
    expert_cache: Option<usize>,
    run: PipelineOptions,
) -> Pipeline<CpuBackend> {
    let make = if unified {
        cpu_runner
    } else {
        sluice::engine::cpu_runner_discrete
    };
    make(
        s.clone(),
        &PlanInput {
            device_budget: budget,
            host_cache_budget: host_cache,
            opts: OPTS,
            prefetch: Some(3),
            expert_cache,
            expert_profile: None,
            backend_reserved: 0,
            self_draft_reserved: 0,
            host: Default::default(),
        },
        2,
        io(),
        run,
    )
    .unwrap()
}

fn runner(s: &Arc<Store>, budget: Option<u64>, host_cache: u64) -> Pipeline<CpuBackend> {
    runner_as(s, budget, host_cache, false)
}

/// The plan with every unit resident.
fn free_plan(s: &Store) -> sluice::plan::Plan {
    plan(
        s.manifest(),
        &PlanInput {
            device_budget: None,
            host_cache_budget: 0,
            opts: OPTS,
            prefetch: None,
            expert_cache: None,
            expert_profile: None,
            backend_reserved: 0,
            self_draft_reserved: 0,
            host: Default::default(),
        },
    )
    .unwrap()
}

/// Budgets from all-resident down to the least that runs: KV + workspace + 2 slots.
fn budgets(s: &Store) -> Vec<(String, Option<u64>)> {
    let p = free_plan(s);
    let fixed = p.kv_cache_bytes + p.workspace_bytes;
    let sizes: Vec<u64> = s
        .units()
        .iter()
        .map(|u| u.raw_len.div_ceil(4096) * 4096)
        .collect();
    let (largest, smallest) = (*sizes.iter().max().unwrap(), *sizes.iter().min().unwrap());
    // A streamed embedding's lookup gathers a step's rows into a table of their own (and
    // a tied head keeps the rows between its parts, at most one per frame boundary).
    let t = s.units()[0].tensor("model.embed_tokens.weight").unwrap();
    let seams = if s.manifest().arch.tied_embeddings {
        s.units()[0].frames.len() as u64
    } else {
        0
    };
    let table = ((OPTS.max_batch_tokens as u64 + seams) * t.dtype.row_bytes(t.shape[1]).unwrap())
        .div_ceil(4096)
        * 4096;

    vec![
        ("all resident".into(), None),
        // Half the weights, or (for the tiny models, whose units are a third of them each)
        // two slots and one resident unit
        (
            "partial".into(),
            // (with room for a streamed embedding's gathered rows, below all resident).
            Some(
                fixed
                    + ((p.resident_bytes / 2).max(2 * largest + smallest) + table)
                        .min(p.resident_bytes - 4096),
            ),
        ),
        ("two slots".into(), Some(fixed + table + 2 * largest)),
    ]
}

#[test]
fn every_budget_gives_bit_identical_outputs_within_its_arena() {
    let tmp = tempfile::tempdir().unwrap();
    let mut partial = 0;
    for src in [
        fixture("tiny-llama"),
        fixture("tiny-qwen2.gguf"),
        fixture("tiny-llama-q.gguf"),
        fixture("tiny-qwen3"),
        fixture("tiny-gemma3"),
        fixture("tiny-qwen3moe-mixed"),
        fixture("tiny-mixtral.gguf"),
        smollm2_gguf(),
    ] {
        let name = src.file_name().unwrap().to_string_lossy().to_string();
        let s = store(&src, &tmp.path().join(&name));
        let vocab = s.manifest().arch.vocab;
        let mut want = None;
        for unified in [false, true] {
            for (label, budget) in budgets(&s) {
                let mut r = runner_as(&s, budget, 0, unified);
                let streamed = r.plan.layers_streamed();
                match label.as_str() {
                    "all resident" => assert_eq!(streamed, 0),
                    // Unified: the budget caps the arena alone (staging slots are host
                    // memory outside it), so less streams.
                    "two slots" if unified => {
                        assert!(streamed > 0, "{name}: nothing streams at the least budget");
                        assert!(r.plan.host.staging_slots >= 2, "{name}");
                    }
                    "two slots" => {
                        // The planner may keep the largest unit resident and stream the rest
                        // through smaller slots, whichever streams fewer bytes.
                        assert!(r.plan.stream_slots >= 2, "{name}");
                        assert!(
                            streamed >= s.units().len() / 2,
                            "{name}: only {streamed} units stream at the least budget"
                        );
                    }
                    _ => assert!(streamed > 0, "{name}: nothing streams at half the model"),
                }
                let got = outputs(&mut r, vocab);
                let b = r.backend.budget();
                assert!(
                    b.peak() <= b.limit(),
                    "{name} {label}: peak {} over budget {}",
                    b.peak(),
                    b.limit()
                );
                if let Some(budget) = budget {
                    assert_eq!(b.limit(), budget);
                    // Streamed units are uploaded; a streamed embedding's rows are
                    // gathered from the store (at the partial budget of a tiny untied
                    // model that can be all that streams).
                    let t = r.total();
                    assert!(
                        t.bytes_uploaded > 0 || t.bytes_gathered > 0,
                        "{name} {label}: nothing was uploaded or gathered"
                    );
                    assert_eq!(
                        t.bytes_gathered > 0,
                        r.plan.embedding_gathered,
                        "{name} {label}: the embedding's rows are gathered where it streams"
                    );
                }
                match &want {
                    None => want = Some(got),
                    Some(w) => assert!(
                        w == &got,
                        "{name}: outputs at budget {label} differ from all-resident"
                    ),
                }
                if label == "two slots" && !unified {
                    // Uploads in parts as frames finish decompressing (4 KiB parts: many per
                    // unit) give the same outputs.
                    // Whether the pipeline catches up with a unit still decompressing is a
                    // matter of timing: repeat a few times so that some run does.
                    let chunked = PipelineOptions {
                        upload_chunk: 4096,
                        ..Default::default()
                    };
                    let mut r = runner_run(&s, budget, 0, false, None, chunked);
                    for _ in 0..10 {
                        let got = outputs(&mut r, vocab);
                        assert!(
                            want.as_ref() == Some(&got),
                            "{name}: outputs with partial uploads differ"
                        );
                        if r.partial_uploads() > 0 {
                            break;
                        }
                    }
                    partial += r.partial_uploads();
                }
            }
        }
    }
    assert!(
        partial > 0,
        "no unit was ever uploaded before it was complete"
    );
}

/// Gemma 3 270M streams its decoder layers with bit-identical outputs. Its tied
/// embedding (170 MiB of its 235) is needed at both ends of every pass, so a budget below
/// it cannot run; this one holds the embedding and half the layers' bytes.
#[test]
fn gemma3_270m_streamed_is_bit_identical_to_resident() {
    let tmp = tempfile::tempdir().unwrap();
    let s = store(&gemma3_gguf(), &tmp.path().join("g"));
    let vocab = s.manifest().arch.vocab;
    let p = plan(
        s.manifest(),
        &PlanInput {
            device_budget: None,
            host_cache_budget: 0,
            opts: OPTS,
            prefetch: None,
            expert_cache: None,
            expert_profile: None,
            backend_reserved: 0,
            self_draft_reserved: 0,
            host: Default::default(),
        },
    )
    .unwrap();
    let units = s.units();
    let embedding = units[0].raw_len.div_ceil(4096) * 4096;
    let layers: u64 = units[1..].iter().map(|u| u.raw_len).sum();
    let budget = p.kv_cache_bytes + p.workspace_bytes + embedding + layers / 2;
    let want = outputs(&mut runner(&s, None, 0), vocab);
    let mut r = runner(&s, Some(budget), 0);
    assert!(
        r.plan.layers_streamed() >= units.len() / 3,
        "only {} of {} units stream",
        r.plan.layers_streamed(),
        units.len()
    );
    assert!(
        outputs(&mut r, vocab) == want,
        "streamed outputs differ from resident"
    );
    assert!(r.total().bytes_uploaded > 0);
}

#[test]
fn every_planned_staging_slot_is_in_use_while_a_layer_runs() {
    // `prefetch` loads go out before the one about to run is waited for, so the plan's
    // prefetch + 1 staging slots are all taken at once (topped up only after a layer had
    // run, one stood empty and the disk idled while the layer computed); the engine sends
    // the later loads' reads as the oldest's last are out (`io::FOLLOW_BYTES_DEFAULT`).
    // (SmolLM2: the tiny fixtures stream too few units through slots at these budgets.)
    let tmp = tempfile::tempdir().unwrap();
    let s = store(&smollm2_gguf(), &tmp.path().join("s"));
    let vocab = s.manifest().arch.vocab;
    let (_, budget) = budgets(&s)
        .into_iter()
        .find(|(label, _)| label == "partial")
        .unwrap();
    for unified in [false, true] {
        let mut r = runner_as(&s, budget, 0, unified);
        assert!(r.plan.layers_streamed() > 0, "nothing streams");
        let slots = r.plan.host.staging_slots as u64;
        // (runner_as asks for prefetch 3, which the budget leaves.)
        assert_eq!(
            slots,
            r.plan.prefetch as u64 + 1,
            "prefetch + 1 slots planned"
        );
        assert!(slots >= 3, "{slots} slots");
        outputs(&mut r, vocab);
        assert_eq!(
            r.io().stats().slots_busy_max,
            slots,
            "unified {unified}: staging slots in use at once"
        );
    }
}

#[test]
fn the_host_cache_serves_streamed_layers_without_disk() {
    let tmp = tempfile::tempdir().unwrap();
    let s = store(&fixture("tiny-llama"), &tmp.path().join("t"));
    let vocab = s.manifest().arch.vocab;
    let (_, half) = budgets(&s)[1].clone();
    let want = outputs(&mut runner(&s, None, 0), vocab);
    let mut r = runner(&s, half, 1 << 30);
    assert!(r
        .plan
        .units
        .iter()
        .any(|u| u.placement == sluice::plan::Placement::HostCached));
    assert_eq!(r.plan.disk_bytes_per_pass, 0);
    let got = outputs(&mut r, vocab);
    assert!(got == want);
    assert_eq!(
        r.total().bytes_read,
        0,
        "host-cached layers must not touch the disk"
    );
    assert!(r.total().bytes_from_host_cache > 0);
}

#[test]
fn a_budget_too_small_fails_at_start_with_the_numbers() {
    let tmp = tempfile::tempdir().unwrap();
    let s = store(&fixture("tiny-llama"), &tmp.path().join("t"));
    let e = cpu_runner(
        s.clone(),
        &PlanInput {
            device_budget: Some(64 << 10),
            host_cache_budget: 0,
            opts: OPTS,
            prefetch: None,
            expert_cache: None,
            expert_profile: None,
            backend_reserved: 0,
            self_draft_reserved: 0,
            host: Default::default(),
        },
        1,
        io(),
        Default::default(),
    )
    .err()
    .unwrap()
    .to_string();
    for want in [
        "too small",
        "KV cache",
        "workspace",
        "streaming slots",
        "--device-memory",
    ] {
        assert!(e.contains(want), "{e}");
    }
    let e = sluiced_err(&[
        "run",
        "--temperature",
        "0",
        s.dir().to_str().unwrap(),
        "--prompt-ids",
        "1,2",
        "--device-memory",
        "100KiB",
    ]);
    assert!(e.contains("too small") && e.contains("KV cache"), "{e}");
}

#[test]
fn a_corrupted_streamed_layer_fails_its_step_and_the_pipeline_keeps_serving() {
    corrupted_layer(false, false);
    corrupted_layer(false, true);
}

/// The same with the unit's last frame corrupted and 4 KiB upload parts: the unit fails
/// after part of it was handed out and copied; the engine keeps that staging slot until
/// the pipeline has waited for the copy, then takes it back.
#[test]
fn a_layer_failing_after_partial_uploads_returns_its_staging_slot() {
    corrupted_layer(true, false);
}

/// `unified`: the CPU as it runs (streamed units computed in their staging slots), where
/// partial uploads do not exist; else acting as a discrete device.
fn corrupted_layer(last_frame_with_parts: bool, unified: bool) {
    let tmp = tempfile::tempdir().unwrap();
    let s = store(&fixture("tiny-llama"), &tmp.path().join("t"));
    let vocab = s.manifest().arch.vocab;
    let want = outputs(&mut runner(&s, None, 0), vocab);
    let (_, two) = budgets(&s)[2].clone();
    // One decompression worker: frames finish in file order, so the unit's prefix is handed
    // out (and copied) before its last frame fails.
    let make = if unified {
        cpu_runner
    } else {
        sluice::engine::cpu_runner_discrete
    };
    // Unified, the device budget caps the arena only: one slot's worth less keeps layers
    // streaming.
    let largest = s
        .units()
        .iter()
        .map(|u| u.raw_len.div_ceil(4096) * 4096)
        .max()
        .unwrap();
    let two = two.map(|b| if unified { b - largest } else { b });
    let run = PipelineOptions {
        upload_chunk: if last_frame_with_parts {
            4096
        } else {
            sluice::pipeline::UPLOAD_CHUNK_DEFAULT
        },
        ..Default::default()
    };
    let mut r = make(
        s.clone(),
        &input_at(two, Default::default()),
        2,
        IoConfig { workers: 1, ..io() },
        run,
    )
    .unwrap();
    let unit = (0..s.units().len())
        .find(|&u| {
            r.plan.placement(u) == sluice::plan::Placement::Streamed
                && s.units()[u].kind.to_string().starts_with("layer")
        })
        .unwrap();
    let frames = &s.units()[unit].frames;
    let f = if last_frame_with_parts {
        assert!(frames.len() > 2, "the layer needs several frames");
        frames[frames.len() - 1].clone()
    } else {
        frames[0].clone()
    };
    let w = s.weights_path().to_path_buf();
    let good = std::fs::read(&w).unwrap();
    let mut bad = good.clone();
    bad[(f.file_offset + f.stored_len() / 2) as usize] ^= 0x08;
    std::fs::write(&w, &bad).unwrap();
    let mut logits = Vec::new();
    // Three failing steps, and more (up to 100) until one copied part of the unit before
    // its last frame failed, when that is the case under test.
    let mut tries = 0;
    while tries < 3 || (last_frame_with_parts && r.partial_uploads() == 0 && tries < 100) {
        tries += 1;
        let msg = failing_step(&mut r, &mut logits);
        assert!(
            msg.contains(&s.units()[unit].kind.to_string())
                && msg.contains(&format!("offset {}", f.file_offset)),
            "{msg}"
        );
    }
    if last_frame_with_parts {
        assert!(
            r.partial_uploads() > 0,
            "no part was copied before the failure"
        );
    }
    pools_refill(&r);
    // The data is repaired (restored from a backup): the same pipeline serves again, exactly.
    std::fs::write(&w, &good).unwrap();
    assert!(outputs(&mut r, vocab) == want);
}

/// A prefill step that must fail on bad stored data; its message.
fn failing_step(r: &mut Pipeline<CpuBackend>, logits: &mut Vec<f32>) -> String {
    let e = r
        .step(
            &[SeqStep {
                slot: 0,
                pos: 0,
                tokens: vec![1, 2, 3],
                verify: false,
                ..Default::default()
            }],
            logits,
        )
        .unwrap_err();
    assert!(e.is_data_loss(), "{e}");
    e.to_string()
}

/// Nothing leaked: every staging slot and read buffer comes back (within 10 s).
fn pools_refill(r: &Pipeline<CpuBackend>) {
    let t0 = std::time::Instant::now();
    loop {
        let p = r.io().pool_status();
        if p.slots_free == p.slots && p.read_buffers_free == p.read_buffers {
            break;
        }
        assert!(t0.elapsed().as_secs() < 10, "pools not full: {p:?}");
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
}

#[test]
fn sluiced_run_streams_under_a_budget_and_reports_it() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("s");
    sluiced_ok(&[
        "pack",
        smollm2_gguf().to_str().unwrap(),
        "-o",
        dir.to_str().unwrap(),
        "--codec",
        "zstd:3",
    ]);
    let args = |dm: &str| -> serde_json::Value {
        let mut a = vec![
            "run",
            "--temperature",
            "0",
            dir.to_str().unwrap(),
            "--prompt",
            "The history of the printing press begins",
            "--max-tokens",
            "12",
            "--max-context",
            "256",
            "--json",
        ];
        if !dm.is_empty() {
            a.extend(["--device-memory", dm]);
        }
        serde_json::from_str(&sluiced_ok(&a)).unwrap()
    };
    let full = args("");
    let streamed = args("80MiB");
    assert_eq!(full["generated_token_ids"], streamed["generated_token_ids"]);
    assert_eq!(full["layers_streamed"], 0);
    assert!(streamed["layers_streamed"].as_u64().unwrap() > 0);
    assert_eq!(streamed["device_bytes_budget"], 80 << 20);
    assert!(streamed["device_bytes_peak"].as_u64().unwrap() <= 80 << 20);
    assert!(streamed["bytes_streamed"].as_u64().unwrap() > 0);
    for k in ["pass_time_s", "stall_load_s", "compute_s", "upload_s"] {
        assert!(streamed[k].as_f64().is_some(), "{k} missing");
    }
}

/// `run --parallel N` steps N copies of the prompt together; sequence i samples with
/// seed + i, so each must produce what a run of its own with that seed produces (a
/// sequence's tokens do not depend on what else is in the batch), streamed under a budget.
#[test]
fn sluiced_run_parallel_sequences_match_runs_of_their_own() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("s");
    pack_store(&smollm2_gguf(), &dir, "none", 1 << 20);
    let run = |parallel: u32, seed: u64| -> serde_json::Value {
        let (p, s) = (parallel.to_string(), seed.to_string());
        let a = [
            "run",
            dir.to_str().unwrap(),
            "--prompt",
            "The history of the printing press begins",
            "--max-tokens",
            "10",
            "--ignore-eos",
            "--temperature",
            "0.9",
            "--seed",
            &s,
            "--max-context",
            "128",
            "--device-memory",
            "80MiB",
            "--parallel",
            &p,
            "--json",
        ];
        serde_json::from_str(&sluiced_ok(&a)).unwrap()
    };
    let batch = run(3, 7);
    assert_eq!(batch["parallel"], 3);
    assert!(batch["layers_streamed"].as_u64().unwrap() > 0);
    let seqs = batch["sequences"].as_array().unwrap();
    assert_eq!(seqs.len(), 3);
    let mut distinct = std::collections::HashSet::new();
    for (i, seq) in seqs.iter().enumerate() {
        let own = run(1, 7 + i as u64);
        assert_eq!(
            seq["generated_token_ids"],
            own["generated_token_ids"],
            "sequence {i} of the batch differs from its own run with seed {}",
            7 + i
        );
        assert_eq!(seq["generated_token_ids"].as_array().unwrap().len(), 10);
        distinct.insert(seq["generated_token_ids"].to_string());
    }
    // The seeds differ, so the sampled texts do (the test would not see a batch that
    // ran one sequence three times otherwise).
    assert!(distinct.len() > 1, "every sequence sampled the same text");
    // Sequence 0 is the top-level result, and the batch's decode rate counts all three.
    assert_eq!(batch["generated_token_ids"], seqs[0]["generated_token_ids"]);
    let decode_s = batch["decode_s"].as_f64().unwrap();
    let tps = batch["decode_tokens_per_s"].as_f64().unwrap();
    assert!((tps * decode_s - 27.0).abs() < 1e-6, "{tps} x {decode_s}");
}

/// SmolLM2's tied embedding (27 MiB of Q8_0 rows, 612 bytes each) under a budget that
/// keeps nothing large resident: its lookup gathers the step's rows, the head reads it in
/// row parts through layer-sized slots, and the rows that straddle two parts come from
/// their own table. Stored raw (read straight into the slots, 1 MiB frames) and as zstd
/// (64 KiB frames), copied to device slots or run from staging: the same bits as resident.
#[test]
fn smollm2_tied_embedding_streamed_in_row_parts_is_bit_identical_to_resident() {
    let tmp = tempfile::tempdir().unwrap();
    for (codec, frame) in [("none", 1u32 << 20), ("zstd:1", 64 << 10)] {
        let s = pack_store(&smollm2_gguf(), &tmp.path().join(codec), codec, frame);
        let vocab = s.manifest().arch.vocab;
        let want = outputs(&mut runner(&s, None, 0), vocab);
        let free = free_plan(&s);
        let layer = s.units()[1..]
            .iter()
            .map(|u| u.raw_len.div_ceil(4096) * 4096)
            .max()
            .unwrap();
        let emb = &s.units()[0];
        assert!(
            emb.raw_len > 4 * layer,
            "the table is several layers' worth"
        );
        let t = emb.tensor("model.embed_tokens.weight").unwrap();
        let rb = t.dtype.row_bytes(t.shape[1]).unwrap();
        let table =
            ((OPTS.max_batch_tokens as u64 + emb.frames.len() as u64) * rb).div_ceil(4096) * 4096;
        // Two slots of a layer, the gathered rows and a few layers resident.
        let budget = free.kv_cache_bytes + free.workspace_bytes + table + 5 * layer;
        for unified in [false, true] {
            let mut r = runner_as(&s, Some(budget), 0, unified);
            let p = r.plan.clone();
            let at = format!("{codec}, unified {unified}");
            assert_ne!(p.placement(0), sluice::plan::Placement::Resident, "{at}");
            assert!(p.embedding_gathered, "{at}");
            assert!(
                p.head_parts.len() >= 4,
                "{at}: {} parts",
                p.head_parts.len()
            );
            assert!(
                !p.head_seams.is_empty(),
                "{at}: 612-byte rows straddle frames"
            );
            let slot = if unified {
                p.host.staging_slot_bytes
            } else {
                p.stream_slot_bytes
            };
            assert!(slot <= layer, "{at}: slots of {slot} for layers of {layer}");
            let got = outputs(&mut r, vocab);
            assert!(got == want, "{at}: streamed outputs differ from resident");
            let b = r.backend.budget();
            assert!(b.peak() <= b.limit(), "{at}: over budget");
            // Per pass the parts read the table once; the lookup reads a frame or two per
            // distinct token, not the table.
            let tot = r.total();
            let passes = tot.passes;
            assert!(tot.bytes_gathered > 0, "{at}");
            assert!(
                tot.bytes_gathered / passes < emb.stored_len / 4,
                "{at}: the lookup read {} per pass of a {}-byte table",
                tot.bytes_gathered / passes,
                emb.stored_len
            );
            // The planned bytes per pass, each load's read rounded to 4096 at its ends, and
            // the last pass's reads ahead: the next pass's first `prefetch` loads, each at
            // most a slot.
            let streamed = tot.bytes_read - tot.bytes_gathered;
            let loads = (p.layers_streamed() + p.head_parts.len()) as u64;
            let ahead = p.prefetch as u64 * slot;
            assert!(
                streamed >= passes * p.disk_bytes_per_pass
                    && streamed <= passes * (p.disk_bytes_per_pass + 2 * 4096 * loads) + ahead,
                "{at}: {streamed} bytes read in {passes} passes of {} planned",
                p.disk_bytes_per_pass
            );
        }
    }
}

/// Dense layers larger than the slots stream in pieces (attention, then the gate, up and
/// down projections, each loaded as the piece before runs), so the slots hold pieces and
/// more of the model stays resident. A piece is at least one read request, so the tiny
/// fixtures' layers are cut only with 4 KiB requests, which these runs use. At the least
/// device budget (discrete) and, for models large enough to stream there, the least host
/// budget (unified), compressed and stored raw (read straight into the slots: cut only
/// where O_DIRECT allows, which `pack` gives every projection), outputs are bit-identical
/// to all-resident, Gemma 3's too (a norm after its feed-forward block, which lies in the
/// first piece, kept until the last runs). With 4 MiB requests SmolLM2's layers (2.1 MB)
/// are not cut.
#[test]
fn dense_layers_stream_in_pieces_bit_identical_to_resident() {
    use sluice::import::synth::{model, SynthSpec};
    use sluice::store::writer::{pack, PackOptions};
    let tmp = tempfile::tempdir().unwrap();
    let synth = model(&SynthSpec::llama_like(512, 4, sluice::dtype::DType::Q8_0));
    let pack_synth = |codec: &str| {
        let out = tmp.path().join(format!("synth-{codec}"));
        let opts = PackOptions {
            auto: None,
            codec: codec.parse().unwrap(),
            frame_size: 64 << 10,
            threads: 2,
            force: true,
            link: false,
        };
        pack(&synth, &synth.units().unwrap(), &out, &opts, |_| {}).unwrap();
        Arc::new(Store::open(&out).unwrap())
    };
    let t = tmp.path();
    // Each store with the runs it gets: discrete at the least device budget, unified at
    // the least host budget, unified at a given host budget.
    enum Budget {
        LeastDevice,
        LeastHost,
        Host(u64),
    }
    use Budget::*;
    let tiny = |src: &str, dir: &str, codec: &str| {
        pack_store(&fixture(src), &t.join(dir), codec, 64 << 10)
    };
    let stores = [
        (tiny("tiny-llama", "l", "zstd:1"), vec![LeastDevice]),
        (tiny("tiny-qwen3", "q", "lz4"), vec![LeastDevice]),
        (tiny("tiny-llama-q.gguf", "lq", "float"), vec![LeastDevice]),
        // Norms after the feed-forward block, in the first piece: kept to the end.
        (
            tiny("tiny-gemma3", "g", "zstd:1"),
            vec![LeastDevice, LeastHost],
        ),
        (tiny("tiny-gemma3.gguf", "gq", "none"), vec![LeastDevice]),
        (pack_synth("none"), vec![LeastDevice, LeastHost]),
        (pack_synth("zstd:1"), vec![LeastDevice, LeastHost]),
        // Stored raw: `pack` starts each projection at a 4 KiB block, so the cuts are
        // O_DIRECT-aligned whatever the tensors' sizes (SmolLM2's q is 50.6 blocks). At its
        // least budgets its tied head streams in parts of a 1 MiB frame at least, through
        // slots that hold a layer whole; at 80 MiB the embedding stays and layers stream.
        (
            pack_store(&smollm2_gguf(), &t.join("smol"), "none", 1 << 20),
            vec![Host(80 << 20)],
        ),
    ];
    let small_reads = IoConfig {
        request_bytes: 4096,
        read_buffers: 64,
        queue_depth: 64,
        ..io()
    };
    for (s, runs) in &stores {
        let name = s.manifest().source.clone();
        let vocab = s.manifest().arch.vocab;
        let want = outputs(&mut runner(s, None, 0), vocab);
        let layer_max = s.units()[1..].iter().map(|u| u.raw_len).max().unwrap();
        for run in runs {
            let (mut r, unified) = match run {
                LeastDevice => (least_runner(s, false, &small_reads), false),
                LeastHost => (least_runner(s, true, &small_reads), true),
                Host(b) => {
                    let host = sluice::plan::HostInput {
                        budget: Some(*b),
                        ..Default::default()
                    };
                    let input = input_at(None, host);
                    let r = cpu_runner(
                        s.clone(),
                        &input,
                        2,
                        small_reads.clone(),
                        Default::default(),
                    )
                    .unwrap();
                    (r, true)
                }
            };
            let pieced: Vec<usize> = (0..s.units().len())
                .filter(|&u| r.plan.pieces[u].is_some())
                .collect();
            assert!(
                !pieced.is_empty(),
                "{name} unified={unified}: no layer streams in pieces\n{}",
                r.plan.table()
            );
            for &u in &pieced {
                let pieces = r.plan.pieces[u].as_ref().unwrap();
                assert!(pieces.len() >= 2, "{name}: {pieces:?}");
                assert_eq!(pieces[0].phases.start, 0);
                assert_eq!(pieces[0].frames.start, 0);
                assert_eq!(
                    pieces.last().unwrap().phases.end,
                    sluice::plan::LAYER_PHASES
                );
                assert_eq!(pieces.last().unwrap().frames.end, s.units()[u].frames.len());
                assert!(pieces
                    .windows(2)
                    .all(|w| w[0].frames.end == w[1].frames.start
                        && w[0].phases.end == w[1].phases.start));
                assert_eq!(r.plan.units[u].pieces, pieces.len());
            }
            assert!(
                r.plan.host.staging_slot_bytes < layer_max,
                "{name} unified={unified}: slots of {} hold a whole layer of {layer_max}",
                r.plan.host.staging_slot_bytes
            );
            let got = outputs(&mut r, vocab);
            assert!(
                got == want,
                "{name} unified={unified}: pieced outputs differ"
            );
            // Each pieced layer's bytes are handed to the compute every pass.
            let passes = r.total().passes;
            let pieced_bytes: u64 = pieced.iter().map(|&u| s.units()[u].raw_len).sum();
            assert!(r.total().bytes_uploaded >= passes * pieced_bytes, "{name}");
        }
    }
    let smol = &stores.last().unwrap().0;
    for u in 0..smol.units().len() {
        assert!(sluice::plan::layer_pieces(smol.manifest(), u, 4 << 20).is_none());
    }
    assert!(sluice::plan::layer_pieces(smol.manifest(), 1, 4096).is_some());
}

/// A pipeline at the least budget that plans for `s` with reads of `io`: the device
/// budget (discrete) or the host budget (unified), from the planner's own error.
fn least_runner(s: &Arc<Store>, unified: bool, io: &IoConfig) -> Pipeline<CpuBackend> {
    let mut budget = 4096;
    for _ in 0..64 {
        let (device, host) = match unified {
            true => (None, Some(budget)),
            false => (Some(budget), None),
        };
        let input = input_at(
            device,
            sluice::plan::HostInput {
                budget: host,
                ..Default::default()
            },
        );
        let make = if unified {
            cpu_runner
        } else {
            sluice::engine::cpu_runner_discrete
        };
        match make(s.clone(), &input, 2, io.clone(), Default::default()) {
            Ok(r) => return r,
            Err(sluice::engine::EngineError::Plan(e)) if e.need() > budget => budget = e.need(),
            Err(sluice::engine::EngineError::Plan(_)) => budget += 4096,
            Err(e) => panic!("{e}"),
        }
    }
    panic!("no budget plans")
}

/// The tests' plan input with a device budget and a host input: prefetch 3, no host
/// cache, no experts pinned.
fn input_at(device_budget: Option<u64>, host: sluice::plan::HostInput) -> PlanInput {
    PlanInput {
        device_budget,
        host_cache_budget: 0,
        opts: OPTS,
        prefetch: Some(3),
        expert_cache: None,
        expert_profile: None,
        backend_reserved: 0,
        self_draft_reserved: 0,
        host,
    }
}

/// The least device budget that plans for `s` (`unified`: the arena's), from the planner's
/// own error.
fn least_budget(s: &Store, expert_cache: Option<usize>, unified: bool) -> u64 {
    let input = |budget| PlanInput {
        expert_cache,
        ..input_at(
            Some(budget),
            sluice::plan::HostInput {
                unified,
                ..Default::default()
            },
        )
    };
    match plan(s.manifest(), &input(4096)) {
        Err(e) => {
            plan(s.manifest(), &input(e.need())).unwrap();
            e.need()
        }
        Ok(_) => panic!("a page plans nothing"),
    }
}

/// A pipeline for a mixture at the least budget that plans with `expert_cache` slots.
fn moe_runner(
    s: &Arc<Store>,
    unified: bool,
    expert_cache: Option<usize>,
    host_cache: u64,
) -> Pipeline<CpuBackend> {
    let budget = least_budget(s, expert_cache, unified);
    runner_with(s, Some(budget), host_cache, unified, expert_cache)
}

/// A mixture's streamed layers load their dense part and only the experts a step routes
/// to: with an expert cache of every expert, of one slot and (unified) the planner's
/// choice, from a raw store and a compressed one, on the CPU as it runs and as a discrete
/// device, outputs are bit-identical to all-resident and the arena stays in its budget. A
/// decode step of one sequence loads top-k experts per layer, not the layer; a cache of
/// every expert loads each expert once.
#[test]
fn moe_layers_stream_only_their_routed_experts_bit_identical_to_resident() {
    let tmp = tempfile::tempdir().unwrap();
    // Configurations that kept a dense part resident, discrete and unified.
    let mut dense_kept = [0; 2];
    for src in [
        fixture("tiny-qwen3moe"),
        fixture("tiny-mixtral.gguf"),
        fixture("tiny-qwen3moe-mixed"),
        fixture("tiny-gptoss"),
        fixture("tiny-gptoss-mxfp4.gguf"),
    ] {
        for codec in ["none", "zstd:1"] {
            let name = format!("{} {codec}", src.file_name().unwrap().to_string_lossy());
            let s = pack_store(
                &src,
                &tmp.path().join(name.replace([' ', ':'], "-")),
                codec,
                64 << 10,
            );
            let m = s.manifest();
            let (vocab, k) = (m.arch.vocab, m.arch.moe.as_ref().unwrap().top_k as u64);
            let want = outputs(&mut runner(&s, None, 0), vocab);
            for unified in [false, true] {
                for cache in [Some(1000), Some(1), None] {
                    let label = format!("{name} unified={unified} cache={cache:?}");
                    let mut r = moe_runner(&s, unified, cache, 0);
                    let sparse: Vec<usize> = (0..s.units().len())
                        .filter(|&u| r.plan.sparse[u].is_some())
                        .collect();
                    assert!(!sparse.is_empty(), "{label}: no layer streams its experts");
                    // Slots hold a dense part or an expert, not a layer.
                    let layer = sparse.iter().map(|&u| s.units()[u].raw_len).max().unwrap();
                    assert!(r.plan.host.staging_slot_bytes < layer, "{label}");
                    assert!(r.plan.table().contains("expert cache"), "{label}");
                    let experts = r.plan.experts_streamed;
                    match cache {
                        Some(n) => assert_eq!(r.plan.expert_cache_slots, n.min(experts), "{label}"),
                        None if !unified => assert!(r.plan.expert_cache_slots >= 1, "{label}"),
                        None => {}
                    }
                    let got = outputs(&mut r, vocab);
                    assert!(got == want, "{label}: outputs differ from all-resident");
                    let b = r.backend.budget();
                    assert!(
                        b.peak() <= b.limit(),
                        "{label}: peak {} over {}",
                        b.peak(),
                        b.limit()
                    );
                    // The last step decoded one sequence: k experts per streamed layer ran,
                    // and with fewer cache slots than experts some loaded.
                    let last = r.last_pass().clone();
                    assert_eq!(last.experts_routed, k * sparse.len() as u64, "{label}");
                    assert_eq!(
                        last.expert_cache_hits + last.experts_loaded,
                        last.experts_routed,
                        "{label}"
                    );
                    let t = r.total().clone();
                    assert!(t.experts_predicted > 0, "{label}: no prediction was made");
                    // Unified, consecutive streamed sparse layers: the next one's router ran
                    // on this one's hidden state (a prediction the routing then scored).
                    let consecutive = sparse.windows(2).any(|w| w[1] == w[0] + 1);
                    if unified && consecutive {
                        let p = r.model.prediction_stats();
                        assert!(p.lookahead.predicted > 0, "{label}: {p:?}");
                        assert!(p.lookahead.right <= p.lookahead.predicted, "{label}");
                    }
                    if cache.is_none() {
                        // Budgets above the least, until one leaves room for dense parts
                        // of streamed layers: they stay resident and only experts load
                        // (the router lookahead then works from them on any backend).
                        // (Whether one does depends on the sizes: a budget step may go
                        // to whole units first.)
                        let least = least_budget(&s, None, unified);
                        for step in 1..=64u64 {
                            let mut r =
                                runner_with(&s, Some(least + step * 8192), 0, unified, None);
                            let kept: Vec<usize> = (0..s.units().len())
                                .filter(|&u| r.plan.dense_resident[u])
                                .collect();
                            if kept.is_empty() {
                                continue;
                            }
                            dense_kept[usize::from(unified)] += 1;
                            assert!(outputs(&mut r, vocab) == want, "{label}: dense resident");
                            let b = r.backend.budget();
                            assert!(b.peak() <= b.limit(), "{label}: dense resident over budget");
                            // The last (decode) pass loaded no dense part of those layers.
                            let last = r.last_pass();
                            assert!(last.experts_routed > 0, "{label}");
                            // A kept dense part after a streamed sparse layer: that layer ran
                            // the next one's router (lookahead).
                            let next_kept = kept.iter().any(|&n| r.plan.sparse[n - 1].is_some());
                            if next_kept {
                                let p = r.model.prediction_stats();
                                assert!(p.lookahead.predicted > 0, "{label}: {p:?}");
                            }
                            break;
                        }
                    }
                    if cache == Some(1) {
                        // Predictions change what loads when, never the outputs.
                        for mode in [
                            sluice::pipeline::Prediction::Previous,
                            sluice::pipeline::Prediction::Off,
                        ] {
                            let budget = least_budget(&s, cache, unified);
                            let run = PipelineOptions {
                                expert_prediction: mode,
                                ..Default::default()
                            };
                            let mut r = runner_run(&s, Some(budget), 0, unified, cache, run);
                            assert!(outputs(&mut r, vocab) == want, "{label} {mode:?}");
                            let t = r.total();
                            if mode == sluice::pipeline::Prediction::Off {
                                assert_eq!(t.expert_prefetches, 0, "{label}");
                            }
                        }
                    }
                    assert!(t.experts_predicted_used <= t.experts_predicted, "{label}");
                    if r.plan.expert_cache_slots >= experts {
                        // Every expert loads at most once; a second run loads none.
                        assert!(t.experts_loaded <= experts as u64, "{label}: {t:?}");
                        let got = outputs(&mut r, vocab);
                        assert!(got == want, "{label}: second run differs");
                        assert_eq!(r.total().experts_loaded, t.experts_loaded, "{label}");
                    } else {
                        // A decode pass reads the dense parts and at most k experts a layer:
                        // less than the streamed layers whole, but for the predicted experts
                        // it prefetched in vain (how many depends on the threads' timing: a
                        // prefetch goes out only when it is ahead of the routing).
                        let whole: u64 = sparse.iter().map(|&u| s.units()[u].stored_len).sum();
                        let expert_max = sparse
                            .iter()
                            .flat_map(|&u| {
                                let unit = &s.units()[u];
                                let experts = unit.experts().unwrap_or_default();
                                experts.into_iter().map(move |e| {
                                    unit.frames[e.frames].iter().map(|f| f.stored_len()).sum()
                                })
                            })
                            .max()
                            .unwrap_or(0u64);
                        let in_vain = last.expert_prefetches_wasted * (expert_max + 2 * 4096);
                        let dense: u64 = r
                            .plan
                            .units
                            .iter()
                            .enumerate()
                            .filter(|(u, p)| {
                                p.placement != sluice::plan::Placement::Resident
                                    && !sparse.contains(u)
                            })
                            .map(|(u, _)| s.units()[u].stored_len)
                            .sum();
                        assert!(
                            last.bytes_read < whole + dense + in_vain,
                            "{label}: a decode pass read {} of {} whole ({} prefetches in vain)",
                            last.bytes_read,
                            whole + dense,
                            last.expert_prefetches_wasted
                        );
                        assert!(last.experts_loaded > 0, "{label}");
                    }
                }
            }
        }
    }
    assert!(
        dense_kept.iter().all(|&n| n > 0),
        "dense parts kept resident (discrete, unified): {dense_kept:?}"
    );
}

/// A corrupted expert fails the step that routed to it, with the layer and offset named,
/// and gives back every staging slot; the expert cache keeps nothing of it, and once the
/// data is repaired the same pipeline serves exactly again. Experts of a host-cached layer
/// come from the host cache, not the disk.
#[test]
fn a_corrupted_expert_fails_its_step_and_host_cached_experts_skip_the_disk() {
    let tmp = tempfile::tempdir().unwrap();
    let s = store(&fixture("tiny-qwen3moe"), &tmp.path().join("t"));
    let vocab = s.manifest().arch.vocab;
    let want = outputs(&mut runner(&s, None, 0), vocab);
    for unified in [false, true] {
        let mut r = moe_runner(&s, unified, Some(1), 0);
        let u = (0..s.units().len())
            .find(|&u| r.plan.sparse[u].is_some())
            .unwrap();
        let sp = r.plan.sparse[u].clone().unwrap();
        let w = s.weights_path().to_path_buf();
        let good = std::fs::read(&w).unwrap();
        let mut bad = good.clone();
        let frames = &s.units()[u].frames;
        for x in &sp.experts {
            let f = &frames[x.frames.start];
            bad[(f.file_offset + f.stored_len() / 2) as usize] ^= 0x08;
        }
        std::fs::write(&w, &bad).unwrap();
        let mut logits = Vec::new();
        for _ in 0..3 {
            let msg = failing_step(&mut r, &mut logits);
            let offsets: Vec<String> = sp
                .experts
                .iter()
                .map(|x| format!("offset {}", frames[x.frames.start].file_offset))
                .collect();
            assert!(
                msg.contains(&s.units()[u].kind.to_string())
                    && offsets.iter().any(|o| msg.contains(o)),
                "{msg}"
            );
        }
        pools_refill(&r);
        std::fs::write(&w, &good).unwrap();
        assert!(outputs(&mut r, vocab) == want, "unified={unified}");
    }
    // A discrete device with the streamed layers host-cached: their dense parts and
    // experts are copied from host memory, nothing is read from disk after start.
    let mut r = moe_runner(&s, false, Some(1), 64 << 20);
    let cached: Vec<usize> = (0..s.units().len())
        .filter(|&u| {
            r.plan.sparse[u].is_some() && r.plan.placement(u) == sluice::plan::Placement::HostCached
        })
        .collect();
    assert!(!cached.is_empty(), "no sparse layer is host-cached");
    assert!(outputs(&mut r, vocab) == want);
    let t = r.total();
    assert!(t.experts_loaded > 0 && t.bytes_from_host_cache > 0, "{t:?}");
    let streamed_all_cached = (0..s.units().len())
        .all(|u| r.plan.placement(u) != sluice::plan::Placement::Streamed || u == 0);
    assert!(streamed_all_cached, "{}", r.plan.table());
    // Only a streamed embedding's row lookup reads the store.
    assert_eq!(t.bytes_read, t.bytes_gathered, "{t:?}");
}

/// `sluiced synth --moe` writes a mixture (Mixtral's layout) whose router prefers the
/// low-numbered experts; `run` streams it under a host budget through an expert cache of
/// a few slots, with the same tokens as all resident, the frequency eviction hitting more
/// than LRU, and both routing predictors measured. Bad `--moe` values are refused.
#[test]
fn sluiced_synth_moe_streams_its_routed_experts() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("m");
    let d = dir.to_str().unwrap();
    let e = sluiced_err(&["synth", "-o", d, "--layers", "2", "--moe", "8/9"]);
    assert!(e.contains("TOP_K <= EXPERTS"), "{e}");
    let e = sluiced_err(&[
        "synth", "-o", d, "--layers", "2", "--hidden", "320", "--dtype", "q4_k", "--moe", "8/2",
    ]);
    assert!(e.contains("--hidden 320") && e.contains("blocks"), "{e}");
    sluiced_ok(&[
        "synth",
        "-o",
        d,
        "--layers",
        "4",
        "--hidden",
        "256",
        "--vocab",
        "512",
        "--dtype",
        "f16",
        "--moe",
        "16/2",
        "--expert-intermediate",
        "256",
        "--codec",
        "none",
    ]);
    let run = |extra: &[&str]| -> serde_json::Value {
        let mut a = vec![
            "run",
            "--temperature",
            "0",
            d,
            "--prompt-ids",
            "1,2,3,4,5,6,7,8",
            "--max-tokens",
            "24",
            "--ignore-eos",
            "--max-context",
            "64",
            "--json",
        ];
        a.extend(extra);
        serde_json::from_str(&sluiced_ok(&a)).unwrap()
    };
    let full = run(&["--measure-expert-prediction"]);
    assert_eq!(full["layers_streamed"], 0);
    // Every layer resident: the lookahead ran for layers 1..3 and was scored.
    let p = &full["expert_prediction"]["counts"];
    assert!(p["lookahead_predicted"].as_u64().unwrap() > 0, "{p}");
    assert!(p["previous_predicted"].as_u64().unwrap() > 0, "{p}");
    // A device budget below one layer: every layer streams its routed experts.
    let mut hits = Vec::new();
    for eviction in ["frequency", "lru"] {
        let s = run(&[
            "--device-memory",
            "12MiB",
            "--expert-cache",
            "4",
            "--expert-eviction",
            eviction,
        ]);
        assert_eq!(
            s["generated_token_ids"], full["generated_token_ids"],
            "{eviction}"
        );
        assert!(s["layers_streamed"].as_u64().unwrap() > 0, "{eviction}");
        let x = &s["experts"];
        assert!(x["routed"].as_u64().unwrap() > 0, "{eviction}: {x}");
        assert!(x["loaded"].as_u64().unwrap() > 0, "{eviction}: {x}");
        assert!(
            s["device_bytes_peak"].as_u64().unwrap() <= 12 << 20,
            "{eviction}: {s}"
        );
        hits.push(x["cache_hits"].as_u64().unwrap());
    }
    assert!(
        hits[0] > hits[1],
        "frequency eviction {} hits, LRU {}",
        hits[0],
        hits[1]
    );
    // Eight sequences route more experts a layer than the loads in flight (2 x top 2):
    // the predicted experts leave the layer's first missing one a read, and every sequence
    // gets the tokens it gets all resident.
    let wide = |extra: &[&str]| -> serde_json::Value {
        let mut a = vec!["--parallel", "8"];
        a.extend(extra);
        run(&a)
    };
    let all = wide(&[]);
    for prediction in ["lookahead", "previous"] {
        let s = wide(&[
            "--device-memory",
            "12MiB",
            "--expert-cache",
            "6",
            "--expert-prediction",
            prediction,
        ]);
        assert_eq!(s["sequences"], all["sequences"], "{prediction}");
        assert!(s["experts"]["loaded"].as_u64().unwrap() > 0, "{prediction}");
    }
    // A warm-up run saves its routing as a profile; a run that loads it starts with the
    // hottest experts in the cache (some pinned), hits more and generates the same tokens.
    let prof = tmp.path().join("experts.json");
    let pr = prof.to_str().unwrap();
    run(&["--device-memory", "12MiB", "--save-expert-profile", pr]);
    let saved: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&prof).unwrap()).unwrap();
    assert_eq!(saved["layers"].as_array().unwrap().len(), 4, "{saved}");
    let cold = run(&["--device-memory", "12MiB"]);
    let warm = run(&["--device-memory", "12MiB", "--expert-profile", pr]);
    assert_eq!(warm["generated_token_ids"], full["generated_token_ids"]);
    let w = &warm["expert_profile"];
    assert!(w["experts_loaded"].as_u64().unwrap() > 0, "{w}");
    assert!(w["experts_pinned"].as_u64().unwrap() > 0, "{w}");
    assert!(
        warm["plan"]["expert_hot_slots"].as_u64().unwrap() > 0,
        "{}",
        warm["plan"]
    );
    assert!(warm["device_bytes_peak"].as_u64().unwrap() <= 12 << 20);
    let hits = |v: &serde_json::Value| v["experts"]["cache_hits"].as_u64().unwrap();
    assert!(
        hits(&warm) > hits(&cold),
        "with the profile {} hits, without {}",
        hits(&warm),
        hits(&cold)
    );
    // A profile that is not one: the file is named.
    std::fs::write(&prof, "{\"model\": 1}").unwrap();
    let e = sluiced_err(&[
        "run",
        "--temperature",
        "0",
        d,
        "--prompt-ids",
        "1,2",
        "--max-tokens",
        "2",
        "--expert-profile",
        pr,
    ]);
    assert!(e.contains("experts.json"), "{e}");
}

/// An expert profile (the routing counts of an earlier run) plans room for the hottest
/// experts, loads them into the expert cache at start and pins them: they are still there
/// after steps that route elsewhere, the first step already hits them, and the outputs are
/// the same bits as all-resident, within the budget, on the CPU as it runs and as a discrete
/// device. A profile of another model is refused naming its file.
#[test]
fn an_expert_profile_pins_the_hottest_experts_and_outputs_stay_bit_identical() {
    use sluice::pipeline::{ExpertProfile, PROFILE_HOT_SHARE};
    let tmp = tempfile::tempdir().unwrap();
    let s = pack_store(
        &fixture("tiny-qwen3moe"),
        &tmp.path().join("s"),
        "none",
        64 << 10,
    );
    let m = s.manifest();
    let vocab = m.arch.vocab;
    let want = outputs(&mut runner(&s, None, 0), vocab);
    // The profile of a run, saved and read back.
    let mut warm = runner(&s, None, 0);
    outputs(&mut warm, vocab);
    let path = tmp.path().join("profile.json");
    warm.expert_profile().save(&path).unwrap();
    let profile = ExpertProfile::load(&path, &m.arch).unwrap();
    assert_eq!(profile, warm.expert_profile());
    let hot = profile.hot_set(PROFILE_HOT_SHARE);
    assert!(
        hot > 0 && hot < 8,
        "{hot} of the 8 experts served half the tokens"
    );
    // The hottest experts, as (unit, expert), hottest first.
    let mut ranked: Vec<(u64, usize, u32)> = profile
        .layers
        .iter()
        .enumerate()
        .flat_map(|(i, l)| {
            l.iter()
                .enumerate()
                .map(move |(e, &n)| (n, i + 1, e as u32))
        })
        .collect();
    ranked.sort_by(|a, b| b.0.cmp(&a.0).then((a.1, a.2).cmp(&(b.1, b.2))));
    for unified in [false, true] {
        let input = |budget| PlanInput {
            device_budget: Some(budget),
            host_cache_budget: 0,
            opts: OPTS,
            prefetch: Some(3),
            expert_cache: None,
            expert_profile: Some(hot),
            backend_reserved: 0,
            self_draft_reserved: 0,
            host: sluice::plan::HostInput {
                unified,
                ..Default::default()
            },
        };
        // From the least that plans the hot experts and a step's loads (2 x top 2) as a
        // cache, the first budget that still streams and pins some (the streamed layers'
        // dense parts come first).
        let least = least_budget(&s, Some(hot + 4), unified);
        let budget = (0..256u64)
            .map(|i| least + i * 4096)
            .find(|&b| {
                plan(m, &input(b))
                    .is_ok_and(|p| p.expert_hot_slots > 0 && p.sparse.iter().any(Option::is_some))
            })
            .expect("a budget that streams experts and pins some");
        let make = if unified {
            sluice::engine::cpu_runner
        } else {
            sluice::engine::cpu_runner_discrete
        };
        let mut r = make(s.clone(), &input(budget), 2, io(), Default::default()).unwrap();
        let label = format!("unified={unified}");
        let p = &r.plan;
        assert!(
            p.sparse.iter().any(Option::is_some),
            "{label}: nothing streams"
        );
        assert!(p.expert_hot_slots > 0, "{label}: {}", p.table());
        assert!(p.table().contains("resident hot experts"), "{label}");
        let hot_slots = p.expert_hot_slots;
        let loaded = r.load_expert_profile(profile.clone()).unwrap();
        let pinned_of = |r: &Pipeline<CpuBackend>| -> Vec<(usize, u32)> {
            r.cached_experts()
                .into_iter()
                .filter(|c| c.2)
                .map(|c| (c.0, c.1))
                .collect()
        };
        let pinned = pinned_of(&r);
        let hottest: Vec<(usize, u32)> = ranked
            .iter()
            .filter(|x| x.0 > 0 && r.plan.sparse[x.1].is_some())
            .take(hot_slots)
            .map(|x| (x.1, x.2))
            .collect();
        assert!(loaded >= pinned.len(), "{label}");
        assert_eq!(pinned, hottest, "{label}: the pinned experts");
        let got = outputs(&mut r, vocab);
        assert!(got == want, "{label}: outputs differ from all-resident");
        let first = r.total().clone();
        assert!(
            first.expert_cache_hits > 0,
            "{label}: no hit from the warm cache"
        );
        // Still pinned after the steps, whatever they routed.
        assert_eq!(
            pinned_of(&r),
            hottest,
            "{label}: a pinned expert was evicted"
        );
        let b = r.backend.budget();
        assert!(
            b.peak() <= b.limit(),
            "{label}: peak {} over {}",
            b.peak(),
            b.limit()
        );
    }
    // A profile of another model (Mixtral's: other layers and experts) says so.
    let other = tmp.path().join("other.json");
    std::fs::write(
        &other,
        serde_json::to_string(&ExpertProfile {
            model: "other".into(),
            layers: vec![vec![1; 8]; 3],
        })
        .unwrap(),
    )
    .unwrap();
    let e = ExpertProfile::load(&other, &m.arch)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("other.json") && e.contains("--save-expert-profile"),
        "{e}"
    );
}

/// A linked store (`pack --link`) points at the GGUF's own bytes instead of copying them:
/// for SmolLM2 (llama q/k rows in llama.cpp's rotary order, put back as frames decode)
/// and Gemma 3 (K-quants) it costs under 1 % of the GGUF on disk, streams with the same
/// bits as a copied store run resident, and refuses a source that changed since packing.
#[test]
fn linked_stores_stream_bit_identical_to_copied_ones_and_refuse_a_changed_source() {
    let tmp = tempfile::tempdir().unwrap();
    for (name, src) in [("smollm2", smollm2_gguf()), ("gemma3", gemma3_gguf())] {
        // The store links a copy: this test changes it afterwards.
        let gguf = tmp.path().join(format!("{name}.gguf"));
        std::fs::copy(&src, &gguf).unwrap();
        let copied = pack_store(
            &gguf,
            &tmp.path().join(format!("{name}-copied")),
            "none",
            1 << 20,
        );
        let dir = tmp.path().join(format!("{name}-linked"));
        let out = sluiced_ok(&[
            "pack",
            "--link",
            gguf.to_str().unwrap(),
            "-o",
            dir.to_str().unwrap(),
        ]);
        assert!(out.contains("linked"), "{out}");
        let gguf_len = std::fs::metadata(&gguf).unwrap().len();
        let on_disk: u64 = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| {
                use std::os::unix::fs::MetadataExt;
                let m = e.unwrap().metadata().unwrap();
                m.len().max(m.blocks() * 512)
            })
            .sum();
        assert!(
            (on_disk as f64) < 0.01 * gguf_len as f64,
            "{name}: the linked store takes {on_disk} bytes of a {gguf_len}-byte GGUF"
        );
        let linked = Arc::new(Store::open(&dir).unwrap());
        assert!(!dir.join("weights.bin").exists(), "{name}: no second copy");
        // `--codec auto` packs a copy (a linked store streams slower under a tight
        // budget) and names `--link` as what would save the disk: no codec saves 3 % of
        // a quantized model.
        let auto = tmp.path().join(format!("{name}-auto"));
        let out = sluiced_ok(&[
            "pack",
            "--codec",
            "auto",
            "--disk-gbps",
            "2",
            gguf.to_str().unwrap(),
            "-o",
            auto.to_str().unwrap(),
        ]);
        assert!(
            out.contains("`pack --link` would point at"),
            "{name}: {out}"
        );
        assert!(
            Store::open(&auto).unwrap().manifest().link.is_none(),
            "{name}"
        );
        assert!(auto.join("weights.bin").exists(), "{name}");
        assert_eq!(linked.weights_path(), std::fs::canonicalize(&gguf).unwrap());
        sluiced_ok(&["verify", dir.to_str().unwrap()]);

        let vocab = copied.manifest().arch.vocab;
        let want = outputs(&mut runner(&copied, None, 0), vocab);
        let free = free_plan(&linked);
        let units = linked.units();
        let layer = units[1..]
            .iter()
            .map(|u| u.raw_len.div_ceil(4096) * 4096)
            .max()
            .unwrap();
        let fixed = free.kv_cache_bytes + free.workspace_bytes;
        // SmolLM2 streams its tied embedding in row parts too; Gemma 3's (170 MiB) stays
        // and half of its layers stream.
        let budget = if name == "smollm2" {
            let emb = &units[0];
            let t = emb.tensor("model.embed_tokens.weight").unwrap();
            let rb = t.dtype.row_bytes(t.shape[1]).unwrap();
            let table = ((OPTS.max_batch_tokens as u64 + emb.frames.len() as u64) * rb)
                .div_ceil(4096)
                * 4096;
            fixed + table + 5 * layer
        } else {
            let layers: u64 = units[1..].iter().map(|u| u.raw_len).sum();
            fixed + units[0].raw_len.div_ceil(4096) * 4096 + layers / 2
        };
        for unified in [false, true] {
            let mut r = runner_as(&linked, Some(budget), 0, unified);
            assert!(r.plan.layers_streamed() >= units.len() / 3, "{name}");
            assert!(
                outputs(&mut r, vocab) == want,
                "{name}, unified {unified}: the linked store streams other bits than the copied one"
            );
            assert!(r.total().bytes_read > 0, "{name}");
        }
        assert!(
            outputs(&mut runner(&linked, None, 0), vocab) == want,
            "{name}: resident"
        );
        drop(linked);

        // A changed source is refused at open, naming it.
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&gguf)
            .unwrap();
        let mtime = std::fs::metadata(&gguf).unwrap().modified().unwrap();
        f.set_modified(mtime + std::time::Duration::from_secs(1))
            .unwrap();
        let err = match Store::open(&dir) {
            Err(e) => e.to_string(),
            Ok(_) => panic!("{name}: a touched source opened"),
        };
        assert!(
            err.contains(gguf.file_name().unwrap().to_str().unwrap()) && err.contains("modified"),
            "{err}"
        );
        let err = sluiced_err(&["verify", dir.to_str().unwrap()]);
        assert!(err.contains("modified") && err.contains("--link"), "{err}");
        // Bytes changed behind an unchanged size and mtime: a sampled range catches it at
        // open (the first sample is the file's start), any other at its frame's checksum.
        use std::os::unix::fs::FileExt;
        let mut b = [0u8; 1];
        f.read_at(&mut b, 100).unwrap();
        f.write_all_at(&[b[0] ^ 0x55], 100).unwrap();
        f.set_modified(mtime).unwrap();
        let err = match Store::open(&dir) {
            Err(e) => e.to_string(),
            Ok(_) => panic!("{name}: a source with changed bytes opened"),
        };
        assert!(err.contains("at offset 0 changed"), "{err}");
        f.write_all_at(&b, 100).unwrap();
        f.set_modified(mtime).unwrap();
        let at = Store::open(&dir).unwrap().units()[1].frames[0].file_offset + 1000;
        f.read_at(&mut b, at).unwrap();
        f.write_all_at(&[b[0] ^ 0x55], at).unwrap();
        f.set_modified(mtime).unwrap();
        let err = sluiced_err(&["verify", dir.to_str().unwrap()]);
        assert!(
            err.contains("layer 0")
                && err.contains("checksum")
                && err.contains(&format!("{name}.gguf")),
            "{name}: {err}"
        );
    }
}
