#!/usr/bin/env python3
"""Clients nobody here wrote calling tools against a running sluiced (tests/tests/tools.rs).

  tools_client.py loop BASE_URL
      The `openai` package's tool loop on SmolLM2 (a template without tools: calls are
      forced): request -> tool call -> tool result -> answer, without and with streaming;
      a named tool_choice; every call's arguments validated by `jsonschema` against its
      function's schema. Streamed calls are checked to arrive as OpenAI streams them: the
      id, type and name first with empty arguments, then arguments in pieces.
  tools_client.py forced BASE_URL MODEL
      One forced call (required, then each function by name) and one `auto` turn through
      the `openai` package, on a model whose own template has tools (a random tiny model:
      schemas whose instances are all short).
  tools_client.py harmony BASE_URL MODEL
      gpt-oss's harmony format on a random tiny model with harmony's tokens: a forced call
      (its header and arguments read back from the channels), the tool loop (the call and
      its result rendered back by gpt-oss's template, then an answer), the call streamed.
  tools_client.py langchain BASE_URL
      LangChain's ChatOpenAI(...).bind_tools: a two-step task (the weather in a city, then
      a sum with the temperature) with forced calls, each tool run by LangChain's own
      @tool functions and its ToolMessage results, then the answer.
Each prints one JSON object of what happened.
"""
import json
import sys

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "minLength": 1, "maxLength": 40},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Adds two numbers.",
    "parameters": {"type": "object", "properties": {
        "a": {"type": "number", "minimum": -1000, "maximum": 1000},
        "b": {"type": "number", "minimum": -1000, "maximum": 1000}},
        "required": ["a", "b"], "additionalProperties": False}}}
TOOLS = [WEATHER, ADD]
# For random tiny models, which write a number's digits or a string's characters for as long
# as they may: schemas whose every instance is short.
# (gpt-oss's template needs each function's description.)
TIGHT = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather.", "parameters": {
        "type": "object", "properties": {"city": {"enum": ["Oslo", "Paris", "Rome"]}},
        "required": ["city"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "add", "description": "Adds.", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                                         "b": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["a", "b"], "additionalProperties": False}}},
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
TIGHT_SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TIGHT}


def valid(name, arguments, schemas=SCHEMAS):
    import jsonschema
    try:
        jsonschema.validate(json.loads(arguments), schemas[name])
        return True
    except (ValueError, KeyError, jsonschema.ValidationError):
        return False


def client(base):
    import openai
    return openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)


def streamed_calls(stream):
    """A stream's tool-call deltas, its finish reason, the first delta and the arguments."""
    deltas, finish = [], None
    for chunk in stream:
        for d in chunk.choices:
            if d.delta.tool_calls:
                deltas.extend(t.model_dump(exclude_none=True) for t in d.delta.tool_calls)
            finish = d.finish_reason or finish
    first = deltas[0] if deltas else {}
    args = "".join(d.get("function", {}).get("arguments", "") for d in deltas)
    return deltas, finish, first, args


def loop(base):
    c = client(base)
    model = c.models.list().data[0].id
    msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
    out = {}
    r = c.chat.completions.create(model=model, messages=msgs, tools=TOOLS, tool_choice="required",
                                  parallel_tool_calls=False, temperature=0, max_tokens=80)
    ch = r.choices[0]
    calls = ch.message.tool_calls or []
    out["call"] = {"finish_reason": ch.finish_reason, "content": ch.message.content,
                   "calls": [{"id": t.id, "type": t.type, "name": t.function.name,
                              "arguments": t.function.arguments,
                              "valid": valid(t.function.name, t.function.arguments)} for t in calls]}
    msgs.append(ch.message.model_dump(exclude_none=True))
    for t in calls:
        msgs.append({"role": "tool", "tool_call_id": t.id, "content": "sunny, 21 degrees celsius"})
    r = c.chat.completions.create(model=model, messages=msgs, tools=TOOLS, tool_choice="none",
                                  temperature=0, max_tokens=40)
    out["answer"] = {"finish_reason": r.choices[0].finish_reason, "content": r.choices[0].message.content,
                     "calls": len(r.choices[0].message.tool_calls or [])}
    # Streamed, as OpenAI streams calls.
    stream = c.chat.completions.create(model=model, messages=msgs[:1], tools=TOOLS, tool_choice="required",
                                       parallel_tool_calls=False, temperature=0, max_tokens=80, stream=True)
    deltas, finish, first, args = streamed_calls(stream)
    out["stream"] = {"finish_reason": finish, "deltas": len(deltas),
                     "first_has_id_and_name": bool(first.get("id")) and bool(first.get("function", {}).get("name"))
                     and first.get("function", {}).get("arguments") == "" and first.get("type") == "function",
                     "later_only_arguments": all("id" not in d and "name" not in d.get("function", {})
                                                 for d in deltas[1:]),
                     "name": first.get("function", {}).get("name"), "arguments": args,
                     "same_as_unstreamed": args == (calls[0].function.arguments if calls else None),
                     "valid": valid(first.get("function", {}).get("name", ""), args)}
    # A named function, sampled.
    r = c.chat.completions.create(model=model, messages=[{"role": "user", "content": "What is 2 plus 40?"}],
                                  tools=TOOLS, tool_choice={"type": "function", "function": {"name": "add"}},
                                  temperature=0.7, seed=3, max_tokens=80)
    t = (r.choices[0].message.tool_calls or [None])[0]
    out["named"] = {"finish_reason": r.choices[0].finish_reason, "name": t and t.function.name,
                    "valid": bool(t) and valid(t.function.name, t.function.arguments)}
    print(json.dumps(out))


