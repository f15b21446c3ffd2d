//! Speculative decoding with a draft model (`sluiced run --draft STORE`): a q8_0 copy made
//! by `sluiced pack --quantize` drafts, the target verifies, and the text is the target's
//! own, token for token, greedy and seeded, on every architecture, alone and
//! beside other sequences; the real models resident and streamed with the draft inside the
//! same budget; a draft of another vocabulary, or one that would not be resident, is
//! refused with what to do.

use sluice::backend::cpu::CpuBackend;
use sluice::engine::draft::{DraftConfig, DraftKind, SpecStats};
use sluice::engine::draft_model::DraftModel;
use sluice::engine::generate::{generate_with, GenerateOutput};
use sluice::engine::sequence::GenerateParams;
use sluice::model::ModelOptions;
use sluice::pipeline::Pipeline;
use sluice::store::Store;
use sluice::text::{SamplingParams, Tokenizer};
use sluice_tests::*;
use std::path::Path;
use std::sync::Arc;

/// Every proposal verified whole: these tests are about what verification gives.
const MODEL: DraftConfig = DraftConfig {
    kind: DraftKind::Model,
    max: 5,
    fixed: true,
    branches: 0,
};

/// MODEL with token trees: the draft's runner-ups as two leaves beside its chain.
const MODEL_TREE: DraftConfig = DraftConfig {
    branches: 2,
    ..MODEL
};

fn runner(store: Arc<Store>, kv_slots: usize, verify_rows: usize) -> Pipeline<CpuBackend> {
    let opts = ModelOptions {
        max_context: 128,
        kv_slots,
        max_batch_tokens: 64,
        kv_dtype: sluice::engine::kv_dtype_for(false, None),
        exact: false,
        verify_rows,
    };
    sluice::engine::cpu_runner(store, &plan_input(opts), 2, small_io(), Default::default())
        .expect("runner")
}

fn params(sampling: SamplingParams, draft: Option<DraftConfig>) -> GenerateParams {
    GenerateParams {
        max_tokens: 32,
        sampling,
        stop: Vec::new(),
        ignore_eos: true,
        logprobs: None,
        logit_bias: Vec::new(),
        format: Default::default(),
        draft,
        markers: false,
    }
}

fn total(outs: &[GenerateOutput]) -> SpecStats {
    let mut s = SpecStats::default();
    for o in outs {
        s.add(&o.speculative);
    }
    s
}

/// `n` sequences of a prompt of `src`, plain and with its q8_0 copy drafting.
fn both(
    src: &str,
    dir: &Path,
    (n, draft): (usize, DraftConfig),
    sampling: SamplingParams,
) -> (Vec<GenerateOutput>, Vec<GenerateOutput>) {
    let target = pack_store(&fixture(src), &dir.join("t"), "none", 1 << 20);
    let draft_dir = dir.join("d");
    sluiced_ok(&[
        "pack",
        fixture(src).to_str().expect("path"),
        "-o",
        draft_dir.to_str().expect("path"),
        "--quantize",
        "q8_0",
    ]);
    let draft_store = Arc::new(Store::open(&draft_dir).expect("draft store"));
    let tok = Tokenizer::from_manifest(target.manifest()).expect("tokenizer");
    let prompt = tok
        .encode("one two three four five six seven", false)
        .expect("encode");
    let mut plain = runner(target.clone(), n, 0);
    let a = generate_with(
        &mut plain,
        None,
        &tok,
        &prompt,
        &params(sampling, None),
        n,
        |_| {},
    )
    .expect("plain");
    drop(plain);
    let mut target = runner(target, n, n * draft.rows());
    let mut dm = DraftModel::new(runner(draft_store, n, 0));
    let p = params(sampling, Some(draft));
    let b =
        generate_with(&mut target, Some(&mut dm), &tok, &prompt, &p, n, |_| {}).expect("drafted");
    assert!(
        dm.passes > 0 && b[0].draft_passes == dm.passes,
        "{src}: {} passes",
        dm.passes
    );
    (a, b)
}

