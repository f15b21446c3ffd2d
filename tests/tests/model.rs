//! The model against references from implementations nobody here wrote: Hugging Face
//! transformers (logits and greedy continuations, scripts/make_reference.py) and llama.cpp
//! (tokenizer ids, scripts/make_tokenizer_reference.py).

use serde_json::Value;
use sluice::backend::cpu::CpuBackend;
use sluice::engine::generate::generate;
use sluice::engine::sequence::GenerateParams;
use sluice::import;
use sluice::io::IoConfig;
use sluice::model::{ModelOptions, SeqStep};
use sluice::pipeline::Pipeline;
use sluice::store::writer::{pack, PackOptions};
use sluice::store::Store;
use sluice::text::sampler::argmax;
use sluice::text::{ChatMessage, ChatTemplate, SamplingParams, Tokenizer};
use sluice_tests::*;
use std::path::Path;

fn reference(name: &str) -> Value {
    let p = fixture("reference").join(name);
    serde_json::from_str(
        &std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display())),
    )
    .unwrap()
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

fn load(src: &Path, dir: &Path, max_context: usize) -> Pipeline<CpuBackend> {
    let store = pack_store(src, dir, "zstd:1", 1 << 20);
    let opts = ModelOptions {
        max_context,
        kv_slots: 1,
        max_batch_tokens: 64,
    };
    let io = IoConfig {
        staging_slots: 2,
        queue_depth: 8,
        read_buffers: 8,
        request_bytes: 1 << 20,
        ..IoConfig::default()
    };
    sluice::engine::cpu_runner(
        store,
        &sluice::plan::PlanInput {
            device_budget: None,
            host_cache_budget: 0,
            opts,
            prefetch: None,
            backend_reserved: 0,
        },
        2,
        io,
    )
    .unwrap()
}

/// max |a - b| / max |b|: the relative error of a logits vector.
fn rel_err(a: &[f32], b: &[f64]) -> f64 {
    let scale = b.iter().fold(0f64, |m, x| m.max(x.abs()));
    a.iter()
        .zip(b)
        .fold(0f64, |m, (x, y)| m.max((*x as f64 - y).abs()))
        / scale
}

#[test]
fn tiny_models_match_transformers_logits_and_greedy_continuations() {
    let tmp = tempfile::tempdir().unwrap();
    // Each fixture through every importer that can read it: the HF directory and the GGUF
    // hold the same weights, so both must match the same reference.
    let cases = [
        ("tiny-llama", "tiny-llama.json"),
        ("tiny-llama.gguf", "tiny-llama.json"),
        ("tiny-qwen2", "tiny-qwen2.json"),
        ("tiny-qwen2.gguf", "tiny-qwen2.json"),
        ("tiny-llama-q.gguf", "tiny-llama-q.json"),
    ];
    for (src, refname) in cases {
        let r = reference(refname);
        let mut runner = load(&fixture(src), &tmp.path().join(src), 64);
        for (ci, c) in r["cases"].as_array().unwrap().iter().enumerate() {
            let prompt = ids(&c["prompt_token_ids"]);
            let want: Vec<f64> = c["last_logits"]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_f64().unwrap())
                .collect();
            let mut logits = Vec::new();
            runner
                .step(
                    &[SeqStep {
                        slot: 0,
                        pos: 0,
                        tokens: prompt.clone(),
                    }],
                    &mut logits,
                )
                .unwrap();
            let e = rel_err(&logits, &want);
            assert!(e <= 1e-3, "{src} case {ci}: logits relative error {e:.2e}");
            // Greedy continuation, eos ignored as in the reference.
            let mut got = Vec::new();
            let mut next = argmax(&logits);
            for pos in prompt.len()..prompt.len() + ids(&c["greedy"]).len() {
                got.push(next);
                runner
                    .step(
                        &[SeqStep {
                            slot: 0,
                            pos,
                            tokens: vec![next],
                        }],
                        &mut logits,
                    )
                    .unwrap();
                next = argmax(&logits);
            }
            assert_eq!(
                got,
                ids(&c["greedy"]),
                "{src} case {ci}: greedy continuation differs"
            );
        }
    }
}

