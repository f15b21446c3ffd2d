#!/usr/bin/env python3
"""Tokenizer reference ids from llama.cpp (llama-cpp-python, vocab_only) for SmolLM2's GGUF,
whose `smollm` pre-tokenizer transformers' GGUF loader does not know. Writes
tests/fixtures/reference/smollm2-tokens.json: a few hundred varied strings (unicode,
whitespace, code, digits) and their ids, without BOS and with special tokens parsed.

    pip install llama-cpp-python
    python3 scripts/make_tokenizer_reference.py [path/to/SmolLM2-135M-Instruct.Q4_1.gguf]
"""
import itertools
import json
import os
import random
import sys

import llama_cpp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def corpus():
    base = [
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
        "<|im_start|>user\nHi<|im_end|>\n", "<|im_start|>assistant\n", "text<|endoftext|>more",
    ]
    rng = random.Random(20261129)
    words = ["the", "quick", "brown", "fox", "42", "jumps", "über", "日本", "x1", "  ", "\n", "3.5", "don't", "{", "}", "=>", "🙂", "7", "é"]
    extra = []
    for n in range(240):
        k = rng.randint(1, 12)
        sep = rng.choice([" ", "", "  ", "\n", "\t", " - "])
        extra.append(sep.join(rng.choice(words) for _ in range(k)))
    return base + extra


def main():
    gguf = sys.argv[1] if len(sys.argv) > 1 else os.path.expanduser("~/.cache/sluice/models/SmolLM2-135M-Instruct.Q4_1.gguf")
    llm = llama_cpp.Llama(model_path=gguf, vocab_only=True, verbose=False)
    cases = [{"text": t, "ids": llm.tokenize(t.encode("utf-8"), add_bos=False, special=True)} for t in corpus()]
    out = os.path.join(ROOT, "tests", "fixtures", "reference", "smollm2-tokens.json")
    with open(out, "w") as fh:
        json.dump({"source": f"llama-cpp-python {llama_cpp.__version__} (llama.cpp tokenizer, vocab_only, special=True, no BOS)",
                   "model": os.path.basename(gguf), "cases": cases}, fh, ensure_ascii=False, indent=0)
    print(f"wrote {len(cases)} cases to {out}")


if __name__ == "__main__":
    main()
