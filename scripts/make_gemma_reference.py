#!/usr/bin/env python3
"""Reference outputs for Gemma 3 270M (base model, Q4_K_M GGUF, SentencePiece vocabulary, no chat
template) from two implementations nobody here wrote: llama.cpp (llama-cpp-python) and Hugging Face
transformers (which dequantizes the GGUF to float32). Writes into tests/fixtures/reference/:

  gemma3-270m-tokens.json  ~300 varied strings (scripts, emoji, whitespace runs, digits, code, CJK,
                           Gemma's control and user-defined tokens inline, characters outside the
                           vocabulary that fall back to <0xNN> bytes) with their ids from llama.cpp
                           (vocab_only, special=True, no BOS) and from transformers' GGUF tokenizer
                           (add_special_tokens=False); "disagreements" lists the indices where they
                           differ; "gguf_tokenizer" holds the GGUF's tokenizer metadata
  gemma3-270m.json         like smollm2.json: 3 plain-text prompts, prompt ids (transformers, with
                           BOS; and llama.cpp's, add_bos=True), top 64 logits at the last prompt
                           position in float32 and in float64 (the same weights cast), the largest
                           |f32 - f64| over the whole last-position logit vector, 48 greedy tokens
                           (eos <eos>) with the top1 - top2 logit margin at each step (float32), the
                           float64 greedy tokens, and llama.cpp's own 48 greedy tokens and top logits
                           (argmax over llm.eval, n_ctx 512) for information
  (step "steps", added to an existing gemma3-270m.json)
                           llama_cpp_step_max_abs_diff: teacher-forced over prompt + transformers'
                           greedy tokens, at each of the 48 steps the largest |llama.cpp - transformers|
                           over the whole logit vector (both float32): how far an engine that
                           quantizes every activation to 8 bits lands from transformers, step by step

    pip install torch transformers accelerate gguf sentencepiece numpy llama-cpp-python
    python3 scripts/make_gemma_reference.py [path/to/gemma-3-270m-q4_k_m.gguf] [tokens] [model] [steps]
"""
import json
import os
import random
import sys

import llama_cpp
import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "tests", "fixtures", "reference")
DEFAULT_GGUF = os.path.expanduser("~/.cache/sluice/models/gemma-3-270m-q4_k_m.gguf")
TOP = 64
GREEDY = 48


