#!/usr/bin/env python3
"""llama.cpp (llama-cpp-python, mmap) and sluice inside the same memory cgroup, at limits
from "everything fits" down to the least each survives, at batch 1 and 8 (llama.cpp: that
many parallel sequences in one llama_decode per step; sluice: `run --parallel`), greedy
decode, same prompt and threads. For each limit, batch and engine: decode tokens/s of the
batch, bytes read from storage per decode step (from /proc/PID/io, polled while it runs),
and the cgroup's peak memory (anonymous memory and page cache). fio measures the disk in
the same run (4 MiB x 64, registered buffers: its best here); the disk bound is batch x
fio's rate / sluice's bytes per step, the compute bound sluice's own rate with no limit
(everything resident, same batch, measured first), and "vs bound" is sluice's rate over the
lower of the two ("limit" names it: the disk where streaming is the limit).

Models: SmolLM2-135M (the project's GGUF) and, with --big, a random 1.2 GB Llama made by
scripts/make_random_llama_gguf.py; with --moe, a random 0.87 GiB mixture of experts (8
layers, hidden 1024, 64 experts of 512 rows, top 4, Q8_0, a skewed router) made by the same
script. sluice runs with --host-memory equal to the limit; SLUICED=BIN runs another build
(an earlier commit's, to compare).
Needs root (a child of this process's memory cgroup, v1 or v2), llama-cpp-python, fio and
a release build.

    python3 scripts/bench_memlimit.py [--threads 2] [--big] [--no-small] [--decode 32] [--batch 1,8]
        [--rounds 3] [--time-limit 300]

A run past --time-limit seconds is stopped: its cell shows "< X", the decode rate it could
at most have reached (the decode steps' tokens over the seconds it ran, load included), and
sluice's ratio to it "> Y" (llama.cpp with 8 sequences at 96 MiB on SmolLM2 ran for more
than 10 minutes here).
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The binaries are wherever cargo puts them (CARGO_TARGET_DIR, build.target-dir or ./target).
RELEASE = os.path.join(subprocess.run([os.path.join(ROOT, "scripts/target-dir.sh")], check=True, capture_output=True,
                                      text=True).stdout.strip(), "release")
SLUICED = os.environ.get("SLUICED", os.path.join(RELEASE, "sluiced"))
PROMPT = "The history of the printing press begins"
MIB = 2**20

WORKER = r'''
import sys, time, json, numpy as np, llama_cpp
gguf, threads, decode, prompt, parallel = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], int(sys.argv[5])
def io():
    d = dict(l.split(": ") for l in open("/proc/self/io").read().splitlines())
    return int(d["read_bytes"])
# parallel sequences in one decode call per step, as llama.cpp's batched example does: a
# KV cache of 256 positions per sequence, the prompt prefilled for every sequence in one
# batch, then one token per sequence per llama_decode.
# Llama() takes no n_seq_max: its context parameters come from llama_context_default_params,
# wrapped here to allow `parallel` sequences in one unified KV cache.
low = llama_cpp.llama_cpp
defaults = low.llama_context_default_params
def with_sequences():
    p = defaults()
    p.n_seq_max, p.kv_unified = parallel, True
    return p
low.llama_context_default_params = with_sequences
llm = llama_cpp.Llama(model_path=gguf, n_threads=threads, n_threads_batch=threads, n_ctx=256 * parallel,
                      n_batch=512, use_mmap=True, verbose=False)
ctx = llm._ctx.ctx
n_vocab = llm.n_vocab()
ids = llm.tokenize(prompt.encode(), add_bos=False)
batch = llama_cpp.llama_batch_init(max(len(ids) * parallel, parallel), 0, parallel)
def submit(rows):
    # rows: (token, pos, seq, wants logits)
    batch.n_tokens = len(rows)
    for i, (t, p, s, want) in enumerate(rows):
        batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = t, p, 1, want
        batch.seq_id[i][0] = s
    if llama_cpp.llama_decode(ctx, batch) != 0:
        raise SystemExit("llama_decode failed")
def argmax(i):
    return int(np.argmax(np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, i), shape=(n_vocab,))))
t0 = time.perf_counter()
submit([(t, p, s, p == len(ids) - 1) for s in range(parallel) for p, t in enumerate(ids)])
nxt = [argmax((s + 1) * len(ids) - 1) for s in range(parallel)]
t1 = time.perf_counter()
r0 = io()
for step in range(decode):
    submit([(nxt[s], len(ids) + step, s, True) for s in range(parallel)])
    nxt = [argmax(s) for s in range(parallel)]
t2 = time.perf_counter()
print(json.dumps({"decode_tps": decode * parallel / (t2 - t1), "read_per_step": (io() - r0) / decode}))
'''


class Cgroup:
    """A child memory cgroup of this process's own (v1 or v2) with a limit."""

    def __init__(self, name, limit):
        own = open("/proc/self/cgroup").read().splitlines()
        v1 = [l.split(":", 2)[2] for l in own if "memory" in l.split(":")[1].split(",")]
        if v1:
            parent, self.v2 = "/sys/fs/cgroup/memory" + v1[0], False
        else:
            parent, self.v2 = "/sys/fs/cgroup" + own[-1].split(":", 2)[2], True
            try:
                open(os.path.join(parent, "cgroup.subtree_control"), "w").write("+memory")
            except OSError:
                pass
        self.dir = os.path.join(parent.rstrip("/"), name)
        if os.path.isdir(self.dir):
            os.rmdir(self.dir)
        os.mkdir(self.dir)
        f = "memory.max" if self.v2 else "memory.limit_in_bytes"
        open(os.path.join(self.dir, f), "w").write(str(limit))

    def peak(self):
        f = "memory.peak" if self.v2 else "memory.max_usage_in_bytes"
        return int(open(os.path.join(self.dir, f)).read())

    def oom_kills(self):
        f = "memory.events" if self.v2 else "memory.oom_control"
        for l in open(os.path.join(self.dir, f)).read().splitlines():
            if l.startswith("oom_kill "):
                return int(l.split()[1])
        return 0

    def run(self, argv, time_limit=None):
        """Runs argv inside the cgroup; returns (returncode, stdout, stderr, read_bytes of the
        process as last polled, seconds it ran or None if it finished within time_limit)."""
        procs = os.path.join(self.dir, "cgroup.procs")
        p = subprocess.Popen(["sh", "-c", f'echo $$ > {procs}; exec "$0" "$@"', *argv],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        last = 0
        t0 = time.monotonic()
        timed_out = None
        while p.poll() is None:
            if time_limit and time.monotonic() - t0 > time_limit:
                timed_out = time.monotonic() - t0
                p.kill()
                p.wait()
                break
            try:
                d = dict(l.split(": ") for l in open(f"/proc/{p.pid}/io").read().splitlines())
                last = int(d["read_bytes"])
            except (OSError, ValueError):
                pass
            time.sleep(0.01)
        out, err = p.communicate()
        return p.returncode, out, err, last, timed_out

    def close(self):
        for _ in range(100):
            try:
                os.rmdir(self.dir)
                return
            except OSError:
                time.sleep(0.05)


def drop_caches():
    # Dirty pages are not dropped: a GGUF just written (the random Llama, made in this run)
    # would stay cached, charged to this script's group, and the next engine would read it
    # from memory its limit does not see.
    os.sync()
    try:
        open("/proc/sys/vm/drop_caches", "w").write("1")
    except OSError:
        pass


def fio_rate(path, seconds=3):
    """The disk's rate as fio gets it at its best here: 4 MiB x 64 in flight into registered
    buffers (without --fixedbufs this VM gives about half; at 1 MiB x 8 it gave 0.8 GB/s
    where 4 MiB x 64 gave 2.0)."""
    out = subprocess.run(["fio", "--name=r", f"--filename={path}", "--rw=read", "--bs=4m", "--direct=1",
                          "--ioengine=io_uring", "--fixedbufs", "--iodepth=64", f"--runtime={seconds}",
                          "--time_based", "--readonly", "--output-format=json"],
                         capture_output=True, text=True, check=True).stdout
    return json.loads(out)["jobs"][0]["read"]["bw_bytes"]


def stopped(r, late, batch, a):
    """A run stopped after `late` seconds: the decode rate it could at most have reached."""
    r.update(error=f"stopped after {late:.0f} s", tps_max=batch * a.decode / late)
    return r


def llama_cpp(gguf, limit, batch, a):
    cg = Cgroup("sluice-memlimit", limit)
    drop_caches()
    rc, out, err, _, late = cg.run([sys.executable, "-c", WORKER, gguf, str(a.threads), str(a.decode), PROMPT,
                                    str(batch)], a.time_limit)
    r = {"peak": cg.peak(), "oom": cg.oom_kills()}
    cg.close()
    if late is not None:
        return stopped(r, late, batch, a)
    if rc != 0:
        r["error"] = (err.strip().splitlines() or [f"exit {rc}"])[-1][:80]
        return r
    j = json.loads(out.strip().splitlines()[-1])
    r.update(tps=j["decode_tps"], read=j["read_per_step"])
    return r


def sluice(store, limit, batch, a):
    cg = Cgroup("sluice-memlimit", limit)
    drop_caches()
    argv = [SLUICED, "run", store, "--prompt", PROMPT, "--max-tokens", str(a.decode + 1), "--temperature", "0", "--ignore-eos",
            "--max-context", "256", "--threads", str(a.threads), "--host-memory", str(limit),
            "--parallel", str(batch), "--json"]
    rc, out, err, read, late = cg.run(argv, a.time_limit)
    r = {"peak": cg.peak(), "oom": cg.oom_kills()}
    cg.close()
    if late is not None:
        return stopped(r, late, batch, a)
    if rc != 0:
        r["error"] = (err.strip().splitlines() or [f"exit {rc}"])[-1][:100]
        return r
    j = json.loads(out)
    passes = max(j["passes"], 1)
    # /proc/PID/io counts the start-up load of the resident units too (O_DIRECT, stored =
    # raw with --codec none): what is left is the passes' reads.
    r.update(tps=j["decode_tokens_per_s"], read=max(read - j["plan"]["resident_bytes"], 0) / passes,
             own_read=j["bytes_read"] / passes,
             planned=j["host_bytes_planned"], overhead=j["plan"]["host"]["overhead_bytes"],
             streamed=j["layers_streamed"], weights=sum(u["raw_bytes"] for u in j["plan"]["units"]),
             resident=j["plan"]["resident_bytes"])
    return r


def unlimited(store, batch, a):
    """sluice's decode tokens/s with no memory limit (every unit resident): the compute
    bound of a batch."""
    argv = [SLUICED, "run", store, "--prompt", PROMPT, "--max-tokens", str(a.decode + 1), "--temperature", "0", "--ignore-eos",
            "--max-context", "256", "--threads", str(a.threads), "--parallel", str(batch), "--json"]
    p = subprocess.run(argv, capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"sluice with no limit failed: {p.stderr.strip()[-300:]}")
    return json.loads(p.stdout)["decode_tokens_per_s"]


def bench(name, gguf, limits, a):
    size = os.path.getsize(gguf)
    with tempfile.TemporaryDirectory(dir=os.path.expanduser("~/.cache/sluice")) as tmp:
        store = os.path.join(tmp, "store")
        subprocess.run([SLUICED, "pack", gguf, "-o", store, "--codec", "none"], check=True, capture_output=True)
        disk = fio_rate(os.path.join(store, "weights.bin"))
        compute = {b: unlimited(store, b, a) for b in a.batches}
        print(f"\n{name}: GGUF {size / MIB:.0f} MiB, {a.threads} threads, batches {a.batch}, {a.decode} greedy decode steps; fio sequential O_DIRECT read {disk / 1e9:.2f} GB/s")
        print("sluice with no limit (the compute bound): " + ", ".join(f"batch {b} {t:.1f} tok/s" for b, t in compute.items()))
        print(f"{'limit':>9} {'batch':>5} | {'llama.cpp tok/s':>15} {'MB/step':>9} {'peak MiB':>9} | {'sluice tok/s':>15} {'MB/step':>9} {'peak MiB':>9} {'disk bound':>10} {'limit':>7} {'vs bound':>8} {'vs llama':>8} | fio GB/s, sluice plan")
        for limit in limits:
            for batch in a.batches:
                # The disk varies (a VM's burst credits, the host's cache): with --rounds N
                # the engines alternate N times and the round with the median sluice/llama
                # ratio is shown, with every round's ratio after it.
                rounds = []
                for _ in range(a.rounds):
                    l = llama_cpp(gguf, limit, batch, a)
                    # Measured again just before each sluice run.
                    disk = fio_rate(os.path.join(store, "weights.bin"), 1)
                    s = sluice(store, limit, batch, a)
                    ok = "error" not in l and "error" not in s
                    # Against a llama.cpp run that was stopped: a lower bound on the ratio.
                    lo = "error" not in s and "tps_max" in l
                    rounds.append((s["tps"] / l["tps"] if ok else s["tps"] / l["tps_max"] if lo else float("nan"),
                                   l, disk, s))
                ratios = sorted(r[0] for r in rounds)
                _, l, disk, s = min(rounds, key=lambda r: abs(r[0] - ratios[len(ratios) // 2]) if r[0] == r[0] else float("inf"))
                def cells(r):
                    if "tps_max" in r:
                        return f"{'< %.2f' % r['tps_max']:>15} {'':>9} {r['peak'] / MIB:>9.0f}"
                    if "error" in r:
                        return f"{'failed' + (' (OOM)' if r['oom'] else ''):>15} {'':>9} {r['peak'] / MIB:>9.0f}"
                    return f"{r['tps']:>15.2f} {r['read'] / 1e6:>9.1f} {r['peak'] / MIB:>9.0f}"
                line = f"{limit / MIB:>5.0f} MiB {batch:>5} | {cells(l)} | {cells(s)}"
                if "error" not in s:
                    # A step reads its bytes once for every sequence of the batch.
                    bound = batch * disk / s["read"] if s["read"] > 0 else float("inf")
                    limit_by = "disk" if bound < compute[batch] else "compute"
                    vs_bound = s["tps"] / min(bound, compute[batch])
                    vs_llama = (f"{s['tps'] / l['tps']:>8.2f}" if "error" not in l
                                else f"{'> %.2f' % (s['tps'] / l['tps_max']):>8}" if "tps_max" in l else f"{'nan':>8}")
                    line += f" {bound:>10.1f} {limit_by:>7} {vs_bound:>8.2f} {vs_llama} | {disk / 1e9:.2f}, {s['streamed']} units streamed, overhead {s['overhead'] / MIB:.0f} MiB, planned {s['planned'] / MIB:.0f} MiB, read {s['own_read'] / 1e6:.1f} MB/pass vs weights - resident {(s['weights'] - s['resident']) / 1e6:.1f} MB"
                else:
                    line += f"  ({s['error']})"
                if "error" in l:
                    line += f"  [llama.cpp: {l['error']}]"
                if a.rounds > 1:
                    line += "  [rounds, sluice/llama: " + ", ".join(f"{r:.2f}" for r in ratios) + "]"
                    if any("tps_max" in r[1] for r in rounds):
                        line += " (llama.cpp stopped: lower bounds)"
                print(line, flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--decode", type=int, default=32, help="decode steps (each a token per sequence)")
    ap.add_argument("--time-limit", type=float, default=300,
                    help="seconds an engine's run may take before it is stopped and shown as a bound (0: none)")
    ap.add_argument("--batch", default="1,8", help="sequences decoded together, comma-separated")
    ap.add_argument("--rounds", type=int, default=1, help="alternate the engines this many times per limit and batch")
    ap.add_argument("--small", action=argparse.BooleanOptionalAction, default=True, help="SmolLM2 (--no-small: only --big)")
    ap.add_argument("--smollm2", default=os.path.expanduser("~/.cache/sluice/models/SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--big", action="store_true", help="also the random 1.2 GB Llama (made if missing)")
    ap.add_argument("--limits", default="256,144,128,112,96,80,64", help="SmolLM2 limits in MiB")
    ap.add_argument("--big-limits", default="1600,1024,768,512,384,256", help="1.2 GB model limits in MiB")
    ap.add_argument("--moe", action="store_true", help="also the random 0.87 GiB mixture of experts (made if missing)")
    ap.add_argument("--moe-limits", default="1200,512,384,256", help="mixture limits in MiB")
    a = ap.parse_args()
    a.batches = [int(x) for x in a.batch.split(",")]
    if a.small:
        bench("SmolLM2-135M-Instruct Q4_1", a.smollm2, [int(x) * MIB for x in a.limits.split(",")], a)
    if a.big:
        big = os.path.expanduser("~/.cache/sluice/bench/random-llama-1.2g.gguf")
        if not os.path.exists(big):
            os.makedirs(os.path.dirname(big), exist_ok=True)
            subprocess.run([sys.executable, os.path.join(ROOT, "scripts/make_random_llama_gguf.py"), big], check=True)
        a.decode = min(a.decode, 8)
        bench("random Llama 1.2 GB Q8_0", big, [int(x) * MIB for x in a.big_limits.split(",")], a)
    if a.moe:
        moe = os.path.expanduser("~/.cache/sluice/bench/random-moe-64x4.gguf")
        if not os.path.exists(moe):
            os.makedirs(os.path.dirname(moe), exist_ok=True)
            subprocess.run([sys.executable, os.path.join(ROOT, "scripts/make_random_llama_gguf.py"), moe, "--layers", "8",
                            "--hidden", "1024", "--moe", "64/4", "--expert-inter", "512"], check=True)
        a.decode = min(a.decode, 16)
        bench("random mixture 64x4 0.87 GiB Q8_0", moe, [int(x) * MIB for x in a.moe_limits.split(",")], a)
    print("\ntok/s: decode tokens per second of the whole batch. MB/step: storage reads per decode step (one token for each")
    print("sequence) from /proc/PID/io (llama.cpp: its page cache refaults; sluice: O_DIRECT reads).")
    print("peak: the cgroup's max usage (anonymous + page cache). disk bound: batch x fio rate / sluice's bytes per step;")
    print("limit: the lower of it and the compute bound (sluice with no limit); vs bound: sluice over that one.")


if __name__ == "__main__":
    main()
