//! `sluice chat` through a pseudo-terminal (pexpect drives it as a person would): arrow
//! keys edit the line, slash commands stay out of the conversation, Ctrl-C stops a reply
//! and the daemon frees its sequence while the conversation keeps it, the next turn sends
//! the whole conversation (its reply is the HTTP API's for those messages), multi-line
//! input, /system, /clear, a conversation past the context trimmed from its oldest turns,
//! history across sessions, exit status 0 on /exit and Ctrl-D. The steps are in
//! tests/chat_pty.py.

use sluice_tests::*;
use std::process::Command;

#[test]
fn chat_edits_lines_stops_replies_on_ctrl_c_and_trims_to_the_context() {
    let d = Daemon::start(&["--max-context", "320", "--max-batch", "2"]);
    let history = d.tmp.path().join("chat_history");
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/chat_pty.py");
    let o = Command::new("python3")
        .args([
            script,
            bin("sluice").to_str().unwrap(),
            &d.addr,
            &d.http,
            history.to_str().unwrap(),
        ])
        .output()
        .expect("python3 with pexpect (pip install pexpect; .ci/run does)");
    assert!(
        o.status.success() && stdout(&o).trim_end().ends_with("ok"),
        "chat_pty.py failed:\n{}\n{}",
        stdout(&o),
        stderr(&o)
    );
    // The lines typed are kept for the next session, the edited one as it was sent.
    let h = std::fs::read_to_string(&history).unwrap();
    assert!(h.contains("My name is Bob\n") && !h.contains("Bxb"), "{h}");
}
