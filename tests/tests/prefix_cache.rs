//! The prefix cache reuses KV and changes no output: a prompt prefilled after a reused
//! prefix (kept in place, or copied from another slot) has the bits a prefill of the whole
//! prompt gives, on every architecture, across a sliding window's ring (taken only where
//! the ring still holds what the next query reads) and with a one-token rest; the
//! scheduler's greedy outputs are token for token those without the cache for a
//! conversation's turns and for requests sharing a prompt, which report the tokens they
//! did not prefill; and the daemon reports them as OpenAI does, on both real models.

use sluice::backend::cpu::CpuBackend;
use sluice::engine::draft::{DraftConfig, DraftKind};
use sluice::engine::scheduler::{Event, Finish, Request, Scheduler, SchedulerConfig};
use sluice::engine::sequence::GenerateParams;
use sluice::model::{ModelOptions, SeqStep};
use sluice::pipeline::Pipeline;
use sluice::text::{SamplingParams, Tokenizer};
use sluice_tests::*;
use std::path::Path;
use std::sync::Arc;
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

/// A runner on a tiny model: a context of 128, `batch_tokens` a pass (a window of 8 keeps
/// a ring of 8 + batch_tokens - 1 positions).
fn runner(
    src: &Path,
    dir: &Path,
    exact: bool,
    slots: usize,
    batch_tokens: usize,
) -> Pipeline<CpuBackend> {
    let store = pack_store(src, dir, "zstd:1", 1 << 20);
    let opts = ModelOptions {
        max_context: 128,
        kv_slots: slots,
        max_batch_tokens: batch_tokens,
        kv_dtype: sluice::engine::kv_dtype_for(exact, None),
        exact,
        verify_rows: 0,
    };
    sluice::engine::cpu_runner(store, &plan_input(opts), 2, small_io(), Default::default()).unwrap()
}

/// `runner` with the fast numerics and room for `verify_rows` drafted rows a pass.
fn runner_rows(src: &Path, dir: &Path, slots: usize, verify_rows: usize) -> Pipeline<CpuBackend> {
    let store = pack_store(src, dir, "zstd:1", 1 << 20);
    let opts = ModelOptions {
        max_context: 128,
        kv_slots: slots,
        max_batch_tokens: 64,
        kv_dtype: sluice::engine::kv_dtype_for(false, None),
        exact: false,
        verify_rows,
    };
    sluice::engine::cpu_runner(store, &plan_input(opts), 2, small_io(), Default::default()).unwrap()
}

/// A prompt chunk of `tokens` at `pos` in `slot`.
fn chunk(slot: usize, pos: usize, tokens: &[u32]) -> SeqStep {
    SeqStep {
        slot,
        pos,
        tokens: tokens.to_vec(),
        prompt: true,
        ..Default::default()
    }
}

fn bits(l: &[f32]) -> Vec<u32> {
    l.iter().map(|v| v.to_bits()).collect()
}

/// Prefills `prompt` into `slot` from `from` in chunks of at most `batch` tokens; the
/// last chunk's logits.
fn prefill(
    r: &mut Pipeline<CpuBackend>,
    slot: usize,
    prompt: &[u32],
    from: usize,
    batch: usize,
) -> Vec<u32> {
    let mut logits = Vec::new();
    let mut at = from;
    while at < prompt.len() {
        let end = (at + batch).min(prompt.len());
        r.step(&[chunk(slot, at, &prompt[at..end])], &mut logits)
            .unwrap();
        at = end;
    }
    bits(&logits)
}

