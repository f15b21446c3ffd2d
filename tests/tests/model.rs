//! The model against references from implementations nobody here wrote: Hugging Face
//! transformers (logits and greedy continuations, scripts/make_reference.py) and llama.cpp
//! (tokenizer ids, scripts/make_tokenizer_reference.py).

use serde_json::Value;
use sluice::backend::cpu::CpuBackend;
use sluice::dtype::DType;
use sluice::engine::generate::generate;
use sluice::engine::sequence::GenerateParams;
use sluice::import;
use sluice::io::IoConfig;
use sluice::model::{ArchConfig, ModelOptions, SeqStep};
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

/// One sequence (slot 0) steps `tokens` at `pos`; its last row's logits into `logits`.
fn step(runner: &mut Pipeline<CpuBackend>, pos: usize, tokens: Vec<u32>, logits: &mut Vec<f32>) {
    runner
        .step(
            &[SeqStep {
                slot: 0,
                pos,
                tokens,
                verify: false,
                ..Default::default()
            }],
            logits,
        )
        .unwrap();
}

/// `tokens` at `pos` of `slot`, one plain span of a step.
fn seq(slot: usize, pos: usize, tokens: &[u32]) -> SeqStep {
    SeqStep {
        slot,
        pos,
        tokens: tokens.to_vec(),
        verify: false,
        ..Default::default()
    }
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

fn load(src: &Path, dir: &Path, max_context: usize) -> Pipeline<CpuBackend> {
    load_chunked(src, dir, max_context, 64)
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
            step(&mut runner, 0, prompt.clone(), &mut logits);
            let e = rel_err(&logits, &want);
            assert!(e <= 1e-3, "{src} case {ci}: logits relative error {e:.2e}");
            // Greedy continuation, eos ignored as in the reference.
            let mut got = Vec::new();
            let mut next = argmax(&logits);
            for pos in prompt.len()..prompt.len() + ids(&c["greedy"]).len() {
                got.push(next);
                step(&mut runner, pos, vec![next], &mut logits);
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

/// A pipeline whose steps carry at most `batch` tokens (a sliding-window layer's ring is
/// then window + batch - 1 positions).
fn load_chunked(src: &Path, dir: &Path, max_context: usize, batch: usize) -> Pipeline<CpuBackend> {
    load_as(src, dir, max_context, batch, true)
}

/// `exact`: the reference numerics (f32 activations, f32 KV cache); else the default fast
/// path (8-bit activations for decode rows, f16 KV cache).
fn load_as(
    src: &Path,
    dir: &Path,
    max_context: usize,
    batch: usize,
    exact: bool,
) -> Pipeline<CpuBackend> {
    runner_with(src, dir, max_context, batch, exact, 1)
}

/// A runner of `kv_slots` sequences (see `load_as`).
fn runner_with(
    src: &Path,
    dir: &Path,
    max_context: usize,
    batch: usize,
    exact: bool,
    kv_slots: usize,
) -> Pipeline<CpuBackend> {
    let kv = sluice::engine::kv_dtype_for(exact, None);
    runner_kv(src, dir, (max_context, batch, kv_slots), exact, kv)
}

/// A runner with its KV cache of `kv` whatever the activations (`runner_with`).
fn runner_kv(
    src: &Path,
    dir: &Path,
    (max_context, batch, kv_slots): (usize, usize, usize),
    exact: bool,
    kv: sluice::backend::KvDtype,
) -> Pipeline<CpuBackend> {
    let store = pack_store(src, dir, "zstd:1", 1 << 20);
    let opts = ModelOptions {
        max_context,
        kv_slots,
        max_batch_tokens: batch,
        kv_dtype: kv,
        exact,
        verify_rows: 0,
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
        &sluice_tests::plan_input(opts),
        2,
        io,
        Default::default(),
    )
    .unwrap()
}

fn floats(v: &Value) -> Vec<f64> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap())
        .collect()
}

/// Qwen3 (q/k norm, head dim 32 over hidden 64 / 4 heads) and Gemma 3 (scaled embeddings,
/// four norms per layer, GeGLU, q/k norm, query_pre_attn_scalar 24, window 8 on six of
/// seven layers with their own RoPE base, linear RoPE scaling on the global one, tied
/// embeddings), random weights made with transformers (tests/fixtures/
/// make_tiny_new_arch.py), each from its Hugging Face directory (bf16 / f16) and from the
/// GGUF llama.cpp's converter wrote of it: the logits at every prompt position and the
/// greedy tokens equal transformers'. Prompts go in chunks of 16, so Gemma's ring (8 + 15
/// positions) wraps on the 40-token prompt. Mistral (window 8 on both layers, f32) is
/// there for its sliding window: without it its logits from position 8 on differ from
/// transformers' by up to 2.7.
///
/// tiny-gemma3.gguf has a reference of its own: a Gemma 3 GGUF does not carry
/// query_pre_attn_scalar, and llama.cpp scales by the head dim (32) where the checkpoint
/// says 24 (`gemma3_gguf_reads_as_llama_cpp_does`), so the file is the model transformers
/// runs with the config as llama.cpp reads it (and whose logits llama.cpp's own run,
/// recorded beside them, matches to 6e-3).
///
/// The mixtures of experts (tests/fixtures/make_tiny_moe.py): Qwen3-MoE (4 experts, top 2,
/// renormalized; its GGUF's experts merged per layer), Qwen3-MoE with a dense layer between
/// two sparse ones and the top-2 probabilities not renormalized, and Mixtral (its GGUF a
/// "llama" with experts, q/k rows permuted), each also against llama.cpp's logits on the
/// same GGUF where the reference has them. Their routing has no near tie (the least gap
/// between the k-th and the next router probability is recorded, >= 2e-5), so the same
/// experts run here as in transformers.
#[test]
fn qwen3_gemma3_mistral_and_mixtures_match_transformers_at_every_position() {
    let tmp = tempfile::tempdir().unwrap();
    let cases = [
        ("tiny-qwen3", "tiny-qwen3.json"),
        ("tiny-qwen3.gguf", "tiny-qwen3.json"),
        ("tiny-gemma3", "tiny-gemma3.json"),
        ("tiny-gemma3.gguf", "tiny-gemma3-gguf.json"),
        ("tiny-mistral", "tiny-mistral.json"),
        ("tiny-qwen3moe", "tiny-qwen3moe.json"),
        ("tiny-qwen3moe.gguf", "tiny-qwen3moe.json"),
        ("tiny-qwen3moe-mixed", "tiny-qwen3moe-mixed.json"),
        ("tiny-mixtral", "tiny-mixtral.json"),
        ("tiny-mixtral.gguf", "tiny-mixtral.json"),
        ("tiny-gptoss", "tiny-gptoss.json"),
        ("tiny-gptoss.gguf", "tiny-gptoss-gguf.json"),
        // OpenAI's checkpoint layout (MXFP4 experts) against transformers' own MXFP4
        // decoder (Mxfp4Config(dequantize=True)).
        ("tiny-gptoss-mxfp4-hf", "tiny-gptoss-mxfp4-hf.json"),
    ];
    for (src, refname) in cases {
        let r = reference(refname);
        let mut runner = load_chunked(&fixture(src), &tmp.path().join(src), 64, 16);
        let mut decisive = 0;
        for (ci, c) in r["cases"].as_array().unwrap().iter().enumerate() {
            let prompt = ids(&c["prompt_token_ids"]);
            let per_pos = c["logits"].as_array().unwrap();
            assert_eq!(per_pos.len(), prompt.len());
            // Every position's logits: the prompt in chunks of up to 16, each chunk's
            // last row read out, then the rest one token at a time.
            let mut logits = Vec::new();
            let mut pos = 0;
            for chunk in prompt.chunks(16) {
                step(&mut runner, pos, chunk.to_vec(), &mut logits);
                pos += chunk.len();
                let e = rel_err(&logits, &floats(&per_pos[pos - 1]));
                assert!(
                    e <= 1e-3,
                    "{src} case {ci} position {}: logits relative error {e:.2e}",
                    pos - 1
                );
            }
            let last = floats(&c["last_logits"]);
            assert!(
                rel_err(&logits, &last) <= 1e-3,
                "{src} case {ci}: last logits"
            );
            // Position by position from a fresh sequence (the decode kernels).
            let mut step_logits = Vec::new();
            for (p, &t) in prompt.iter().enumerate() {
                step(&mut runner, p, vec![t], &mut step_logits);
                // And llama.cpp's own logits, where the reference has them (its f16
                // intermediates put it 6e-3 from transformers' f32).
                // Or as far from it as transformers itself is, plus a little (llama.cpp's
                // experts run on f16-rounded activations: up to 1.1e-2 on tiny-qwen3moe).
                if let Some(lc) = c.get("llama_cpp_logits") {
                    let lc = floats(&lc[p]);
                    let e = rel_err(&step_logits, &lc);
                    let tf: Vec<f32> = floats(&per_pos[p]).iter().map(|&v| v as f32).collect();
                    let theirs = rel_err(&tf, &lc);
                    assert!(
                        e <= 1e-2_f64.max(theirs + 2e-3),
                        "{src} case {ci} position {p}: {e:.2e} from llama.cpp (transformers: {theirs:.2e})"
                    );
                }
                let e = rel_err(&step_logits, &floats(&per_pos[p]));
                assert!(
                    e <= 1e-3,
                    "{src} case {ci} decode position {p}: logits relative error {e:.2e}"
                );
            }
            let label = format!("{src} case {ci}");
            decisive += greedy_until_a_near_tie(&mut runner, c, prompt.len(), step_logits, &label);
        }
        // Random weights tie now and then; enough steps must still be compared.
        assert!(
            decisive >= 16,
            "{src}: only {decisive} greedy steps were decisive"
        );
    }
}

/// The reference case `c`'s greedy tokens (`greedy`) after its prompt of `len` tokens, whose
/// last logits are `logits`, up to the first step transformers itself nearly tied on (a
/// top-2 margin under 0.01 in `greedy_margins`); returns how many were compared.
fn greedy_until_a_near_tie(
    runner: &mut Pipeline<CpuBackend>,
    c: &Value,
    len: usize,
    mut logits: Vec<f32>,
    label: &str,
) -> usize {
    let want = ids(&c["greedy"]);
    let margins = floats(&c["greedy_margins"]);
    let sure = margins.iter().position(|&m| m < 0.01).unwrap_or(want.len());
    let mut next = argmax(&logits);
    let mut got = Vec::new();
    for p in len..len + sure {
        got.push(next);
        step(runner, p, vec![next], &mut logits);
        next = argmax(&logits);
    }
    assert_eq!(got, want[..sure], "{label}: greedy tokens differ");
    sure
}

/// Tensor `n` of an import as copied into a store, as f32 bits (bf16 widened): llama.cpp's
/// converter writes in f32 what a checkpoint has in bf16 (the same numbers).
fn f32_bits(m: &import::ImportedModel, n: &str) -> Vec<u32> {
    let t = &m.tensors[n];
    let mut b = vec![0u8; t.len as usize];
    m.copy_source(t, &mut b);
    match t.dtype {
        DType::F32 => b
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
        DType::BF16 => b
            .chunks_exact(2)
            .map(|c| (u16::from_le_bytes([c[0], c[1]]) as u32) << 16)
            .collect(),
        other => panic!("{n}: {other}"),
    }
}

/// A mixture's GGUF imports as its checkpoint does: the same config (but the name), and
/// every tensor under the same name with the same bytes once copied (the merged
/// `ffn_*_exps` cut into experts, Mixtral's `w1/w3/w2` renamed to gate/up/down and its
/// q/k rows un-permuted); and the config maps the experts as transformers reads them.
#[test]
fn moe_ggufs_import_as_their_checkpoints() {
    use sluice::store::arch::{Arch, MoeConfig};
    for (name, arch) in [
        ("tiny-qwen3moe", Arch::Qwen3Moe),
        ("tiny-mixtral", Arch::Mixtral),
    ] {
        let hf = import::open(&fixture(name)).unwrap();
        let gg = import::open(&fixture(&format!("{name}.gguf"))).unwrap();
        assert_eq!(hf.arch.arch, arch);
        let want = MoeConfig {
            n_experts: 4,
            top_k: 2,
            intermediate: 96,
            norm_topk_prob: true,
            dense_layers: vec![],
        };
        assert_eq!(hf.arch.moe.as_ref(), Some(&want), "{name}");
        let gcfg = sluice::store::arch::ArchConfig {
            name: hf.arch.name.clone(),
            // llama.cpp's qwen3moe keeps feed_forward_length for a dense MLP it never has;
            // transformers' intermediate_size (128) is unused when every layer is sparse.
            intermediate: hf.arch.intermediate,
            rms_eps: hf.arch.rms_eps,
            max_context: hf.arch.max_context,
            ..gg.arch.clone()
        };
        assert_eq!(gcfg, hf.arch, "{name}: the GGUF's config");
        let names: Vec<&String> = hf.tensors.keys().collect();
        assert_eq!(names, gg.tensors.keys().collect::<Vec<_>>(), "{name}");
        // As f32 bits (`f32_bits`: norms are f32 in the GGUF, bf16 in the checkpoint).
        for n in names {
            assert!(
                f32_bits(&hf, n) == f32_bits(&gg, n),
                "{name}: tensor {n} differs between the checkpoint and the GGUF"
            );
        }
    }
    let mixed = import::open(&fixture("tiny-qwen3moe-mixed")).unwrap().arch;
    let m = mixed.moe.as_ref().unwrap();
    assert_eq!((m.dense_layers.clone(), m.norm_topk_prob), (vec![1], false));
    assert!(mixed.is_sparse(0) && !mixed.is_sparse(1) && mixed.is_sparse(2));
}

/// The Gemma 3 GGUF of the tiny model maps to the same config as its checkpoint, except
/// for what llama.cpp itself derives (the attention scale from the head dim).
#[test]
fn gemma3_gguf_reads_as_llama_cpp_does() {
    let hf = import::open(&fixture("tiny-gemma3")).unwrap().arch;
    let gg = import::open(&fixture("tiny-gemma3.gguf")).unwrap().arch;
    assert_eq!(hf.ext.sliding_layers, vec![0, 1, 2, 3, 4, 6]);
    assert_eq!(gg.ext.sliding_layers, hf.ext.sliding_layers);
    assert_eq!(gg.ext.rope_local_theta, Some(10000.0));
    assert_eq!(gg.ext.embed_scale, hf.ext.embed_scale);
    assert_eq!(hf.ext.attn_scale, Some(24f64.powf(-0.5) as f32));
    assert_eq!(gg.ext.attn_scale, Some(32f64.powf(-0.5) as f32));
    assert_eq!(
        (gg.sliding_window, gg.rope_theta, &gg.rope_scaling),
        (hf.sliding_window, hf.rope_theta, &hf.rope_scaling)
    );
    let gg = sluice::store::arch::ArchConfig {
        ext: hf.ext.clone(),
        name: hf.name.clone(),
        ..gg
    };
    assert_eq!(gg, hf);
}

/// A multimodal Gemma 3 checkpoint (config under text_config, the text model's tensors
/// under model.language_model., a vision tower beside them) imports as its text model.
#[test]
fn a_multimodal_gemma3_checkpoint_imports_as_its_text_model() {
    let src = fixture("tiny-gemma3");
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("mm");
    copy_dir(&src, &dir);
    let text: Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    let config = serde_json::json!({
        "architectures": ["Gemma3ForConditionalGeneration"],
        "model_type": "gemma3",
        "text_config": text,
        "vision_config": {"model_type": "siglip_vision_model"},
    });
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    let bytes = std::fs::read(src.join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let vision = [0u8; 16];
    let mut views: Vec<(String, safetensors::tensor::TensorView<'_>)> = st
        .tensors()
        .into_iter()
        .map(|(n, v)| {
            (
                format!("model.language_model.{}", n.trim_start_matches("model.")),
                v,
            )
        })
        .collect();
    views.push((
        "model.vision_tower.patch_embedding.weight".into(),
        safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![4], &vision).unwrap(),
    ));
    safetensors::serialize_to_file(views, None, &dir.join("model.safetensors")).unwrap();
    let (a, b) = (import::open(&src).unwrap(), import::open(&dir).unwrap());
    assert_eq!(
        a.arch,
        ArchConfig {
            name: a.arch.name.clone(),
            ..b.arch.clone()
        }
    );
    let shapes = |m: &import::ImportedModel| -> Vec<(String, Vec<u64>)> {
        m.tensors
            .iter()
            .map(|(n, t)| (n.clone(), t.shape.clone()))
            .collect()
    };
    assert_eq!(shapes(&a), shapes(&b));
    b.units()
        .expect("the text model's units, nothing unexpected");
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
                .map(|x| {
                    ChatMessage::new(x["role"].as_str().unwrap(), x["content"].as_str().unwrap())
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
            logprobs: None,
            logit_bias: Vec::new(),
            format: Default::default(),
            draft: None,
            markers: false,
        };
        let out = generate(&mut runner, &tok, &prompt, &params, |_| {}).unwrap();
        assert_eq!(
            out.generated_token_ids, want,
            "case {ci}: greedy continuation differs from transformers'"
        );
        assert_eq!(out.text, tok.decode(&want));
        // The top logits agree too.
        let mut logits = Vec::new();
        step(&mut runner, 0, prompt.clone(), &mut logits);
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
            auto: None,
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
    pack_lz4(&smollm2_gguf(), &dir);
    let out = sluiced_ok(&[
        "run",
        "--temperature",
        "0",
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
    // Which path ran: the fast numerics, through this CPU's integer dots.
    assert_eq!(j["numerics"], "fast");
    assert_eq!(j["int_dots"], sluice::backend::cpu::q8::dots_name());
    // --prompt-ids takes ids as they are; a bad id is a clear error.
    let out = sluiced_ok(&[
        "run",
        "--temperature",
        "0",
        dir.to_str().unwrap(),
        "--prompt-ids",
        "504,3458,282",
        "--max-tokens",
        "3",
        "--json",
    ]);
    let j: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(ids(&j["prompt_token_ids"]), vec![504, 3458, 282]);
    // Under --exact no integer dots run.
    let out = sluiced_ok(&[
        "run",
        "--temperature",
        "0",
        dir.to_str().unwrap(),
        "--prompt-ids",
        "504",
        "--max-tokens",
        "1",
        "--exact",
        "--json",
    ]);
    let j: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(
        (&j["numerics"], &j["int_dots"]),
        (&"exact".into(), &"".into())
    );
    let e = sluiced_err(&["run", dir.to_str().unwrap(), "--prompt-ids", "1,999999"]);
    assert!(e.contains("999999") && e.contains("vocabulary"), "{e}");
}

/// Gemma 3 270M's SentencePiece vocabulary (262 144 tokens, byte fallback, no space
/// prefix) on ~300 varied strings: ids equal llama.cpp's (llama-cpp-python, vocab_only)
/// for every string, and transformers' wherever transformers agrees with llama.cpp (two
/// long runs of spaces it splits differently; scripts/make_gemma_reference.py); decoding
/// gives the text back.
#[test]
fn gemma3_sentencepiece_matches_llama_cpp_and_transformers() {
    let r = reference("gemma3-270m-tokens.json");
    let tmp = tempfile::tempdir().unwrap();
    let store = pack_store(&gemma3_gguf(), &tmp.path().join("g"), "none", 1 << 20);
    let tok = Tokenizer::from_manifest(store.manifest()).unwrap();
    let cases = r["cases"].as_array().unwrap();
    assert!(cases.len() >= 300);
    let disagree: Vec<u64> = r["disagreements"]["indices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap())
        .collect();
    assert!(disagree.len() <= 2, "{disagree:?}");
    let (mut bad, mut vs_hf) = (Vec::new(), 0);
    for (i, c) in cases.iter().enumerate() {
        let text = c["text"].as_str().unwrap();
        let got = tok.encode(text, false).unwrap();
        if got != ids(&c["llama_cpp"]) {
            bad.push(format!(
                "{text:?}: got {got:?}, llama.cpp {:?}",
                ids(&c["llama_cpp"])
            ));
        }
        if !disagree.contains(&(i as u64)) {
            assert_eq!(got, ids(&c["transformers"]), "{text:?}: transformers");
            vs_hf += 1;
        }
        // Control tokens (<bos>, <unused0>, ...) decode to nothing, as llama.cpp's do.
        let has_special = text.contains('<') && text.contains('>');
        if !has_special {
            assert_eq!(tok.decode(&got), text, "decode of {got:?}");
        }
    }
    assert!(
        bad.is_empty(),
        "{} of {} strings tokenize differently from llama.cpp:\n{}",
        bad.len(),
        cases.len(),
        bad.join("\n")
    );
    assert!(vs_hf >= 300, "{vs_hf} compared with transformers");
    // A prompt gets BOS (the vocabulary asks for it), as llama.cpp's add_bos does.
    assert_eq!(
        tok.encode("Hello world", true).unwrap(),
        vec![2, 9259, 1902]
    );
}

/// Gemma 3 270M Q4_K_M (F32, Q8_0, Q5_0, Q4_K, Q6_K; SentencePiece) against transformers
/// loading the same GGUF dequantized to float32 (scripts/make_gemma_reference.py): prompt
/// ids equal transformers' and llama.cpp's, the top logits at the last prompt position
/// agree, and the 48-token greedy continuation is the same up to the first step where
/// transformers' own top-2 margin is under 0.01.
#[test]
fn gemma3_270m_matches_transformers() {
    let r = reference("gemma3-270m.json");
    let tmp = tempfile::tempdir().unwrap();
    let mut runner = load(&gemma3_gguf(), &tmp.path().join("g"), 512);
    let tok = Tokenizer::from_manifest(runner.store.manifest()).unwrap();
    let mut worst = 0f64;
    for (ci, c) in r["cases"].as_array().unwrap().iter().enumerate() {
        let prompt = tok.encode(c["text"].as_str().unwrap(), true).unwrap();
        assert_eq!(
            prompt,
            ids(&c["prompt_token_ids"]),
            "case {ci}: transformers' ids"
        );
        assert_eq!(
            prompt,
            ids(&c["prompt_token_ids_llama_cpp"]),
            "case {ci}: llama.cpp's ids"
        );
        let mut logits = Vec::new();
        step(&mut runner, 0, prompt.clone(), &mut logits);
        for t in c["top_logits"].as_array().unwrap() {
            let (id, want) = (t[0].as_u64().unwrap() as usize, t[1].as_f64().unwrap());
            worst = worst.max((logits[id] as f64 - want).abs());
        }
        let want = ids(&c["greedy"]);
        let margins = floats(&c["greedy_margins"]);
        let sure = margins.iter().position(|&m| m < 0.01).unwrap_or(want.len());
        let params = GenerateParams {
            max_tokens: sure,
            sampling: SamplingParams::default(),
            stop: Vec::new(),
            ignore_eos: true,
            logprobs: None,
            logit_bias: Vec::new(),
            format: Default::default(),
            draft: None,
            markers: false,
        };
        let out = generate(&mut runner, &tok, &prompt, &params, |_| {}).unwrap();
        assert_eq!(
            out.generated_token_ids,
            want[..sure],
            "case {ci}: greedy continuation"
        );
        assert!(sure >= 24, "case {ci}: only {sure} decisive steps");
    }
    eprintln!("gemma3-270m: largest top-64 logit difference from transformers {worst:.2e}");
    // transformers' own f32 run is 1.6e-5 to 2.1e-5 from its f64 run (the reference records
    // it); allow a few times that, plus the 5e-6 rounding of the stored values.
    assert!(
        worst <= 1e-4,
        "top logits differ from transformers' by {worst}"
    );
}

/// The default numerics (f16 KV cache; 8-bit activations for the decode rows of every
/// layer matrix, here Gemma's q8_0, q5_0, q4_k and q6_k; 16-bit into the head) against
/// transformers' f32 run of Gemma 3 270M and against sluice's exact path, teacher-forced
/// over transformers' greedy continuations: the steps' logits stay as close to the exact
/// path's (itself within 1e-4 of transformers) as llama.cpp's are to transformers at the
/// same steps, and wherever transformers' top-2 margin exceeds twice that step's measured
/// difference (plus the exact path's own 1e-4) the fast path picks transformers' token.
#[test]
fn the_fast_path_agrees_with_transformers_wherever_the_margin_allows() {
    let r = reference("gemma3-270m.json");
    let tmp = tempfile::tempdir().unwrap();
    let mut fast = load_as(&gemma3_gguf(), &tmp.path().join("f"), 512, 64, false);
    let mut exact = load_as(&gemma3_gguf(), &tmp.path().join("e"), 512, 64, true);
    assert!(!fast.options().exact && fast.options().kv_dtype == sluice::backend::KvDtype::F16);
    // Tolerance on logits, which here span about +-30. The f16 cache alone moved them by
    // 2e-2 (11 significant bits of K and V); 8-bit activations into every layer matrix by
    // up to 1.31 (measured; the head's 16 bits add about 1e-3: `Backend::matmul_head`).
    // llama.cpp, which quantizes the activations of every matrix to 8 bits (the K-quants'
    // per 256, coarser than sluice's per 32), is up to 2.49 from transformers at these very
    // steps, median 0.81 to 1.45 per prompt (`llama_cpp_step_max_abs_diff`, recorded by
    // scripts/make_gemma_reference.py): the fast path must stay within llama.cpp's worst
    // and within its median.
    let llama_steps: Vec<f64> = r["cases"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|c| floats(&c["llama_cpp_step_max_abs_diff"]))
        .collect();
    let median = |v: &[f64]| {
        let mut v = v.to_vec();
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let (tol, llama_median) = (
        llama_steps.iter().cloned().fold(0f64, f64::max),
        median(&llama_steps),
    );
    let mut diffs = Vec::new();
    let mut worst = 0f64;
    let (mut worst_prompt, mut llama_cpp) = (0f64, 0f64);
    let (mut decided, mut steps) = (0, 0);
    for (ci, c) in r["cases"].as_array().unwrap().iter().enumerate() {
        let prompt = ids(&c["prompt_token_ids"]);
        let want = ids(&c["greedy"]);
        let margins = floats(&c["greedy_margins"]);
        let (mut lf, mut le) = (Vec::new(), Vec::new());
        let mut pos = 0;
        let mut input = prompt.clone();
        for (t, &next) in want.iter().enumerate() {
            step(&mut fast, pos, input.clone(), &mut lf);
            step(&mut exact, pos, input.clone(), &mut le);
            pos += input.len();
            if t == 0 {
                // The prompt's last position: transformers' top 64, and llama.cpp's logits
                // for the same ids.
                let tl: Vec<(usize, f64)> = c["top_logits"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|x| (x[0].as_u64().unwrap() as usize, x[1].as_f64().unwrap()))
                    .collect();
                for &(id, v) in &tl {
                    worst_prompt = worst_prompt.max((lf[id] as f64 - v).abs());
                }
                for x in c["llama_cpp_top_logits"].as_array().unwrap() {
                    let id = x[0].as_u64().unwrap() as usize;
                    if let Some(&(_, v)) = tl.iter().find(|p| p.0 == id) {
                        llama_cpp = llama_cpp.max((x[1].as_f64().unwrap() - v).abs());
                    }
                }
            }
            let d = lf
                .iter()
                .zip(&le)
                .fold(0f64, |m, (a, b)| m.max((*a as f64 - *b as f64).abs()));
            worst = worst.max(d);
            diffs.push(d);
            steps += 1;
            if margins[t] > 2.0 * d + 2e-4 {
                let top = lf
                    .iter()
                    .enumerate()
                    .max_by(|a, b| a.1.total_cmp(b.1))
                    .map(|(i, _)| i as u32)
                    .unwrap();
                assert_eq!(
                    top, next,
                    "case {ci} step {t}: fast path's choice (margin {})",
                    margins[t]
                );
                decided += 1;
            }
            input = vec![next];
        }
    }
    let fast_median = median(&diffs);
    eprintln!("fast path vs exact: largest logit difference {worst:.3e}, median {fast_median:.3}; llama.cpp vs transformers at the same steps: largest {tol:.3}, median {llama_median:.3}; {decided} of {steps} steps decided; at the prompts' last positions fast path vs transformers {worst_prompt:.3}, llama.cpp vs transformers {llama_cpp:.3}");
    assert_eq!(llama_steps.len(), steps, "a llama.cpp difference per step");
    assert!(
        worst <= tol,
        "fast path logits differ by {worst}, llama.cpp's by {tol}"
    );
    assert!(
        fast_median <= llama_median,
        "fast path's median step difference {fast_median}, llama.cpp's {llama_median}"
    );
    assert!(
        worst_prompt <= llama_cpp,
        "the fast path is {worst_prompt} from transformers, llama.cpp {llama_cpp}"
    );
    // Every step whose margin allows is checked (all agree); most do (measured 92 of 144:
    // a larger difference leaves fewer margins decisive).
    assert!(
        decided * 2 >= steps,
        "only {decided} of {steps} steps decisive"
    );
}

#[test]
fn repetition_penalty_continuations_match_transformers() {
    let r = reference("smollm2-penalties.json");
    let tmp = tempfile::tempdir().unwrap();
    let mut runner = load(&smollm2_gguf(), &tmp.path().join("s"), 512);
    let tok = Tokenizer::from_manifest(runner.store.manifest()).unwrap();
    let mut changed = 0;
    for (ci, c) in r["cases"].as_array().unwrap().iter().enumerate() {
        let prompt = tok.encode(c["text"].as_str().unwrap(), true).unwrap();
        assert_eq!(
            prompt,
            ids(&c["prompt_token_ids"]),
            "case {ci}: prompt ids differ"
        );
        let want = ids(&c["greedy"]);
        let params = GenerateParams {
            max_tokens: want.len(),
            sampling: SamplingParams {
                repetition_penalty: c["repetition_penalty"].as_f64().unwrap() as f32,
                ..SamplingParams::default()
            },
            stop: Vec::new(),
            ignore_eos: false,
            logprobs: None,
            logit_bias: Vec::new(),
            format: Default::default(),
            draft: None,
            markers: false,
        };
        let out = generate(&mut runner, &tok, &prompt, &params, |_| {}).unwrap();
        assert_eq!(
            out.generated_token_ids, want,
            "case {ci}: greedy with repetition_penalty {} differs from transformers'",
            c["repetition_penalty"]
        );
        changed += usize::from(want != ids(&c["unpenalized"]));
    }
    assert!(
        changed >= 2,
        "the penalty should change some continuations: {changed}"
    );
}

/// A mixture's rows are routed and computed one by one: a sequence's logits are the same
/// bits alone as beside others in a step (decode rows with other decode rows and with
/// prefill chunks routed to the same experts), on the reference path and the fast one.
#[test]
fn a_mixtures_sequence_gets_the_same_bits_alone_as_in_a_batch() {
    let tmp = tempfile::tempdir().unwrap();
    for src in [
        "tiny-qwen3moe",
        "tiny-mixtral.gguf",
        "tiny-gptoss-mxfp4.gguf",
    ] {
        for exact in [true, false] {
            let dir = tmp.path().join(format!("{src}-{exact}"));
            let mut r = runner_with(&fixture(src), &dir, 64, 64, exact, 4);
            let vocab = r.store.manifest().arch.vocab as usize;
            let a: Vec<u32> = (0..9).map(|i| 5 + i * 31 % 280).collect();
            let b: Vec<u32> = (0..12).map(|i| 7 + i * 17 % 280).collect();
            let bits = |l: &[f32]| l.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            // Alone: a's prompt, then four decode steps.
            let mut logits = Vec::new();
            let mut alone = Vec::new();
            r.step(&[seq(0, 0, &a)], &mut logits).unwrap();
            alone.push(bits(&logits[..vocab]));
            for (i, t) in [11u32, 12, 13, 14].iter().enumerate() {
                r.step(&[seq(0, a.len() + i, &[*t])], &mut logits).unwrap();
                alone.push(bits(&logits[..vocab]));
            }
            // In company: a's prompt beside b's, then a's decode rows beside b's prefill
            // chunk, beside b's decode and c's prompt, and beside both decoding.
            r.step(&[seq(2, 0, &b[..4]), seq(1, 0, &a)], &mut logits)
                .unwrap();
            assert_eq!(
                bits(&logits[vocab..2 * vocab]),
                alone[0],
                "{src} exact={exact}: prompt"
            );
            let c: Vec<u32> = (0..6).map(|i| 9 + i * 13 % 270).collect();
            let company: [Vec<SeqStep>; 4] = [
                vec![seq(1, a.len(), &[11]), seq(2, 4, &b[4..])],
                vec![
                    seq(2, b.len(), &[40]),
                    seq(1, a.len() + 1, &[12]),
                    seq(3, 0, &c),
                ],
                vec![
                    seq(1, a.len() + 2, &[13]),
                    seq(3, c.len(), &[50]),
                    seq(2, b.len() + 1, &[41]),
                ],
                vec![seq(3, c.len() + 1, &[51]), seq(1, a.len() + 3, &[14])],
            ];
            for (i, steps) in company.iter().enumerate() {
                r.step(steps, &mut logits).unwrap();
                let at = steps.iter().position(|s| s.slot == 1).unwrap();
                assert_eq!(
                    bits(&logits[at * vocab..(at + 1) * vocab]),
                    alone[i + 1],
                    "{src} exact={exact}: decode step {i} in company"
                );
            }
        }
    }
}

/// A finished sequence's KV pages go back to the system (`Pipeline::discard_slot`), and
/// nothing else changes: the same steps give the same bits with and without the discard,
/// the neighbouring slot's sequence included, on a full cache and a sliding-window ring.
#[test]
fn a_discarded_slot_gives_its_kv_pages_back_and_changes_no_bits() {
    let tmp = tempfile::tempdir().unwrap();
    // Exact: an f32 cache, 128 bytes a position for tiny-llama (2 layers), so each slot of
    // 2048 positions is 64 whole pages per layer and K or V.
    for (src, per_slot) in [("tiny-llama", 2 * 2 * 2048 * 128), ("tiny-gemma3", 0)] {
        let a: Vec<u32> = (0..9).map(|i| 5 + i * 31 % 200).collect();
        let b: Vec<u32> = (0..40).map(|i| 7 + i * 17 % 200).collect();
        let c: Vec<u32> = (0..23).map(|i| 3 + i * 13 % 200).collect();
        let steps: Vec<Vec<SeqStep>> = vec![
            vec![seq(1, 0, &b), seq(0, 0, &a)],
            vec![seq(1, b.len(), &[20]), seq(0, a.len(), &[11])],
            // b is over here: its slot is discarded before the next step.
            vec![seq(0, a.len() + 1, &[12]), seq(1, 0, &c)],
            vec![seq(1, c.len(), &[30]), seq(0, a.len() + 2, &[13])],
        ];
        let mut runs = Vec::new();
        for discard in [false, true] {
            let dir = tmp.path().join(format!("{src}-{discard}"));
            let mut r = runner_with(&fixture(src), &dir, 2048, 64, true, 4);
            let mut logits = Vec::new();
            let mut out = Vec::new();
            for (i, st) in steps.iter().enumerate() {
                if discard && i == 2 {
                    let given = r.discard_slot(1);
                    if per_slot > 0 {
                        assert_eq!(given, per_slot, "{src}: bytes given back");
                    }
                    assert!(given > 0, "{src}: nothing given back");
                    assert_eq!(r.discard_slot(9), 0, "{src}: no such slot");
                }
                r.step(st, &mut logits).unwrap();
                out.push(logits.iter().map(|v| v.to_bits()).collect::<Vec<_>>());
            }
            runs.push(out);
        }
        for (i, (x, y)) in runs[0].iter().zip(&runs[1]).enumerate() {
            assert!(x == y, "{src}: step {i} changed by the discard");
        }
    }
}

/// transformers 5 holds a layer's experts fused (`mlp.experts.gate_up_proj` [experts, 2 x
/// rows, hidden], gate rows first; `mlp.experts.down_proj` [experts, hidden, rows]); a
/// checkpoint written that way imports to the same tensors as the per-expert one.
#[test]
fn fused_experts_import_as_per_expert_ones() {
    use safetensors::tensor::{serialize_to_file, Dtype, TensorView};
    let src = fixture("tiny-qwen3moe");
    let per = import::open(&src).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("fused");
    std::fs::create_dir(&dir).unwrap();
    for f in ["config.json", "tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(src.join(f), dir.join(f)).unwrap();
    }
    let bytes = |n: &str| {
        let t = &per.tensors[n];
        let mut b = vec![0u8; t.len as usize];
        per.copy_source(t, &mut b);
        b
    };
    let mut owned: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
    for (name, t) in &per.tensors {
        if !name.contains(".mlp.experts.") {
            owned.push((
                name.clone(),
                t.shape.iter().map(|&d| d as usize).collect(),
                bytes(name),
            ));
        }
    }
    for l in 0..2 {
        let p = format!("model.layers.{l}.mlp.experts");
        let (mut gu, mut dn) = (Vec::new(), Vec::new());
        for e in 0..4 {
            gu.extend(bytes(&format!("{p}.{e}.gate_proj.weight")));
            gu.extend(bytes(&format!("{p}.{e}.up_proj.weight")));
            dn.extend(bytes(&format!("{p}.{e}.down_proj.weight")));
        }
        owned.push((format!("{p}.gate_up_proj"), vec![4, 192, 64], gu));
        owned.push((format!("{p}.down_proj"), vec![4, 64, 96], dn));
    }
    let views: Vec<(String, TensorView<'_>)> = owned
        .iter()
        .map(|(n, s, b)| {
            (
                n.clone(),
                TensorView::new(Dtype::BF16, s.clone(), b).unwrap(),
            )
        })
        .collect();
    serialize_to_file(views, None, &dir.join("model.safetensors")).unwrap();
    let fused = import::open(&dir).unwrap();
    assert_eq!(
        fused.arch,
        sluice::model::ArchConfig {
            name: "fused".into(),
            ..per.arch.clone()
        }
    );
    assert_eq!(
        fused.tensors.keys().collect::<Vec<_>>(),
        per.tensors.keys().collect::<Vec<_>>()
    );
    for (n, t) in &fused.tensors {
        let mut b = vec![0u8; t.len as usize];
        fused.copy_source(t, &mut b);
        assert!(b == bytes(n), "{n}");
    }
    // A fused tensor of another shape is refused by name, with the shape it should have.
    let bad: Vec<(String, TensorView<'_>)> = owned
        .iter()
        .map(|(n, s, b)| {
            let s = if n.ends_with("0.mlp.experts.down_proj") {
                vec![4, 96, 64]
            } else {
                s.clone()
            };
            (n.clone(), TensorView::new(Dtype::BF16, s, b).unwrap())
        })
        .collect();
    serialize_to_file(bad, None, &dir.join("model.safetensors")).unwrap();
    let e = import::open(&dir)
        .err()
        .expect("a misshapen fused tensor")
        .to_string();
    assert!(
        e.contains("model.layers.0.mlp.experts.down_proj") && e.contains("[4, 64, 96]"),
        "{e}"
    );
}

/// gpt-oss as OpenAI ships it has its experts in MXFP4: the tiny model's GGUF quantized by
/// llama.cpp's own quantizer (experts MXFP4, attention Q8_0) gives transformers' logits on
/// the same numbers (every weight dequantized by gguf-py) at every position, and its greedy
/// tokens; and, printed beside, how far llama.cpp's own run of the file is.
#[test]
fn gpt_oss_with_mxfp4_experts_matches_transformers_on_the_same_numbers() {
    let tmp = tempfile::tempdir().unwrap();
    let r = reference("tiny-gptoss-mxfp4.json");
    let src = fixture("tiny-gptoss-mxfp4.gguf");
    let types: std::collections::BTreeSet<String> = import::open(&src)
        .unwrap()
        .tensors
        .values()
        .map(|t| t.dtype.to_string())
        .collect();
    assert!(
        types.contains("mxfp4") && types.contains("q8_0"),
        "{types:?}"
    );
    let mut runner = load_as(&src, &tmp.path().join("s"), 64, 16, true);
    let mut decisive = 0;
    // With an f16 KV cache (f32 activations) the attention takes the grouped f16 path, a
    // decode row's keys split in chunks across threads, each chunk's softmax partial merged
    // with the sinks at the end: as close to transformers as f16 keys and values allow.
    let kv16 = &mut runner_kv(
        &src,
        &tmp.path().join("kv16"),
        (64, 16, 1),
        true,
        sluice::backend::KvDtype::F16,
    );
    for (ci, c) in r["cases"].as_array().unwrap().iter().enumerate() {
        let prompt = ids(&c["prompt_token_ids"]);
        let per_pos = c["logits"].as_array().unwrap();
        let mut logits = Vec::new();
        for (p, &t) in prompt.iter().enumerate() {
            step(kv16, p, vec![t], &mut logits);
            let e = rel_err(&logits, &floats(&per_pos[p]));
            assert!(
                e <= 5e-3,
                "f16 KV case {ci} position {p}: {e:.2e} from transformers"
            );
        }
    }
    for (ci, c) in r["cases"].as_array().unwrap().iter().enumerate() {
        let prompt = ids(&c["prompt_token_ids"]);
        let per_pos = c["logits"].as_array().unwrap();
        let lc = c["llama_cpp_logits"].as_array().unwrap();
        let mut logits = Vec::new();
        let (mut worst, mut worst_lc) = (0f64, 0f64);
        for (p, &t) in prompt.iter().enumerate() {
            step(&mut runner, p, vec![t], &mut logits);
            let e = rel_err(&logits, &floats(&per_pos[p]));
            worst = worst.max(e);
            worst_lc = worst_lc.max(rel_err(&logits, &floats(&lc[p])));
            assert!(
                e <= 1e-3,
                "case {ci} position {p}: {e:.2e} from transformers"
            );
        }
        eprintln!(
            "case {ci}: worst relative error {worst:.2e} from transformers, {worst_lc:.2e} from llama.cpp"
        );
        decisive +=
            greedy_until_a_near_tie(&mut runner, c, prompt.len(), logits, &format!("case {ci}"));
    }
    assert!(decisive >= 16, "only {decisive} greedy steps were decisive");
}

/// gpt-oss's GGUF (llama.cpp's converter de-interleaves and transposes the fused experts,
/// splits their biases, keeps vectors in f32) imports as its checkpoint: the same tensors
/// with the same values, and the same config but for what a GGUF cannot say (YaRN's
/// `truncate`, which llama.cpp always applies) and the name.
#[test]
fn gpt_oss_gguf_imports_as_its_checkpoint() {
    use sluice::store::arch::{Arch, RopeScaling, SwigluClamp};
    let hf = import::open(&fixture("tiny-gptoss")).unwrap();
    let gg = import::open(&fixture("tiny-gptoss.gguf")).unwrap();
    assert_eq!(hf.arch.arch, Arch::GptOss);
    let a = &hf.arch;
    assert_eq!(a.sliding_window, Some(8));
    assert_eq!(a.ext.sliding_layers, vec![0]);
    assert!(a.qkv_bias);
    assert_eq!(
        a.swiglu,
        Some(SwigluClamp {
            alpha: 1.702,
            limit: 7.0
        })
    );
    let Some(RopeScaling::Yarn {
        factor,
        original_max_position,
        truncate,
        attention_factor,
        ..
    }) = a.rope_scaling.clone()
    else {
        panic!("{:?}", a.rope_scaling)
    };
    assert_eq!(
        (factor, original_max_position, truncate),
        (32.0, 4096, false)
    );
    assert!((attention_factor - (1.0 + 0.1 * 32f32.ln())).abs() < 1e-6);
    let mut want = hf.arch.clone();
    want.name = gg.arch.name.clone();
    if let Some(RopeScaling::Yarn { truncate, .. }) = &mut want.rope_scaling {
        *truncate = true;
    }
    assert_eq!(gg.arch, want, "the GGUF's config");
    let names: Vec<&String> = hf.tensors.keys().collect();
    assert_eq!(names, gg.tensors.keys().collect::<Vec<_>>());
    for n in names {
        assert!(
            f32_bits(&hf, n) == f32_bits(&gg, n),
            "tensor {n} differs between the checkpoint and the GGUF"
        );
    }
    // An expert's gate is the even columns of the fused gate_up_proj, transposed.
    let t = &hf.tensors["model.layers.1.mlp.experts.2.gate_proj.weight"];
    assert_eq!(t.shape, vec![96, 64]);
}

/// YaRN as transformers computes it for gpt-oss's rope settings (`truncate` false), and
/// the rotary table carries its attention scaling.
#[test]
fn yarn_frequencies_and_scaling_match_transformers() {
    let r = reference("tiny-gptoss.json");
    let cfg = import::open(&fixture("tiny-gptoss")).unwrap().arch;
    let want = floats(&r["rope"]["inv_freq"]);
    let got = sluice::model::inv_freq(&cfg);
    assert_eq!(got.len(), want.len());
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert!((g - w).abs() <= 1e-6 * w.abs(), "pair {i}: {g} vs {w}");
    }
    let s = r["rope"]["attention_scaling"].as_f64().unwrap();
    let table = sluice::model::rope_table(&cfg, 8);
    let half = cfg.head_dim as usize / 2;
    for p in [0usize, 5] {
        for i in 0..half {
            let a = p as f64 * want[i];
            let (c, sn) = (table[(p * half + i) * 2], table[(p * half + i) * 2 + 1]);
            assert!(((c as f64) - a.cos() * s).abs() < 1e-6, "pos {p} pair {i}");
            assert!(((sn as f64) - a.sin() * s).abs() < 1e-6, "pos {p} pair {i}");
        }
    }
}

/// OpenAI's MXFP4 checkpoint layout imports to GGML's MXFP4 blocks without dequantizing: the
/// tiny model's experts, laid out as OpenAI ships gpt-oss, are byte for byte the blocks
/// llama.cpp's quantizer wrote into the MXFP4 GGUF they came from (gate and up rows
/// de-interleaved, the nibbles reordered, each scale joined to its block).
#[test]
fn openai_mxfp4_experts_import_as_the_gguf_blocks_they_came_from() {
    let hf = import::open(&fixture("tiny-gptoss-mxfp4-hf")).unwrap();
    let gg = import::open(&fixture("tiny-gptoss-mxfp4.gguf")).unwrap();
    let experts: Vec<&String> = hf
        .tensors
        .keys()
        .filter(|n| n.contains(".mlp.experts.") && n.ends_with(".weight"))
        .collect();
    assert_eq!(experts.len(), 2 * 4 * 3);
    let bytes = |m: &import::ImportedModel, n: &str| -> Vec<u8> {
        let t = &m.tensors[n];
        let mut b = vec![0u8; t.len as usize];
        m.copy_source(t, &mut b);
        b
    };
    for n in experts {
        assert_eq!(hf.tensors[n].dtype, DType::Mxfp4, "{n}");
        assert_eq!(hf.tensors[n].shape, gg.tensors[n].shape, "{n}");
        assert!(
            bytes(&hf, n) == bytes(&gg, n),
            "{n} differs from the GGUF's blocks"
        );
    }
}