#[test]
fn text_with_a_draft_model_is_the_text_without_on_every_architecture() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let seeded = SamplingParams {
        temperature: 0.8,
        top_k: 40,
        top_p: 0.95,
        repetition_penalty: 1.1,
        seed: 7,
        ..SamplingParams::default()
    };
    let greedy = SamplingParams {
        temperature: 0.0,
        ..SamplingParams::default()
    };
    for src in TINY_ARCHS {
        for (how, sampling) in [("greedy", greedy), ("seeded", seeded)] {
            for (n, draft) in [(1, MODEL), (3, MODEL), (1, MODEL_TREE), (3, MODEL_TREE)] {
                let what = format!("{src} {how} batch {n} branches {}", draft.branches);
                let dir = tmp.path().join(what.replace(' ', "-"));
                let (plain, drafted) = both(src, &dir, (n, draft), sampling);
                for (a, b) in plain.iter().zip(&drafted) {
                    assert_eq!(a.generated_token_ids, b.generated_token_ids, "{what}");
                    assert_eq!(a.finish_reason, b.finish_reason, "{what}");
                }
                let s = total(&drafted);
                // A tiny random model's sampled tokens rarely are its copy's argmax: only
                // greedy decoding must accept drafts; seeded runs must verify them.
                assert!(s.drafted_tokens > 0, "{what}: nothing drafted: {s:?}");
                if how == "greedy" {
                    assert!(s.accepted_tokens > 0, "{what}: nothing accepted: {s:?}");
                }
                // Accepted drafts are tokens that took no step of their own.
                let steps: usize = drafted.iter().map(|o| o.decode_steps).sum();
                let tokens: usize = drafted.iter().map(|o| o.decode_tokens()).sum();
                assert_eq!(
                    steps as u64 + s.accepted_tokens,
                    tokens as u64,
                    "{what}: {s:?}"
                );
            }
        }
    }
}

/// `sluiced run --json` of a chat prompt, greedy.
fn run_json(store: &str, extra: &[&str]) -> serde_json::Value {
    run_json_env(store, extra, &[])
}

/// `run_json` with environment variables for `sluiced`.
fn run_json_env(store: &str, extra: &[&str], env: &[(&str, &str)]) -> serde_json::Value {
    let mut args = vec![
        "run",
        store,
        "--prompt",
        "Write a short story about a lighthouse keeper who finds a message in a bottle.",
        "--max-tokens",
        "40",
        "--temperature",
        "0",
        "--max-context",
        "256",
        "--ignore-eos",
        "--json",
    ];
    args.extend_from_slice(extra);
    let o = std::process::Command::new(bin("sluiced"))
        .args(&args)
        .envs(env.iter().copied())
        .env("RUST_LOG", "warn")
        .output()
        .expect("spawn sluiced");
    assert!(o.status.success(), "{args:?}: {}", stderr(&o));
    serde_json::from_str(&stdout(&o)).expect("run --json")
}

#[test]
fn real_models_text_is_the_same_with_a_draft_model_resident_and_streamed() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let smol = tmp.path().join("smollm2");
    let gemma = tmp.path().join("gemma3");
    let path = |p: &Path| p.to_str().expect("path").to_string();
    sluiced_ok(&[
        "pack",
        smollm2_gguf().to_str().expect("p"),
        "-o",
        &path(&smol),
    ]);
    sluiced_ok(&[
        "pack",
        gemma3_gguf().to_str().expect("p"),
        "-o",
        &path(&gemma),
    ]);
    // Both GGUFs are quantized already (nothing here to make a lighter copy from), so each
    // model drafts for itself: the draft's cache, catch-up and positions on the real
    // architectures (Gemma's sliding windows and 262k vocabulary), resident and beside a
    // streamed target in one budget. Rejections are the tiny models' test's (seeded).
    for (target, budget) in [(&smol, "160MiB"), (&gemma, "480MiB")] {
        let draft = target;
        for (placement, extra) in [
            ("resident", &[][..]),
            ("streamed", &["--device-memory", budget][..]),
        ] {
            for parallel in ["1", "2"] {
                let what = format!("{} {placement} --parallel {parallel}", path(target));
                let mut plain_args = extra.to_vec();
                plain_args.extend(["--parallel", parallel]);
                let plain = run_json(&path(target), &plain_args);
                let d = path(draft);
                let mut args = plain_args.clone();
                args.extend(["--draft", &d, "--draft-fixed"]);
                let drafted = run_json(&path(target), &args);
                if placement == "streamed" {
                    assert!(
                        drafted["layers_streamed"].as_u64().expect("n") > 0,
                        "{what}"
                    );
                }
                assert_eq!(plain["sequences"], drafted["sequences"], "{what}");
                let s = &drafted["speculative"];
                assert!(s["accepted_tokens"].as_u64().expect("n") > 0, "{what}: {s}");
                assert!(s["draft_passes"].as_u64().expect("n") > 0, "{what}: {s}");
                assert!(
                    drafted["decode_passes"].as_u64() < plain["decode_passes"].as_u64(),
                    "{what}: {} passes drafted, {} plain",
                    drafted["decode_passes"],
                    plain["decode_passes"]
                );
            }
        }
    }
}