def corpus():
    base = [
        # the probe set of make_tokenizer_reference.py (without SmolLM's specials)
        "Hello world", "hello  world", " leading space", "trailing space ", "\ttab\tseparated", "line\nbreak", "crlf\r\nline",
        "multiple\n\n\nnewlines", "   ", "\n", "", "a", "I'm can't won't you'll they'd we've she's", "UPPER lower MiXeD",
        "1", "12", "123", "1234567890", "3.14159", "-42", "1e-9", "v1.2.3", " 2024-11-29", "call 555-0100 now", "x = 10 + 20",
        "The year 1969 and 2001.", "Room 101, floor 7", "$100.00", "50%", "#1 best", "0x1F 0b1010",
        "naïve café résumé", "Zürich Straße", "日本語のテキスト", "中文文本测试", "한국어 텍스트", "Русский текст", "العربية",
        "עברית", "ελληνικά", "हिन्दी", "🙂 emoji 🚀🔥", "👨‍👩‍👧‍👦 family", "mixed 日本 and English 123",
        "def f(x):\n    return x * 2\n", "for (int i = 0; i < n; ++i) { sum += a[i]; }", "fn main() { println!(\"{}\", 42); }",
        "<html><body class=\"x\">text</body></html>", "{\"key\": [1, 2, 3], \"nested\": {\"a\": null}}", "SELECT * FROM t WHERE id = 7;",
        "path/to/file.txt", "https://example.com/a?b=c&d=e", "user@example.com", "snake_case camelCase kebab-case",
        "...!!!???", "-- ** __ ~~", "a,b;c:d", "(parens) [brackets] {braces}", "tabs\t\tand  spaces",
        # Gemma's control tokens inline (parsed with special=True)
        "<start_of_turn>user\nHi<end_of_turn>\n", "<start_of_turn>model\n", "<bos>", "<eos>", "<pad>", "<unk>", "<mask>",
        "<bos><bos>", "text<eos>more", "<start_of_turn>user\nWrite a poem.<end_of_turn>\n<start_of_turn>model\nRoses<end_of_turn>",
        "<start_of_turn>", "<end_of_turn>", "<unused0>", "<unused99> x", "[multimodal]", "<start_of_image>", "<end_of_image>",
        "<start_of_turn> user", " <start_of_turn>", "<start_of_turn>\n\n", "<start_of_turn", "start_of_turn>", "<<bos>>",
        # Gemma's user-defined tokens: whitespace runs, newline runs, tab runs, html tags
        "  ", "    ", "        ", " " * 31, " " * 32, " " * 40, "a" + " " * 5 + "b", "\n\n", "\n\n\n\n", "\n" * 31, "\n" * 33,
        "\t", "\t\t\t", "\t" * 31, "\t" * 35, " \n \n", "\n \n\t\n", "end.\n\n\nNext", "  indented\n    more\n",
        "<table><tr><td>1</td></tr></table>", "<b>bold</b> and <i>italic</i>", "<h1>Title</h1>", "<div><span>x</span></div>",
        "<code>x</code>", "<a>link</a>", "<blockquote>q</blockquote>", "<b", "b>", "</b", "<B>upper</B>",
        # byte fallback: characters that are likely missing from the vocabulary
        "\x00", "\x01\x02\x03", "\x7f", "bell\x07", "\u200b zero width", "\u2028line sep", "\ue000 private use",
        "\U000f0000 plane 15", "𓀀 hieroglyph", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢", "ꙮ", "🫠🫨", "\U0010fffd", "\ufffd replacement",
        "ᚠᛇᚻ runes", "ⵜⴰⵎⴰⵣⵉⵖⵜ", "𐌰𐌱𐌲 gothic", "ࠀࠁ samaritan", "\u0301 lone combining", "e\u0301 combining",
        # more scripts and mixed text
        "ไทย ภาษา", "Tiếng Việt có dấu", "ქართული", "Հայերեն", "தமிழ்", "বাংলা", "ᐃᓄᒃᑎᑐᑦ", "Ελληνικά και English",
        "العربية 123 English", "日本語、中文，한국어。", "ｆｕｌｌｗｉｄｔｈ ＡＢＣ１２３", "½ ¾ ⅓ ∞ ≈ ≠ ≤", "© ® ™ § ¶",
        "x² + y² = z²", "αβγδ", "∑∫∂√", "→ ← ↑ ↓ ⇒", "“smart quotes” ‘single’", "em—dash en–dash", "…ellipsis",
        # digits
        "0", "00", "000", "0000", "12345678901234567890", "3.14159265358979", "1,000,000", "1_000_000", "٣٤٥ arabic digits",
        "१२३ devanagari digits", "①②③", "2^10=1024",
        # code
        "import numpy as np\nx = np.zeros((3, 4))\n", "#include <stdio.h>\nint main(void) { return 0; }\n",
        "if x == 1:\n\tprint('tab')\n", "    def method(self):\n        pass\n", "const f = (a, b) => a + b;",
        "$ ls -la | grep foo && echo ok", "<?xml version=\"1.0\"?>", "// comment\n/* block */", "a\\nb\\tc", "'''docstring'''",
        "```python\nprint(1)\n```", "key: value\nlist:\n  - a\n  - b\n",
        # prompts used in the model reference
        "The history of the printing press begins", "def fibonacci(n):\n", "The capital of France is",
    ]
    rng = random.Random(20261201)
    words = ["the", "quick", "brown", "fox", "42", "jumps", "über", "日本", "x1", "  ", "\n", "3.5", "don't", "{", "}", "=>",
             "🙂", "7", "é", "<start_of_turn>", "<end_of_turn>", "\t", "    ", "\n\n", "<b>", "𓀀", "<eos>", "Ω", "ß"]
    extra = []
    for n in range(140):
        k = rng.randint(1, 12)
        sep = rng.choice([" ", "", "  ", "\n", "\t", " - "])
        extra.append(sep.join(rng.choice(words) for _ in range(k)))
    return base + extra