#[test]
fn a_prefill_after_a_reused_prefix_has_the_bits_of_the_whole_prefill_on_every_architecture() {
    let tmp = tempfile::tempdir().unwrap();
    // 100 tokens through a ring of 8 + 16 - 1 = 23 positions: the ring wraps four times.
    let prompt: Vec<u32> = (0..100).map(|i| 3 + (i * 37) % 250).collect();
    let batch = 16;
    for src in TINY_ARCHS {
        for exact in [true, false] {
            let what = format!("{src} exact={exact}");
            let dir = tmp.path().join(format!("{src}-{exact}"));
            let mut r = runner(&fixture(src), &dir, exact, 3, batch);
            let arch = &r.store.manifest().arch;
            let ring = (0..arch.n_layers).any(|l| arch.window(l).is_some());
            // Slot 0: the whole prompt.
            let whole = prefill(&mut r, 0, &prompt, 0, batch);
            // A rest of one token takes the prefill kernels as it did in its chunk.
            for k in [99, 90, 37] {
                let resumable = r.model.can_resume(k, prompt.len());
                // A ring of 23 that has seen 100 positions holds 77..100: a query at k
                // sees k - 7..=k, so only k >= 84 can go on from it.
                assert_eq!(resumable, !ring || k >= 84, "{what}: k={k}");
                if !resumable {
                    continue;
                }
                // Slot 1: the prefix copied from slot 0, then the rest prefilled.
                r.copy_kv((0, 1), 0..k, prompt.len());
                let copied = prefill(&mut r, 1, &prompt, k, batch);
                assert_eq!(copied, whole, "{what}: copied prefix of {k}");
            }
            // In place: slot 2 holds another text's KV sharing the first 50 tokens; the
            // prompt goes on from there (what a kept slot gives a new sequence).
            let mut other = prompt[..50].to_vec();
            other.extend((0..30).map(|i| 200 - i));
            prefill(&mut r, 2, &other, 0, batch);
            if r.model.can_resume(50, other.len()) {
                let in_place = prefill(&mut r, 2, &prompt, 50, batch);
                assert_eq!(in_place, whole, "{what}: in place from 50");
            } else {
                assert!(ring, "{what}: a full-attention model always resumes");
            }
        }
    }
}

/// How the requests of a run sample and draft.
#[derive(Clone, Copy)]
struct Decoding {
    sampling: SamplingParams,
    draft: Option<DraftConfig>,
}

fn greedy() -> Decoding {
    Decoding {
        sampling: SamplingParams::default(),
        draft: None,
    }
}

fn submit(
    s: &Scheduler,
    prompt: &[u32],
    max_tokens: usize,
    how: Decoding,
) -> UnboundedReceiver<Event> {
    let (events, rx) = unbounded_channel();
    let params = GenerateParams {
        max_tokens,
        sampling: how.sampling,
        stop: Vec::new(),
        ignore_eos: true,
        logprobs: None,
        logit_bias: Vec::new(),
        format: Default::default(),
        draft: how.draft,
    };
    s.submit(Request {
        prompt_ids: prompt.to_vec(),
        params,
        events,
    })
    .unwrap();
    rx
}

/// A request's generated tokens and the prompt tokens it took from the cache.
fn collect(mut rx: UnboundedReceiver<Event>) -> (Vec<u32>, usize) {
    loop {
        match rx.blocking_recv() {
            Some(Event::Done(d)) => {
                assert_eq!(d.finish, Finish::Length);
                return (d.generated_token_ids, d.cached_tokens);
            }
            Some(Event::Failed { message, .. }) => panic!("{message}"),
            Some(Event::Piece { .. }) => {}
            None => panic!("the engine went away"),
        }
    }
}

