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
                assert_eq!(got, want, "{what}");
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
    assert!(
        same >= 24 && refused >= 2,
        "{same} equal, {refused} refused alike"
    );
}