#[test]
fn a_draft_of_another_vocabulary_or_too_big_to_stay_resident_is_refused() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let llama = pack_store(
        &fixture("tiny-llama"),
        &tmp.path().join("l"),
        "none",
        1 << 20,
    );
    let qwen = pack_store(
        &fixture("tiny-gemma3"),
        &tmp.path().join("q"),
        "none",
        1 << 20,
    );
    let (l, q) = (
        llama.dir().to_str().expect("p"),
        qwen.dir().to_str().expect("p"),
    );
    let e = sluiced_err(&["run", l, "--prompt-ids", "1,2,3", "--draft", q]);
    assert!(
        e.contains("cannot draft for this model") && e.contains("384 tokens"),
        "{e}"
    );
    let e = sluiced_err(&[
        "run",
        l,
        "--prompt-ids",
        "1,2,3",
        "--draft",
        "/nonexistent/store",
    ]);
    assert!(
        e.contains("--draft /nonexistent/store") && e.contains("ngram"),
        "{e}"
    );
    let smol = tmp.path().join("smollm2");
    let smol = smol.to_str().expect("p");
    sluiced_ok(&["pack", smollm2_gguf().to_str().expect("p"), "-o", smol]);
    let e = sluiced_err(&[
        "run",
        smol,
        "--prompt-ids",
        "1,2,3",
        "--max-context",
        "256",
        "--draft",
        smol,
        "--device-memory",
        "64MiB",
    ]);
    assert!(
        e.contains("must be resident") && e.contains("--quantize"),
        "{e}"
    );
}

fn chat(d: &Daemon, n: u32) -> serde_json::Value {
    let body = serde_json::json!({
        "model": "smollm2",
        "messages": [{"role": "user", "content": "Write a short story about a lighthouse keeper."}],
        "max_tokens": 32,
        "temperature": 0,
        "n": n,
    });
    let (code, out) = post_json(&d.http, "/v1/chat/completions", &body.to_string());
    assert_eq!(code, 200, "{out}");
    serde_json::from_str(&out).expect("completion JSON")
}

#[test]
fn the_daemon_drafts_with_a_model_and_answers_as_without() {
    let plain = Daemon::start(&[]);
    let store = plain.store();
    let drafted = Daemon::start(&[
        "--draft",
        store.to_str().expect("path"),
        "--draft-max",
        "6",
        "--draft-fixed",
        "--draft-branches",
        "2",
    ]);
    for n in [1, 2] {
        let (a, b) = (chat(&plain, n), chat(&drafted, n));
        for i in 0..n as usize {
            let text = &a["choices"][i]["message"]["content"];
            assert!(text.as_str().is_some_and(|t| !t.is_empty()), "{a}");
            assert_eq!(
                text, &b["choices"][i]["message"]["content"],
                "choice {i} of {n}"
            );
        }
    }
    // The model drafting for itself (`--draft self:TYPE`), its copy made in the cache (the
    // serving path: everything resident and shared here; streaming is `run`'s test's).
    let cache = tempfile::tempdir().expect("tempdir");
    let cache_dir = cache.path().to_str().expect("path");
    let own = Daemon::start_env(
        &["--draft", "self:q8_0", "--draft-fixed"],
        &[("SLUICE_CACHE", cache_dir)],
    );
    for n in [1, 2] {
        let (a, b) = (chat(&plain, n), chat(&own, n));
        for i in 0..n as usize {
            let text = |c: &serde_json::Value| c["choices"][i]["message"]["content"].clone();
            assert_eq!(text(&a), text(&b), "self-draft: choice {i} of {n}");
        }
    }
    let st = grpc_status(&own);
    // Status names the drafter as --draft did.
    assert_eq!(st["speculative"]["drafter"], "self:q8_0", "{st}");
    let accepted = st["speculative"]["acceptedTokens"].as_str().unwrap_or("0");
    assert!(accepted.parse::<u64>().unwrap_or(0) > 0, "{st}");
    let st = grpc_status(&drafted);
    let spec = &st["speculative"];
    assert_eq!(spec["drafter"], store.to_str().expect("path"), "{st}");
    let count = |k: &str| -> u64 { spec[k].as_str().unwrap_or("0").parse().unwrap_or(0) };
    assert!(count("acceptedTokens") > 0, "{spec}");
    // The draft model's passes and its share of the time.
    assert!(count("draftPasses") > 0, "{spec}");
    let secs = |k: &str| spec[k].as_f64().unwrap_or(0.0);
    assert!(
        secs("draftSeconds") > 0.0 && secs("passSeconds") > 0.0,
        "{spec}"
    );
}

