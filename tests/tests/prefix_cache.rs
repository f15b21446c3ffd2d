//! The prefix cache reuses KV and changes no output: a prompt prefilled after a reused
//! prefix (kept in place, or copied from another slot) has the bits a prefill of the whole
//! prompt gives, on every architecture, across a sliding window's ring (taken only where
//! the ring still holds what the next query reads) and with a one-token rest; the
//! scheduler's greedy outputs are token for token those without the cache for a
//! conversation's turns and for requests sharing a prompt, which report the tokens they
//! did not prefill; and the daemon reports them as OpenAI does, on both real models.

use sluice::backend::cpu::CpuBackend;
use sluice::engine::draft::{DraftConfig, DraftKind};
use sluice::engine::scheduler::{Scheduler, SchedulerConfig};
use sluice::model::{ModelOptions, SeqStep};
use sluice::pipeline::Pipeline;
use sluice::text::{SamplingParams, Tokenizer};
use sluice_tests::engine::*;
use sluice_tests::*;
use std::path::Path;
use std::sync::Arc;

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
            kv_tiers: Default::default(),
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

/// A conversation through the daemon's HTTP API. `chat`: as messages (the model's template
/// renders them); else as one growing prompt on /v1/completions (Gemma 3 270M is a base
/// model, without a template).
struct Conversation {
    chat: bool,
    messages: Vec<serde_json::Value>,
    prompt: String,
    next: usize,
}

const QUESTIONS: [&str; 3] = [
    "Name three rivers in Europe.",
    "Which of them is the longest?",
    "And the shortest?",
];

impl Conversation {
    fn new(chat: bool) -> Conversation {
        let first = QUESTIONS[0];
        Conversation {
            chat,
            messages: vec![serde_json::json!({"role": "user", "content": first})],
            prompt: format!("Question: {first}\nAnswer:"),
            next: 1,
        }
    }