/// What one scheduler gives: three turns of a conversation (each prompt the last one, its
/// answer and a new message), then three requests sent at once sharing a long prefix (two
/// the same prompt); per request its tokens and what it took from the cache.
fn conversation(
    r: Pipeline<CpuBackend>,
    prefix_cache: bool,
    how: Decoding,
) -> Vec<(Vec<u32>, usize)> {
    let tok = Arc::new(Tokenizer::from_manifest(r.store.manifest()).unwrap());
    let (s, engine) = Scheduler::start(
        r,
        None,
        tok,
        SchedulerConfig {
            queue_max: 8,
            prefix_cache,
        },
    );
    let mut out = Vec::new();
    let mut prompt: Vec<u32> = (0..20).map(|i| 3 + (i * 37) % 250).collect();
    for turn in 0..3u32 {
        let (answer, cached) = collect(submit(&s, &prompt, 6, how));
        prompt.extend_from_slice(&answer);
        prompt.extend((0..5).map(|i| 100 + 7 * turn + i));
        out.push((answer, cached));
    }
    let shared: Vec<u32> = (0..60).map(|i| 5 + (i * 11) % 240).collect();
    let mut other = shared.clone();
    other.extend([9, 8, 7]);
    let rxs = [
        submit(&s, &shared, 5, how),
        submit(&s, &shared, 5, how),
        submit(&s, &other, 5, how),
    ];
    out.extend(rxs.into_iter().map(collect));
    s.shutdown(std::time::Duration::from_secs(60));
    engine.join().unwrap();
    out
}

#[test]
fn greedy_outputs_with_the_prefix_cache_are_the_outputs_without_on_every_architecture() {
    let tmp = tempfile::tempdir().unwrap();
    for src in TINY_ARCHS {
        let dir = tmp.path().join(src);
        let with = conversation(
            runner(&fixture(src), &dir.join("on"), false, 3, 16),
            true,
            greedy(),
        );
        let without = conversation(
            runner(&fixture(src), &dir.join("off"), false, 3, 16),
            false,
            greedy(),
        );
        for (i, (a, b)) in with.iter().zip(&without).enumerate() {
            assert_eq!(a.0, b.0, "{src}: request {i}'s tokens");
            assert_eq!(b.1, 0, "{src}: request {i} reused KV with the cache off");
        }
        let cached: Vec<usize> = with.iter().map(|w| w.1).collect();
        // Turn 1 finds nothing; turns 2 and 3 find the conversation so far, at least the
        // previous prompt (a ring model's too: the new message is short).
        assert_eq!(cached[0], 0, "{src}: {cached:?}");
        assert!(cached[1] >= 20 && cached[2] >= 31, "{src}: {cached:?}");
        // The three sent at once share 60 tokens: each is computed once and copied to the
        // other two (59 of them for the two whole prompts: the last always runs), whichever
        // sequence computes which chunk, except where less than WAIT_MIN (32) of the shared
        // part is left to compute: there each computes it beside the others rather than
        // lose a pass waiting (up to 31 tokens each for two of them).
        let at_once: usize = cached[3..].iter().sum();
        assert!(at_once >= 2 * 59 - 2 * 31, "{src}: {cached:?}");
    }
}

#[test]
fn seeded_sampling_and_drafted_token_trees_with_the_prefix_cache_give_the_tokens_without() {
    // Seeded sampling draws from the same logits with the cache as without; with ngram
    // token trees, a sequence can end with an accepted path whose KV has not moved into
    // place yet, which its slot must not keep as if it had.
    let sampled = Decoding {
        sampling: SamplingParams {
            temperature: 0.9,
            seed: 7,
            ..SamplingParams::default()
        },
        draft: None,
    };
    let tree = DraftConfig {
        kind: DraftKind::Ngram,
        max: 6,
        fixed: true,
        branches: 3,
    };
    let drafted = Decoding {
        draft: Some(tree),
        ..greedy()
    };
    let tmp = tempfile::tempdir().unwrap();
    for src in ["tiny-llama", "tiny-gemma3", "tiny-gptoss"] {
        for (k, how) in [sampled, drafted].into_iter().enumerate() {
            let dir = tmp.path().join(format!("{src}-{k}"));
            let rows = 3 * tree.rows();
            let with = conversation(
                runner_rows(&fixture(src), &dir.join("on"), 3, rows),
                true,
                how,
            );
            let without = conversation(
                runner_rows(&fixture(src), &dir.join("off"), 3, rows),
                false,
                how,
            );
            for (i, (a, b)) in with.iter().zip(&without).enumerate() {
                assert_eq!(a.0, b.0, "{src} ({k}): request {i}'s tokens");
            }
            assert!(with[1].1 > 0 && with[2].1 > 0, "{src} ({k}): {with:?}");
        }
    }
}