def gguf_tokenizer_metadata(path):
    import gguf
    r = gguf.GGUFReader(path)
    meta = {}
    for k, f in r.fields.items():
        if k.startswith("tokenizer.ggml.") and k not in ("tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type", "tokenizer.ggml.merges"):
            v = f.contents()
            meta[k] = v.item() if hasattr(v, "item") else v
    meta["n_tokens"] = len(r.fields["tokenizer.ggml.tokens"].data)
    return meta


def tokens(gguf_path):
    d, f = os.path.split(gguf_path)
    llm = llama_cpp.Llama(model_path=gguf_path, vocab_only=True, verbose=False)
    try:
        tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
        tok_error = None
    except Exception as e:  # record it rather than fail: llama.cpp's ids are the reference either way
        tok, tok_error = None, f"{type(e).__name__}: {e}"
    cases, disagree = [], []
    for i, t in enumerate(corpus()):
        case = {"text": t, "llama_cpp": llm.tokenize(t.encode("utf-8"), add_bos=False, special=True)}
        if tok is not None:
            case["transformers"] = tok(t, add_special_tokens=False)["input_ids"]
            if case["transformers"] != case["llama_cpp"]:
                disagree.append(i)
        cases.append(case)
    out = {
        "source": f"llama-cpp-python {llama_cpp.__version__} (llama.cpp tokenizer, vocab_only, special=True, no BOS); "
                  f"transformers {__import__('transformers').__version__} GGUF tokenizer (add_special_tokens=False)",
        "model": f,
        "gguf_tokenizer": gguf_tokenizer_metadata(gguf_path),
        "transformers_tokenizer": type(tok).__name__ if tok is not None else None,
        "transformers_error": tok_error,
        "disagreements": {"count": len(disagree), "indices": disagree},
        "cases": cases,
    }
    with open(os.path.join(OUT, "gemma3-270m-tokens.json"), "w") as fh:
        json.dump(out, fh, ensure_ascii=False, indent=0)
    print(f"tokens: {len(cases)} cases, {len(disagree)} disagreements {disagree}")


def top(logits, k=TOP):
    t = torch.topk(logits, k)
    return [[int(i), round(float(v), 5)] for v, i in zip(t.values, t.indices)]


def greedy(model, ids, n, eos):
    """n greedy tokens (stopping at eos) and the top1 - top2 raw logit margin at each step."""
    out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=eos, pad_token_id=eos,
                         attention_mask=torch.ones(1, len(ids), dtype=torch.long), output_logits=True,
                         return_dict_in_generate=True)
    margins = []
    for s in out.logits:
        t = torch.topk(s[0].double(), 2).values
        margins.append(round(float(t[0] - t[1]), 6))
    return out.sequences[0, len(ids):].tolist(), margins


def llama_cpp_greedy(llm, ids, n, eos):
    llm.reset()
    llm.eval(ids)
    n_vocab = llm.n_vocab()
    first = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1), shape=(n_vocab,)).copy()
    outs = []
    for _ in range(n):
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1), shape=(n_vocab,))
        t = int(np.argmax(logits))
        outs.append(t)
        if t == eos:
            break
        llm.eval([t])
    return outs, top(torch.from_numpy(first))


