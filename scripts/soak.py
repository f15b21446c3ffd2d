#!/usr/bin/env python3
"""A soak: the daemon under a streaming memory budget, driven for MINUTES by CLIENTS
concurrent clients over gRPC (grpcio, stubs generated from proto/sluice.proto) and HTTP
(server-sent events read with http.client): random prompts, lengths and sampling
parameters; a third of the streams cancelled mid-way; some invalid requests and some
prompts longer than the context. Then it checks:

- the daemon never died;
- every valid request got a whole answer (a finish reason) or a clean refusal (429 /
  RESOURCE_EXHAUSTED); every invalid one its 400 / INVALID_ARGUMENT; nothing else;
- no sequence is left in the batch and nothing in the queue; every read buffer is free
  and the staging slots stand as before the soak;
- the resident set, sampled every --sample-s seconds, has a fitted growth of its anonymous
  part (what the daemon allocated; the file pages of its code are reported beside) over
  the last two thirds of the run of at most --rss-slope MiB per hour, and at the end is at
  most --rss-slack MiB above its plateau (the median of the samples from a sixth to a third
  of the run: the resident set climbs for the first minutes while every thread, buffer and pool
  meets its first peak, and the check is for drift after that, not for the climb); the
  heap's live allocations (glibc mallinfo2) at the end are no more than at warm-up;
- greedy outputs after the soak equal those before;
- the prefix cache's host tier (--kv-cache-host) and disk tier (--kv-cache-dir, with
  --kv-cache-disk) stay within their budgets at every sample, by their own count and, on
  disk, by the files' sizes; the resident-set and heap checks above are on the memory
  less the host tier's own count (the tier fills to its budget on purpose).

For the middle third of the run the disk misbehaves under the daemon (SLUICE_FAULTS: a
fifth of reads cut short, 2 % answered 300 ms late, under a 5 s read timeout): the same
checks hold, and no request fails for it (--no-faults leaves the disk alone).

It prints requests/s, p50/p99 time to first token, tokens/s, RSS start/end, then one JSON
line. Exit status 0 only if every check held.

    pip install grpcio grpcio-tools
    cargo build --release
    scripts/soak.sh [MINUTES]            # or: python3 scripts/soak.py --minutes 2

The binaries are taken from cargo's target directory (scripts/target-dir.sh), or from the
directory SLUICE_BIN names.
"""
import argparse
import http.client
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.environ.get("SLUICE_BIN") or os.path.join(subprocess.run(
    [os.path.join(ROOT, "scripts", "target-dir.sh")], check=True, capture_output=True,
    text=True).stdout.strip(), "release")
sys.path.insert(0, os.path.join(ROOT, "scripts"))
from bench_http import free_port, grpc_stubs  # noqa: E402  (the same ports and stubs)
WORDS = ("river stone light paper engine garden music winter signal market forest number "
         "window theory ocean letter planet mirror").split()
PROMPTS = [
    "Write a short story about a lighthouse keeper.",
    "Explain how a hash table works.",
    "What causes the seasons on Earth?",
    "Give me three tips for learning a language.",
]


def slope_per_hour(points):
    """Least-squares slope of (seconds, MiB) points, in MiB per hour (0 for fewer than 2)."""
    if len(points) < 2:
        return 0.0
    mt = statistics.fmean(t for t, _ in points)
    mv = statistics.fmean(v for _, v in points)
    var = sum((t - mt) ** 2 for t, _ in points)
    if var == 0:
        return 0.0
    return sum((t - mt) * (v - mv) for t, v in points) / var * 3600


