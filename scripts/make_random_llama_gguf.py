#!/usr/bin/env python3
"""A Llama GGUF of about 1.2 GB with random weights, for memory-limit benchmarks
(scripts/bench_memlimit.py): 24 layers, hidden 2048, intermediate 5632, 32 heads of 64 (4
KV heads), tied embeddings, Q8_0 matrices, SmolLM2's vocabulary and tokenizer copied from
its GGUF (so llama.cpp and sluice both load it). Written with gguf-py; weights N(0, 0.02),
norms 1, so activations stay finite.

With --moe EXPERTS/TOP_K every layer is a mixture instead (Mixtral's layout as llama.cpp's
converter writes it: arch "llama" with expert_count, the router ffn_gate_inp and the merged
ffn_{gate,up,down}_exps), each expert of --expert-inter rows, the router's row e scaled by
(e + 1)^-skew (--router-skew, as `sluiced synth --moe`: a skewed expert popularity).

    python3 scripts/make_random_llama_gguf.py OUT.gguf [--layers 24] [--smollm2 PATH]
        [--hidden 2048] [--moe 64/4 --expert-inter 512 --router-skew 1]
"""
import argparse
import os

import numpy as np
from gguf import GGUFReader, GGUFWriter, GGMLQuantizationType, GGUFValueType
from gguf.quants import quantize


def copy_tokenizer(src, w):
    """Every tokenizer.* key of the SmolLM2 GGUF, as it is."""
    r = GGUFReader(src)
    for name, f in r.fields.items():
        if not name.startswith("tokenizer."):
            continue
        t = f.types[0]
        if t == GGUFValueType.ARRAY:
            sub = f.types[1]
            vals = [f.parts[i] for i in f.data]
            if sub == GGUFValueType.STRING:
                w.add_array(name, [bytes(v).decode("utf-8", errors="surrogateescape") for v in vals])
            else:
                w.add_array(name, [v.tolist()[0] for v in vals])
        elif t == GGUFValueType.STRING:
            w.add_string(name, bytes(f.parts[f.data[0]]).decode())
        elif t == GGUFValueType.UINT32:
            w.add_uint32(name, int(f.parts[f.data[0]][0]))
        elif t == GGUFValueType.BOOL:
            w.add_bool(name, bool(f.parts[f.data[0]][0]))
        elif t == GGUFValueType.INT32:
            w.add_int32(name, int(f.parts[f.data[0]][0]))
    vocab = len(r.fields["tokenizer.ggml.tokens"].data)
    return vocab


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--smollm2", default=os.path.expanduser("~/.cache/sluice/models/SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--moe", help="EXPERTS/TOP_K: every layer a mixture")
    ap.add_argument("--expert-inter", type=int, default=512)
    ap.add_argument("--router-skew", type=float, default=1.0)
    a = ap.parse_args()
    hidden, inter, head_dim = a.hidden, 5632, 64
    heads, kv_heads = hidden // head_dim, max(hidden // head_dim // 8, 1)
    experts, top_k = (int(x) for x in a.moe.split("/")) if a.moe else (0, 0)
    w = GGUFWriter(a.out, "llama")
    w.add_name(f"random-llama-moe-{experts}x{top_k}" if experts else "random-llama-1.2g")
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(top_k)
        w.add_expert_feed_forward_length(a.expert_inter)
    w.add_context_length(2048)
    w.add_embedding_length(hidden)
    w.add_block_count(a.layers)
    # llama.cpp's llama graph sizes a mixture's experts by feed_forward_length.
    w.add_feed_forward_length(a.expert_inter if experts else inter)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(7)  # MOSTLY_Q8_0
    vocab = copy_tokenizer(a.smollm2, w)
    rng = np.random.default_rng(0)

    def mat(name, rows, cols):
        x = (rng.standard_normal((rows, cols), dtype=np.float32) * 0.02).astype(np.float32)
        q = quantize(x, GGMLQuantizationType.Q8_0)
        w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=GGMLQuantizationType.Q8_0)

    def norm(name):
        w.add_tensor(name, np.ones(hidden, dtype=np.float32))

    mat("token_embd.weight", vocab, hidden)
    for i in range(a.layers):
        p = f"blk.{i}"
        norm(f"{p}.attn_norm.weight")
        mat(f"{p}.attn_q.weight", heads * head_dim, hidden)
        mat(f"{p}.attn_k.weight", kv_heads * head_dim, hidden)
        mat(f"{p}.attn_v.weight", kv_heads * head_dim, hidden)
        mat(f"{p}.attn_output.weight", hidden, heads * head_dim)
        norm(f"{p}.ffn_norm.weight")
        if experts:
            router = (rng.standard_normal((experts, hidden), dtype=np.float32) * 0.02)
            router *= (np.arange(1, experts + 1, dtype=np.float32) ** -a.router_skew)[:, None]
            w.add_tensor(f"{p}.ffn_gate_inp.weight", router.astype(np.float32))
            for proj, rows, cols in (("gate", a.expert_inter, hidden), ("up", a.expert_inter, hidden),
                                     ("down", hidden, a.expert_inter)):
                x = (rng.standard_normal((experts, rows, cols), dtype=np.float32) * 0.02)
                q = quantize(x, GGMLQuantizationType.Q8_0)
                w.add_tensor(f"{p}.ffn_{proj}_exps.weight", q, raw_shape=q.shape, raw_dtype=GGMLQuantizationType.Q8_0)
            continue
        mat(f"{p}.ffn_gate.weight", inter, hidden)
        mat(f"{p}.ffn_up.weight", inter, hidden)
        mat(f"{p}.ffn_down.weight", hidden, inter)
    norm("output_norm.weight")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print(f"{a.out}: {os.path.getsize(a.out) / 2**30:.2f} GiB, {a.layers} layers, vocab {vocab}")


if __name__ == "__main__":
    main()
