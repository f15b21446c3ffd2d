#!/usr/bin/env python3
"""Clients nobody here wrote, driven against a running sluiced by tests/tests/http.rs.

  openai_client.py basic BASE_URL CHAT_PROMPT TEXT_PROMPT IDS MAX_TOKENS
      The official `openai` package: models, chat (plain and streamed with include_usage),
      completions from text and from token ids, greedy. Prints one JSON object of what
      came back; the Rust test compares it with `sluiced run`.
  openai_client.py json BASE_URL CHAT_PROMPT TEXT_PROMPT MAX_TOKENS
      JSON mode through the `openai` package: chat greedy with and without
      response_format json_object, chat sampled with n=4 and a seed, and a completion with
      response_format (vLLM's extension, as extra_body). Each text is judged by Python's
      `json` module: {"text", "finish_reason", "is_object"}.
  openai_client.py schema BASE_URL CHAT_PROMPT SCHEMA_FILE MAX_TOKENS
      Structured outputs through the `openai` package: chat with response_format
      json_schema, greedy and sampled (n=4, a seed). Each text is validated against the
      schema by the `jsonschema` package: {"text", "finish_reason", "valid", "error"}.
  openai_client.py guided BASE_URL CHAT_PROMPT REGEX GRAMMAR_FILE GRAMMAR_REGEX MAX_TOKENS
      Regex, grammar and choice constraints through the `openai` package's extra_body, in
      vLLM's two spellings: guided_regex greedy and sampled (n=3, a seed), structured_outputs
      grammar (the Lark grammar in GRAMMAR_FILE) greedy, and guided_choice greedy. Each text
      is judged by Python's `re.fullmatch` (the grammar's by GRAMMAR_REGEX, a regex of the
      same language): {"text", "finish_reason", "matches"}.
  openai_client.py metrics BASE_URL
      GET /metrics parsed by `prometheus_client`'s text parser (a parse error fails).
      Prints {"name{label=value,...}": value}.
"""
import json
import sys
import urllib.request


def basic(base, chat_prompt, text_prompt, ids, max_tokens):
    import openai

    c = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
    out = {"models": [m.model_dump() for m in c.models.list()]}
    msgs = [{"role": "user", "content": chat_prompt}]
    r = c.chat.completions.create(model=out["models"][0]["id"], messages=msgs,
                                  temperature=0, max_tokens=max_tokens)
    out["chat"] = {"text": r.choices[0].message.content, "role": r.choices[0].message.role,
                   "finish_reason": r.choices[0].finish_reason, "usage": r.usage.model_dump(),
                   "object": r.object, "id": r.id}
    chunks = list(c.chat.completions.create(
        model=out["models"][0]["id"], messages=msgs, temperature=0, max_tokens=max_tokens,
        stream=True, stream_options={"include_usage": True}))
    out["chat_stream"] = {
        "text": "".join((ch.choices[0].delta.content or "") for ch in chunks if ch.choices),
        "role": chunks[0].choices[0].delta.role,
        "finish_reasons": [ch.choices[0].finish_reason for ch in chunks if ch.choices],
        # Only the last chunk carries usage, with no choices.
        "usage_chunks": [i for i, ch in enumerate(chunks) if ch.usage is not None],
        "usage": chunks[-1].usage.model_dump() if chunks[-1].usage else None,
        "last_choices": len(chunks[-1].choices),
        "chunks": len(chunks),
        "ids": sorted({ch.id for ch in chunks}),
    }
    r = c.completions.create(model=out["models"][0]["id"], prompt=text_prompt,
                             temperature=0, max_tokens=max_tokens)
    out["completion"] = {"text": r.choices[0].text, "finish_reason": r.choices[0].finish_reason,
                         "usage": r.usage.model_dump(), "object": r.object}
    r = c.completions.create(model=out["models"][0]["id"], prompt=ids, temperature=0,
                             max_tokens=max_tokens)
    out["completion_ids"] = {"text": r.choices[0].text, "usage": r.usage.model_dump()}
    chunks = list(c.completions.create(model=out["models"][0]["id"], prompt=text_prompt,
                                       temperature=0, max_tokens=max_tokens, stream=True))
    out["completion_stream"] = {"text": "".join(ch.choices[0].text for ch in chunks if ch.choices)}
    print(json.dumps(out))


def judged(text, finish_reason):
    try:
        is_object = isinstance(json.loads(text), dict)
    except ValueError:
        is_object = False
    return {"text": text, "finish_reason": finish_reason, "is_object": is_object}