/// Every tensor of `a` and `b`, unit by unit, by name: the same bytes.
fn same_tensors(a: &Store, b: &Store) {
    let read = |s: &Store, u: usize| -> Vec<u8> {
        let file = s.open_weights().expect("weights");
        let mut dec = s
            .frame_decoder(s.manifest().frame_raw_len_max() as usize)
            .expect("decoder");
        let mut out = vec![0u8; s.units()[u].raw_len as usize];
        s.read_unit(&file, u, &mut Vec::new(), &mut out, &mut dec)
            .expect("read unit");
        out
    };
    assert_eq!(a.units().len(), b.units().len());
    for u in 0..a.units().len() {
        let (ra, rb) = (read(a, u), read(b, u));
        for (ta, tb) in a.units()[u].tensors.iter().zip(&b.units()[u].tensors) {
            assert_eq!((&ta.name, ta.dtype), (&tb.name, tb.dtype));
            let bytes = |r: &[u8], t: &sluice::store::TensorEntry| -> Vec<u8> {
                r[t.offset as usize..(t.offset + t.len) as usize].to_vec()
            };
            assert!(bytes(&ra, ta) == bytes(&rb, tb), "{} differs", ta.name);
        }
    }
}

/// `--draft self:q8_0` on every architecture, with a device budget that streams part of
/// the model: the quantized copy is `pack --quantize`'s, tensor for tensor, made once; the
/// draft runs the units the model keeps resident from the model's own memory and holds
/// copies of the streamed ones only, within the plan; the text is the model's own.
#[test]
fn a_self_draft_shares_the_resident_units_and_its_text_is_the_text_without_on_every_architecture() {
    use sluice::engine::draft_model::{with_draft, DraftSource};
    use sluice::engine::self_draft;
    let tmp = tempfile::tempdir().expect("tempdir");
    let greedy = SamplingParams {
        temperature: 0.0,
        ..SamplingParams::default()
    };
    let chosen = sluice::engine::Chosen::Cpu { why: String::new() };
    let plan = |m: &sluice::store::Manifest, i: &sluice::plan::PlanInput| {
        sluice::engine::plan_for(&chosen, m, i, &small_io(), 2)
    };
    let make = |s: &Arc<Store>, i: &sluice::plan::PlanInput| {
        sluice::engine::cpu_runner(s.clone(), i, 2, small_io(), Default::default())
    };
    for src in TINY_ARCHS {
        let dir = tmp.path().join(src);
        let target = pack_store(&fixture(src), &dir.join("t"), "none", 1 << 20);
        let cache = dir.join("cache");
        let q = self_draft::quantized_store(&target, sluice::dtype::DType::Q8_0, 2, Some(&cache))
            .expect("quantized copy");
        let packed = dir.join("p");
        sluiced_ok(&[
            "pack",
            fixture(src).to_str().expect("path"),
            "-o",
            packed.to_str().expect("path"),
            "--quantize",
            "q8_0",
        ]);
        same_tensors(&q, &Store::open(&packed).expect("packed copy"));
        let again =
            self_draft::quantized_store(&target, sluice::dtype::DType::Q8_0, 2, Some(&cache))
                .expect("found again");
        assert_eq!(again.dir(), q.dir(), "{src}: made once");
        for n in [1, 3] {
            let what = format!("{src} batch {n}");
            let opts = |verify_rows| ModelOptions {
                max_context: 128,
                kv_slots: n,
                max_batch_tokens: 64,
                kv_dtype: sluice::engine::kv_dtype_for(false, None),
                exact: false,
                verify_rows,
            };
            // Room for the model whole, and for the draft's own decoder: the copies then
            // push some of the model's units out to stream.
            let whole = plan(target.manifest(), &plan_input(opts(n * MODEL.rows())))
                .expect("plan")
                .device_bytes();
            let (draft_fixed, _) = sluice::plan::decoder_bytes(q.manifest(), &opts(0));
            let mut input = plan_input(opts(n * MODEL.rows()));
            input.device_budget = Some(whole + draft_fixed);
            let source = DraftSource::SelfDraft(q.clone());
            let (mut runner, dm) = with_draft(&make, &plan, &target, Some(&source), &input)
                .unwrap_or_else(|e| panic!("{what}: {e}"));
            let mut dm = dm.expect("a self-draft");
            let (resident, streamed) =
                (runner.plan.layers_resident(), runner.plan.layers_streamed());
            assert!(
                resident > 0 && streamed > 0,
                "{what}: {resident} resident, {streamed} streamed"
            );
            assert!(
                dm.describe().contains(&format!("{resident} units shared")),
                "{what}: {}",
                dm.describe()
            );
            let mut plain = make(&target, &{
                let mut i = plan_input(opts(0));
                i.device_budget = input.device_budget;
                i
            })
            .expect("plain runner");
            let prompt = [1, 5, 9, 2, 7, 3, 8, 4];
            let a = generate_with(
                &mut plain,
                None,
                &Tokenizer::from_manifest(target.manifest()).expect("tok"),
                &prompt,
                &params(greedy, None),
                n,
                |_| {},
            )
            .expect("plain");
            let tok = Tokenizer::from_manifest(target.manifest()).expect("tok");
            let b = generate_with(
                &mut runner,
                Some(&mut dm),
                &tok,
                &prompt,
                &params(greedy, Some(MODEL)),
                n,
                |_| {},
            )
            .expect("self-drafted");
            for (x, y) in a.iter().zip(&b) {
                assert_eq!(x.generated_token_ids, y.generated_token_ids, "{what}");
            }
            let s = total(&b);
            assert!(s.accepted_tokens > 0 && dm.passes > 0, "{what}: {s:?}");
            // The draft's memory is the model's plan's, and within it: the copies of the
            // streamed units only (the shared ones cost nothing).
            let budget = sluice::backend::Backend::budget(&runner.backend);
            assert!(budget.peak() <= runner.plan.device_bytes(), "{what}");
            let (fixed, raw) = sluice::plan::decoder_bytes(q.manifest(), &opts(0));
            let copies: u64 = (0..raw.len())
                .filter(|&u| runner.plan.placement(u) != sluice::plan::Placement::Resident)
                .map(|u| raw[u])
                .sum();
            assert!(
                fixed + copies <= runner.plan.self_draft_bytes
                    && runner.plan.self_draft_bytes < fixed + raw.iter().sum::<u64>(),
                "{what}: {} reserved for {fixed} + {copies}",
                runner.plan.self_draft_bytes
            );
        }
    }
}

