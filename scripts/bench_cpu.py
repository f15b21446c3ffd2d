#!/usr/bin/env python3
"""GGUFs on the CPU: sluice beside llama.cpp (llama-cpp-python) on the same GGUF, the same
threads and the same 512-token prompt, measured in one run. Prints prefill and decode
tokens/s of each and the ratios. By default SmolLM2 three ways: its Q4_1 GGUF, and the
same rewritten as F16 and as BF16 by llama.cpp's own quantizer (`llama_model_quantize`,
allow_requantize; made once, beside the Q4_1 in the model cache), so the 16-bit kernels are
never out of sight; --gguf (repeatable) for others, e.g. Gemma 3 270M.

    pip install llama-cpp-python
    cargo build --release
    python3 scripts/bench_cpu.py [--gguf FILE]... [--threads 2] [--decode 128] [--rounds 2] [--baseline BIN] [--no-exact]

sluice runs twice a round: its default numerics (8-bit activations, f16 KV cache) and --exact.
--baseline BIN adds another sluiced binary (an earlier build) to every round, so a change is
measured against its parent in the same alternation. Ratios are per round (each engine
against the llama.cpp run of its own round), then their median.
"""
import argparse
import ctypes
import re
import json
import os
import subprocess
import sys
import tempfile
import time

import llama_cpp
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The binaries are wherever cargo puts them (CARGO_TARGET_DIR, build.target-dir or ./target).
RELEASE = os.path.join(subprocess.run([os.path.join(ROOT, "scripts/target-dir.sh")], check=True, capture_output=True,
                                      text=True).stdout.strip(), "release")
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


def sluice_run(store, ids, threads, decode, extra=(), binary=None):
    out = subprocess.run([binary or os.path.join(RELEASE, "sluiced"), "run", store, "--prompt-ids", ",".join(map(str, ids)),
                          "--max-tokens", str(decode + 1), "--temperature", "0", "--ignore-eos", "--threads", str(threads), "--json", *extra],
                         check=True, capture_output=True, text=True).stdout
    j = json.loads(out)
    return j["prefill_tokens_per_s"], j["decode_tokens_per_s"]


SMOLLM2 = os.path.join(os.environ.get("SLUICE_CACHE", os.path.expanduser("~/.cache/sluice")), "models",
                       "SmolLM2-135M-Instruct.Q4_1.gguf")


def rewritten(src, name, ftype):
    """`src` rewritten as `name` (F16, BF16) by llama.cpp's quantizer, made once beside it."""
    dst = re.sub(r"(\.Q4_1)?\.gguf$", f".{name}.gguf", src)
    if not os.path.exists(dst):
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype, params.allow_requantize, params.nthread = ftype, True, 2
        # The quantizer logs every tensor on stderr: keep it off the table.
        saved, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 2)
        try:
            rc = llama_cpp.llama_model_quantize(src.encode(), (dst + ".tmp").encode(), ctypes.byref(params))
        finally:
            os.dup2(saved, 2)
            os.close(null)
            os.close(saved)
        if rc != 0:
            sys.exit(f"llama_model_quantize {src} -> {name} failed ({rc})")
        os.replace(dst + ".tmp", dst)
    return dst


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", action="append", help="a GGUF to run (repeatable; default: SmolLM2 Q4_1, F16 and BF16)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--decode", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--baseline", help="another sluiced binary to run beside this one in every round")
    ap.add_argument("--no-exact", action="store_true", help="skip the --exact runs")
    ap.add_argument("--no-llama", action="store_true", help="sluice against --baseline only (no llama.cpp runs)")
    a = ap.parse_args()
    if a.no_llama and not a.baseline:
        ap.error("--no-llama needs --baseline")
    ggufs = a.gguf or [SMOLLM2, rewritten(SMOLLM2, "F16", 1), rewritten(SMOLLM2, "BF16", 32)]
    for gguf in ggufs:
        bench(a, gguf)


def bench(a, gguf):
    vocab = llama_cpp.Llama(model_path=gguf, vocab_only=True, verbose=False)
    ids = vocab.tokenize((TEXT * 40).encode(), add_bos=False)[:512]
    assert len(ids) == 512
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "smollm2")
        subprocess.run([os.path.join(RELEASE, "sluiced"), "pack", gguf, "-o", store, "--codec", "none"], check=True, capture_output=True)
        rows = []
        for r in range(a.rounds):
            if not a.no_llama:
                rows.append((r, "llama.cpp", *llama_cpp_run(gguf, ids, a.threads, a.decode)))
            rows.append((r, "sluice", *sluice_run(store, ids, a.threads, a.decode)))
            if a.baseline:
                rows.append((r, "baseline", *sluice_run(store, ids, a.threads, a.decode, binary=a.baseline)))
            if not a.no_exact:
                rows.append((r, "sluice --exact", *sluice_run(store, ids, a.threads, a.decode, ["--exact"])))
    print(f"\n{os.path.basename(gguf)}, {a.threads} threads, 512-token prompt, {a.decode} decode tokens, {a.rounds} rounds alternating")
    print(f"{'round':<6} {'engine':<16} {'prefill tok/s':>14} {'decode tok/s':>13}")
    for r, name, p, d in rows:
        print(f"{r:<6} {name:<16} {p:>14.1f} {d:>13.1f}")
    names = [n for n in ("sluice", "baseline", "sluice --exact") if any(row[1] == n for row in rows)]
    med = lambda v: v[len(v) // 2] if len(v) % 2 else (v[len(v) // 2 - 1] + v[len(v) // 2]) / 2
    pairs = [("llama.cpp", n) for n in names] + ([("baseline", "sluice")] if a.baseline else [])
    for ref_name, n in pairs:
        ref = {r: (p, d) for r, m, p, d in rows if m == ref_name}
        if not ref:
            continue
        pr = sorted(p / ref[r][0] for r, m, p, _ in rows if m == n)
        dr = sorted(d / ref[r][1] for r, m, _, d in rows if m == n)
        print(f"{n}/{ref_name}: prefill median {med(pr):.2f} (rounds {', '.join(f'{x:.2f}' for x in pr)}), "
              f"decode median {med(dr):.2f} (rounds {', '.join(f'{x:.2f}' for x in dr)})")


if __name__ == "__main__":
    sys.exit(main())
