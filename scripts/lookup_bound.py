#!/usr/bin/env python3
"""The most tokens a streamed pass can yield by prompt lookup on bench_spec's prompts: what
the text itself allows, whatever the engine.

Greedy decoding is deterministic, so a drafter's accepted tokens at each step are the
agreement of its proposal with the model's own greedy continuation. This script decodes
each prompt of scripts/bench_spec_prompts.json once, greedily, with plain `sluiced run` (the
same token ids bench_spec.py feeds every engine), then replays the continuation through
each lookup rule with whole drafts of --draft tokens, no row budget (every proposal
verified whole, as `--draft-fixed` does) and prints the tokens each pass yields: per prompt,
and their mean per kind (bench_spec.py's median over a kind's prompts is near it).

Rules: `sluice` (sluiced's `ngram`: the longest suffix of the text, 4 tokens down to 1, that
occurred before; its latest occurrence, for one token its first) and `llama.cpp` (bench_spec's
llama.cpp worker, as llama-cpp-python's LlamaPromptLookupDecoding: the last 2-gram, else the
last token, at its first occurrence).

    python3 scripts/lookup_bound.py [--models smollm2,gemma3] [--decode 64] [--draft 8,10]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_spec import CACHE, GEMMA3, ROOT, SLUICED, chat_ids  # noqa: E402
from bench_cpu import SMOLLM2, rewritten  # noqa: E402


def propose(text, length, longest, latest):
    """Up to `length` tokens after the latest (or first) earlier occurrence of the text's
    longest suffix of `longest` tokens down to one; read on into themselves past the end."""
    end = len(text)
    for n in range(min(longest, end - 1), 0, -1):
        suffix = text[end - n:]
        ends = [a for a in range(n, end) if text[a - n:a] == suffix]
        if not ends:
            continue
        at = ends[-1] if latest and n > 1 else ends[0]
        out = []
        for k in range(length):
            out.append(text[at + k] if at + k < end else out[at + k - end])
        return out
    return []


RULES = {"sluice": (4, True), "llama.cpp": (2, False)}


def tokens_per_pass(prompt, greedy, length, rule):
    longest, latest = RULES[rule]
    text, pos, passes = prompt + greedy[:1], 1, 0
    while pos < len(greedy):
        draft = propose(text, length, longest, latest)
        ok = 0
        while ok < len(draft) and pos + ok < len(greedy) and draft[ok] == greedy[pos + ok]:
            ok += 1
        step = min(ok + 1, len(greedy) - pos)
        text += greedy[pos:pos + step]
        pos += step
        passes += 1
    return (len(greedy) - 1) / passes


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="smollm2,gemma3")
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--draft", default="8,10")
    a = ap.parse_args()
    prompts = json.load(open(os.path.join(ROOT, "scripts", "bench_spec_prompts.json")))
    sources = {"smollm2": SMOLLM2, "gemma3": GEMMA3}
    for m in a.models.split(","):
        gguf = rewritten(sources[m], "F16", 1)
        store = os.path.join(CACHE, "bench-spec", os.path.basename(gguf) + ".store")
        if not os.path.isdir(store):
            subprocess.run([SLUICED, "pack", gguf, "-o", store], check=True, capture_output=True)
        print(f"{m}: {os.path.basename(gguf)}, {a.decode} greedy tokens a prompt")
        runs = []
        for p in prompts:
            ids = chat_ids(gguf, p["prompt"])
            out = subprocess.run([SLUICED, "run", store, "--prompt-ids", ",".join(map(str, ids)),
                                  "--max-tokens", str(a.decode + 1), "--temperature", "0", "--ignore-eos",
                                  "--max-context", str(len(ids) + a.decode + 16), "--json"],
                                 check=True, capture_output=True, text=True).stdout
            runs.append((p["kind"], ids, json.loads(out)["sequences"][0]["generated_token_ids"]))
        for length in map(int, a.draft.split(",")):
            for rule in RULES:
                per = [(k, tokens_per_pass(ids, g, length, rule)) for k, ids, g in runs]
                kinds = sorted({k for k, _ in per})
                line = ", ".join(f"{k} {statistics.mean(v for kk, v in per if kk == k):.2f} "
                                 f"({' '.join(f'{v:.2f}' for kk, v in per if kk == k)})" for k in kinds)
                print(f"  drafts of {length:>2}, {rule:<9}: {line}")


if __name__ == "__main__":
    main()