#[test]
fn sluiced_run_parallel_sequences_share_the_prompt_and_decode_as_without() {
    let tmp = tempfile::tempdir().unwrap();
    let store = tmp.path().join("smollm2");
    pack_lz4(&smollm2_gguf(), &store);
    let run = |cache: &str| -> serde_json::Value {
        let out = sluiced_ok(&[
            "run",
            store.to_str().unwrap(),
            "--chat",
            "--prompt",
            "Write a list of five fruits and say which is the sweetest.",
            "--max-tokens",
            "24",
            "--temperature",
            "0",
            "--parallel",
            "3",
            "--prefix-cache",
            cache,
            "--json",
        ]);
        serde_json::from_str(&out).unwrap()
    };
    let (on, off) = (run("on"), run("off"));
    let prompt = on["prompt_tokens"].as_u64().unwrap();
    assert_eq!(off["cached_tokens"], 0, "{off}");
    assert_eq!(
        on["cached_tokens"].as_u64().unwrap(),
        2 * (prompt - 1),
        "{on}"
    );
    for i in 0..3 {
        assert_eq!(
            on["sequences"][i]["generated_token_ids"], off["sequences"][i]["generated_token_ids"],
            "sequence {i}"
        );
    }
}

/// A two-turn conversation through the daemon's HTTP API: each turn's answer and usage.
/// `chat`: as messages (the model's template renders them); else as one growing prompt
/// on /v1/completions (Gemma 3 270M is a base model, without a template).
fn turns(d: &Daemon, model: &str, chat: bool) -> Vec<(String, serde_json::Value)> {
    let first = "Name three rivers in Europe.";
    let mut messages = vec![serde_json::json!({"role": "user", "content": first})];
    let mut prompt = format!("Question: {first}\nAnswer:");
    let mut out = Vec::new();
    for next in ["Which of them is the longest?", "And the shortest?"] {
        let (path, mut body) = if chat {
            (
                "/v1/chat/completions",
                serde_json::json!({"messages": messages}),
            )
        } else {
            ("/v1/completions", serde_json::json!({"prompt": prompt}))
        };
        body["model"] = model.into();
        body["max_tokens"] = 24.into();
        body["temperature"] = 0.into();
        let (code, text) = post_json(&d.http, path, &body.to_string());
        assert_eq!(code, 200, "{text}");
        let j: serde_json::Value = serde_json::from_str(&text).unwrap();
        let c = &j["choices"][0];
        let answer = c["message"]["content"]
            .as_str()
            .or(c["text"].as_str())
            .unwrap()
            .to_string();
        messages.push(serde_json::json!({"role": "assistant", "content": answer}));
        messages.push(serde_json::json!({"role": "user", "content": next}));
        prompt = format!("{prompt}{answer}\nQuestion: {next}\nAnswer:");
        out.push((answer, j["usage"].clone()));
    }
    out
}