def forced(base, model):
    c = client(base)
    msgs = [{"role": "user", "content": "Weather in Oslo?"}]
    out = {}
    for name, choice in [("required", "required"),
                         ("get_weather", {"type": "function", "function": {"name": "get_weather"}}),
                         ("add", {"type": "function", "function": {"name": "add"}})]:
        r = c.chat.completions.create(model=model, messages=msgs, tools=TIGHT, tool_choice=choice,
                                      parallel_tool_calls=False, temperature=0, max_tokens=400)
        ch = r.choices[0]
        out[name] = {"finish_reason": ch.finish_reason, "content": ch.message.content,
                     "calls": [{"name": t.function.name, "arguments": t.function.arguments,
                                "valid": valid(t.function.name, t.function.arguments, TIGHT_SCHEMAS)}
                               for t in ch.message.tool_calls or []]}
    r = c.chat.completions.create(model=model, messages=msgs, tools=TIGHT, temperature=0, max_tokens=20)
    ch = r.choices[0]
    out["auto"] = {"finish_reason": ch.finish_reason, "content": ch.message.content,
                   "calls": len(ch.message.tool_calls or [])}
    print(json.dumps(out))


def harmony(base, model):
    c = client(base)
    msgs = [{"role": "user", "content": "Weather in Oslo?"}]
    out = {}
    r = c.chat.completions.create(model=model, messages=msgs, tools=TIGHT, tool_choice="required",
                                  temperature=0, max_tokens=400)
    ch = r.choices[0]
    calls = ch.message.tool_calls or []
    out["call"] = {"finish_reason": ch.finish_reason, "content": ch.message.content,
                   "calls": [{"name": t.function.name, "arguments": t.function.arguments,
                              "valid": valid(t.function.name, t.function.arguments, TIGHT_SCHEMAS)}
                             for t in calls]}
    msgs.append(ch.message.model_dump(exclude_none=True))
    for t in calls:
        msgs.append({"role": "tool", "tool_call_id": t.id, "content": "sunny"})
    r = c.chat.completions.create(model=model, messages=msgs, tools=TIGHT, temperature=0, max_tokens=20)
    out["answer"] = {"finish_reason": r.choices[0].finish_reason,
                     "content": r.choices[0].message.content,
                     "prompt_tokens": r.usage.prompt_tokens}
    stream = c.chat.completions.create(model=model, messages=msgs[:1], tools=TIGHT,
                                       tool_choice={"type": "function", "function": {"name": "add"}},
                                       temperature=0, max_tokens=400, stream=True)
    deltas, finish, first, args = streamed_calls(stream)
    out["stream"] = {"finish_reason": finish, "name": first.get("function", {}).get("name"),
                     "id": bool(first.get("id")), "valid": valid("add", args, TIGHT_SCHEMAS)}
    print(json.dumps(out))


def langchain(base):
    from langchain_core.messages import HumanMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        return f"sunny, 21 degrees in {city}"

    @tool
    def add(a: float, b: float) -> float:
        """Adds two numbers."""
        return a + b

    llm = ChatOpenAI(base_url=base + "/v1", api_key="unused", model="smollm2", temperature=0,
                     max_tokens=80, max_retries=0)
    tools = {"get_weather": get_weather, "add": add}
    msgs = [HumanMessage("What is the weather in Paris? Then add 10 to the temperature.")]
    steps = []
    for name in ["get_weather", "add"]:
        ai = llm.bind_tools([get_weather, add], tool_choice=name, parallel_tool_calls=False).invoke(msgs)
        msgs.append(ai)
        for call in ai.tool_calls:
            result = tools[call["name"]].invoke(call)  # a ToolMessage with the call's id
            msgs.append(result)
            steps.append({"name": call["name"], "args": call["args"], "result": str(result.content)})
    answer = llm.invoke(msgs)
    print(json.dumps({"steps": steps, "answer": answer.content}))


if __name__ == "__main__":
    mode, base = sys.argv[1], sys.argv[2]
    if mode == "loop":
        loop(base)
    elif mode == "forced":
        forced(base, sys.argv[3])
    elif mode == "harmony":
        harmony(base, sys.argv[3])
    elif mode == "langchain":
        langchain(base)
    else:
        sys.exit(f"unknown mode {mode}")
