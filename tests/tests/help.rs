//! Every flag and argument of every command of both binaries says what it does: the help
//! text clap prints (`-h`, one line per entry) is read for each subcommand, and an entry
//! with nothing after its name is a failure.

use sluice_tests::*;
use std::process::Command;

fn help(prog: &str, sub: &[&str]) -> String {
    let o = Command::new(bin(prog))
        .args(sub)
        .arg("-h")
        .output()
        .unwrap();
    assert!(o.status.success(), "{prog} {sub:?} -h: {}", stderr(&o));
    stdout(&o)
}

/// The lines of a help section ("Commands:", "Options:", "Arguments:"), blank lines
/// between entries included.
fn section<'a>(text: &'a str, name: &str) -> Vec<&'a str> {
    text.lines()
        .skip_while(|l| l.trim() != name)
        .skip(1)
        .take_while(|l| l.is_empty() || l.starts_with(' '))
        .collect()
}

/// Entries with no description. clap prints an entry and its description on one line
/// (`--flag <X>  what it does`), or, when they do not fit, the description on the lines
/// below, indented deeper.
fn blank(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    for s in ["Options:", "Arguments:"] {
        let lines = section(text, s);
        let indent = |l: &str| l.len() - l.trim_start().len();
        for (i, l) in lines.iter().enumerate() {
            let entry = l.trim_start();
            if !(entry.starts_with('-') || entry.starts_with('<') || entry.starts_with('[')) {
                continue;
            }
            let same_line = entry
                .split_once("  ")
                .is_some_and(|(_, d)| !d.trim().is_empty());
            let below = lines
                .get(i + 1)
                .is_some_and(|n| !n.trim().is_empty() && indent(n) > indent(l));
            if !same_line && !below {
                out.push(entry.to_string());
            }
        }
    }
    out
}

#[test]
fn every_flag_of_every_command_says_what_it_does() {
    let mut missing = Vec::new();
    for prog in ["sluiced", "sluice"] {
        let top = help(prog, &[]);
        missing.extend(blank(&top).into_iter().map(|e| format!("{prog}: {e}")));
        let subs: Vec<String> = section(&top, "Commands:")
            .iter()
            .filter_map(|l| l.split_whitespace().next())
            .filter(|s| *s != "help")
            .map(str::to_string)
            .collect();
        assert!(subs.len() >= 6, "{prog}: no subcommands found in {top}");
        for s in &subs {
            let text = help(prog, &[s]);
            assert!(text.contains("Options:"), "{prog} {s} -h: {text}");
            missing.extend(blank(&text).into_iter().map(|e| format!("{prog} {s}: {e}")));
        }
    }
    assert!(missing.is_empty(), "without help text: {missing:#?}");
}
