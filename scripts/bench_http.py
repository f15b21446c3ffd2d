#!/usr/bin/env python3
"""The HTTP API against gRPC on one daemon: time to first token and decode tokens/s of one
request over each wire (same chat prompt, greedy, alternating A B B A), then 32 concurrent
streams over HTTP and over gRPC: total tokens/s and p50/p99 time to first token.

Clients nobody here wrote: the official `openai` package for HTTP, grpcio (stubs generated
from proto/sluice.proto at start with grpcio-tools) for gRPC. Times are taken in the client,
from sending the request to the first piece of text and to the end.

    pip install openai grpcio grpcio-tools
    cargo build --release
    python3 scripts/bench_http.py [--store DIR] [--rounds 8] [--max-tokens 128] [--threads 2]
"""
import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.join(ROOT, "target", "release")

PROMPTS = [
    "Write a short story about a lighthouse keeper.",
    "Explain how a hash table works.",
    "What causes the seasons on Earth?",
    "Describe the water cycle.",
    "Give me three tips for learning a language.",
    "Why is the sky blue?",
    "How do vaccines work?",
    "Summarize the plot of Romeo and Juliet.",
]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def grpc_stubs(tmp):
    from grpc_tools import protoc

    proto_dir = os.path.join(ROOT, "proto")
    rc = protoc.main(["protoc", f"-I{proto_dir}", f"--python_out={tmp}", f"--grpc_python_out={tmp}",
                      os.path.join(proto_dir, "sluice.proto")])
    if rc != 0:
        sys.exit("grpcio-tools could not compile proto/sluice.proto")
    sys.path.insert(0, tmp)
    import sluice_pb2
    import sluice_pb2_grpc

    return sluice_pb2, sluice_pb2_grpc


def http_once(client, prompt, max_tokens):
    t0 = time.perf_counter()
    first = None
    tokens = 0
    stream = client.chat.completions.create(
        model="", messages=[{"role": "user", "content": prompt}], temperature=0,
        max_tokens=max_tokens, stream=True, stream_options={"include_usage": True})
    text = []
    for ch in stream:
        if ch.choices and ch.choices[0].delta.content:
            if first is None:
                first = time.perf_counter()
            text.append(ch.choices[0].delta.content)
        if ch.usage:
            tokens = ch.usage.completion_tokens
    end = time.perf_counter()
    return first - t0, end - t0, tokens, "".join(text)


def grpc_once(stub, pb, prompt, max_tokens):
    t0 = time.perf_counter()
    first = None
    tokens = 0
    text = []
    req = pb.GenerateRequest(messages=[pb.ChatMessage(role="user", content=prompt)],
                             max_tokens=max_tokens)
    for msg in stub.Generate(req):
        if msg.HasField("piece") and msg.piece.text:
            if first is None:
                first = time.perf_counter()
            text.append(msg.piece.text)
        elif msg.HasField("done"):
            tokens = msg.done.stats.generated_tokens
    end = time.perf_counter()
    return first - t0, end - t0, tokens, "".join(text)


