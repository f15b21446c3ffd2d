//! Tool calling: models' own chat templates render tools and tool calls byte for byte as
//! transformers' `apply_chat_template(..., tools=...)` does (the reference was written by
//! transformers: tests/fixtures/make_tool_template_reference.py).

use serde_json::Value;
use sluice::text::{ChatMessage, ChatTemplate};

fn fixtures() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures")
}

fn message(m: &Value) -> ChatMessage {
    ChatMessage {
        role: m["role"].as_str().expect("role").into(),
        content: m["content"].as_str().unwrap_or_default().into(),
        tool_calls: m["tool_calls"].as_array().cloned().unwrap_or_default(),
        tool_call_id: m["tool_call_id"].as_str().map(str::to_string),
        reasoning_content: m["reasoning_content"].as_str().map(str::to_string),
        thinking: m["thinking"].as_str().map(str::to_string),
    }
}

/// `want` with the date after "Current date: " (gpt-oss's template writes today's, by
/// `strftime_now`) taken from `got`, which must have one in the same place.
fn on_the_same_day(want: &str, got: &str) -> String {
    const AT: &str = "Current date: ";
    match (want.find(AT), got.find(AT)) {
        (Some(i), Some(j)) if i == j && got.len() >= j + AT.len() + 10 => {
            let day = &got[j + AT.len()..j + AT.len() + 10];
            assert!(
                day.bytes().all(|b| b.is_ascii_digit() || b == b'-'),
                "{day}"
            );
            format!(
                "{}{day}{}",
                &want[..i + AT.len()],
                &want[i + AT.len() + 10..]
            )
        }
        _ => want.to_string(),
    }
}

#[test]
fn templates_render_tools_as_transformers_does() {
    let path = fixtures().join("reference/tool-templates.json");
    let r: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let tools = r["tools"].as_array().unwrap();
    let mut vars = serde_json::Map::new();
    vars.insert("date_string".into(), "26 Jul 2024".into());
    let (mut same, mut refused) = (0, 0);
    for case in r["renders"].as_array().unwrap() {
        let file = case["file"].as_str().unwrap();
        let src = std::fs::read_to_string(fixtures().join("templates").join(file)).unwrap();
        let s = |k: &str| case[k].as_str().unwrap_or_default().to_string();
        let t = ChatTemplate::new(&src, s("bos"), s("eos"))
            .unwrap_or_else(|e| panic!("{file}: {e}"))
            .with_vars(vars.clone());
        let conv = case["conversation"].as_str().unwrap();
        let messages: Vec<ChatMessage> = r["conversations"][conv]
            .as_array()
            .unwrap()
            .iter()
            .map(message)
            .collect();
        let with: &[Value] = if case["tools"] == true { tools } else { &[] };
        let got = t.render_with_tools(&messages, with, true);
        let what = format!("{file} {conv} tools={}", case["tools"]);
        match (case["text"].as_str(), got) {
            (Some(want), Ok(got)) => {
                assert_eq!(got, on_the_same_day(want, &got), "{what}");
                same += 1;
            }
            (None, Err(e)) => {
                // transformers refused it too (raise_exception in the template).
                let want = case["error"].as_str().unwrap();
                let reason = want.split(": ").nth(1).unwrap_or(want);
                assert!(e.to_string().contains(reason), "{what}: {e} vs {want}");
                refused += 1;
            }
            (want, got) => panic!("{what}: transformers {want:?}, sluice {got:?}"),
        }
    }
    // 5 templates x 4 conversations x with and without tools; Llama 3.1's refuses two calls
    // in a turn either way.
    assert_eq!((same, refused), (38, 2), "equal, refused alike");
}

fn tools_client(args: &[&str]) -> Value {
    sluice_tests::python_json(
        "tools_client.py",
        args,
        "openai jsonschema langchain-openai",
    )
}

fn post(d: &sluice_tests::Daemon, body: &Value) -> (u16, Value) {
    let (status, b) = sluice_tests::post_json(&d.http, "/v1/chat/completions", &body.to_string());
    (status, serde_json::from_str(&b).unwrap_or(Value::Null))
}

