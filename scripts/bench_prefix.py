#!/usr/bin/env python3
"""The prefix cache where it pays: `sluiced serve` with the cache on and with
`--prefix-cache off`, alternating in one run, each daemon inside the same memory cgroup,
where most of the model's layers stream (F16 targets: SmolLM2-135M and Gemma 3 270M
rewritten as F16 by llama.cpp's quantizer, as scripts/bench_spec.py makes them).

Workloads, through the daemon's OpenAI HTTP API (streamed, so time to first token is what
a client sees):
- a 6-turn chat (SmolLM2 through its chat template; Gemma 3 270M, a base model, as one
  growing completion prompt): per turn the time to first token, the passes its prefill ran
  (`sluice_passes_total` around the request, less one a decode step), the prompt and
  cached tokens; and the same turn's new tokens alone (a cold prompt of that many tokens)
  for the goal: turn N's first token within 1.2x of prefilling its new tokens alone;
- 32 requests sharing a long system prompt (~1,000 tokens), --concurrency at a time:
  wall time, mean time to first token, passes, cached tokens;
- the same conversation resumed after a restart: turns 1-5 on one daemon, a clean stop
  (SIGTERM, as `systemctl restart` sends), a new daemon on the same --kv-cache-dir, turn 6:
  its time to first token against turn 6 on the daemon that ran the whole conversation
  (goal: within 1.5x) and with the cache off;
- a batch job (`sluice batch`) of 32 short documents whose --template carries a long
  instruction (~800 tokens): wall time, passes, cached tokens.
Beside them, llama.cpp (llama-cpp-python) on the same chat in the same cgroup: its `Llama`
reuses the previous call's KV for a common prefix by itself; per turn its time to first
token; and its restart: turns 1-5 in one process with `LlamaDiskCache`, turn 6 in a new
one (`--llama-only` runs just these).

With the cache on, each daemon has a disk tier in a fresh directory (--kv-cache-dir) and
the default host tier. Every output is compared: cache on and off must agree.

    pip install llama-cpp-python
    cargo build --release
    sudo python3 scripts/bench_prefix.py [--models smollm2,gemma3] [--rounds 2]
        [--limit-smollm2 288MiB] [--limit-gemma3 384MiB] [--batch-tokens 128]
        [--max-tokens 48] [--concurrency 4] [--no-llama | --llama-only]

Needs root (a child memory cgroup of this process's own, v1 or v2).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import shutil
import tempfile
import threading
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_cpu import RELEASE, SMOLLM2, rewritten  # noqa: E402
from bench_memlimit import Cgroup, drop_caches  # noqa: E402
from bench_spec import GEMMA3, size  # noqa: E402

import llama_cpp  # noqa: E402

SLUICED = os.environ.get("SLUICED", os.path.join(RELEASE, "sluiced"))
CACHE = os.environ.get("SLUICE_CACHE", os.path.expanduser("~/.cache/sluice"))

TURNS = [
    "I am planning a week of dinners for a family of four on a small budget. Suggest a plan "
    "with one main dish a day, and say what to buy for it.",
    "Two of us do not eat meat. Change the plan so every dinner works for them too, and keep "
    "the cost about the same.",
    "We have only one large pot and an oven. Which dishes need changes, and how?",
    "Write the shopping list grouped by the part of the shop where each thing is found.",
    "Which three dinners can be cooked ahead on Sunday, and how should they be stored?",
    "Summarize the final plan in one short paragraph for the family's group chat.",
]

SYSTEM = (
    "You are the support assistant of a company that rents bicycles in a large city. "
    "Customers write about bookings, payments, damaged bicycles, lost keys, opening hours, "
    "prices for students and families, group tours, electric bicycles and their batteries, "
    "helmets, child seats, insurance, deposits and refunds. Answer in two sentences at most, "
    "politely, and never promise a refund before a person has checked the booking. "
) * 10
QUESTIONS = [f"Question {i}: " + q for i, q in enumerate([
    "How much is a day for a student?", "Can I bring the bicycle back late?",
    "My battery died halfway, what now?", "Do you have child seats?",
    "Is a helmet included?", "I lost the key, who pays?", "Can twelve of us book a tour?",
    "When do you open on Sunday?"] * 4)]


class Daemon:
    """`sluiced serve` on `store` inside a memory cgroup of `limit` bytes."""

    def __init__(self, store, model, limit, cache_on, a, kv_dir=None):
        self.cg = Cgroup("sluice-prefix", limit)
        drop_caches()
        self.port = free_port()
        self.grpc = f"127.0.0.1:{free_port()}"
        argv = [SLUICED, "serve", "--model", store, "--config", "/dev/null",
                "--listen", self.grpc, "--http-listen", f"127.0.0.1:{self.port}",
                "--host-memory", str(limit), "--max-context", "1024", "--max-batch", str(a.concurrency),
                "--batch-tokens", str(a.batch_tokens), "--threads", str(a.threads),
                "--prefix-cache", "on" if cache_on else "off"]
        if cache_on:
            self.kv_dir = kv_dir or tempfile.mkdtemp(prefix="sluice-bench-kv-")
            argv += ["--kv-cache-dir", self.kv_dir]
        procs = os.path.join(self.cg.dir, "cgroup.procs")
        self.log = open(os.path.join(CACHE, "bench-prefix.log"), "a")
        self.p = subprocess.Popen(["sh", "-c", f'echo $$ > {procs}; exec "$0" "$@"', *argv],
                                  stdout=self.log, stderr=self.log, env={**os.environ, "RUST_LOG": "info"})
        self.base = f"http://127.0.0.1:{self.port}"
        self.model = model
        t0 = time.monotonic()
        while True:
            try:
                if urllib.request.urlopen(self.base + "/health", timeout=1).status == 200:
                    break
            except OSError:
                pass
            if self.p.poll() is not None or time.monotonic() - t0 > 120:
                sys.exit(f"sluiced serve did not come up (see {self.log.name})")
            time.sleep(0.1)

    def metric(self, name):
        text = urllib.request.urlopen(self.base + "/metrics").read().decode()
        for line in text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        return 0.0

    def passes_after(self):
        """Passes run so far, read once the last request's pass is counted (the engine
        publishes its counts after it has sent the request's end)."""
        time.sleep(0.1)
        return self.metric("sluice_passes_total")

    def stream(self, path, body):
        """Streams a request; returns (seconds to the first text, text, usage)."""
        body = {**body, "model": self.model, "stream": True, "stream_options": {"include_usage": True},
                "temperature": 0}
        req = urllib.request.Request(self.base + path, json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        t0 = time.monotonic()
        first, text, usage = None, "", None
        with urllib.request.urlopen(req) as r:
            for raw in r:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                j = json.loads(line[6:])
                if "error" in j:
                    sys.exit(f"request failed: {j['error']}")
                if j.get("usage"):
                    usage = j["usage"]
                for c in j.get("choices", []):
                    piece = (c.get("delta") or {}).get("content") or c.get("text") or ""
                    if piece and first is None:
                        first = time.monotonic() - t0
                    text += piece
        return first if first is not None else time.monotonic() - t0, text, usage

    def close(self):
        self.p.terminate()
        if self.p.wait() != 0:
            sys.exit(f"sluiced serve did not stop cleanly (see {self.log.name})")
        self.log.close()
        self.cg.close()


def free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def chat(d, chat_api, a, turns=None, state=None):
    """The 6-turn conversation (or `turns` of it, going on from `state`, which it updates):
    per turn (ttft, prefill passes, prompt, cached, answer)."""
    state = state if state is not None else {"messages": [], "prompt": ""}
    messages, out = state["messages"], []
    for turn in (TURNS if turns is None else turns):
        prompt = state["prompt"]
        before = d.metric("sluice_passes_total")
        if chat_api:
            messages.append({"role": "user", "content": turn})
            ttft, text, usage = d.stream("/v1/chat/completions", {"messages": messages, "max_tokens": a.max_tokens})
            messages.append({"role": "assistant", "content": text})
        else:
            prompt += f"Question: {turn}\nAnswer:"
            ttft, text, usage = d.stream("/v1/completions", {"prompt": prompt, "max_tokens": a.max_tokens})
            state["prompt"] = prompt + text + "\n"
        passes = d.passes_after() - before - (usage["completion_tokens"] - 1)
        out.append({"ttft": ttft, "passes": passes, "prompt": usage["prompt_tokens"],
                    "cached": usage["prompt_tokens_details"]["cached_tokens"], "text": text})
    return out


def alone(d, n, seed, a):
    """Time to first token of a cold prompt of n token ids (nothing any slot holds)."""
    ids = [1000 + (seed * 7919 + i * 31) % 20000 for i in range(n)]
    ttft, _, usage = d.stream("/v1/completions", {"prompt": ids, "max_tokens": 2})
    assert usage["prompt_tokens_details"]["cached_tokens"] == 0, usage
    return ttft


def shared(d, chat_api, a):
    """32 requests sharing SYSTEM, a.concurrency at a time: wall, mean ttft, passes, cached."""
    todo, lock, res = list(QUESTIONS), threading.Lock(), []

    def worker():
        while True:
            with lock:
                if not todo:
                    return
                q = todo.pop()
            if chat_api:
                body = {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]}
                r = d.stream("/v1/chat/completions", {**body, "max_tokens": 16})
            else:
                r = d.stream("/v1/completions", {"prompt": SYSTEM + "\n" + q + "\nAnswer:", "max_tokens": 16})
            with lock:
                res.append(r)

    before = d.metric("sluice_passes_total")
    t0 = time.monotonic()
    threads = [threading.Thread(target=worker) for _ in range(a.concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.monotonic() - t0
    return {"wall": wall, "ttft": statistics.mean(r[0] for r in res), "passes": d.passes_after() - before,
            "prompt": sum(r[2]["prompt_tokens"] for r in res),
            "cached": sum(r[2]["prompt_tokens_details"]["cached_tokens"] for r in res),
            "texts": sorted(r[1] for r in res)}


def restart(store, limit, chat_api, a):
    """Turns 1-5 on one daemon, a clean stop, turn 6 on a new daemon over the same disk tier."""
    kv = tempfile.mkdtemp(prefix="sluice-bench-kv-")
    state = {"messages": [], "prompt": ""}
    d = Daemon(store, os.path.basename(store), limit, True, a, kv_dir=kv)
    try:
        first = chat(d, chat_api, a, TURNS[:5], state)
    finally:
        d.close()
    d = Daemon(store, os.path.basename(store), limit, True, a, kv_dir=kv)
    try:
        last = chat(d, chat_api, a, TURNS[5:], state)[0]
        last["disk_tokens"] = d.metric("sluice_prefix_cache_disk_tokens_total")
    finally:
        d.close()
        shutil.rmtree(kv, ignore_errors=True)
    return first, last


DOCS = [f"Document {i}: " + " ".join(
    ["The shop on", "Elm Street", "sold", str(40 + i), "bicycles in", ["March", "April", "May", "June"][i % 4],
     "and repaired", str(7 + 3 * i), "of them; two customers asked about", ["helmets", "child seats",
     "batteries", "insurance"][i % 4], "and one lost a key."]) for i in range(32)]
INSTRUCTION = ("Read the report below and write one sentence for the monthly newsletter. Keep numbers "
               "exact, name the month, do not invent anything, and do not mention customers by name. ") * 12


def batch(d, a):
    """`sluice batch` over DOCS with the long INSTRUCTION in its template: wall, passes,
    cached tokens (the metric's change), outputs by id."""
    tmp = tempfile.mkdtemp(prefix="sluice-bench-batch-")
    inp, out = os.path.join(tmp, "in.jsonl"), os.path.join(tmp, "out.jsonl")
    with open(inp, "w") as f:
        for i, t in enumerate(DOCS):
            f.write(json.dumps({"id": f"d{i}", "text": t}) + "\n")
    before = (d.metric("sluice_passes_total"), d.metric("sluice_prefix_cache_cached_tokens_total"),
              d.metric("sluice_prefix_cache_prompt_tokens_total"))
    t0 = time.monotonic()
    subprocess.run([os.path.join(RELEASE, "sluice"), "--addr", f"http://{d.grpc}", "batch", inp, "-o", out,
                    "--template", INSTRUCTION + "\\n\\n{text}\\n\\nSentence:", "--max-tokens", "16",
                    "--temperature", "0", "--raw"], check=True, capture_output=True)
    wall = time.monotonic() - t0
    outputs = {}
    with open(out) as f:
        for line in f:
            j = json.loads(line)
            outputs[j["id"]] = j["output"]
    shutil.rmtree(tmp, ignore_errors=True)
    return {"wall": wall, "passes": d.passes_after() - before[0],
            "cached": d.metric("sluice_prefix_cache_cached_tokens_total") - before[1],
            "prompt": d.metric("sluice_prefix_cache_prompt_tokens_total") - before[2], "outputs": outputs}


LLAMA_WORKER = r'''
import json, sys, time
import llama_cpp
gguf, threads, turns, max_tokens, chat_api = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3]), int(sys.argv[4]), sys.argv[5] == "1"
history, cache_dir = json.loads(sys.argv[6]), sys.argv[7]
# Llama keeps the last call's tokens and KV and prefills only what follows their common
# prefix: its own prompt cache for a conversation. (LlamaRAMCache, which also saves whole
# states between prompts, does not fit under these limits beside the KV cache.) With a
# cache directory, LlamaDiskCache saves the state after each call and a new process loads
# the longest prefix's state: llama.cpp's way across a restart.
llm = llama_cpp.Llama(model_path=gguf, n_threads=threads, n_threads_batch=threads, n_ctx=1024, n_batch=128,
                      use_mmap=True, verbose=False)
if cache_dir:
    llm.set_cache(llama_cpp.LlamaDiskCache(cache_dir=cache_dir, capacity_bytes=2 << 30))
messages, prompt, out = history.get("messages", []), history.get("prompt", ""), []
for turn in turns:
    t0 = time.monotonic()
    first = None
    text = ""
    if chat_api:
        messages.append({"role": "user", "content": turn})
        it = llm.create_chat_completion(messages=messages, max_tokens=max_tokens, temperature=0, stream=True)
    else:
        prompt += f"Question: {turn}\nAnswer:"
        it = llm.create_completion(prompt, max_tokens=max_tokens, temperature=0, stream=True)
    for c in it:
        ch = c["choices"][0]
        piece = (ch.get("delta") or {}).get("content") or ch.get("text") or ""
        if piece and first is None:
            first = time.monotonic() - t0
        text += piece
    if chat_api:
        messages.append({"role": "assistant", "content": text})
    else:
        prompt += text + "\n"
    out.append(first if first is not None else time.monotonic() - t0)
print(json.dumps({"ttft": out, "history": {"messages": messages, "prompt": prompt}}))
'''


def llama_run(gguf, limit, chat_api, a, turns, history=None, cache_dir=""):
    cg = Cgroup("sluice-prefix", limit)
    drop_caches()
    rc, out, err, _, _ = cg.run([sys.executable, "-c", LLAMA_WORKER, gguf, str(a.threads), json.dumps(turns),
                                 str(a.max_tokens), "1" if chat_api else "0", json.dumps(history or {}),
                                 cache_dir])
    cg.close()
    if rc != 0:
        why = "killed by the cgroup's OOM killer" if rc == -9 else f"exit {rc}"
        return {"error": f"{why}: " + (err.strip().splitlines() or [""])[-1][:120]}
    return json.loads(out.strip().splitlines()[-1])


def llama_chat(gguf, limit, chat_api, a):
    return llama_run(gguf, limit, chat_api, a, TURNS)


def llama_restart(gguf, limit, chat_api, a):
    """Turns 1-5 in one process with LlamaDiskCache, turn 6 in a new one over it."""
    d = tempfile.mkdtemp(prefix="sluice-bench-llama-cache-")
    try:
        first = llama_run(gguf, limit, chat_api, a, TURNS[:5], cache_dir=d)
        if "error" in first:
            return first
        return llama_run(gguf, limit, chat_api, a, TURNS[5:], first["history"], d)
    finally:
        shutil.rmtree(d, ignore_errors=True)


def bench(name, gguf, limit, chat_api, a):
    store = os.path.join(CACHE, "bench-spec", os.path.basename(gguf) + ".store")
    if not os.path.isdir(store):
        subprocess.run([SLUICED, "pack", gguf, "-o", store, "--codec", "lz4", "--force"], check=True,
                       capture_output=True)
    print(f"\n## {name} F16, memory limit {limit // 2**20} MiB, --batch-tokens {a.batch_tokens}, "
          f"--max-batch {a.concurrency}, {a.threads} threads, {a.max_tokens} tokens a turn")
    if not a.llama_only:
        sluice_bench(name, store, limit, chat_api, a)
    if not a.no_llama:
        l = llama_chat(gguf, limit, chat_api, a)
        if "error" in l:
            print(f"\nllama.cpp (same cgroup): {l['error']}")
        else:
            print("\nllama.cpp (llama-cpp-python, same cgroup, its own KV reuse), TTFT per turn: " +
                  ", ".join(f"{t:.3f}" for t in l["ttft"]) + " s")
        r = llama_restart(gguf, limit, chat_api, a)
        if "error" in r:
            print(f"llama.cpp turn 6 after a restart (LlamaDiskCache): {r['error']}")
        else:
            print(f"llama.cpp turn 6 after a restart (turns 1-5 in one process with LlamaDiskCache, turn 6 in a "
                  f"new one): TTFT {r['ttft'][0]:.3f} s")


def sluice_bench(name, store, limit, chat_api, a):
    rounds = {True: [], False: []}
    for r in range(a.rounds):
        for on in ([True, False] if r % 2 == 0 else [False, True]):
            d = Daemon(store, os.path.basename(store), limit, on, a)
            try:
                turns = chat(d, chat_api, a)
                for i, t in enumerate(turns):
                    t["alone"] = alone(d, max(t["prompt"] - t["cached"], 1), 100 * r + i, a)
                sh = shared(d, chat_api, a)
                bt = batch(d, a)
            finally:
                d.close()
            rs = restart(store, limit, chat_api, a) if on else None
            rounds[on].append((turns, sh, bt, rs))
    # Outputs: every round's texts, cache on and off, must agree.
    ref = rounds[False][0]
    for on in (True, False):
        for turns, sh, bt, rs in rounds[on]:
            if bt["outputs"] != ref[2]["outputs"]:
                sys.exit(f"{name}: the batch job's outputs differ with the cache {'on' if on else 'off'}")
            if rs is not None:
                resumed = [t["text"] for t in rs[0]] + [rs[1]["text"]]
                if resumed != [t["text"] for t in ref[0]]:
                    sys.exit(f"{name}: the conversation resumed after a restart answers otherwise")
            for i, (x, y) in enumerate(zip(turns, ref[0])):
                if x["text"] != y["text"]:
                    sys.exit(f"{name}: turn {i + 1} differs with the cache {'on' if on else 'off'}:\n{x['text']!r}\n{y['text']!r}")
            if sh["texts"] != ref[1]["texts"]:
                sys.exit(f"{name}: the shared-prompt answers differ with the cache {'on' if on else 'off'}")
    print("0 outputs changed (6 turns, 32 shared-prompt answers, 32 batch items and the resumed "
          "conversation, every round, cache on and off)")
    med = statistics.median
    print("\nturn | prompt | cached | prefill passes on/off | TTFT on s | TTFT off s | off/on | new tokens alone s | on/alone")
    for i in range(len(TURNS)):
        on = [rt[0][i] for rt in rounds[True]]
        off = [rt[0][i] for rt in rounds[False]]
        ton, toff = med(t["ttft"] for t in on), med(t["ttft"] for t in off)
        al = med(t["alone"] for t in on)
        print(f"{i + 1:4} | {on[0]['prompt']:6} | {on[0]['cached']:6} | {med(t['passes'] for t in on):5.0f} / "
              f"{med(t['passes'] for t in off):3.0f} | {ton:9.3f} | {toff:10.3f} | {toff / ton:5.2f}x | "
              f"{al:18.3f} | {ton / al:5.2f}x")
        print("     rounds: on " + ", ".join(f"{t['ttft']:.3f}" for t in on) + "; off " +
              ", ".join(f"{t['ttft']:.3f}" for t in off))
    on = [rt[1] for rt in rounds[True]]
    off = [rt[1] for rt in rounds[False]]
    print(f"\n32 requests sharing a {on[0]['prompt'] // 32}-token prompt, {a.concurrency} at a time:")
    for label, xs in (("on", on), ("off", off)):
        print(f"  cache {label:3}: wall {med(x['wall'] for x in xs):7.2f} s (rounds " +
              ", ".join(f"{x['wall']:.2f}" for x in xs) + f"), mean TTFT {med(x['ttft'] for x in xs):6.2f} s, "
              f"passes {med(x['passes'] for x in xs):4.0f}, cached {xs[0]['cached']} of {xs[0]['prompt']} prompt tokens")
    print(f"  off/on wall: {med(x['wall'] for x in off) / med(x['wall'] for x in on):.2f}x")
    on = [rt[2] for rt in rounds[True]]
    off = [rt[2] for rt in rounds[False]]
    print(f"\nsluice batch: 32 items, a {int(on[0]['prompt']) // 32}-token template with a long instruction:")
    for label, xs in (("on", on), ("off", off)):
        print(f"  cache {label:3}: wall {med(x['wall'] for x in xs):7.2f} s (rounds " +
              ", ".join(f"{x['wall']:.2f}" for x in xs) + f"), passes {med(x['passes'] for x in xs):4.0f}, "
              f"cached {xs[0]['cached']:.0f} of {xs[0]['prompt']:.0f} prompt tokens")
    print(f"  off/on wall: {med(x['wall'] for x in off) / med(x['wall'] for x in on):.2f}x")
    rs = [rt[3] for rt in rounds[True]]
    warm = med(rt[0][5]["ttft"] for rt in rounds[True])
    cold = med(rt[0][5]["ttft"] for rt in rounds[False])
    after = med(r[1]["ttft"] for r in rs)
    print(f"\nturn 6 after a restart (turns 1-5 on a daemon stopped with SIGTERM, turn 6 on a new one "
          f"over the same --kv-cache-dir):")
    print(f"  TTFT {after:.3f} s (rounds " + ", ".join(f"{r[1]['ttft']:.3f}" for r in rs) +
          f"); warm cache {warm:.3f} s; cache off {cold:.3f} s")
    print(f"  restart/warm {after / warm:.2f}x (goal <= 1.5x); off/restart {cold / after:.2f}x; "
          f"cached {rs[0][1]['cached']} of {rs[0][1]['prompt']} prompt tokens "
          f"({rs[0][1]['disk_tokens']:.0f} from the disk tier), prefill passes {med(r[1]['passes'] for r in rs):.0f}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="smollm2,gemma3")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--limit-smollm2", type=size, default=size("288MiB"))
    ap.add_argument("--limit-gemma3", type=size, default=size("384MiB"))
    ap.add_argument("--batch-tokens", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-llama", action="store_true")
    ap.add_argument("--llama-only", action="store_true")
    a = ap.parse_args()
    ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_F16
    for name in a.models.split(","):
        if name == "smollm2":
            bench("SmolLM2-135M", rewritten(SMOLLM2, "F16", ftype), a.limit_smollm2, True, a)
        elif name == "gemma3":
            bench("Gemma 3 270M", rewritten(GEMMA3, "F16", ftype), a.limit_gemma3, False, a)
        else:
            sys.exit(f"unknown model {name}")


if __name__ == "__main__":
    main()
