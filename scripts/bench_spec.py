#!/usr/bin/env python3
"""Speculative decoding under a memory limit: plain sluice against sluice with each drafter,
beside llama.cpp (llama-cpp-python) plain and with its prompt-lookup drafting
(`LlamaPromptLookupDecoding`), every engine inside the same memory cgroup, where sluice's
target model streams. The targets are F16: SmolLM2-135M and Gemma 3 270M rewritten as F16
by llama.cpp's own quantizer (`llama_model_quantize`, allow_requantize; made once, beside
the GGUF in the model cache). The prompts (scripts/bench_spec_prompts.json: summaries of
committed documents, a code rewrite, chat questions) go to every engine as the same token
ids: the model's own chat template rendered by llama-cpp-python's Jinja formatter and
tokenized by llama.cpp (a GGUF without a template, as Gemma 3's: the text after its BOS). Greedy decoding, --decode tokens past the end token (the same
count for every engine).

For each model, batch (sluice: `run --parallel`; llama.cpp runs batch 1 only: its Python
API has no batched drafting) and engine, over all prompts: decode tokens/s (the batch's),
tokens a streamed pass yields, bytes read from storage per token (sluice's own count),
drafted-token acceptance; then each drafter's speed-up over plain sluice and over
llama.cpp's prompt lookup, per round and their median. Engines alternate within a round.
Every sluice run's greedy ids must equal plain sluice's, prompt by prompt (a mismatch is
printed and fails the script).

    pip install llama-cpp-python
    cargo build --release
    python3 scripts/bench_spec.py [--models smollm2,gemma3] [--batch 1,8] [--rounds 2]
        [--decode 96] [--limit-smollm2 192MiB] [--limit-gemma3 320MiB] [--threads 2]
        [--draft-max 8] [--no-llama] [--llama-decode 48] [--llama-kinds summary,code,chat]
        [--self-draft q8_0,q5_k] [--draft-store q8_0] [--branches 2] [--engines ngram,self:q4_k]

Drafters: `ngram` (prompt lookup); for each --self-draft TYPE `--draft self:TYPE` (the
target drafting for itself: the units it keeps resident shared, resident copies of the
units it streams quantized to TYPE by `sluiced pack --quantize`, made once in the cache);
for each --draft-store TYPE the target's own weights quantized to TYPE as a separate draft
store, resident whole. Every draft lives inside the same limit and host budget as the
target. With --branches N each drafter also runs with token trees (`--draft-branches N`).

llama.cpp decodes --llama-decode tokens on the --llama-kinds prompts (fewer where its reads
under the limit make it slow; compare with the same count where it is not).

Needs root (a child memory cgroup of this process's own, v1 or v2).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_cpu import RELEASE, SMOLLM2, rewritten  # noqa: E402
from bench_memlimit import Cgroup, drop_caches  # noqa: E402

import llama_cpp  # noqa: E402
from llama_cpp.llama_chat_format import Jinja2ChatFormatter  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SLUICED = os.environ.get("SLUICED", os.path.join(RELEASE, "sluiced"))
CACHE = os.environ.get("SLUICE_CACHE", os.path.expanduser("~/.cache/sluice"))
GEMMA3 = os.path.join(CACHE, "models", "gemma-3-270m-q4_k_m.gguf")
MIB = 2**20

LLAMA_WORKER = r'''
import json, sys, time
import numpy as np
import llama_cpp
# llama.cpp through its C API (llama-cpp-python's bindings): greedy decoding, and with LOOKUP > 0
# prompt lookup as llama.cpp's lookup example and llama-cpp-python's LlamaPromptLookupDecoding
# do it (the last 2-gram, else 1-gram, searched in the text; the tokens after its first match,
# LOOKUP at most), verified in one llama_decode with logits for every row, the rejected rows'
# cells removed from the KV cache. (llama-cpp-python's own draft_model path keeps logits for the
# whole context, n_ctx x n_vocab floats, which no memory limit here holds.)
gguf, threads, ids, decode, lookup = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
low = llama_cpp
llm = llama_cpp.Llama(model_path=gguf, n_threads=threads, n_threads_batch=threads, n_ctx=len(ids) + decode + lookup + 8,
                      n_batch=512, use_mmap=True, verbose=False)
ctx, n_vocab = llm._ctx.ctx, llm.n_vocab()
batch = low.llama_batch_init(512, 0, 1)
mem = low.llama_get_memory(ctx)
def submit(tokens, pos0, all_logits):
    batch.n_tokens = len(tokens)
    for i, t in enumerate(tokens):
        batch.token[i], batch.pos[i], batch.n_seq_id[i] = t, pos0 + i, 1
        batch.seq_id[i][0] = 0
        batch.logits[i] = all_logits or i == len(tokens) - 1
    if low.llama_decode(ctx, batch) != 0:
        raise SystemExit("llama_decode failed")
def argmax(i):
    return int(np.argmax(np.ctypeslib.as_array(low.llama_get_logits_ith(ctx, i), shape=(n_vocab,))))
def propose(text):
    for n in (2, 1):
        if len(text) <= n:
            continue
        tail = text[-n:]
        for i in range(len(text) - n):
            if text[i:i + n] == tail:
                return text[i + n:i + n + lookup]
    return []
t0 = time.perf_counter()
for i in range(0, len(ids), 512):
    submit(ids[i:i + 512], i, False)
out = [argmax(-1)]
t1 = time.perf_counter()
passes = 0
while len(out) < decode + 1:
    pos = len(ids) + len(out) - 1
    draft = propose(ids + out)[:decode + 1 - len(out) - 1] if lookup else []
    submit([out[-1]] + draft, pos, True)
    passes += 1
    for j in range(len(draft) + 1):
        t = argmax(j)
        out.append(t)
        if len(out) == decode + 1 or j == len(draft) or t != draft[j]:
            break
    # Rows past the accepted ones leave the cache.
    low.llama_memory_seq_rm(mem, 0, len(ids) + len(out) - 1, -1)
t2 = time.perf_counter()
print(json.dumps({"decode_tps": (len(out) - 1) / (t2 - t1), "ttft": t1 - t0, "passes": passes, "ids": out}))
'''


def chat_ids(gguf, prompt):
    """The prompt as a user message in the model's own chat template, as llama.cpp
    tokenizes it (special tokens parsed, the template's own BOS only)."""
    llm = llama_cpp.Llama(model_path=gguf, vocab_only=True, verbose=False)
    meta = llm.metadata
    if "tokenizer.chat_template" not in meta:
        # No template (the Gemma 3 GGUF): the prompt is the text, after the model's BOS.
        return llm.tokenize(prompt.encode(), add_bos=True, special=False)
    eos = llm.detokenize([llm.token_eos()]).decode(errors="replace")
    bos = llm.detokenize([llm.token_bos()], special=True).decode(errors="replace") if llm.token_bos() >= 0 else ""
    fmt = Jinja2ChatFormatter(meta["tokenizer.chat_template"], eos_token=eos, bos_token=bos)
    text = fmt(messages=[{"role": "user", "content": prompt}]).prompt
    return llm.tokenize(text.encode(), add_bos=False, special=True)


def sluice_run(store, ids, batch, limit, a, draft, branches=0):
    cg = Cgroup("sluice-spec", limit)
    drop_caches()
    # Greedy, as llama.cpp's worker decodes: `run` otherwise samples with the model's (or
    # llama.cpp's usual) settings, temperature 0.8.
    argv = [SLUICED, "run", store, "--prompt-ids", ",".join(map(str, ids)), "--max-tokens", str(a.decode + 1),
            "--temperature", "0", "--ignore-eos", "--max-context", str(len(ids) + a.decode + 80), "--threads", str(a.threads),
            "--host-memory", str(limit),
            "--parallel", str(batch), "--json"]
    if draft:
        argv += ["--draft", draft, "--draft-max", str(a.draft_max)]
    if branches:
        argv += ["--draft-branches", str(branches)]
    rc, out, err, _, _ = cg.run(argv)
    cg.close()
    if rc != 0 and ("a draft must be resident" in err or "with a self-draft of" in err):
        # The draft does not fit beside this batch's KV cache within the limit: refused,
        # as it should be, and reported as such.
        return {"refused": err.strip().splitlines()[-1][:160]}
    if rc != 0:
        sys.exit(f"sluice failed ({' '.join(argv[:3])} ...): {err.strip()[-400:]}")
    j = json.loads(out)
    tokens = sum(len(s["generated_token_ids"]) - 1 for s in j["sequences"])
    per_pass = j["bytes_read"] / max(j["passes"], 1)
    spec = j["speculative"]
    return {"tps": j["decode_tokens_per_s"], "per_pass": tokens / max(j["decode_passes"], 1),
            "read_per_token": per_pass * j["decode_passes"] / max(tokens, 1),
            "drafted": spec["drafted_tokens"], "accepted": spec["accepted_tokens"],
            "ids": j["sequences"][0]["generated_token_ids"], "streamed": j["layers_streamed"]}


def llama_run(gguf, ids, limit, a, lookup):
    cg = Cgroup("sluice-spec", limit)
    drop_caches()
    rc, out, err, _, _ = cg.run([sys.executable, "-c", LLAMA_WORKER, gguf, str(a.threads), json.dumps(ids),
                                 str(a.llama_decode), str(lookup)])
    cg.close()
    if rc != 0:
        return {"error": (err.strip().splitlines() or [f"exit {rc}"])[-1][:100]}
    j = json.loads(out.strip().splitlines()[-1])
    return {"tps": j["decode_tps"], "ids": j["ids"], "per_pass": (len(j["ids"]) - 1) / max(j["passes"], 1)}


def bench(name, gguf, limit, prompts, a):
    store = os.path.join(CACHE, "bench-spec", os.path.basename(gguf) + ".store")
    if not os.path.isdir(store):
        subprocess.run([SLUICED, "pack", gguf, "-o", store], check=True, capture_output=True)
    idss = [chat_ids(gguf, p["prompt"]) for p in prompts]
    engines = [("sluice", None, 0), ("sluice ngram", "ngram", 0)]
    if a.branches:
        engines.append(("sluice ngram tree", "ngram", a.branches))
    for t in filter(None, a.self_draft.split(",")):
        # The self-draft (`--draft self:TYPE`): the target's resident units shared, copies of
        # its streamed ones quantized by `pack --quantize`, made once in the cache (here,
        # outside the cgroup, before the rounds).
        subprocess.run([SLUICED, "run", store, "--prompt-ids", "1", "--max-tokens", "1", "--max-context", "64",
                        "--draft", f"self:{t}"], check=True, capture_output=True)
        engines.append((f"sluice self:{t}", f"self:{t}", 0))
        if a.branches:
            engines.append((f"sluice self:{t} tree", f"self:{t}", a.branches))
    for t in filter(None, a.draft_store.split(",")):
        # A draft store: the target's own weights quantized by `pack --quantize`, a store of
        # its own, resident whole inside the same limit.
        draft = os.path.join(CACHE, "bench-spec", f"{os.path.basename(gguf)}.{t}.store")
        if not os.path.isdir(draft):
            subprocess.run([SLUICED, "pack", gguf, "-o", draft, "--quantize", t], check=True, capture_output=True)
        engines.append((f"sluice draft {t}", draft, 0))
        if a.branches:
            engines.append((f"sluice draft {t} tree", draft, a.branches))
    if a.engines:
        # Plain sluice stays: every ratio is against it.
        keep = set(a.engines.split(","))
        engines = [e for e in engines if e[0] == "sluice" or e[0].removeprefix("sluice ") in keep]
    print(f"\n{name}: {os.path.basename(gguf)}, limit {limit / MIB:.0f} MiB, {a.threads} threads, {len(prompts)} prompts "
          f"({', '.join(str(len(i)) for i in idss)} tokens), {a.decode} greedy tokens each, --draft-max {a.draft_max}")
    for batch in a.batches:
        rows = {e: [] for e, _, _ in engines}
        llama = {"llama.cpp": [], "llama.cpp lookup": []} if batch == 1 and not a.no_llama else {}
        for r in range(a.rounds):
            for k, (p, ids) in enumerate(zip(prompts, idss)):
                plain_ids = None
                for e, draft, branches in engines:
                    s = sluice_run(store, ids, batch, limit, a, draft, branches)
                    s.update(kind=p["kind"], round=r)
                    if "refused" in s:
                        a.refused.add(f"{name} batch {batch} {e}: {s['refused']}")
                        continue
                    if plain_ids is None:
                        plain_ids = s["ids"]
                    elif s["ids"] != plain_ids:
                        a.mismatch.append(f"{name} batch {batch} prompt {k} {e}: ids differ from plain sluice's")
                    rows[e].append(s)
                for e, lookup in (("llama.cpp", 0), ("llama.cpp lookup", 10)):
                    if e in llama and p["kind"] in a.llama_kinds.split(","):
                        l = llama_run(gguf, ids, limit, a, lookup)
                        l.update(kind=p["kind"], round=r)
                        llama[e].append(l)
        print(f"batch {batch}:")
        print(f"  {'engine':<24} {'kind':<8} {'tok/s':>8} {'tok/pass':>9} {'MB read/tok':>12} {'acceptance':>11}")
        for e, runs in rows.items():
            for kind in sorted({x["kind"] for x in runs}):
                sel = [x for x in runs if x["kind"] == kind]
                acc = sum(x["accepted"] for x in sel) / max(sum(x["drafted"] for x in sel), 1)
                print(f"  {e:<24} {kind:<8} {statistics.median(x['tps'] for x in sel):>8.2f} "
                      f"{statistics.median(x['per_pass'] for x in sel):>9.2f} "
                      f"{statistics.median(x['read_per_token'] for x in sel) / 1e6:>12.1f} "
                      f"{acc if e != 'sluice' else float('nan'):>11.2f}")
        for e, runs in llama.items():
            for kind in sorted({x["kind"] for x in runs}):
                sel = [x for x in runs if x["kind"] == kind and "error" not in x]
                tps = statistics.median(x["tps"] for x in sel) if sel else float("nan")
                per = statistics.median(x["per_pass"] for x in sel) if sel else float("nan")
                errs = sorted({x["error"] for x in runs if x["kind"] == kind and "error" in x})
                print(f"  {e:<24} {kind:<8} {tps:>8.2f} {per:>9.2f}" + (f"  failed: {'; '.join(errs)}" if errs else ""))
        # Speed-ups per round, all prompts of a kind together (total tokens over total time).
        for kind in sorted({p["kind"] for p in prompts}):
            def rate(runs, r):
                sel = [x for x in runs if x["kind"] == kind and x["round"] == r and "error" not in x]
                return len(sel) / sum(1 / x["tps"] for x in sel) if sel else float("nan")
            for e, _, _ in engines[1:]:
                vs_plain = [rate(rows[e], r) / rate(rows["sluice"], r) for r in range(a.rounds)]
                line = f"  {kind:<8} {e}: {statistics.median(vs_plain):.2f}x plain sluice (rounds {', '.join(f'{v:.2f}' for v in vs_plain)})"
                if llama and kind in a.llama_kinds.split(","):
                    vs_lookup = [rate(rows[e], r) / rate(llama["llama.cpp lookup"], r) for r in range(a.rounds)]
                    vs_llama = [rate(rows[e], r) / rate(llama["llama.cpp"], r) for r in range(a.rounds)]
                    line += (f", {statistics.median(vs_lookup):.2f}x llama.cpp lookup (rounds "
                             f"{', '.join(f'{v:.2f}' for v in vs_lookup)}), {statistics.median(vs_llama):.2f}x llama.cpp plain")
                print(line)


def size(s):
    units = {"kib": 2**10, "mib": 2**20, "gib": 2**30}
    for u, m in units.items():
        if s.lower().endswith(u):
            return int(float(s[:-3]) * m)
    return int(s)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="smollm2,gemma3")
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--decode", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--draft-max", type=int, default=8)
    ap.add_argument("--limit-smollm2", default="192MiB")
    ap.add_argument("--limit-gemma3", default="320MiB")
    ap.add_argument("--kinds", default="summary,code,chat")
    ap.add_argument("--self-draft", default="q8_0",
                    help="types of the self-drafts to run (--draft self:TYPE), comma-separated; '' for none")
    ap.add_argument("--draft-store", default="",
                    help="types of separate draft stores of the target (pack --quantize) to run, comma-separated")
    ap.add_argument("--branches", type=int, default=0,
                    help="also run each drafter with token trees of this many branches (--draft-branches)")
    ap.add_argument("--engines", default="",
                    help="run only these drafters (as the table names them: ngram, self:q4_k, ngram tree, "
                         "draft q8_0, ...), comma-separated, beside plain sluice; '' for all")
    ap.add_argument("--no-llama", action="store_true")
    # llama.cpp reads the whole model from disk for every pass under the limit (its mmap's
    # pages are evicted): a few tokens give its rate.
    ap.add_argument("--llama-decode", type=int, default=48)
    ap.add_argument("--llama-kinds", default="summary,code,chat")
    a = ap.parse_args()
    a.batches = [int(b) for b in a.batch.split(",")]
    a.mismatch = []
    a.refused = set()
    prompts = [p for p in json.load(open(os.path.join(ROOT, "scripts", "bench_spec_prompts.json")))
               if p["kind"] in a.kinds.split(",")]
    os.makedirs(os.path.join(CACHE, "bench-spec"), exist_ok=True)
    for m in a.models.split(","):
        if m == "smollm2":
            bench("SmolLM2-135M F16", rewritten(SMOLLM2, "F16", 1), size(a.limit_smollm2), prompts, a)
        elif m == "gemma3":
            bench("Gemma 3 270M F16", rewritten(GEMMA3, "F16", 1), size(a.limit_gemma3), prompts, a)
        else:
            sys.exit(f"unknown model {m}: smollm2 or gemma3")
    for m in sorted(a.refused):
        print("REFUSED:", m)
    for m in a.mismatch:
        print("MISMATCH:", m)
    sys.exit(1 if a.mismatch else 0)


if __name__ == "__main__":
    main()