/// The `openai` package's tool loop on SmolLM2, whose template has no tools (so calls are
/// forced, in the generic format): request -> call -> result -> answer, streamed and not;
/// arguments valid by `jsonschema`; a streamed call arrives as OpenAI streams one. Then the
/// refusals, each a 400 naming its field: `auto` on such a template, a tool_call_id that
/// matches no call, a malformed tools entry, a schema llguidance does not enforce.
#[test]
fn the_openai_tool_loop_runs_on_smollm2() {
    let d = sluice_tests::Daemon::start(&["--max-context", "1024", "--max-batch", "4"]);
    let got = tools_client(&["loop", &d.http]);
    let call = &got["call"];
    assert_eq!(call["finish_reason"], "tool_calls", "{got}");
    assert_eq!(call["content"], Value::Null, "{got}");
    let calls = call["calls"].as_array().unwrap();
    assert_eq!(calls.len(), 1, "{got}");
    assert_eq!(
        (&calls[0]["name"], &calls[0]["type"], &calls[0]["valid"]),
        (&"get_weather".into(), &"function".into(), &true.into()),
        "{got}"
    );
    let id = calls[0]["id"].as_str().unwrap();
    assert!(id.starts_with("call_") && id.len() == 29, "{id}");
    let answer = &got["answer"];
    assert_eq!(
        (&answer["finish_reason"], &answer["calls"]),
        (&"stop".into(), &0.into()),
        "{got}"
    );
    assert!(!answer["content"].as_str().unwrap().is_empty(), "{got}");
    let s = &got["stream"];
    for k in [
        "first_has_id_and_name",
        "later_only_arguments",
        "same_as_unstreamed",
        "valid",
    ] {
        assert_eq!(s[k], true, "{k}: {got}");
    }
    assert_eq!(s["finish_reason"], "tool_calls", "{got}");
    assert!(
        s["deltas"].as_u64().unwrap() > 3,
        "arguments in pieces: {got}"
    );
    let named = &got["named"];
    assert_eq!(
        (&named["name"], &named["valid"], &named["finish_reason"]),
        (&"add".into(), &true.into(), &"tool_calls".into()),
        "{got}"
    );

    let weather = serde_json::json!({"type": "function", "function": {"name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}});

    // `sluice chat --tools` shows the call, takes its result with /tool, and the model
    // answers with it.
    let file = d.tmp.path().join("tools.json");
    std::fs::write(&file, serde_json::json!([weather]).to_string()).unwrap();
    let mut child = std::process::Command::new(sluice_tests::bin("sluice"))
        .args([
            "--addr",
            &d.addr,
            "chat",
            "--no-history",
            "--temperature",
            "0",
        ])
        .args(["--max-tokens", "60", "--tools", file.to_str().unwrap()])
        .args(["--tool-choice", "get_weather"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("sluice chat");
    std::io::Write::write_all(
        child.stdin.as_mut().unwrap(),
        b"What is the weather in Oslo?\n/tool snowing, -3 C\n/history json\n/exit\n",
    )
    .unwrap();
    let o = child.wait_with_output().unwrap();
    let out = sluice_tests::stdout(&o);
    assert!(o.status.success(), "{}", sluice_tests::stderr(&o));
    assert!(
        out.contains("-> get_weather({") && out.contains("[call_"),
        "{out}"
    );
    let history: Vec<Value> = out
        .lines()
        .find_map(|l| serde_json::from_str(l).ok())
        .unwrap_or_else(|| panic!("/history json in {out}"));
    let roles: Vec<&str> = history
        .iter()
        .map(|m| m["role"].as_str().unwrap())
        .collect();
    assert_eq!(roles, ["user", "assistant", "tool", "assistant"], "{out}");
    let user = serde_json::json!({"role": "user", "content": "Weather in Rome?"});
    for (body, param, says) in [
        (
            serde_json::json!({"messages": [user], "tools": [weather]}),
            "tools",
            "renders no tools",
        ),
        (
            serde_json::json!({"messages": [user, {"role": "assistant", "content": "",
                "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": "call_2", "content": "sunny"}], "tools": [weather], "tool_choice": "required"}),
            "messages",
            "\"call_2\" matches no call",
        ),
        (
            serde_json::json!({"messages": [user], "tools": [weather, {"type": "function", "function": {"name": "a b"}}], "tool_choice": "required"}),
            "tools",
            "tools[1]",
        ),
        (
            serde_json::json!({"messages": [user], "tools": [{"type": "function", "function": {"name": "tag",
                "parameters": {"type": "object", "properties": {"t": {"type": "array", "uniqueItems": true}}}}}], "tool_choice": "required"}),
            "tools",
            "uniqueItems",
        ),
        (
            serde_json::json!({"messages": [user, {"role": "assistant", "content": "", "reasoning_content": 3}], "tools": [weather], "tool_choice": "required"}),
            "messages",
            "messages[1].reasoning_content",
        ),
        (
            serde_json::json!({"messages": [user], "tools": [weather], "tool_choice": {"type": "function", "function": {"name": "nope"}}}),
            "tool_choice",
            "\"nope\"",
        ),
    ] {
        let (status, e) = post(&d, &body);
        assert_eq!(status, 400, "{body}: {e}");
        assert_eq!(e["error"]["param"], param, "{body}: {e}");
        assert!(
            e["error"]["message"].as_str().unwrap().contains(says),
            "{body}: {e}"
        );
    }
}

/// gpt-oss's harmony format, on the tiny gpt-oss given harmony's tokens and gpt-oss's own
/// template (`make_tiny_harmony.py`): a forced call is written as a message to the
/// function on the commentary channel and read back from it, its arguments holding the
/// schema; the call and its result go back through the template and the model answers;
/// the call streams as OpenAI streams one; grpcurl gets it in GenerateDone.
#[test]
fn harmony_calls_run_the_tool_loop_on_gpt_oss() {
    let tmp = tempfile::tempdir().unwrap();
    let store = tmp.path().join("gptoss");
    sluice_tests::sluiced_ok(&[
        "pack",
        fixtures().join("tiny-gptoss-harmony").to_str().unwrap(),
        "-o",
        store.to_str().unwrap(),
    ]);
    let d = sluice_tests::Daemon::serve(
        tmp,
        &["--model", store.to_str().unwrap()],
        &["--max-context", "4096"],
    );
    let got = tools_client(&["harmony", &d.http, "gptoss"]);
    let call = &got["call"];
    assert_eq!(call["finish_reason"], "tool_calls", "{got}");
    assert_eq!(call["content"], Value::Null, "{got}");
    let calls = call["calls"].as_array().unwrap();
    assert_eq!(calls.len(), 1, "one call a turn: {got}");
    assert_eq!(calls[0]["valid"], true, "{got}");
    // The second turn's prompt holds the call and its result.
    let answer = &got["answer"];
    assert_ne!(answer["finish_reason"], "tool_calls", "{got}");
    assert!(answer["prompt_tokens"].as_u64().unwrap() > 0, "{got}");
    let s = &got["stream"];
    assert_eq!(
        (&s["finish_reason"], &s["name"], &s["id"], &s["valid"]),
        (
            &"tool_calls".into(),
            &"add".into(),
            &true.into(),
            &true.into()
        ),
        "{got}"
    );

    let (done, out) = grpc_weather_call(&d);
    let args: Value =
        serde_json::from_str(done["toolCalls"][0]["arguments"].as_str().unwrap()).unwrap();
    assert!(
        ["Oslo", "Rome"].contains(&args["city"].as_str().unwrap()),
        "{done}"
    );
    // The header's markers never reach the pieces' text.
    assert!(
        !out.contains("<|channel|>") && !out.contains("<|message|>"),
        "{out}"
    );
}

/// LangChain (`ChatOpenAI(...).bind_tools`, its @tool functions and ToolMessages) completes
/// a two-step task on SmolLM2 with forced calls: the weather, then a sum with it.
#[test]
fn langchain_completes_a_two_step_tool_task() {
    let d = sluice_tests::Daemon::start(&["--max-context", "1024"]);
    let got = tools_client(&["langchain", &d.http]);
    let steps = got["steps"].as_array().unwrap();
    assert_eq!(steps.len(), 2, "{got}");
    assert_eq!(steps[0]["name"], "get_weather", "{got}");
    assert!(steps[0]["args"]["city"].is_string(), "{got}");
    assert_eq!(steps[1]["name"], "add", "{got}");
    let (a, b) = (&steps[1]["args"]["a"], &steps[1]["args"]["b"]);
    assert!(a.is_number() && b.is_number(), "{got}");
    // LangChain ran the tool on the model's arguments.
    let sum = a.as_f64().unwrap() + b.as_f64().unwrap();
    assert_eq!(steps[1]["result"], format!("{sum:?}"), "{got}");
    assert!(got["answer"].is_string(), "{got}");
}

/// grpcurl asks for a call of get_weather (a city of two) by name: the Done message, which
/// must end with it, and the whole output.
fn grpc_weather_call(d: &sluice_tests::Daemon) -> (Value, String) {
    let body = serde_json::json!({
        "messages": [{"role": "user", "content": "Weather in Oslo?"}],
        "max_tokens": 400, "sampling": {"temperature": 0},
        "tools": [{"name": "get_weather", "description": "The weather.",
                   "parameters": "{\"type\": \"object\", \"properties\": {\"city\": {\"enum\": [\"Oslo\", \"Rome\"]}}, \"required\": [\"city\"], \"additionalProperties\": false}"}],
        "tool_choice": "get_weather"});
    let o = sluice_tests::grpcurl_generate(d, &body);
    assert!(o.status.success(), "{}", sluice_tests::stderr(&o));
    let out = sluice_tests::stdout(&o);
    let done: Value = serde_json::Deserializer::from_str(&out)
        .into_iter::<Value>()
        .map_while(Result::ok)
        .find_map(|m| m.get("done").cloned())
        .expect("a Done message");
    assert_eq!(done["finishReason"], "FINISH_REASON_TOOL_CALLS", "{done}");
    assert_eq!(done["toolCalls"][0]["name"], "get_weather", "{done}");
    (done, out)
}

/// A model whose own template has tools (tiny Qwen3 served with Qwen3's real template, the
/// Hermes format; tiny Llama with Llama 3.1's, the JSON format): forced calls parse and
/// hold their schemas on HTTP; `auto` leaves the text free; grpcurl gets the calls in
/// GenerateDone.tool_calls with FINISH_REASON_TOOL_CALLS.
#[test]
fn templates_with_tools_get_calls_in_their_own_format() {
    for (model, template) in [
        ("tiny-qwen3", "qwen3.jinja"),
        ("tiny-llama", "llama3.1.jinja"),
    ] {
        let tmp = tempfile::tempdir().unwrap();
        let store = tmp.path().join(model);
        sluice_tests::sluiced_ok(&[
            "pack",
            fixtures().join(model).to_str().unwrap(),
            "-o",
            store.to_str().unwrap(),
        ]);
        let tpl = fixtures().join("templates").join(template);
        let d = sluice_tests::Daemon::serve(
            tmp,
            &["--model", store.to_str().unwrap()],
            &[
                "--chat-template",
                tpl.to_str().unwrap(),
                "--max-context",
                "2048",
            ],
        );
        let got = tools_client(&["forced", &d.http, model]);
        for k in ["required", "get_weather", "add"] {
            let r = &got[k];
            assert_eq!(r["finish_reason"], "tool_calls", "{model} {k}: {got}");
            let calls = r["calls"].as_array().unwrap();
            assert!(!calls.is_empty(), "{model} {k}: {got}");
            for c in calls {
                assert_eq!(c["valid"], true, "{model} {k}: {got}");
                if k != "required" {
                    assert_eq!(c["name"], k, "{model}: {got}");
                }
            }
        }
        // A random tiny model does not start calls by itself: free text.
        assert_eq!(got["auto"]["calls"], 0, "{model}: {got}");
        assert_ne!(got["auto"]["finish_reason"], "tool_calls", "{model}: {got}");

        let (done, _) = grpc_weather_call(&d);
        let call = &done["toolCalls"][0];
        assert!(call["id"].as_str().unwrap().starts_with("call_"), "{done}");
        let args: Value = serde_json::from_str(call["arguments"].as_str().unwrap()).unwrap();
        assert!(args["city"].is_string(), "{done}");
    }
}
