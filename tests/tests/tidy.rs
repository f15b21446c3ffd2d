//! The shape of the production code, checked: no function longer than `FN_LINES_MAX`
//! lines, no file longer than `FILE_LINES_MAX`, and no `super::super` (a path that climbs
//! two modules hides a dependency the architecture test must then resolve; name it from
//! `crate::`). The functions and files past the limits today are listed with their sizes:
//! an entry may only shrink (a change that shrinks one lowers its number here, and one
//! that brings it within the limit removes it), and nothing new joins the list.
//!
//! Sources: the daemon library and binary (`daemon/src`) and the client (`client/src`),
//! test-only files and `#[cfg(test)]` modules left out. Lines are counted from the `fn`
//! keyword to the closing brace, and for a file, all of it.

use sluice_tests::source::{closing, code_only, is_test_file, rust_files};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

const FN_LINES_MAX: usize = 100;
const FILE_LINES_MAX: usize = 1000;

/// Functions over `FN_LINES_MAX` today: (file, function, lines). Where a file has several
/// functions of one name, the longest counts.
const LONG_FUNCTIONS: &[(&str, &str, usize)] = &[
    ("client/src/batch.rs", "read_items", 106),
    ("client/src/batch.rs", "run", 185),
    ("client/src/chat.rs", "run", 112),
    ("client/src/main.rs", "cmd_status", 119),
    ("daemon/src/backend/cuda/bench.rs", "run", 153),
    ("daemon/src/backend/cuda/device.rs", "new", 110),
    ("daemon/src/backend/cuda/matmul.rs", "prefill_rows", 101),
    ("daemon/src/bin/sluiced/bench.rs", "run_stream", 134),
    ("daemon/src/bin/sluiced/codec.rs", "load", 142),
    ("daemon/src/bin/sluiced/inspect.rs", "print_summary", 143),
    ("daemon/src/bin/sluiced/pack.rs", "run", 113),
    ("daemon/src/bin/sluiced/run.rs", "run_generate", 169),
    (
        "daemon/src/bin/sluiced/serve.rs",
        "listen_until_stopped",
        112,
    ),
    ("daemon/src/bin/sluiced/serve.rs", "serve", 145),
    ("daemon/src/engine/bench_stream.rs", "bench_stream", 120),
    ("daemon/src/import/gguf.rs", "arch_config", 147),
    ("daemon/src/import/gguf.rs", "map_tensors", 141),
    ("daemon/src/import/gguf.rs", "parse", 131),
    ("daemon/src/import/hf.rs", "arch_of_config", 154),
    ("daemon/src/import/hf.rs", "import", 215),
    ("daemon/src/import/synth.rs", "model", 150),
    ("daemon/src/model/decoder.rs", "new_part", 105),
    ("daemon/src/server/metrics.rs", "render_model", 191),
    ("daemon/src/store/arch.rs", "validate", 133),
    ("daemon/src/store/codec.rs", "decode", 113),
    ("daemon/src/store/format.rs", "validate", 195),
    ("daemon/src/store/writer.rs", "pack_into", 106),
];

/// Files over `FILE_LINES_MAX` today: (file, lines).
const LONG_FILES: &[(&str, usize)] = &[
    ("daemon/src/backend/cpu/q8.rs", 1091),
    ("daemon/src/import/gguf.rs", 1116),
    ("daemon/src/import/hf.rs", 1101),
    ("daemon/src/store/codec.rs", 1188),
    ("daemon/src/store/format.rs", 1057),
    ("daemon/src/store/writer.rs", 1059),
    ("daemon/src/text/sampler.rs", 1085),
];

fn roots() -> Vec<PathBuf> {
    let here = Path::new(env!("CARGO_MANIFEST_DIR"));
    vec![here.join("../daemon/src"), here.join("../client/src")]
}

/// Every production source file: (path relative to the repository, text).
fn sources() -> Vec<(String, String)> {
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut out = Vec::new();
    for root in roots() {
        let mut files = Vec::new();
        rust_files(&root, &mut files);
        for f in files {
            let rel = f.strip_prefix(&repo).expect("under the repository");
            if is_test_file(rel) {
                continue;
            }
            let text =
                std::fs::read_to_string(&f).unwrap_or_else(|e| panic!("read {}: {e}", f.display()));
            out.push((rel.display().to_string(), text));
        }
    }
    out
}

fn is_ident(c: u8) -> bool {
    c.is_ascii_alphanumeric() || c == b'_'
}

/// Byte ranges of the `#[cfg(test)]` modules in `code`.
fn test_modules(code: &str) -> Vec<(usize, usize)> {
    let b = code.as_bytes();
    let mut out = Vec::new();
    let mut from = 0;
    while let Some(k) = code[from..].find("#[cfg(test)]") {
        let at = from + k;
        from = at + 1;
        let rest = code[at + 12..].trim_start();
        let rest = rest.strip_prefix("pub ").unwrap_or(rest).trim_start();
        if !rest.starts_with("mod ") {
            continue;
        }
        let start = code.len() - rest.len();
        // `mod tests;` (a file of its own, left out by name) or `mod tests { .. }`.
        let Some(open) = code[start..].find(['{', ';']).map(|o| start + o) else {
            continue;
        };
        if b[open] == b'{' {
            if let Some(close) = closing(b, open) {
                out.push((at, close));
            }
        }
    }
    out
}

