#!/usr/bin/env python3
"""What a constraint costs in decode: `sluiced run` tokens/s with plain sampling against
JSON mode, a JSON schema, and (where the binary has them) a regular expression and a Lark
grammar, on SmolLM2-135M (49k tokens) and Gemma 3 270M (262k tokens), both resident.
Runs alternate mode by mode within each round, so drift hits every mode alike; the table
gives each mode's median decode tokens/s and its ratio to plain sampling in the same
binary (goal: constrained >= 0.97x plain). SmolLM2 gets the prompt through its chat
template; Gemma 3 270M (a base model whose GGUF has no template) as plain text.

`--before BINARY` adds a second sluiced (an older build: the hand-written JSON automaton)
and alternates the two binaries too, so before and after are measured in one run.

Sampling is llama.cpp's default (temperature 0.8, top-k 40, top-p 0.95, min-p 0.05, a
fixed seed per round): greedy decoding would try the best token first and rarely compute
a mask at all. Plain runs ignore end tokens so they decode the same number of tokens as a
constrained run at most; constrained runs end where their text is whole.

    cargo build --release
    python3 scripts/bench_constrained.py [--rounds 5] [--max-tokens 96] [--threads 2]
        [--models smollm2,gemma3] [--before /path/to/old/sluiced]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_cpu import RELEASE, SMOLLM2  # noqa: E402
from bench_spec import GEMMA3  # noqa: E402

SLUICED = os.environ.get("SLUICED", os.path.join(RELEASE, "sluiced"))
CACHE = os.environ.get("SLUICE_CACHE", os.path.expanduser("~/.cache/sluice"))

PROMPT = ("Describe three fictional people as JSON: for each their name, age, city, "
          "a list of hobbies and whether they are employed.")

# Supported by the old schema compiler and by llguidance alike.
SCHEMA = {
    "type": "object",
    "properties": {
        "people": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string"},
                    "age": {"type": "integer"},
                    "city": {"type": "string"},
                    "hobbies": {"type": "array", "items": {"type": "string"}},
                    "employed": {"type": "boolean"},
                },
                "required": ["name", "age", "city", "hobbies", "employed"],
            },
        },
    },
    "required": ["people"],
}

REGEX = r"(Name: [A-Z][a-z]+ [A-Z][a-z]+, age [1-9][0-9]?, lives in [A-Z][a-z ]+\.\n){3}"

GRAMMAR = r"""
start: person person person
person: "Name: " NAME ", age " AGE ", hobbies: " hobby ("," " " hobby)* ".\n"
hobby: /[a-z]+( [a-z]+)?/
NAME: /[A-Z][a-z]+ [A-Z][a-z]+/
AGE: /[1-9][0-9]?/
"""


def has_flag(binary, flag):
    out = subprocess.run([binary, "run", "--help"], capture_output=True, text=True).stdout
    return flag in out


def store_of(gguf, name):
    store = os.path.join(CACHE, "bench-grammar", name + ".store")
    if not os.path.isdir(store):
        os.makedirs(os.path.dirname(store), exist_ok=True)
        subprocess.run([SLUICED, "pack", gguf, "-o", store], check=True, capture_output=True)
    return store


def run(binary, store, mode_args, a, seed, chat):
    cmd = [binary, "run", store, *(["--chat"] if chat else []), "--prompt", PROMPT, "--max-tokens", str(a.max_tokens),
           "--temperature", "0.8", "--top-k", "40", "--top-p", "0.95", "--min-p", "0.05",
           "--seed", str(seed), "--threads", str(a.threads), "--max-context", "1024", "--json",
           *mode_args]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{p.stderr[-2000:]}")
    j = json.loads(p.stdout)
    return j["decode_tokens_per_s"], j["generated_tokens"], j["finish_reason"]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--models", default="smollm2,gemma3")
    ap.add_argument("--before", help="an older sluiced to measure in the same run")
    a = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="bench-constrained-")
    schema = os.path.join(tmp, "schema.json")
    grammar = os.path.join(tmp, "people.lark")
    with open(schema, "w") as f:
        json.dump(SCHEMA, f)
    with open(grammar, "w") as f:
        f.write(GRAMMAR)
    binaries = [("after", SLUICED)] + ([("before", a.before)] if a.before else [])
    models = {"smollm2": SMOLLM2, "gemma3": GEMMA3}
    for model in a.models.split(","):
        store = store_of(models[model], model)
        engines = []
        for label, binary in binaries:
            engines.append((label, "plain", binary, ["--ignore-eos"]))
            engines.append((label, "json_object", binary, ["--json-object"]))
            engines.append((label, "json_schema", binary, ["--json-schema", schema]))
            if has_flag(binary, "--regex"):
                engines.append((label, "regex", binary, ["--regex", REGEX]))
            if has_flag(binary, "--grammar"):
                engines.append((label, "grammar", binary, ["--grammar", grammar]))
        rates = {(lab, mode): [] for lab, mode, _, _ in engines}
        tokens = {(lab, mode): [] for lab, mode, _, _ in engines}
        for r in range(a.rounds):
            for lab, mode, binary, args in engines:
                tps, n, finish = run(binary, store, args, a, 1000 + r, model == "smollm2")
                rates[(lab, mode)].append(tps)
                tokens[(lab, mode)].append(n)
                print(f"  {model} round {r} {lab:6} {mode:12} {tps:7.1f} tok/s  {n:3} tokens ({finish})",
                      file=sys.stderr, flush=True)
        print(f"\n{model}: {a.rounds} rounds, {a.threads} threads, at most {a.max_tokens} tokens, sampled")
        print(f"| binary | mode | decode tok/s (median) | min-max | tokens (median) | ÷ plain |")
        print("|---|---|---|---|---|---|")
        for lab, mode, _, _ in engines:
            v = rates[(lab, mode)]
            plain = statistics.median(rates[(lab, "plain")])
            print(f"| {lab} | {mode} | {statistics.median(v):.1f} | {min(v):.1f}-{max(v):.1f} | "
                  f"{statistics.median(tokens[(lab, mode)]):.0f} | {statistics.median(v) / plain:.3f} |")


if __name__ == "__main__":
    main()