/// `sluiced run --draft self:q8_0` on SmolLM2 streamed within a host budget: the text is
/// the model's own, the quantized copy is made once in the cache directory, and a type
/// nothing quantizes to is refused with the ones there are.
#[test]
fn real_model_self_draft_gives_the_text_without() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let smol = tmp.path().join("smollm2");
    let smol = smol.to_str().expect("p");
    sluiced_ok(&["pack", smollm2_gguf().to_str().expect("p"), "-o", smol]);
    let cache = tmp.path().join("cache");
    let env = [("SLUICE_CACHE", cache.to_str().expect("path"))];
    let run = |extra: &[&str]| {
        let mut args = vec!["--host-memory", "160MiB"];
        args.extend_from_slice(extra);
        run_json_env(smol, &args, &env)
    };
    let plain = run(&[]);
    for _ in 0..2 {
        let drafted = run(&["--draft", "self:q8_0", "--draft-fixed"]);
        assert_eq!(plain["sequences"], drafted["sequences"]);
        assert!(
            drafted["layers_streamed"].as_u64().expect("n") > 0,
            "{drafted}"
        );
        let s = &drafted["speculative"];
        assert!(s["accepted_tokens"].as_u64().expect("n") > 0, "{s}");
        assert!(
            drafted["host_bytes_peak"].as_u64() <= drafted["host_bytes_budget"].as_u64(),
            "{drafted}"
        );
    }
    let made: Vec<_> = std::fs::read_dir(cache.join("self-draft"))
        .expect("the copies' directory")
        .collect();
    assert_eq!(made.len(), 1, "one copy, made once: {made:?}");
    let e = sluiced_err(&["run", smol, "--prompt-ids", "1,2,3", "--draft", "self:f16"]);
    assert!(e.contains("self:TYPE") && e.contains("q8_0"), "{e}");
}