#[test]
fn the_daemon_reuses_a_conversations_kv_on_both_real_models_and_reports_it() {
    for (name, gguf) in [("smollm2", smollm2_gguf()), ("gemma3", gemma3_gguf())] {
        let start = |extra: &[&str]| {
            let tmp = tempfile::tempdir().unwrap();
            let store = tmp.path().join(name);
            pack_lz4(&gguf, &store);
            let store = store.to_str().unwrap().to_string();
            let mut args = vec!["--max-context", "1024"];
            args.extend_from_slice(extra);
            Daemon::serve(tmp, &["--model", &store], &args)
        };
        let on = start(&[]);
        let off = start(&["--prefix-cache", "off"]);
        let chat = name == "smollm2";
        let (a, b) = (turns(&on, name, chat), turns(&off, name, chat));
        for (turn, (x, y)) in a.iter().zip(&b).enumerate() {
            assert_eq!(x.0, y.0, "{name}: turn {turn}'s answer");
            assert_eq!(
                x.1["prompt_tokens"], y.1["prompt_tokens"],
                "{name}: turn {turn}"
            );
            assert_eq!(y.1["prompt_tokens_details"]["cached_tokens"], 0, "{name}");
        }
        assert_eq!(
            a[0].1["prompt_tokens_details"]["cached_tokens"], 0,
            "{name}"
        );
        // The second turn's prompt begins with the first's, which the slot kept.
        let first = a[0].1["prompt_tokens"].as_u64().unwrap();
        let cached = a[1].1["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap();
        assert!(
            cached >= first - 1,
            "{name}: {cached} of the first turn's {first}: {:?}",
            a[1].1
        );
        // Status (grpcurl) and /metrics count it.
        let st = grpc_status(&on);
        let pc = &st["prefixCache"];
        assert_eq!(pc["enabled"], true, "{st}");
        let count = |k: &str| -> u64 { pc[k].as_str().unwrap_or("0").parse().unwrap() };
        assert_eq!(count("hits"), 1, "{pc}");
        assert_eq!(count("cachedTokens"), cached, "{pc}");
        let metrics = stdout(&curl(&["-s", &format!("{}/metrics", on.http)]));
        assert!(
            metrics.contains(&format!("sluice_prefix_cache_cached_tokens_total {cached}")),
            "{metrics}"
        );
        // `sluice ps` shows the KV it keeps.
        let ps = |json: bool| -> String {
            let mut args = vec!["--addr", &on.addr, "ps"];
            if json {
                args.push("--json");
            }
            let o = std::process::Command::new(bin("sluice"))
                .args(&args)
                .output()
                .unwrap();
            assert!(o.status.success(), "{}", stderr(&o));
            stdout(&o)
        };
        let kept = |text: String| -> u64 {
            let j: serde_json::Value = serde_json::from_str(text.trim()).unwrap();
            j["prefix_cache_bytes"].as_u64().unwrap()
        };
        // (Status is published after the step that ended a request: it may lag a moment.)
        let t0 = std::time::Instant::now();
        while kept(ps(true)) == 0 {
            assert!(t0.elapsed().as_secs() < 10, "{name}: ps shows no prefix KV");
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        assert!(ps(false).contains("PREFIX KV"), "{name}");
        // `sluice cache clear` empties it: the same conversation then reuses nothing, and
        // answers the same.
        let o = std::process::Command::new(bin("sluice"))
            .args(["--addr", &on.addr, "cache", "clear"])
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", stderr(&o));
        assert!(
            stdout(&o).contains(&format!("{name}: prefix cache emptied")),
            "{}",
            stdout(&o)
        );
        assert!(
            grpc_status(&on)["prefixCache"]["keptSlots"].is_null(),
            "kept slots after a clear"
        );
        assert_eq!(kept(ps(true)), 0, "{name}");
        let again = turns(&on, name, chat);
        assert_eq!(again[0].0, a[0].0, "{name}");
        assert_eq!(
            again[0].1["prompt_tokens_details"]["cached_tokens"], 0,
            "{name}"
        );
        // The same over HTTP, behind the same key as every request; a body must be an
        // object naming a model, or nothing.
        let (code, body) = post_json(&on.http, "/v1/cache/clear", "");
        assert_eq!(code, 200, "{body}");
        let j: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(j["cleared"][0]["model"], name, "{j}");
        assert!(j["cleared"][0]["positions"].as_u64().unwrap() > 0, "{j}");
        let (code, body) = post_json(&on.http, "/v1/cache/clear", "[1]");
        assert_eq!(code, 400, "{body}");
        let (code, body) = post_json(&on.http, "/v1/cache/clear", r#"{"model": "nope"}"#);
        assert_eq!(code, 404, "{body}");
    }
}
