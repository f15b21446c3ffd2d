#!/usr/bin/env python3
"""Reference outputs from Hugging Face transformers (an implementation nobody here wrote)
for the model tests. Writes small JSON files into tests/fixtures/reference/:

  tiny-llama.json, tiny-qwen2.json  prompt ids, last-position logits (full vocab), greedy
                                    continuations; weights from tests/fixtures (float32)
  tiny-llama-q.json                 the same for tiny-llama-q.gguf (q8_0/q4_0/q4_1), which
                                    transformers dequantizes to float32
  smollm2.json                      SmolLM2-135M-Instruct loaded from its GGUF (transformers
                                    dequantizes it to float32): prompt ids, top logits at the
                                    last position, 40-token greedy continuations, 3 prompts
                                    (one chat-templated)
  smollm2-penalties.json            (with --penalties, alone) greedy continuations under
                                    repetition_penalty 1.3 and 1.8, and without

    pip install torch transformers accelerate gguf numpy
    python3 scripts/make_reference.py [path/to/SmolLM2-135M-Instruct.Q4_1.gguf] [--penalties]
"""
import json
import os
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIX = os.path.join(ROOT, "tests", "fixtures")
OUT = os.path.join(FIX, "reference")


def greedy(model, ids, n, eos):
    out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=eos,
                         pad_token_id=eos if eos is not None else 0, attention_mask=torch.ones(1, len(ids), dtype=torch.long))
    return out[0, len(ids):].tolist()


def last_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, -1].float()


def tiny(name):
    if name.endswith(".gguf"):
        model = AutoModelForCausalLM.from_pretrained(FIX, gguf_file=name, torch_dtype=torch.float32, attn_implementation="eager")
    else:
        model = AutoModelForCausalLM.from_pretrained(os.path.join(FIX, name), torch_dtype=torch.float32, attn_implementation="eager")
    model.eval()
    g = torch.Generator().manual_seed(1234)
    cases = []
    for length in (1, 7, 40):
        ids = torch.randint(3, model.config.vocab_size, (length,), generator=g).tolist()
        cases.append({
            "prompt_token_ids": ids,
            "last_logits": [round(x, 6) for x in last_logits(model, ids).tolist()],
            # eos disabled: random weights would stop anywhere; compare a fixed length.
            "greedy": greedy(model, ids, 16, None),
        })
    return {"source": f"transformers {__import__('transformers').__version__}, torch {torch.__version__}, float32, eager attention",
            "model": name, "cases": cases}


def smollm2(gguf_path):
    d, f = os.path.split(gguf_path)
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, torch_dtype=torch.float32, attn_implementation="eager")
    model.eval()
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    prompts = [
        {"kind": "text", "text": "The history of the printing press begins"},
        {"kind": "text", "text": "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"},
        {"kind": "chat", "messages": [{"role": "user", "content": "Write a short story about a lighthouse keeper who finds a message in a bottle."}]},
    ]
    cases = []
    for p in prompts:
        if p["kind"] == "chat":
            rendered_ids = tok.apply_chat_template(p["messages"], add_generation_prompt=True)
            # Newer transformers return an encoding object rather than a list.
            ids = list(rendered_ids if isinstance(rendered_ids, list) else rendered_ids["input_ids"])
            if ids and isinstance(ids[0], list):
                ids = ids[0]
            rendered = tok.apply_chat_template(p["messages"], add_generation_prompt=True, tokenize=False)
        else:
            ids = tok(p["text"], add_special_tokens=True)["input_ids"]
            rendered = None
        logits = last_logits(model, ids)
        top = torch.topk(logits, 64)
        cases.append({
            **p,
            "rendered": rendered,
            "prompt_token_ids": ids,
            "top_logits": [[int(i), round(float(v), 5)] for v, i in zip(top.values, top.indices)],
            "greedy": greedy(model, ids, 40, eos),
        })
    return {"source": f"transformers {__import__('transformers').__version__}, torch {torch.__version__}, GGUF dequantized to float32, eager attention",
            "model": f, "eos": eos, "cases": cases}


def smollm2_penalties(gguf_path):
    """Greedy continuations under transformers' repetition penalty (its
    RepetitionPenaltyLogitsProcessor: over the prompt and the text so far, positive logits
    divided, negative multiplied), with the unpenalized ones beside them."""
    d, f = os.path.split(gguf_path)
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, torch_dtype=torch.float32, attn_implementation="eager")
    model.eval()
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    cases = []
    for text in ("The history of the printing press begins", "The best way to learn to cook is"):
        ids = tok(text, add_special_tokens=True)["input_ids"]
        for penalty in (1.3, 1.8):
            out = model.generate(torch.tensor([ids]), max_new_tokens=40, do_sample=False, repetition_penalty=penalty,
                                 eos_token_id=eos, pad_token_id=eos, attention_mask=torch.ones(1, len(ids), dtype=torch.long))
            cases.append({"text": text, "prompt_token_ids": ids, "repetition_penalty": penalty,
                          "greedy": out[0, len(ids):].tolist(), "unpenalized": greedy(model, ids, 40, eos)})
    return {"source": f"transformers {__import__('transformers').__version__}, torch {torch.__version__}, GGUF dequantized to float32, eager attention, generate(repetition_penalty=...)",
            "model": f, "eos": eos, "cases": cases}


def main():
    os.makedirs(OUT, exist_ok=True)
    torch.manual_seed(0)
    gguf = sys.argv[1] if len(sys.argv) > 1 and not sys.argv[1].startswith("--") else os.path.expanduser("~/.cache/sluice/models/SmolLM2-135M-Instruct.Q4_1.gguf")
    if "--penalties" in sys.argv:
        with open(os.path.join(OUT, "smollm2-penalties.json"), "w") as fh:
            json.dump(smollm2_penalties(gguf), fh, indent=1)
        return
    for name in ("tiny-llama", "tiny-qwen2", "tiny-llama-q.gguf"):
        with open(os.path.join(OUT, f"{name.removesuffix('.gguf')}.json"), "w") as fh:
            json.dump(tiny(name), fh)
    with open(os.path.join(OUT, "smollm2.json"), "w") as fh:
        json.dump(smollm2(gguf), fh, indent=1)


if __name__ == "__main__":
    main()