/// Every function with a body in `code` (comments and literals blanked), outside the test
/// modules: (name, lines from the `fn` keyword to its closing brace).
fn functions(code: &str) -> Vec<(String, usize)> {
    let b = code.as_bytes();
    let skip = test_modules(code);
    let mut out = Vec::new();
    let mut i = 0;
    while let Some(k) = code[i..].find("fn") {
        let at = i + k;
        i = at + 2;
        let word = (at == 0 || !is_ident(b[at - 1])) && b.get(at + 2).is_some_and(|c| *c == b' ');
        if !word || skip.iter().any(|&(s, e)| at > s && at < e) {
            continue;
        }
        let name_at = at + 3;
        let name_len = b[name_at..].iter().take_while(|&&c| is_ident(c)).count();
        if name_len == 0 {
            continue;
        }
        // The body starts at the first `{` outside parentheses and brackets; a `;` there
        // first is a declaration without one.
        let mut depth = 0i32;
        let mut open = None;
        for (j, &c) in b.iter().enumerate().skip(name_at + name_len) {
            match c {
                b'(' | b'[' => depth += 1,
                b')' | b']' => depth -= 1,
                b';' if depth == 0 => break,
                b'{' if depth == 0 => {
                    open = Some(j);
                    break;
                }
                _ => {}
            }
        }
        let Some(open) = open else { continue };
        let Some(close) = closing(b, open) else {
            continue;
        };
        let lines = code[at..=close].matches('\n').count() + 1;
        out.push((code[name_at..name_at + name_len].to_string(), lines));
    }
    out
}

#[test]
fn functions_and_files_stay_within_their_limits() {
    let mut long_fns: BTreeMap<(String, String), usize> = BTreeMap::new();
    let mut long_files: BTreeMap<String, usize> = BTreeMap::new();
    let mut climbs = Vec::new();
    for (rel, text) in sources() {
        let lines = text.lines().count();
        if lines > FILE_LINES_MAX {
            long_files.insert(rel.clone(), lines);
        }
        let code = code_only(&text);
        let squeezed: String = code.split_whitespace().collect();
        if squeezed.contains("super::super") {
            climbs.push(rel.clone());
        }
        for (name, n) in functions(&code) {
            if n > FN_LINES_MAX {
                let e = long_fns.entry((rel.clone(), name)).or_default();
                *e = (*e).max(n);
            }
        }
    }
    let mut problems = Vec::new();
    for ((file, name), &n) in &long_fns {
        match LONG_FUNCTIONS
            .iter()
            .find(|(f, fun, _)| f == file && fun == name)
        {
            None => problems.push(format!(
                "{file}: fn {name} is {n} lines (at most {FN_LINES_MAX}): cut it into named steps"
            )),
            Some((_, _, was)) if n > *was => problems.push(format!(
                "{file}: fn {name} grew from {was} to {n} lines: listed functions may only shrink"
            )),
            Some((_, _, was)) if n < *was => problems.push(format!(
                "{file}: fn {name} shrank from {was} to {n} lines: lower its entry in LONG_FUNCTIONS"
            )),
            Some(_) => {}
        }
    }
    for (file, name, was) in LONG_FUNCTIONS {
        if !long_fns.contains_key(&(file.to_string(), name.to_string())) {
            problems.push(format!(
                "{file}: fn {name} ({was} lines listed) is within {FN_LINES_MAX} lines or gone: remove its entry from LONG_FUNCTIONS"
            ));
        }
    }
    for (file, &n) in &long_files {
        match LONG_FILES.iter().find(|(f, _)| f == file) {
            None => problems.push(format!(
                "{file} is {n} lines (at most {FILE_LINES_MAX}): split it along its seams"
            )),
            Some((_, was)) if n > *was => problems.push(format!(
                "{file} grew from {was} to {n} lines: listed files may only shrink"
            )),
            Some((_, was)) if n < *was => problems.push(format!(
                "{file} shrank from {was} to {n} lines: lower its entry in LONG_FILES"
            )),
            Some(_) => {}
        }
    }
    for (file, was) in LONG_FILES {
        if !long_files.contains_key(*file) {
            problems.push(format!(
                "{file} ({was} lines listed) is within {FILE_LINES_MAX} lines or gone: remove its entry from LONG_FILES"
            ));
        }
    }
    for file in &climbs {
        problems.push(format!(
            "{file} names a path through super::super: name it from crate:: instead"
        ));
    }
    assert!(
        problems.is_empty(),
        "{}\n\nToday's lists, for reference:\nconst LONG_FUNCTIONS: &[(&str, &str, usize)] = &[\n{}];\nconst LONG_FILES: &[(&str, usize)] = &[\n{}];",
        problems.join("\n"),
        long_fns
            .iter()
            .map(|((f, n), l)| format!("    ({f:?}, {n:?}, {l}),\n"))
            .collect::<String>(),
        long_files
            .iter()
            .map(|(f, l)| format!("    ({f:?}, {l}),\n"))
            .collect::<String>()
    );
}

/// The counter sees what it must: a function's lines from `fn` to its brace, nested
/// braces and a body-less declaration, and not a test module's functions.
#[test]
fn the_counter_counts_what_it_must() {
    let src = "pub(crate) fn a(x: [u8; 2]) -> u32 {\n    if x[0] > 0 { 1 } else { 2 }\n}\ntrait T {\n    fn decl(&self);\n}\nimpl X {\n    pub async fn b() {\n\n}\n}\nfn c() { let f: fn(u32) = g; }\n#[cfg(test)]\nmod tests {\n    fn hidden() {\n    }\n}\n";
    let got = functions(&code_only(src));
    assert_eq!(
        got,
        vec![
            ("a".to_string(), 3),
            ("b".to_string(), 3),
            ("c".to_string(), 1)
        ]
    );
    let squeezed: String = code_only("use super :: super::x; // super::super\n")
        .split_whitespace()
        .collect();
    assert!(squeezed.contains("super::super"));
    assert!(!code_only("// super::super\n\"super::super\"")
        .split_whitespace()
        .collect::<String>()
        .contains("super::super"));
}