def decode_rate(r):
    ttft, total, tokens, _ = r
    return (tokens - 1) / (total - ttft) if tokens > 1 and total > ttft else 0.0


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def concurrent(fn, n, max_tokens):
    results = [None] * n
    barrier = threading.Barrier(n)

    def one(i):
        barrier.wait()
        results[i] = fn(PROMPTS[i % len(PROMPTS)] + f" (variant {i})", max_tokens)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    tokens = sum(r[2] for r in results)
    ttfts = [r[0] for r in results]
    return tokens / wall, pct(ttfts, 0.5), pct(ttfts, 0.99), tokens, wall


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--store", help="a packed store (default: SmolLM2 packed into a temp dir)")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--concurrent", type=int, default=32)
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args()
    import grpc
    import openai

    tmp = tempfile.mkdtemp(prefix="bench-http-")
    pb, pb_grpc = grpc_stubs(tmp)
    store = args.store
    if store is None:
        gguf = subprocess.run([os.path.join(ROOT, "scripts", "fetch-model.sh")], check=True,
                              capture_output=True, text=True).stdout.strip()
        store = os.path.join(tmp, "smollm2")
        subprocess.run([os.path.join(BIN, "sluiced"), "pack", gguf, "-o", store, "--codec", "lz4"],
                       check=True, capture_output=True)
    gport, hport = free_port(), free_port()
    ctx = max(512, args.max_tokens + 128)
    daemon = subprocess.Popen(
        [os.path.join(BIN, "sluiced"), "serve", "--model", store, "--config", "/dev/null",
         "--listen", f"127.0.0.1:{gport}", "--http-listen", f"127.0.0.1:{hport}",
         "--max-batch", str(args.concurrent), "--max-context", str(ctx),
         "--queue-max", str(2 * args.concurrent), "--threads", str(args.threads)],
        stderr=subprocess.DEVNULL, env=dict(os.environ, RUST_LOG="warn"))
    try:
        base = f"http://127.0.0.1:{hport}"
        for _ in range(600):
            try:
                if urllib.request.urlopen(base + "/health").status == 200:
                    break
            except Exception:
                pass
            if daemon.poll() is not None:
                sys.exit("sluiced serve exited")
            time.sleep(0.1)
        client = openai.OpenAI(base_url=base + "/v1", api_key="-", max_retries=0)
        channel = grpc.insecure_channel(f"127.0.0.1:{gport}")
        stub = pb_grpc.InferenceStub(channel)
        http = lambda p, m: http_once(client, p, m)
        grpc_ = lambda p, m: grpc_once(stub, pb, p, m)
        # Warm both paths (connections, the first pass).
        http(PROMPTS[0], 8)
        grpc_(PROMPTS[0], 8)
        runs = {"http": [], "grpc": []}
        fns = {"http": http, "grpc": grpc_}
        for i in range(args.rounds):
            # A B, then B A: neither wire always runs second.
            for wire in (("http", "grpc") if i % 2 == 0 else ("grpc", "http")):
                runs[wire].append(fns[wire](PROMPTS[0], args.max_tokens))
        same = runs["http"][0][3] == runs["grpc"][0][3]
        print(f"one request, {args.rounds} rounds per wire, alternating; max_tokens {args.max_tokens}, "
              f"greedy; same text on both wires: {same}")
        print(f"{'wire':6} {'ttft ms (median)':>18} {'decode tok/s (median)':>22} {'tokens':>7}")
        med = {}
        for wire in ("http", "grpc"):
            rs = runs[wire]
            med[wire] = (statistics.median(r[0] for r in rs) * 1e3,
                         statistics.median(decode_rate(r) for r in rs))
            print(f"{wire:6} {med[wire][0]:18.1f} {med[wire][1]:22.1f} {rs[0][2]:7d}")
        print(f"ratio http/grpc: ttft {med['http'][0] / med['grpc'][0]:.3f}, "
              f"decode tok/s {med['http'][1] / med['grpc'][1]:.3f}")
        print()
        n = args.concurrent
        print(f"{n} concurrent streams, max_tokens {args.max_tokens}, max-batch {n}")
        print(f"{'wire':6} {'total tok/s':>12} {'ttft p50 ms':>12} {'ttft p99 ms':>12} {'tokens':>7} {'wall s':>7}")
        conc = {}
        for wire, fn in (("http", http), ("grpc", grpc_), ("http", http), ("grpc", grpc_)):
            r = concurrent(fn, n, args.max_tokens)
            conc.setdefault(wire, []).append(r)
            print(f"{wire:6} {r[0]:12.1f} {r[1] * 1e3:12.1f} {r[2] * 1e3:12.1f} {r[3]:7d} {r[4]:7.2f}")
        rate = {w: statistics.mean(r[0] for r in rs) for w, rs in conc.items()}
        print(f"ratio http/grpc total tok/s (mean of 2 each): {rate['http'] / rate['grpc']:.3f}")
    finally:
        daemon.terminate()
        daemon.wait()


if __name__ == "__main__":
    main()
