#!/usr/bin/env python3
"""Streaming against the disk, in one run: does a streamed pass at batch 1 move its bytes at
the disk's rate, and does it overlap with compute?

Each round runs fio on the store's weights.bin (io_uring, O_DIRECT, registered buffers,
4 MiB x 64, for `--fio-seconds`), then `sluiced bench-stream --batch 1 --json` (compute-only,
streaming-only and streamed passes, alternated), then fio again. fio's registered buffers
(--fixedbufs) matter on this project's VM: without them the same run read 0.8-1.1 GB/s
against 1.5-2.2 with them, and sluice registers its read buffers and staging slots too. The
disk's rate grew with the bytes in flight when its reads could not merge (0.8 GB/s at 8 MiB,
1.6 at 64, 2.0 at 256); with the engine's buffers on huge pages it no longer does past 32 MiB
(fio 4 MiB reads, four alternating rounds: medians 1.3 GB/s at 8 MiB, 1.55 at 32 and at 256),
which is what sluice keeps in flight at most. 4 MiB x 64 is kept as fio's best here.

    python3 scripts/bench_stream_disk.py STORE [--rounds 3] [--prefetch auto,4]
        [--device-memory 48MiB | --host-memory 640MiB | --weights-budget 50%] [--steps 16]
        [--threads 2] [--sluiced BIN,BIN]

Prints a row a run and, last, one JSON line per prefetch setting: the median over rounds of
streaming_only / fio and of the overlap ratio (pass / max(compute-only, streaming-only)).
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The binaries are wherever cargo puts them (CARGO_TARGET_DIR, build.target-dir or ./target).
RELEASE = os.path.join(subprocess.run([os.path.join(ROOT, "scripts/target-dir.sh")], check=True, capture_output=True,
                                      text=True).stdout.strip(), "release")
SLUICED = os.path.join(RELEASE, "sluiced")


def fio_gbps(path, seconds):
    out = subprocess.run(["fio", "--name=seqread", f"--filename={path}", "--readonly", "--direct=1",
                          "--ioengine=io_uring", "--fixedbufs", "--bs=4M", "--iodepth=64", "--rw=read",
                          "--time_based", f"--runtime={seconds}", "--output-format=json"],
                         check=True, capture_output=True, text=True).stdout
    return json.loads(out)["jobs"][0]["read"]["bw_bytes"] / 1e9


def bench_stream(store, a, prefetch, sluiced):
    cmd = [sluiced, "bench-stream", store, "--batch", "1", "--steps", str(a.steps), "--threads", str(a.threads),
           "--json"]
    if a.device_memory:
        cmd += ["--device-memory", a.device_memory]
    elif a.host_memory:
        cmd += ["--host-memory", a.host_memory]
    else:
        cmd += ["--weights-budget", a.weights_budget]
    if prefetch != "auto":
        cmd += ["--prefetch", prefetch]
    r = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return json.loads(r.stdout)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("store")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prefetch", default="auto,4", help="comma-separated: auto (the plan's) or a unit count")
    ap.add_argument("--device-memory")
    ap.add_argument("--host-memory", help="the whole process's budget (on the CPU it alone decides what streams)")
    ap.add_argument("--sluiced", default=SLUICED,
                    help="comma-separated sluiced binaries, alternated within each round (a change against its parent)")
    ap.add_argument("--weights-budget", default="50%")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--fio-seconds", type=int, default=3)
    a = ap.parse_args()
    if shutil.which("fio") is None:
        sys.exit("bench_stream_disk: fio is missing (apt-get install fio)")
    weights = os.path.join(a.store, "weights.bin")
    binaries = a.sluiced.split(",")
    settings = [(b, p) for b in binaries for p in a.prefetch.split(",")]
    label = lambda b, p: p if len(binaries) == 1 else f"{'ABCDEFGH'[binaries.index(b)]}:{p}"
    for i, b in enumerate(binaries if len(binaries) > 1 else []):
        print(f"{'ABCDEFGH'[i]}: {b}")
    rows = {p: [] for p in settings}
    print(f"{a.store}: fio 4 MiB x 64 over weights.bin for {a.fio_seconds} s before and after each run")
    print(f"{'setting':>16} {'fio GB/s':>9} {'stream GB/s':>11} {'stream/fio':>10} "
          f"{'compute ms':>10} {'stream ms':>9} {'pass ms':>8} {'overlap':>7}")
    prev = fio_gbps(weights, a.fio_seconds)
    for _ in range(a.rounds):
        for b, p in settings:
            j = bench_stream(a.store, a, p, b)
            cur = fio_gbps(weights, a.fio_seconds)
            ref = (prev + cur) / 2
            rate = j["disk_bytes_per_pass"] / j["streaming_only_pass_s"] / 1e9
            row = {"fio_gbps": ref, "stream_gbps": rate, "stream_vs_fio": rate / ref,
                   "overlap_ratio": j["overlap_ratio"], "compute_ms": j["compute_only_pass_s"] * 1e3,
                   "streaming_ms": j["streaming_only_pass_s"] * 1e3, "pass_ms": j["streamed_pass_s"] * 1e3,
                   "disk_bytes_per_pass": j["disk_bytes_per_pass"]}
            rows[(b, p)].append(row)
            print(f"{label(b, p):>16} {ref:9.3f} {rate:11.3f} {rate / ref:10.3f} {row['compute_ms']:10.2f} "
                  f"{row['streaming_ms']:9.2f} {row['pass_ms']:8.2f} {j['overlap_ratio']:7.3f}")
            prev = cur
    for b, p in settings:
        r = rows[(b, p)]
        print(json.dumps({"sluiced": b, "prefetch": p, "rounds": len(r),
                          "disk_bytes_per_pass": r[0]["disk_bytes_per_pass"],
                          "stream_vs_fio_median": round(statistics.median(x["stream_vs_fio"] for x in r), 3),
                          "overlap_ratio_median": round(statistics.median(x["overlap_ratio"] for x in r), 3)}))


if __name__ == "__main__":
    main()
