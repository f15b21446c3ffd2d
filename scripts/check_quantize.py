#!/usr/bin/env python3
"""`sluiced pack --quantize TYPE` on a real model against llama.cpp's own quantizer
(llama-cpp-python's `llama_model_quantize`, `pure`: every weight matrix to the one type, no
importance matrix): for each type, the GGUF llama.cpp writes is packed as it is, the source
is packed with --quantize, and `sluiced inspect --tensors` compares the two stores tensor
by tensor (type, shape, digest of the decoded bytes). Prints a row per type: tensors
identical of all, the types the matrices got, and the time each quantizer took (sluiced's
whole pack, threads = --threads, against llama_model_quantize with nthread = --threads).

Default source: SmolLM2-135M as F16 (llama.cpp's rewrite of the Q4_1 from
scripts/fetch-model.sh, as scripts/bench_cpu.py makes it). Exit status 1 if any tensor
differs.

    pip install llama-cpp-python
    cargo build --release
    python3 scripts/check_quantize.py [--gguf F16.gguf] [--types q8_0,q4_k] [--threads 2]
"""
import argparse
import ctypes
import json
import os
import subprocess
import sys
import tempfile
import time

import llama_cpp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
from bench_cpu import rewritten  # noqa: E402  (the F16 file bench_cpu.py makes)

# llama_ftype (llama.h) whose default tensor type is TYPE.
FTYPES = {"q8_0": 7, "q4_0": 2, "q4_1": 3, "q5_0": 8, "q5_1": 9, "q2_k": 10, "q3_k": 11,
          "q4_k": 14, "q5_k": 16, "q6_k": 18}
BIN = os.path.join(subprocess.run([os.path.join(ROOT, "scripts", "target-dir.sh")], check=True,
                                  capture_output=True, text=True).stdout.strip(), "release")


def llama_quantize(src, dst, ftype, threads):
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.pure, params.nthread = ftype, True, threads
    saved, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 2)  # its log names every tensor
    try:
        t0 = time.time()
        rc = llama_cpp.llama_model_quantize(src.encode(), dst.encode(), ctypes.byref(params))
        secs = time.time() - t0
    finally:
        os.dup2(saved, 2)
        os.close(null)
        os.close(saved)
    if rc != 0:
        sys.exit(f"llama_model_quantize {src} ({ftype}) failed: {rc}")
    return secs


def sluiced(*args):
    return subprocess.run([f"{BIN}/sluiced", *args], check=True, capture_output=True, text=True).stdout


def tensors(store):
    j = json.loads(sluiced("inspect", "--tensors", "--json", store))
    return {t["name"]: (t["dtype"], tuple(t["shape"]), t["xxh3"]) for t in j["tensors"]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", help="an F16/BF16/F32 GGUF (default: SmolLM2-135M F16)")
    ap.add_argument("--types", default=",".join(FTYPES))
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    src = args.gguf
    if not src:
        q41 = subprocess.run([os.path.join(ROOT, "scripts", "fetch-model.sh")], check=True,
                             capture_output=True, text=True).stdout.strip().splitlines()[-1]
        src = rewritten(q41, "F16", 1)
    print(f"source {src}\n")
    print(f"{'type':6} {'identical':>11}  {'sluice s':>9} {'llama.cpp s':>12}  matrices stored as")
    failed = False
    with tempfile.TemporaryDirectory() as tmp:
        for t in args.types.split(","):
            ref = os.path.join(tmp, f"ref-{t}.gguf")
            llama_s = llama_quantize(src, ref, FTYPES[t], args.threads)
            theirs, ours = os.path.join(tmp, f"theirs-{t}"), os.path.join(tmp, f"ours-{t}")
            sluiced("pack", ref, "-o", theirs, "--codec", "none")
            t0 = time.time()
            sluiced("pack", src, "-o", ours, "--codec", "none", "--quantize", t,
                    "--threads", str(args.threads))
            ours_s = time.time() - t0
            a, b = tensors(ours), tensors(theirs)
            same = sum(1 for n in a if a[n] == b.get(n))
            kinds = {}
            for n, (dt, shape, _) in a.items():
                if len(shape) >= 2:
                    kinds[dt] = kinds.get(dt, 0) + 1
            differ = [f"{n}: ours {a[n][0]}, llama.cpp {b.get(n, ('absent',))[0]}"
                      for n in a if a[n] != b.get(n)]
            print(f"{t:6} {same:>5} of {len(a):<3}  {ours_s:9.1f} {llama_s:12.1f}  "
                  + ", ".join(f"{k} x{v}" for k, v in sorted(kinds.items())))
            for d in differ[:3]:
                print(f"         {d}")
            failed |= bool(differ)
            for d in (theirs, ours):
                subprocess.run(["rm", "-rf", d], check=True)
            os.remove(ref)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
