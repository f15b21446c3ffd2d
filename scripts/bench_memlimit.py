#!/usr/bin/env python3
"""SmolLM2 with half the model's memory: llama.cpp (mmap, in a memory cgroup whose limit
is its own baseline plus half the model file) beside sluice (device budget = KV cache +
workspace + half the weights), same prompt, same threads, greedy decode. Needs root for
the cgroup (v1 memory controller or v2), llama-cpp-python and a release build.

    python3 scripts/bench_memlimit.py [--threads 2] [--decode 64]
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPT = "The history of the printing press begins"
WORKER = r'''
import sys, time, json, numpy as np, llama_cpp
gguf, threads, decode = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
llm = llama_cpp.Llama(model_path=gguf, n_threads=threads, n_threads_batch=threads, n_ctx=256, n_batch=64, use_mmap=True, verbose=False)
ids = llm.tokenize(sys.argv[4].encode(), add_bos=False)
t0 = time.perf_counter(); llm.eval(ids); t1 = time.perf_counter()
n_vocab = llm.n_vocab()
for _ in range(decode):
    logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1), shape=(n_vocab,))
    llm.eval([int(np.argmax(logits))])
t2 = time.perf_counter()
print(json.dumps({"prefill_tps": len(ids) / (t1 - t0), "decode_tps": decode / (t2 - t1)}))
'''


def cgroup(limit):
    """A fresh memory cgroup; returns (procs file, usage-peak file)."""
    v1 = "/sys/fs/cgroup/memory"
    if os.path.isdir(v1):
        d = os.path.join(v1, "sluice-memlimit")
        if os.path.isdir(d):
            os.rmdir(d)
        os.mkdir(d)
        with open(os.path.join(d, "memory.limit_in_bytes"), "w") as f:
            f.write(str(limit) if limit else "-1")
        return d, os.path.join(d, "cgroup.procs"), os.path.join(d, "memory.max_usage_in_bytes")
    d = "/sys/fs/cgroup/sluice-memlimit"
    if os.path.isdir(d):
        os.rmdir(d)
    os.mkdir(d)
    with open(os.path.join(d, "memory.max"), "w") as f:
        f.write(str(limit) if limit else "max")
    return d, os.path.join(d, "cgroup.procs"), os.path.join(d, "memory.peak")


def drop_caches():
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1")
    except OSError:
        pass


def llama_cpp_in_cgroup(gguf, threads, decode, limit):
    d, procs, peak = cgroup(limit)
    drop_caches()
    cmd = ["sh", "-c", f'echo $$ > {procs}; exec "$0" "$@"', sys.executable, "-c", WORKER, gguf, str(threads), str(decode), PROMPT]
    out = subprocess.run(cmd, capture_output=True, text=True)
    used = int(open(peak).read())
    os.rmdir(d)
    if out.returncode != 0:
        return {"error": out.stderr.strip().splitlines()[-1] if out.stderr.strip() else f"exit {out.returncode}", "peak_bytes": used}
    r = json.loads(out.stdout.strip().splitlines()[-1])
    r["peak_bytes"] = used
    return r


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", default=os.path.expanduser("~/.cache/sluice/models/SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--decode", type=int, default=64)
    a = ap.parse_args()
    size = os.path.getsize(a.gguf)
    sluiced = os.path.join(ROOT, "target/release/sluiced")

    free = llama_cpp_in_cgroup(a.gguf, a.threads, a.decode, 0)
    # What llama.cpp needs besides the mapped model (Python, buffers, KV cache).
    baseline = max(free["peak_bytes"] - size, 0)
    limit = baseline + size // 2
    limited = llama_cpp_in_cgroup(a.gguf, a.threads, a.decode, limit)

    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "smollm2")
        subprocess.run([sluiced, "pack", a.gguf, "-o", store, "--codec", "lz4"], check=True, capture_output=True)
        def sluice(dm):
            drop_caches()
            args = [sluiced, "run", store, "--prompt", PROMPT, "--max-tokens", str(a.decode + 1), "--ignore-eos", "--max-context", "256", "--threads", str(a.threads), "--json"]
            if dm:
                args += ["--device-memory", str(dm)]
            return json.loads(subprocess.run(args, check=True, capture_output=True, text=True).stdout)
        full = sluice(None)
        weights = sum(u["raw_bytes"] for u in full["plan"]["units"])
        budget = full["plan"]["kv_cache_bytes"] + full["plan"]["workspace_bytes"] + weights // 2
        half = sluice(budget)

    mib = lambda b: f"{b / 2**20:.1f} MiB"
    print(f"SmolLM2-135M-Instruct Q4_1 ({mib(size)}), {a.threads} threads, greedy decode of {a.decode} tokens")
    print(f"llama.cpp baseline besides the model: {mib(baseline)}; cgroup limit = baseline + half the model = {mib(limit)}")
    print(f"{'run':<44} {'decode tok/s':>12} {'memory':>14}")
    print(f"{'llama.cpp, mmap, no limit':<44} {free['decode_tps']:>12.1f} {mib(free['peak_bytes']):>14}")
    if "error" in limited:
        print(f"{'llama.cpp, mmap, limit':<44} {'failed':>12} {mib(limited['peak_bytes']):>14}  ({limited['error']})")
    else:
        print(f"{'llama.cpp, mmap, limit':<44} {limited['decode_tps']:>12.1f} {mib(limited['peak_bytes']):>14}")
    print(f"{'sluice, all resident':<44} {full['decode_tokens_per_s']:>12.1f} {mib(full['device_bytes_peak']):>14}")
    print(f"{'sluice, device budget KV+ws+half the weights':<44} {half['decode_tokens_per_s']:>12.1f} {mib(half['device_bytes_peak']):>14}")
    if "error" not in limited:
        print(f"sluice / llama.cpp under half the model: {half['decode_tokens_per_s'] / limited['decode_tps']:.2f}")
    print("memory: llama.cpp = the cgroup's peak (anonymous + page cache); sluice = its device arena peak (host buffers not counted)")


if __name__ == "__main__":
    main()
