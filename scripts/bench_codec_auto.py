"""`sluiced pack --codec auto` against each fixed codec: the same model packed every way into
one directory (so every store sits on the same file system, the one auto measured), then a
streamed decode under one --host-memory budget, store by store, the order rotated every
round (the disk drifts). Prints tokens/s per store and round, then auto's rate over each
fixed codec's, per round and their median: auto should be at least as fast as every one of
them, within the rounds' spread. The last line is one JSON object.

    python3 scripts/bench_codec_auto.py [--gguf FILE] [--host-memory 80MiB] [--rounds 3]
                                        [--tokens 64] [--dir DIR] [--codecs none,lz4,...]
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The binaries are wherever cargo puts them (CARGO_TARGET_DIR, build.target-dir or ./target).
RELEASE = os.path.join(subprocess.run([os.path.join(ROOT, "scripts/target-dir.sh")], check=True, capture_output=True,
                                      text=True).stdout.strip(), "release")
SLUICED = os.path.join(RELEASE, "sluiced")


def pack(gguf, out, codec):
    args = [SLUICED, "pack", gguf, "-o", out, "--force"]
    args += ["--link"] if codec == "link" else ["--codec", codec]
    p = subprocess.run(args, check=True, capture_output=True, text=True)
    return p.stdout


def decode_rate(store, host_memory, tokens):
    out = subprocess.run([SLUICED, "run", store, "--prompt-ids", "1,2,3,4", "--max-tokens", str(tokens + 1),
                          "--ignore-eos", "--temperature", "0", "--host-memory", host_memory, "--max-context", "256",
                          "--json"], check=True, capture_output=True, text=True).stdout
    return json.loads(out)["decode_tokens_per_s"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", default=None, help="default: SmolLM2 via scripts/fetch-model.sh")
    ap.add_argument("--host-memory", default="80MiB")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--dir", default=None, help="where the stores go (default: a temporary directory in ~/.cache)")
    ap.add_argument("--codecs", default="none,lz4,zstd:1,zstd:3,link")
    a = ap.parse_args()
    gguf = a.gguf or subprocess.run([os.path.join(ROOT, "scripts/fetch-model.sh")], check=True, capture_output=True,
                                    text=True).stdout.strip()
    base = a.dir or os.path.expanduser("~/.cache/sluice")
    os.makedirs(base, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix="bench-codec-auto-", dir=base)
    try:
        stores = {}
        print("packing", gguf, "into", tmp, file=sys.stderr)
        report = pack(gguf, os.path.join(tmp, "auto"), "auto")
        stores["auto"] = os.path.join(tmp, "auto")
        for line in report.splitlines():
            if line.startswith("--codec auto") or line.startswith("  "):
                print(line)
        for c in a.codecs.split(","):
            d = os.path.join(tmp, c.replace(":", "-"))
            pack(gguf, d, c)
            stores[c] = d
        names = list(stores)
        rates = {n: [] for n in names}
        for r in range(a.rounds):
            order = names[r % len(names):] + names[:r % len(names)]
            for n in order:
                rates[n].append(decode_rate(stores[n], a.host_memory, a.tokens))
            print(f"round {r + 1}: " + ", ".join(f"{n} {rates[n][-1]:.1f}" for n in names), file=sys.stderr)
        print(f"\ndecode tokens/s under --host-memory {a.host_memory} ({a.tokens} tokens, greedy), per round:")
        for n in names:
            print(f"  {n:8} " + " ".join(f"{x:7.1f}" for x in rates[n]) + f"   median {statistics.median(rates[n]):.1f}")
        print("auto / fixed codec, per round (>= 1: auto as fast or faster):")
        ratios = {}
        for n in names[1:]:
            rs = [x / y for x, y in zip(rates["auto"], rates[n])]
            ratios[n] = rs
            print(f"  auto/{n:8} " + " ".join(f"{x:6.3f}" for x in rs) + f"   median {statistics.median(rs):.3f}")
        print(json.dumps({"host_memory": a.host_memory, "tokens_per_s": rates,
                          "auto_over": {n: statistics.median(rs) for n, rs in ratios.items()}}))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