    /// Sends the conversation so far to `d`; the answer and its usage.
    fn turn(&mut self, d: &Daemon, model: &str) -> (String, serde_json::Value) {
        let (path, mut body) = if self.chat {
            (
                "/v1/chat/completions",
                serde_json::json!({"messages": self.messages}),
            )
        } else {
            (
                "/v1/completions",
                serde_json::json!({"prompt": self.prompt}),
            )
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
        let next = QUESTIONS[self.next];
        self.next += 1;
        self.messages
            .push(serde_json::json!({"role": "assistant", "content": answer}));
        self.messages
            .push(serde_json::json!({"role": "user", "content": next}));
        self.prompt = format!("{}{answer}\nQuestion: {next}\nAnswer:", self.prompt);
        (answer, j["usage"].clone())
    }
}

/// A two-turn conversation on one daemon: each turn's answer and usage.
fn turns(d: &Daemon, model: &str, chat: bool) -> Vec<(String, serde_json::Value)> {
    let mut c = Conversation::new(chat);
    (0..2).map(|_| c.turn(d, model)).collect()
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

// ---- The host and disk tiers ----

use sluice::engine::kv_block::BLOCK_TOKENS;
use sluice::engine::kv_disk::DiskTier;
use sluice::engine::kv_tiers::{TierConfig, Tiers};
use sluice::engine::prefix::PrefixStats;
use sluice::engine::sequence::{SeqLimits, Sequence};

fn sequence(prompt: &[u32], slot: usize) -> Sequence {
    let limits = SeqLimits {
        max_context: 128,
        vocab: 256,
    };
    Sequence::new(prompt.to_vec(), params(4, greedy()), slot, limits).unwrap()
}

#[test]
fn kv_blocks_taken_back_from_the_tiers_give_the_bits_of_a_whole_prefill_on_every_architecture() {
    let tmp = tempfile::tempdir().unwrap();
    // 100 tokens through a ring of 8 + 16 - 1 = 23 positions: blocks exported from it
    // hold the ring layers only for positions 77 on.
    let prompt: Vec<u32> = (0..100).map(|i| 3 + (i * 37) % 250).collect();
    let batch = 16;
    for src in TINY_ARCHS {
        for exact in [true, false] {
            let what = format!("{src} exact={exact}");
            let mut r = runner(&fixture(src), &tmp.path().join(&what), exact, 3, batch);
            let arch = &r.store.manifest().arch;
            let ring = (0..arch.n_layers).any(|l| arch.window(l).is_some());
            let whole = prefill(&mut r, 0, &prompt, 0, batch);
            let tiers = TierConfig {
                host_bytes: 64 << 20,
                disk: None,
            };
            let mut t = Tiers::new(&r, &tiers).unwrap();
            t.export(&r, &prompt, 0, prompt.len());
            assert_eq!(t.stats().host_blocks, 6, "{what}");
            // Six whole blocks (96 positions); a query at 96 sees 89.. in a ring, which
            // block 5 (80..96) holds.
            let mut s = sequence(&prompt, 1);
            assert_eq!(t.take(&mut r, &mut s, 0), 96, "{what}");
            assert_eq!((s.prefilled(), s.cached()), (96, 96), "{what}");
            assert!(r.model.can_resume(96, s.written()), "{what}");
            assert_eq!(
                prefill(&mut r, 1, &prompt, 96, batch),
                whole,
                "{what}: slot 1"
            );
            // Nothing is taken that is not at least a block past what the slot has.
            let mut again = sequence(&prompt, 2);
            assert_eq!(t.take(&mut r, &mut again, 90), 0, "{what}");
            // A prompt sharing 70 tokens shares four whole blocks (64); at 64 a ring's
            // window needs block 3 (48..64), which no exported block holds ring layers for:
            // a ring model takes nothing, the others take 64 and prefill the rest to the
            // bits of a whole prefill.
            let mut other = prompt[..70].to_vec();
            other.extend((0..20).map(|i| 240 - i));
            let want = prefill(&mut r, 2, &other, 0, batch);
            let mut s = sequence(&other, 1);
            let took = t.take(&mut r, &mut s, 0);
            assert_eq!(took, if ring { 0 } else { 64 }, "{what}");
            assert_eq!(
                prefill(&mut r, 1, &other, took, batch),
                want,
                "{what}: the shorter prefix"
            );
        }
    }
}

/// Runs `turns` (their numbers) of a conversation on a scheduler with one KV slot and `tiers`, a request
/// with another text after each turn (which takes the slot the conversation kept, so the
/// next turn finds its prefix only in the tiers); per turn its tokens and cached prompt
/// tokens, and the cache's counts once the engine is done.
fn tiered(
    r: Pipeline<CpuBackend>,
    (prefix_cache, tiers): (bool, TierConfig),
    prompt: &mut Vec<u32>,
    turns: std::ops::Range<u32>,
) -> (Vec<(Vec<u32>, usize)>, PrefixStats) {
    let tok = Arc::new(Tokenizer::from_manifest(r.store.manifest()).unwrap());
    let cfg = SchedulerConfig {
        queue_max: 8,
        prefix_cache,
        kv_tiers: tiers,
    };
    let (s, engine) = Scheduler::start(r, None, tok, cfg);
    let mut out = Vec::new();
    for turn in turns {
        let (answer, cached) = collect(submit(&s, prompt, 6, greedy()));
        prompt.extend_from_slice(&answer);
        prompt.extend((0..5).map(|i| 100 + 7 * turn + i));
        out.push((answer, cached));
        let intruder: Vec<u32> = (0..30).map(|i| 200 - i - turn).collect();
        collect(submit(&s, &intruder, 2, greedy()));
    }
    s.shutdown(std::time::Duration::from_secs(60));
    engine.join().unwrap();
    (out, s.status().prefix_cache)
}

fn first_prompt() -> Vec<u32> {
    (0..40).map(|i| 3 + (i * 37) % 250).collect()
}

#[test]
fn the_host_and_disk_tiers_change_no_output_and_a_restart_resumes_from_disk_on_every_architecture()
{
    let tmp = tempfile::tempdir().unwrap();
    for src in TINY_ARCHS {
        let dir = tmp.path().join(src);
        // A pass of 64 tokens: a window of 8 keeps a ring of 71, so these short
        // conversations' blocks hold every layer.
        let run = |name: &str, cache: (bool, TierConfig), turns, prompt: &mut Vec<u32>| {
            tiered(
                runner(&fixture(src), &dir.join(name), false, 1, 64),
                cache,
                prompt,
                turns,
            )
        };
        let mut p = first_prompt();
        let (off, st) = run("off", (false, TierConfig::default()), 0..4, &mut p);
        assert_eq!(st.cached_tokens, 0, "{src}");
        let host = TierConfig {
            host_bytes: 16 << 20,
            disk: None,
        };
        let (on, st) = run("host", (true, host), 0..4, &mut first_prompt());
        let want: Vec<&Vec<u32>> = off.iter().map(|o| &o.0).collect();
        let got: Vec<&Vec<u32>> = on.iter().map(|o| &o.0).collect();
        assert_eq!(got, want, "{src}: host tier");
        // Turn 2 on: the previous turn's text (40 + 6 - 1 positions, then + 11 a turn) in
        // whole blocks, from host memory.
        let cached: Vec<usize> = on.iter().map(|o| o.1).collect();
        assert_eq!(cached, [0, 32, 48, 64], "{src}: host tier");
        assert_eq!(st.tiers.host_hits, 3, "{src}: {st:?}");
        assert!(
            st.tiers.host_bytes <= 16 << 20 && st.tiers.host_blocks >= 4,
            "{src}"
        );
        // The disk tier alone, and across a restart: two turns, then a new scheduler over
        // the same directory goes on with turns three and four.
        let kv = dir.join("kv");
        let disk = || TierConfig {
            host_bytes: 0,
            disk: Some(DiskTier::open(&kv, 64 << 20).unwrap()),
        };
        let mut p = first_prompt();
        let (mut on, _) = run("disk1", (true, disk()), 0..2, &mut p);
        let (after, st) = run("disk2", (true, disk()), 2..4, &mut p);
        on.extend(after);
        let got: Vec<&Vec<u32>> = on.iter().map(|o| &o.0).collect();
        assert_eq!(got, want, "{src}: disk tier");
        let cached: Vec<usize> = on.iter().map(|o| o.1).collect();
        assert_eq!(cached, [0, 32, 48, 64], "{src}: disk tier");
        assert_eq!(
            (st.tiers.disk_hits, st.tiers.disk.read_errors),
            (2, 0),
            "{src}"
        );
    }
}

#[test]
fn blocks_on_disk_are_never_reused_under_another_store_kv_type_or_numerics() {
    let tmp = tempfile::tempdir().unwrap();
    let kv = tmp.path().join("kv");
    let disk = || TierConfig {
        host_bytes: 0,
        disk: Some(DiskTier::open(&kv, 64 << 20).unwrap()),
    };
    let src = fixture("tiny-llama");
    let mut p = first_prompt();
    let r = runner(&src, &tmp.path().join("a"), false, 1, 64);
    tiered(r, (true, disk()), &mut p, 0..1);
    // The same store and numerics again: the first turn's blocks are found.
    let mut q = p.clone();
    let r = runner(&src, &tmp.path().join("a"), false, 1, 64);
    let (same, _) = tiered(r, (true, disk()), &mut q, 1..2);
    assert_eq!(same[0].1, 32);
    // The reference numerics (an f32 KV cache, exact matmuls): nothing.
    let mut q = p.clone();
    let r = runner(&src, &tmp.path().join("a"), true, 1, 64);
    let (exact, st) = tiered(r, (true, disk()), &mut q, 1..2);
    assert_eq!((exact[0].1, st.tiers.disk_hits), (0, 0));
    // An f32 KV cache with the fast numerics: nothing.
    let mut q = p.clone();
    let store = pack_store(&src, &tmp.path().join("a"), "zstd:1", 1 << 20);
    let opts = ModelOptions {
        max_context: 128,
        kv_slots: 1,
        max_batch_tokens: 64,
        kv_dtype: sluice::backend::KvDtype::F32,
        exact: false,
        verify_rows: 0,
    };
    let r = sluice::engine::cpu_runner(store, &plan_input(opts), 2, small_io(), Default::default())
        .unwrap();
    let (f32kv, st) = tiered(r, (true, disk()), &mut q, 1..2);
    assert_eq!((f32kv[0].1, st.tiers.disk_hits), (0, 0));
    // The same weights packed another way (another manifest): nothing.
    let mut q = p.clone();
    let r = runner(&src, &tmp.path().join("b"), false, 1, 64);
    let other = pack_store(&src, &tmp.path().join("lz4"), "lz4", 1 << 20);
    assert_ne!(
        std::fs::read(other.dir().join("manifest.bin")).unwrap(),
        std::fs::read(r.store.dir().join("manifest.bin")).unwrap()
    );
    let r = sluice::engine::cpu_runner(
        other,
        &plan_input(*r.options()),
        2,
        small_io(),
        Default::default(),
    )
    .unwrap();
    let (repacked, st) = tiered(r, (true, disk()), &mut q, 1..2);
    assert_eq!((repacked[0].1, st.tiers.disk_hits), (0, 0));
}

/// Whether this process may mount a file system (root with CAP_SYS_ADMIN).
fn mount_tmpfs(at: &Path, bytes: u64) -> bool {
    std::fs::create_dir_all(at).unwrap();
    std::process::Command::new("mount")
        .args(["-t", "tmpfs", "-o", &format!("size={bytes}")])
        .arg("tmpfs")
        .arg(at)
        .status()
        .is_ok_and(|s| s.success())
}

#[test]
fn damaged_files_another_version_a_full_disk_and_a_second_daemon_are_each_a_miss() {
    let tmp = tempfile::tempdir().unwrap();
    let src = fixture("tiny-gemma3");
    let kv = tmp.path().join("kv");
    // Another version's directory is left alone and not read.
    std::fs::create_dir_all(kv.join("v0")).unwrap();
    std::fs::write(kv.join("v0").join("junk.kvb"), b"old").unwrap();
    // Another process holding the directory's lock (as a second daemon would) is named.
    let other = tmp.path().join("other");
    std::fs::create_dir_all(&other).unwrap();
    let lock = other.join("lock");
    let mut holder = std::process::Command::new("sh")
        .arg("-c")
        .arg("exec 9>>\"$1\"; flock 9; echo 4242 > \"$1\"; sleep 60")
        .arg("sh")
        .arg(&lock)
        .spawn()
        .unwrap();
    let t0 = std::time::Instant::now();
    while std::fs::read_to_string(&lock).unwrap_or_default().trim() != "4242" {
        assert!(t0.elapsed().as_secs() < 30, "the lock holder did not start");
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    let e = DiskTier::open(&other, 64 << 20).unwrap_err();
    let _ = holder.kill();
    let _ = holder.wait();
    assert!(
        e.contains("in use by another sluiced (pid 4242)") && e.contains("--kv-cache-dir"),
        "{e}"
    );
    let d = DiskTier::open(&kv, 64 << 20).unwrap();
    // A second tier on the same directory in this process is refused too (after waiting
    // for a tier of its own that may be on its way out).
    let e = DiskTier::open(&kv, 64 << 20).unwrap_err();
    assert!(e.contains("in use by this process already"), "{e}");
    let tiers = |d: &Arc<DiskTier>| TierConfig {
        host_bytes: 0,
        disk: Some(d.clone()),
    };
    let mut p = first_prompt();
    let r = runner(&src, &tmp.path().join("a"), false, 1, 64);
    let key = Tiers::new(&r, &tiers(&d)).unwrap().key();
    let (base, _) = tiered(r, (true, tiers(&d)), &mut p, 0..3);
    d.flush();
    // The conversation's blocks: damage the second (a flipped bit) and truncate the third.
    let names = sluice::engine::kv_block::chain(key, &p, 3);
    let files: Vec<std::path::PathBuf> =
        (0..3).map(|i| d.path_of(key, names[i]).unwrap()).collect();
    let file = |i: usize| files[i].clone();
    let mut b = std::fs::read(file(1)).unwrap();
    b[200] ^= 1;
    std::fs::write(file(1), b).unwrap();
    let len = std::fs::metadata(file(2)).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(file(2))
        .unwrap()
        .set_len(len / 2)
        .unwrap();
    // A stop between writing a block whole and deleting its copy without ring layers
    // leaves both: the start keeps the whole one.
    let partial = file(0).with_extension("kvp");
    std::fs::copy(file(0), &partial).unwrap();
    drop(d);
    let d = DiskTier::open(&kv, 64 << 20).unwrap();
    assert!(kv.join("v0").join("junk.kvb").exists());
    assert!(!partial.exists() && file(0).exists());
    // The next turn takes the first block only, and answers as without a cache.
    let mut q = p.clone();
    let r = runner(&src, &tmp.path().join("a"), false, 1, 64);
    let (next, st) = tiered(r, (true, tiers(&d)), &mut q, 3..4);
    let mut q2 = p.clone();
    let r = runner(&src, &tmp.path().join("a"), false, 1, 64);
    let (want, _) = tiered(r, (false, TierConfig::default()), &mut q2, 3..4);
    assert_eq!(next[0], (want[0].0.clone(), BLOCK_TOKENS));
    // Both damaged files were read (a prompt's blocks are read at once), failed their
    // checks and were deleted; the turn then wrote its blocks afresh.
    assert_eq!(st.tiers.disk.read_errors, 2, "{st:?}");
    d.flush();
    for (i, &name) in names.iter().enumerate().skip(1) {
        let f = std::fs::read(file(i)).unwrap();
        sluice::engine::kv_block::decode_frame(&f, key, name).unwrap();
    }
    drop(d);
    // A full disk: writes fail, are counted, and the outputs stay.
    let small = tmp.path().join("small");
    let full = if mount_tmpfs(&small, 64 << 10) {
        small.clone()
    } else {
        // Without the right to mount: a cache directory whose model directory is a file
        // fails every write the same way.
        eprintln!("no tmpfs (not allowed to mount): writes fail on a file in the way");
        let k = small.join(format!("v1/{key:016x}"));
        std::fs::create_dir_all(k.parent().unwrap()).unwrap();
        std::fs::write(&k, b"in the way").unwrap();
        small.clone()
    };
    let d = DiskTier::open(&full, 1 << 30).unwrap();
    let mut q = first_prompt();
    let r = runner(&src, &tmp.path().join("a"), false, 1, 64);
    let (filled, _) = tiered(r, (true, tiers(&d)), &mut q, 0..3);
    d.flush();
    let st = d.stats();
    assert!(st.write_errors > 0, "{st:?}");
    let got: Vec<&Vec<u32>> = filled.iter().map(|o| &o.0).collect();
    let want: Vec<&Vec<u32>> = base.iter().map(|o| &o.0).collect();
    assert_eq!(got, want);
    drop(d);
    let _ = std::process::Command::new("umount").arg(&small).status();
}

#[test]
fn a_conversation_resumed_after_a_daemon_restart_prefills_only_its_new_turn_on_both_real_models() {
    for (name, gguf) in [("smollm2", smollm2_gguf()), ("gemma3", gemma3_gguf())] {
        let keep = tempfile::tempdir().unwrap();
        let store = keep.path().join(name);
        pack_lz4(&gguf, &store);
        let kv = keep.path().join("kv");
        let start = |extra: &[&str]| {
            let mut args = vec!["--max-context", "1024"];
            args.extend_from_slice(extra);
            let tmp = tempfile::tempdir().unwrap();
            Daemon::serve(tmp, &["--model", store.to_str().unwrap()], &args)
        };
        let chat = name == "smollm2";
        let off = start(&["--prefix-cache", "off"]);
        let want = turns(&off, name, chat);
        drop(off);
        let with_disk = ["--kv-cache-dir", kv.to_str().unwrap()];
        let mut c = Conversation::new(chat);
        let mut first = start(&with_disk);
        let a = c.turn(&first, name);
        // systemctl restart: SIGTERM, a clean stop, a new daemon on the same directory.
        unsafe { libc::kill(first.child.id() as i32, libc::SIGTERM) };
        assert!(first.child.wait().unwrap().success(), "{name}");
        let second = start(&with_disk);
        let b = c.turn(&second, name);
        assert_eq!((&a.0, &b.0), (&want[0].0, &want[1].0), "{name}");
        assert_eq!(b.1["prompt_tokens"], want[1].1["prompt_tokens"], "{name}");
        // The second turn's prompt begins with the first's (and its answer): every whole
        // block of the first turn's prompt comes from disk, the new turn is prefilled.
        let p1 = a.1["prompt_tokens"].as_u64().unwrap();
        let cached = b.1["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap();
        let blocks = p1 / BLOCK_TOKENS as u64 * BLOCK_TOKENS as u64;
        assert!(
            cached >= blocks,
            "{name}: {cached} cached, the first prompt had {p1}"
        );
        let pc = &grpc_status(&second)["prefixCache"];
        let count = |k: &str| -> u64 { pc[k].as_str().unwrap_or("0").parse().unwrap() };
        assert_eq!(count("diskHits"), 1, "{pc}");
        assert_eq!(count("diskTokens"), cached, "{pc}");
        assert!(
            count("diskBlocks") > 0 && count("diskReadErrors") == 0,
            "{pc}"
        );
        // A second daemon on the same directory runs, without the disk tier.
        let third = start(&with_disk);
        let pc3 = &grpc_status(&third)["prefixCache"];
        assert!(pc3["diskEnabled"].is_null(), "{pc3}");
    }
}
