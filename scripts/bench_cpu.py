#!/usr/bin/env python3
"""A GGUF on the CPU (SmolLM2 by default; --gguf for another, e.g. Gemma 3 270M): sluice
beside llama.cpp (llama-cpp-python) on the same GGUF, the same threads and the same 512-token prompt, measured in one run. Prints prefill and decode
tokens/s of each and the ratios.

    pip install llama-cpp-python
    cargo build --release
    python3 scripts/bench_cpu.py [--threads 2] [--decode 128] [--rounds 2]

sluice runs twice a round: its default numerics (8-bit activations, f16 KV cache) and --exact.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import llama_cpp
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEXT = ("The printing press, invented by Johannes Gutenberg around the middle of the fifteenth century, "
        "changed how knowledge moved through Europe. Before it, books were copied by hand, slowly and at great cost. ")


def llama_cpp_run(gguf, ids, threads, decode):
    llm = llama_cpp.Llama(model_path=gguf, n_threads=threads, n_threads_batch=threads, n_ctx=1024, n_batch=512, verbose=False)
    llm.reset()
    t0 = time.perf_counter()
    llm.eval(ids)
    t1 = time.perf_counter()
    n_vocab = llm.n_vocab()
    for _ in range(decode):
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1), shape=(n_vocab,))
        llm.eval([int(np.argmax(logits))])
    t2 = time.perf_counter()
    return len(ids) / (t1 - t0), decode / (t2 - t1)


def sluice_run(store, ids, threads, decode, extra=()):
    out = subprocess.run([os.path.join(ROOT, "target/release/sluiced"), "run", store, "--prompt-ids", ",".join(map(str, ids)),
                          "--max-tokens", str(decode + 1), "--ignore-eos", "--threads", str(threads), "--json", *extra],
                         check=True, capture_output=True, text=True).stdout
    j = json.loads(out)
    return j["prefill_tokens_per_s"], j["decode_tokens_per_s"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", default=os.path.expanduser("~/.cache/sluice/models/SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--decode", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    vocab = llama_cpp.Llama(model_path=a.gguf, vocab_only=True, verbose=False)
    ids = vocab.tokenize((TEXT * 40).encode(), add_bos=False)[:512]
    assert len(ids) == 512
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "smollm2")
        subprocess.run([os.path.join(ROOT, "target/release/sluiced"), "pack", a.gguf, "-o", store, "--codec", "none"], check=True, capture_output=True)
        rows = []
        for r in range(a.rounds):
            rows.append(("llama.cpp", *llama_cpp_run(a.gguf, ids, a.threads, a.decode)))
            rows.append(("sluice", *sluice_run(store, ids, a.threads, a.decode)))
            rows.append(("sluice --exact", *sluice_run(store, ids, a.threads, a.decode, ["--exact"])))
    print(f"{os.path.basename(a.gguf)}, {a.threads} threads, 512-token prompt, {a.decode} decode tokens, {a.rounds} rounds alternating")
    print(f"{'engine':<16} {'prefill tok/s':>14} {'decode tok/s':>13}")
    for name, p, d in rows:
        print(f"{name:<16} {p:>14.1f} {d:>13.1f}")
    names = ("llama.cpp", "sluice", "sluice --exact")
    best = {n: (max(r[1] for r in rows if r[0] == n), max(r[2] for r in rows if r[0] == n)) for n in names}
    for n in names[1:]:
        print(f"best of rounds: {n}/llama.cpp prefill {best[n][0] / best['llama.cpp'][0]:.2f}, decode {best[n][1] / best['llama.cpp'][1]:.2f}")


if __name__ == "__main__":
    sys.exit(main())