def json_mode(base, chat_prompt, text_prompt, max_tokens):
    import openai

    c = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
    model = c.models.list().data[0].id
    msgs = [{"role": "user", "content": chat_prompt}]
    out = {}
    for name, fmt in [("plain", {"type": "text"}), ("greedy", {"type": "json_object"})]:
        r = c.chat.completions.create(model=model, messages=msgs, temperature=0,
                                      max_tokens=max_tokens, response_format=fmt)
        out[name] = judged(r.choices[0].message.content, r.choices[0].finish_reason)
    r = c.chat.completions.create(model=model, messages=msgs, temperature=1, seed=3, n=4,
                                  max_tokens=max_tokens,
                                  response_format={"type": "json_object"})
    out["sampled"] = [judged(ch.message.content, ch.finish_reason) for ch in r.choices]
    r = c.completions.create(model=model, prompt=text_prompt, temperature=0,
                             max_tokens=max_tokens,
                             extra_body={"response_format": {"type": "json_object"}})
    out["completion"] = judged(r.choices[0].text, r.choices[0].finish_reason)
    print(json.dumps(out))


def schema_mode(base, chat_prompt, schema_file, max_tokens):
    import jsonschema
    import openai

    with open(schema_file) as f:
        schema = json.load(f)
    c = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
    model = c.models.list().data[0].id
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}

    def validated(ch):
        text = ch.message.content
        try:
            jsonschema.validate(json.loads(text), schema)
            return {"text": text, "finish_reason": ch.finish_reason, "valid": True, "error": None}
        except (ValueError, jsonschema.ValidationError) as e:
            return {"text": text, "finish_reason": ch.finish_reason, "valid": False, "error": str(e)}

    msgs = [{"role": "user", "content": chat_prompt}]
    r = c.chat.completions.create(model=model, messages=msgs, temperature=0,
                                  max_tokens=max_tokens, response_format=fmt)
    out = {"greedy": validated(r.choices[0])}
    r = c.chat.completions.create(model=model, messages=msgs, temperature=1, seed=5, n=4,
                                  max_tokens=max_tokens, response_format=fmt)
    out["sampled"] = [validated(ch) for ch in r.choices]
    print(json.dumps(out))


def guided_mode(base, chat_prompt, regex, grammar_file, grammar_regex, max_tokens):
    import re

    import openai

    with open(grammar_file) as f:
        grammar = f.read()
    c = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
    model = c.models.list().data[0].id
    msgs = [{"role": "user", "content": chat_prompt}]

    def judged(ch, rx):
        text = ch.message.content
        return {"text": text, "finish_reason": ch.finish_reason,
                "matches": re.fullmatch(rx, text) is not None}

    def ask(extra, **kw):
        return c.chat.completions.create(model=model, messages=msgs, max_tokens=max_tokens,
                                         extra_body=extra, **kw)

    out = {"regex": judged(ask({"guided_regex": regex}, temperature=0).choices[0], regex)}
    r = ask({"guided_regex": regex}, temperature=1, seed=3, n=3)
    out["regex_sampled"] = [judged(ch, regex) for ch in r.choices]
    r = ask({"structured_outputs": {"grammar": grammar}}, temperature=0)
    out["grammar"] = judged(r.choices[0], grammar_regex)
    choices = ["yes", "no", "it depends"]
    r = ask({"guided_choice": choices}, temperature=0)
    out["choice"] = judged(r.choices[0], "|".join(map(re.escape, choices)))
    print(json.dumps(out))


def metrics(base):
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(base + "/metrics") as r:
        ctype = r.headers.get("Content-Type", "")
        text = r.read().decode()
    samples = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            samples[f"{s.name}{{{labels}}}"] = s.value
    print(json.dumps({"content_type": ctype, "samples": samples}))


if __name__ == "__main__":
    mode, base = sys.argv[1], sys.argv[2]
    if mode == "basic":
        basic(base, sys.argv[3], sys.argv[4], [int(t) for t in sys.argv[5].split(",")],
              int(sys.argv[6]))
    elif mode == "json":
        json_mode(base, sys.argv[3], sys.argv[4], int(sys.argv[5]))
    elif mode == "schema":
        schema_mode(base, sys.argv[3], sys.argv[4], int(sys.argv[5]))
    elif mode == "guided":
        guided_mode(base, sys.argv[3], sys.argv[4], sys.argv[5], sys.argv[6], int(sys.argv[7]))
    elif mode == "metrics":
        metrics(base)
    else:
        sys.exit(f"unknown mode {mode}")