#[test]
fn smollm2_greedy_continuations_match_transformers() {
    let r = reference("smollm2.json");
    let tmp = tempfile::tempdir().unwrap();
    let mut runner = load(&smollm2_gguf(), &tmp.path().join("s"), 512);
    let m = runner.store.manifest().clone();
    let tok = Tokenizer::from_manifest(&m).unwrap();
    for (ci, c) in r["cases"].as_array().unwrap().iter().enumerate() {
        let prompt = if c["kind"] == "chat" {
            let msgs: Vec<ChatMessage> = c["messages"]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| ChatMessage {
                    role: x["role"].as_str().unwrap().into(),
                    content: x["content"].as_str().unwrap().into(),
                })
                .collect();
            let t = ChatTemplate::new(
                m.chat_template.as_deref().unwrap(),
                tok.piece(1),
                tok.piece(2),
            )
            .unwrap();
            let rendered = t.render(&msgs, true).unwrap();
            assert_eq!(
                rendered,
                c["rendered"].as_str().unwrap(),
                "case {ci}: chat template renders differently"
            );
            tok.encode(&rendered, false).unwrap()
        } else {
            tok.encode(c["text"].as_str().unwrap(), true).unwrap()
        };
        assert_eq!(
            prompt,
            ids(&c["prompt_token_ids"]),
            "case {ci}: prompt ids differ"
        );
        let want = ids(&c["greedy"]);
        assert!(
            want.len() >= 32,
            "case {ci}: the reference continuation is too short to prove anything"
        );
        let params = GenerateParams {
            max_tokens: want.len(),
            sampling: SamplingParams::default(),
            stop: Vec::new(),
            ignore_eos: false,
        };
        let out = generate(&mut runner, &tok, &prompt, &params, |_| {}).unwrap();
        assert_eq!(
            out.generated_token_ids, want,
            "case {ci}: greedy continuation differs from transformers'"
        );
        assert_eq!(out.text, tok.decode(&want));
        // The top logits agree too.
        let mut logits = Vec::new();
        runner
            .step(
                &[SeqStep {
                    slot: 0,
                    pos: 0,
                    tokens: prompt.clone(),
                }],
                &mut logits,
            )
            .unwrap();
        let top = c["top_logits"].as_array().unwrap();
        let scale = top[0][1].as_f64().unwrap().abs();
        for pair in top {
            let (id, v) = (
                pair[0].as_u64().unwrap() as usize,
                pair[1].as_f64().unwrap(),
            );
            assert!(
                (logits[id] as f64 - v).abs() <= 1e-3 * scale,
                "case {ci}: logit {id}: {} vs {v}",
                logits[id]
            );
        }
    }
}

#[test]
fn smollm2_tokenizer_matches_llama_cpp_on_varied_strings() {
    let r = reference("smollm2-tokens.json");
    let tmp = tempfile::tempdir().unwrap();
    let model = import::open(&smollm2_gguf()).unwrap();
    let units = model.units().unwrap();
    let dir = tmp.path().join("s");
    pack(
        &model,
        &units,
        &dir,
        &PackOptions {
            codec: "none".parse().unwrap(),
            ..PackOptions::default()
        },
        |_| {},
    )
    .unwrap();
    let tok = Tokenizer::from_manifest(Store::open(&dir).unwrap().manifest()).unwrap();
    let cases = r["cases"].as_array().unwrap();
    assert!(cases.len() >= 200);
    let mut bad = Vec::new();
    for c in cases {
        let text = c["text"].as_str().unwrap();
        let got = tok.encode(text, false).unwrap();
        if got != ids(&c["ids"]) {
            bad.push(format!(
                "{text:?}: got {got:?}, llama.cpp {:?}",
                ids(&c["ids"])
            ));
        }
        // Decoding gives the text back (byte-level BPE is lossless), special tokens aside.
        if !text.contains("<|") {
            assert_eq!(tok.decode(&got), text);
        }
    }
    assert!(
        bad.is_empty(),
        "{} of {} strings tokenize differently:\n{}",
        bad.len(),
        cases.len(),
        bad.join("\n")
    );
}

#[test]
fn sluiced_run_json_reports_ids_text_and_rates() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("s");
    sluiced_ok(&[
        "pack",
        smollm2_gguf().to_str().unwrap(),
        "-o",
        dir.to_str().unwrap(),
        "--codec",
        "lz4",
    ]);
    let out = sluiced_ok(&[
        "run",
        dir.to_str().unwrap(),
        "--prompt",
        "The history of the printing press begins",
        "--max-tokens",
        "8",
        "--json",
    ]);
    let j: Value = serde_json::from_str(&out).unwrap();
    let r = reference("smollm2.json");
    assert_eq!(
        ids(&j["prompt_token_ids"]),
        ids(&r["cases"][0]["prompt_token_ids"])
    );
    assert_eq!(
        ids(&j["generated_token_ids"]),
        ids(&r["cases"][0]["greedy"])[..8].to_vec()
    );
    assert!(j["text"].as_str().unwrap().len() > 8);
    for k in [
        "prefill_tokens_per_s",
        "decode_tokens_per_s",
        "device_bytes_peak",
    ] {
        assert!(j[k].as_f64().unwrap() > 0.0, "{k}");
    }
    assert!(j["device_bytes_peak"].as_u64() <= j["device_bytes_budget"].as_u64());
    // --prompt-ids takes ids as they are; a bad id is a clear error.
    let out = sluiced_ok(&[
        "run",
        dir.to_str().unwrap(),
        "--prompt-ids",
        "504,3458,282",
        "--max-tokens",
        "3",
        "--json",
    ]);
    let j: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(ids(&j["prompt_token_ids"]), vec![504, 3458, 282]);
    let e = sluiced_err(&["run", dir.to_str().unwrap(), "--prompt-ids", "1,999999"]);
    assert!(e.contains("999999") && e.contains("vocabulary"), "{e}");
}