def model_reference(gguf_path):
    d, f = os.path.split(gguf_path)
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, torch_dtype=torch.float32, attn_implementation="eager")
    model.eval()
    eos = int(gguf_tokenizer_metadata(gguf_path)["tokenizer.ggml.eos_token_id"])
    bos = int(gguf_tokenizer_metadata(gguf_path)["tokenizer.ggml.bos_token_id"])
    llm = llama_cpp.Llama(model_path=gguf_path, n_ctx=512, n_batch=512, verbose=False)
    prompts = ["The history of the printing press begins", "def fibonacci(n):\n", "The capital of France is"]
    cases = []
    for text in prompts:
        ids = tok(text, add_special_tokens=True)["input_ids"]
        bos_added_here = False
        if not ids or ids[0] != bos:  # Gemma expects BOS; add it if the GGUF tokenizer did not
            ids = [bos] + ids
            bos_added_here = True
        with torch.no_grad():
            l32 = model(torch.tensor([ids])).logits[0, -1].float()
        toks, margins = greedy(model, ids, GREEDY, eos)
        lc_ids = llm.tokenize(text.encode("utf-8"), add_bos=True, special=True)
        lc_greedy, lc_top = llama_cpp_greedy(llm, lc_ids, GREEDY, eos)
        cases.append({"kind": "text", "text": text, "rendered": None, "prompt_token_ids": ids,
                      "bos_prepended_by_script": bos_added_here, "prompt_token_ids_llama_cpp": lc_ids,
                      "top_logits": top(l32), "_l32": l32, "greedy": toks, "greedy_margins": margins,
                      "llama_cpp_greedy": lc_greedy, "llama_cpp_top_logits": lc_top})
    model.to(torch.float64)
    for c in cases:
        with torch.no_grad():
            l64 = model(torch.tensor([c["prompt_token_ids"]])).logits[0, -1]
        c["top_logits_f64"] = top(l64)
        c["max_abs_diff_f32_f64"] = float((c.pop("_l32").double() - l64).abs().max())
        c["greedy_f64"], _ = greedy(model, c["prompt_token_ids"], GREEDY, eos)
    out = {"source": f"transformers {__import__('transformers').__version__}, torch {torch.__version__}, GGUF dequantized to float32 "
                     f"(and cast to float64 for *_f64), eager attention; llama_cpp_*: llama-cpp-python {llama_cpp.__version__}, "
                     f"n_ctx 512, argmax over llm.eval",
           "model": f, "eos": eos, "cases": cases}
    with open(os.path.join(OUT, "gemma3-270m.json"), "w") as fh:
        json.dump(out, fh, indent=1)
    for c in cases:
        print(f"{c['text']!r}: f32-f64 {c['max_abs_diff_f32_f64']:.3g}, min margin {min(c['greedy_margins']):.4g}, "
              f"greedy==f64 {c['greedy'] == c['greedy_f64']}, ids==llama.cpp {c['prompt_token_ids'] == c['prompt_token_ids_llama_cpp']}, "
              f"greedy==llama.cpp {c['greedy'] == c['llama_cpp_greedy']}")


def step_differences(gguf_path):
    """Adds llama_cpp_step_max_abs_diff to each case of gemma3-270m.json (see the docstring)."""
    d, f = os.path.split(gguf_path)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, torch_dtype=torch.float32, attn_implementation="eager")
    model.eval()
    llm = llama_cpp.Llama(model_path=gguf_path, n_ctx=512, n_batch=512, logits_all=True, verbose=False)
    path = os.path.join(OUT, "gemma3-270m.json")
    with open(path) as fh:
        ref = json.load(fh)
    for c in ref["cases"]:
        ids, greedy_ids = c["prompt_token_ids"], c["greedy"]
        seq = ids + greedy_ids
        with torch.no_grad():
            tf = model(torch.tensor([seq])).logits[0].double().numpy()
        llm.reset()
        llm.eval(seq)
        lc = np.array(llm.scores[: len(seq)], dtype=np.float64)
        # Step t predicts greedy[t] from position len(ids) - 1 + t.
        diffs = [float(np.abs(lc[len(ids) - 1 + t] - tf[len(ids) - 1 + t]).max()) for t in range(len(greedy_ids))]
        c["llama_cpp_step_max_abs_diff"] = [round(x, 5) for x in diffs]
        print(f"{c['text']!r}: llama.cpp vs transformers per step: max {max(diffs):.3f}, median {float(np.median(diffs)):.3f}")
    ref["source"] += "; llama_cpp_step_max_abs_diff: llama-cpp-python logits_all over prompt + greedy, vs transformers float32"
    with open(path, "w") as fh:
        json.dump(ref, fh, indent=1)


def main():
    args = sys.argv[1:]
    gguf_path = next((a for a in args if a.endswith(".gguf")), DEFAULT_GGUF)
    steps = [a for a in args if a in ("tokens", "model", "steps")] or ["tokens", "model", "steps"]
    os.makedirs(OUT, exist_ok=True)
    torch.manual_seed(0)
    if "tokens" in steps:
        tokens(gguf_path)
    if "model" in steps:
        model_reference(gguf_path)
    if "steps" in steps:
        step_differences(gguf_path)


if __name__ == "__main__":
    main()