def rss_kib(pid, field="VmRSS"):
    """A resident-set figure of /proc/PID/status in KiB: VmRSS (all), RssAnon (memory the
    process allocated), RssFile (file pages it maps: the binary's and libraries' code,
    paged in as new code paths first run, at most their size)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


class Stats:
    def __init__(self):
        self.lock = threading.Lock()
        self.outcomes = {}
        self.ttft = []
        self.tokens = 0
        self.failures = []

    def add(self, outcome, ttft=None, tokens=0, failure=None):
        with self.lock:
            self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1
            if ttft is not None:
                self.ttft.append(ttft)
            self.tokens += tokens
            if failure:
                self.failures.append(failure)


def http_chat(port, body, cancel_after=None, timeout=120):
    """One chat completion over HTTP. Returns (status, finish, ttft, tokens, text)."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    t0 = time.time()
    c.request("POST", "/v1/chat/completions", json.dumps(body),
              {"Content-Type": "application/json"})
    r = c.getresponse()
    if not body.get("stream"):
        data = json.loads(r.read() or b"{}")
        c.close()
        if r.status != 200:
            return r.status, None, None, 0, data
        ch = data["choices"][0]
        return 200, ch["finish_reason"], time.time() - t0, data["usage"]["completion_tokens"], \
            ch["message"]["content"]
    if r.status != 200:
        data = r.read()
        c.close()
        return r.status, None, None, 0, data
    ttft, chunks, finish, text = None, 0, None, ""
    while True:
        line = r.readline()
        if not line:
            break
        line = line.strip()
        if not line.startswith(b"data: "):
            continue
        payload = line[6:]
        if payload == b"[DONE]":
            break
        ev = json.loads(payload)
        if "error" in ev:
            c.close()
            return 599, ev["error"].get("message"), ttft, chunks, text
        for ch in ev.get("choices", []):
            piece = ch.get("delta", {}).get("content")
            if piece:
                if ttft is None:
                    ttft = time.time() - t0
                chunks += 1
                text += piece
            if ch.get("finish_reason"):
                finish = ch["finish_reason"]
        if cancel_after is not None and chunks >= cancel_after:
            c.close()  # the client goes away mid-stream
            return 200, "cancelled", ttft, chunks, text
    c.close()
    return 200, finish, ttft, chunks, text


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--minutes", type=float, default=2.0)
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--warmup-s", type=float, default=20.0)
    ap.add_argument("--device-memory", default="150MiB",
                    help="a budget below the model and its KV cache, so that layers stream")
    ap.add_argument("--rss-slack", type=float, default=8.0, help="MiB")
    ap.add_argument("--rss-slope", type=float, default=2.0,
                    help="most fitted RSS growth over the last two thirds, MiB per hour")
    ap.add_argument("--sample-s", type=float, default=60.0, help="RSS sampling interval")
    ap.add_argument("--queue-max", type=int, default=32,
                    help="the daemon's queue; fewer places than clients beyond --max-batch 8 "
                         "keep it full, where a bad request must still get its 400")
    ap.add_argument("--no-faults", action="store_true",
                    help="no disk faults in the middle third of the run")
    ap.add_argument("--store", help="a packed SmolLM2 store (default: pack one)")
    ap.add_argument("--kv-cache-host", default="32MiB", help="the prefix cache's host tier")
    ap.add_argument("--kv-cache-disk", default="64MiB", help="its disk tier (in the soak's temp dir)")
    args = ap.parse_args()

    import grpc

    tmp = tempfile.mkdtemp(prefix="sluice-soak-")
    pb, pb_grpc = grpc_stubs(tmp)
    store = args.store
    if not store:
        gguf = subprocess.run([os.path.join(ROOT, "scripts", "fetch-model.sh")], check=True,
                              capture_output=True, text=True).stdout.strip()
        store = os.path.join(tmp, "smollm2")
        subprocess.run([f"{BIN}/sluiced", "pack", gguf, "-o", store, "--codec", "lz4"],
                       check=True, capture_output=True)
    gport, hport = free_port(), free_port()
    context = 512
    log = open(os.path.join(tmp, "sluiced.log"), "w")
    faults = os.path.join(tmp, "faults")
    kv_dir = os.path.join(tmp, "kv")
    open(faults, "w").close()
    daemon = subprocess.Popen(
        [f"{BIN}/sluiced", "serve", "--model", store, "--config", "/dev/null",
         "--listen", f"127.0.0.1:{gport}", "--http-listen", f"127.0.0.1:{hport}",
         "--device-memory", args.device_memory, "--max-batch", "8",
         "--max-context", str(context), "--queue-max", str(args.queue_max),
         "--read-timeout", "5s", "--kv-cache-host", args.kv_cache_host,
         "--kv-cache-dir", kv_dir, "--kv-cache-disk", args.kv_cache_disk],
        stdout=log, stderr=log, env=dict(os.environ, SLUICE_FAULTS=faults))
    deadline = time.time() + 120
    while True:
        try:
            c = http.client.HTTPConnection("127.0.0.1", hport, timeout=2)
            c.request("GET", "/health")
            if c.getresponse().status == 200:
                break
        except OSError:
            pass
        if daemon.poll() is not None or time.time() > deadline:
            sys.exit(f"the daemon did not come up; see {log.name}")
        time.sleep(0.2)
    channel = grpc.insecure_channel(f"127.0.0.1:{gport}")
    stub = pb_grpc.InferenceStub(channel)
    st = stub.Status(pb.StatusRequest())
    if st.layers_streamed == 0:
        sys.exit(f"--device-memory {args.device_memory} streams nothing: lower it")

    def greedy():
        out = []
        for p in PROMPTS:
            s, f, _, _, text = http_chat(hport, {"messages": [{"role": "user", "content": p}],
                                                 "max_tokens": 32, "temperature": 0})
            out.append((s, f, text))
        return out

    def io_settled():
        """The I/O pools once every read is back: (buffers free, buffers, slots free), or
        None if a read buffer stays in use for 10 s (a leak, or a read never answered)."""
        for _ in range(100):
            st = stub.Status(pb.StatusRequest())
            if st.io_read_buffers_free == st.io_read_buffers and st.active_sequences == 0:
                return (st.io_read_buffers_free, st.io_read_buffers, st.io_slots_free)
            time.sleep(0.1)
        return None

    before = greedy()
    io_before = io_settled()
    stats = Stats()
    stop = threading.Event()

    def prompt(rng):
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 60)))

    def client(i):
        rng = random.Random(i)
        while not stop.is_set():
            kind = rng.random()
            cancel = rng.random() < 1 / 3
            max_tokens = rng.randint(4, 64)
            temperature = rng.choice([0.0, 0.7, 1.0])
            try:
                if kind < 0.4:  # HTTP stream
                    body = {"messages": [{"role": "user", "content": prompt(rng)}],
                            "max_tokens": max_tokens, "temperature": temperature,
                            "top_p": rng.choice([1.0, 0.9]), "stream": True,
                            "seed": rng.randint(0, 1000)}
                    s, f, ttft, n, _ = http_chat(hport, body, rng.randint(1, 4) if cancel else None)
                    if s == 200 and f in ("stop", "length", "cancelled"):
                        stats.add("http_" + ("cancelled" if f == "cancelled" else "complete"),
                                  ttft if f != "cancelled" else None, n)
                    elif s == 429:
                        stats.add("http_refused_busy")
                        time.sleep(1.0)  # Retry-After: 1, as a client should
                    else:
                        stats.add("failure", failure=f"http stream: {s} {f}")
                elif kind < 0.8:  # gRPC stream
                    req = pb.GenerateRequest(
                        prompt=prompt(rng), max_tokens=max_tokens,
                        sampling=pb.SamplingParams(temperature=temperature, seed=rng.randint(0, 99)))
                    t0, ttft, n, finish = time.time(), None, 0, None
                    call = stub.Generate(req, timeout=120)
                    limit = rng.randint(1, 4) if cancel else None
                    try:
                        for ev in call:
                            if ev.HasField("piece") and ev.piece.text:
                                if ttft is None:
                                    ttft = time.time() - t0
                                n += 1
                                if limit is not None and n >= limit:
                                    call.cancel()
                                    finish = "cancelled"
                                    break
                            elif ev.HasField("done"):
                                finish = ev.done.finish_reason
                        if finish == "cancelled":
                            stats.add("grpc_cancelled", None, n)
                        elif finish in (pb.FINISH_REASON_STOP, pb.FINISH_REASON_LENGTH):
                            stats.add("grpc_complete", ttft, n)
                        else:
                            stats.add("failure", failure=f"grpc finish {finish}")
                    except grpc.RpcError as e:
                        if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                            stats.add("grpc_refused_busy")
                            time.sleep(1.0)  # back off as a client should
                        elif e.code() == grpc.StatusCode.CANCELLED and finish == "cancelled":
                            stats.add("grpc_cancelled", None, n)
                        else:
                            stats.add("failure", failure=f"grpc: {e.code()} {e.details()}")
                elif kind < 0.9:  # invalid requests, both wires
                    if rng.random() < 0.5:
                        bad = rng.choice([
                            {"messages": [{"role": "user", "content": "x"}], "temperature": -1},
                            {"messages": [], "max_tokens": 4},
                            {"model": "no-such-model", "messages": [{"role": "user", "content": "x"}]},
                            {"messages": [{"role": "wizard", "content": "x"}]},
                        ])
                        s, _, _, _, _ = http_chat(hport, bad)
                        ok = s in (400, 404)
                        stats.add("http_invalid" if ok else "failure",
                                  failure=None if ok else f"invalid body got {s}")
                    else:
                        try:
                            list(stub.Generate(pb.GenerateRequest(
                                prompt="x", sampling=pb.SamplingParams(top_p=2.0)), timeout=30))
                            stats.add("failure", failure="an invalid gRPC request was served")
                        except grpc.RpcError as e:
                            ok = e.code() == grpc.StatusCode.INVALID_ARGUMENT
                            stats.add("grpc_invalid" if ok else "failure",
                                      failure=None if ok else f"invalid gRPC got {e.code()}")
                    time.sleep(0.1)  # a misbehaving client, not a flood
                else:  # a prompt longer than the context
                    long = " ".join(rng.choice(WORDS) for _ in range(context * 2))
                    s, _, _, _, _ = http_chat(hport, {"messages": [{"role": "user", "content": long}],
                                                      "max_tokens": 8})
                    stats.add("http_too_long" if s == 400 else "failure",
                              failure=None if s == 400 else f"over-long prompt got {s}")
                    time.sleep(0.1)
            except (OSError, http.client.HTTPException) as e:
                stats.add("failure", failure=f"{type(e).__name__}: {e}")

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(args.clients)]
    t_start = time.time()
    run_s = args.minutes * 60
    for t in threads:
        t.start()
    # The resident set every --sample-s seconds from the start, the disk's faults switched
    # on for the middle third; the warm-up's figures once it has passed.
    curve, anon, filed, tiers = [], [], [], []

    def tier_sample():
        p = stub.Status(pb.StatusRequest()).prefix_cache
        tiers.append(p)
        return p.host_bytes

    def sample(now):
        # The resident set less the host tier's own count: it fills to its budget on purpose.
        tier = tier_sample() / 2**20
        curve.append((now, rss_kib(daemon.pid) / 1024 - tier))
        anon.append((now, rss_kib(daemon.pid, "RssAnon") / 1024 - tier))
        filed.append((now, rss_kib(daemon.pid, "RssFile") / 1024))

    rss_warm = heap_warm = warm_outcomes = None
    faults_on = faults_off = None
    while True:
        now = time.time() - t_start
        if now >= run_s:
            break
        if rss_warm is None and now >= args.warmup_s:
            tier = tier_sample()
            rss_warm = rss_kib(daemon.pid) - tier / 1024
            heap_warm = stub.Status(pb.StatusRequest()).host_heap_in_use_bytes - tier
            warm_outcomes = sum(stats.outcomes.values())
        if not args.no_faults and faults_on is None and now >= run_s / 3:
            with open(faults, "w") as f:
                f.write("short=0.2 stall=0.02 stall_ms=300 seed=7")
            faults_on = now
        if faults_on is not None and faults_off is None and now >= 2 * run_s / 3:
            open(faults, "w").close()
            faults_off = now
        if not curve or now - curve[-1][0] >= args.sample_s:
            sample(now)
        time.sleep(min(1.0, args.sample_s / 4))
    sample(time.time() - t_start)
    open(faults, "w").close()
    if rss_warm is None:
        sys.exit(f"--minutes {args.minutes} ends before --warmup-s {args.warmup_s}")
    short_reads = stub.Status(pb.StatusRequest()).io_short_reads
    stop.set()
    for t in threads:
        t.join(timeout=180)
    wall = time.time() - t_start
    alive = daemon.poll() is None
    idle = False
    for _ in range(50):
        st = stub.Status(pb.StatusRequest())
        if st.active_sequences == 0 and st.queue_depth == 0:
            idle = True
            break
        time.sleep(0.1)
    after = greedy()
    io_after = io_settled()
    tier_end = tier_sample()
    rss_end = rss_kib(daemon.pid) - tier_end / 1024
    heap_end = stub.Status(pb.StatusRequest()).host_heap_in_use_bytes - tier_end
    kv_files = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(kv_dir) for f in fs
                   if f.endswith((".kvb", ".kvp")))
    last_tier = tiers[-1]
    daemon.terminate()
    daemon.wait(timeout=60)

    total = sum(stats.outcomes.values())
    ttft = sorted(stats.ttft)
    pct = (lambda q: ttft[min(len(ttft) - 1, int(q * len(ttft)))] if ttft else float("nan"))
    # The plateau: the median sample from a sixth to a third of the run (after the climb
    # of the first minutes, before the slope's window); the warm-up sample where no sample
    # falls there (a short run).
    early = [v for t, v in curve if max(args.warmup_s, run_s / 6) <= t <= max(args.warmup_s, run_s / 3)]
    rss_plateau = statistics.median(early) * 1024 if early else rss_warm
    rss_delta_mib = (rss_end - rss_plateau) / 1024
    last = lambda c: [(t, v) for t, v in c if t >= max(args.warmup_s, run_s / 3)]
    tail = last(curve)
    slope = slope_per_hour(tail)
    anon_slope, file_slope = slope_per_hour(last(anon)), slope_per_hour(last(filed))
    checks = {
        "daemon_alive": alive,
        "no_unexpected_outcomes": not stats.failures,
        "batch_and_queue_empty": idle,
        # Each greedy run ends the same way, so the staging slots it leaves prefetched match.
        "no_io_buffer_or_slot_in_use": io_before is not None and io_before == io_after,
        # Growth only: at idle the finished sequences' KV pages are given back, so the end
        # may sit well under the plateau taken under load.
        "rss_within_slack": rss_delta_mib <= args.rss_slack,
        # The growth that matters is the memory the daemon allocated; its file pages (code
        # paged in as paths first run) are bounded by the binary and are reported beside.
        "rss_anon_slope_within_limit": anon_slope <= args.rss_slope,
        # The faults were met: reads were cut short (and resubmitted) while they were on.
        "faults_met": args.no_faults or short_reads > 0,
        # Live allocations at idle after the soak are no more than under load at warm-up
        # (plus a MiB): a leak grows them; the allocator keeping freed pages grows only RSS.
        "heap_in_use_not_grown": heap_end <= heap_warm + 2**20,
        "greedy_outputs_unchanged": before == after,
        # The prefix cache's tiers were used and kept their budgets, by their own count at
        # every sample and, on disk, by the files' sizes at the end.
        "kv_host_tier_within_budget": last_tier.host_blocks > 0 and all(
            t.host_bytes <= t.host_budget_bytes for t in tiers),
        "kv_disk_tier_within_budget": last_tier.disk_blocks > 0 and all(
            t.disk_bytes <= t.disk_budget_bytes for t in tiers)
            and kv_files <= last_tier.disk_budget_bytes,
    }
    print(f"soak: {wall / 60:.1f} min, {args.clients} clients, {total} requests "
          f"({total / wall:.1f}/s; {warm_outcomes} in warm-up)")
    for k in sorted(stats.outcomes):
        print(f"  {k:<20} {stats.outcomes[k]}")
    print(f"time to first token  p50 {pct(0.5):.3f} s  p99 {pct(0.99):.3f} s")
    print(f"tokens/s             {stats.tokens / wall:.1f} (streamed pieces, all requests)")
    print(f"RSS                  {rss_warm / 1024:.1f} MiB after warm-up, plateau {rss_plateau / 1024:.1f} "
          f"({len(early)} samples), {rss_end / 1024:.1f} MiB at the end ({rss_delta_mib:+.1f} on the plateau)")
    print(f"RSS slope            {slope:+.2f} MiB/hour over the last two thirds ({len(tail)} samples)")
    print(f"RSS anon / file      slopes {anon_slope:+.2f} / {file_slope:+.2f} MiB/hour over the last two thirds "
          f"(the check is on anon, limit {args.rss_slope})")
    print("RSS curve            " + " ".join(f"{t / 60:.1f}m:{v:.1f}" for t, v in curve))
    print("RSS anon curve       " + " ".join(f"{t / 60:.1f}m:{v:.1f}" for t, v in anon))
    print("RSS file curve       " + " ".join(f"{t / 60:.1f}m:{v:.1f}" for t, v in filed))
    if not args.no_faults:
        print(f"disk faults          on from {faults_on / 60:.1f} to {(faults_off or run_s) / 60:.1f} min: "
              f"{short_reads} short reads resubmitted")
    print(f"heap in use          {heap_warm / 2**20:.1f} MiB after warm-up, {heap_end / 2**20:.1f} MiB at the end "
          f"({(heap_end - heap_warm) / 2**20:+.1f}; glibc mallinfo2: live allocations only)")
    print(f"layers streamed      {st.layers_streamed} of {st.layers_streamed + st.layers_resident}")
    print(f"prefix cache tiers   host {last_tier.host_bytes / 2**20:.1f} of {last_tier.host_budget_bytes / 2**20:.1f} MiB "
          f"(at most {max(t.host_bytes for t in tiers) / 2**20:.1f}), {last_tier.host_hits} prompts took "
          f"{last_tier.host_tokens} tokens from it; disk {last_tier.disk_bytes / 2**20:.1f} of "
          f"{last_tier.disk_budget_bytes / 2**20:.1f} MiB ({kv_files / 2**20:.1f} MiB of files), "
          f"{last_tier.disk_write_errors} failed writes; {last_tier.cached_tokens} of "
          f"{last_tier.prompt_tokens} prompt tokens not prefilled")
    print(f"I/O pools at idle    before {io_before}, after {io_after} (read buffers free, of, staging slots free)")
    for f in stats.failures[:10]:
        print("  failure:", f)
    for k, v in checks.items():
        print(f"  {'ok  ' if v else 'FAIL'} {k}")
    print(json.dumps({"minutes": wall / 60, "clients": args.clients, "requests": total,
                      "requests_per_s": total / wall, "ttft_p50_s": pct(0.5),
                      "ttft_p99_s": pct(0.99), "tokens_per_s": stats.tokens / wall,
                      "rss_warm_mib": rss_warm / 1024, "rss_plateau_mib": rss_plateau / 1024,
                      "rss_end_mib": rss_end / 1024,
                      "heap_in_use_warm_mib": heap_warm / 2**20, "heap_in_use_end_mib": heap_end / 2**20,
                      "rss_slope_mib_per_hour": slope,
                      "rss_anon_slope_mib_per_hour": anon_slope, "rss_file_slope_mib_per_hour": file_slope,
                      "rss_curve": [[round(t / 60, 2), round(v, 1)] for t, v in curve],
                      "rss_anon_curve": [[round(t / 60, 2), round(v, 1)] for t, v in anon],
                      "rss_file_curve": [[round(t / 60, 2), round(v, 1)] for t, v in filed],
                      "io_short_reads": short_reads, "faults": not args.no_faults,
                      "outcomes": stats.outcomes, "failures": len(stats.failures),
                      "checks": checks}))
    sys.exit(0 if all(checks.values()) else 1)


if __name__ == "__main__":
    main()
