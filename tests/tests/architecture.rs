//! The architecture rule, checked: data flows NVMe -> io -> pipeline -> backend -> model ->
//! engine -> server, and each module of `daemon/src` names (`crate::X`) only the modules
//! ARCHITECTURE.md says it may know. No two files depend on each other in a cycle either.
//!
//! The check reads the source text (comments and string literals removed) for paths that
//! start with `crate::`, `super::` or `self::`, and for a module file's `use child::...`.

use sluice_tests::source::{closing, code_only, is_test_file, rust_files, src_root};
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Each top-level module of the library and the modules it may name. Anything else is a
/// dependency against the flow. `bin` (the `sluiced` binary) may name everything.
const ALLOWED: &[(&str, &[&str])] = &[
    ("dtype", &[]),
    ("util", &[]),
    ("hostbuf", &["util"]),
    ("hostmem", &["util"]),
    ("store", &["dtype", "util"]),
    ("import", &["store", "dtype", "util"]),
    ("io", &["store", "hostbuf", "dtype", "util"]),
    ("backend", &["hostbuf", "dtype", "util"]),
    ("model", &["backend", "store", "dtype", "util"]),
    ("text", &["store", "util"]),
    ("plan", &["model", "store", "dtype", "util"]),
    (
        "pipeline",
        &[
            "io", "backend", "model", "plan", "store", "hostbuf", "hostmem", "dtype", "util",
        ],
    ),
    (
        "engine",
        &[
            "pipeline", "io", "backend", "model", "plan", "store", "text", "hostbuf", "hostmem",
            "dtype", "util",
        ],
    ),
    (
        "server",
        &[
            "engine", "pipeline", "io", "backend", "model", "plan", "store", "text", "hostbuf",
            "hostmem", "dtype", "util",
        ],
    ),
    // The fuzz targets' bodies: above every parser they feed.
    (
        "fuzzing",
        &[
            "server", "engine", "pipeline", "io", "backend", "model", "plan", "store", "text",
            "import", "hostbuf", "hostmem", "dtype", "util",
        ],
    ),
];

/// Test-only files (`tests.rs`, `*_tests.rs`, `test_*.rs`) may also name these, to make fixtures (a
/// synthetic model to pack); nothing they name reaches the library's code.
const TEST_FIXTURES: &[&str] = &["import", "store"];

/// Module path of a file: `io/engine.rs` -> [io, engine], `io/mod.rs` -> [io], `lib.rs` -> [].
fn module_path(rel: &Path) -> Vec<String> {
    let mut parts: Vec<String> = rel
        .iter()
        .map(|p| p.to_string_lossy().into_owned())
        .collect();
    let last = parts.pop().expect("a file name");
    let stem = last.trim_end_matches(".rs");
    if stem != "mod" && stem != "lib" {
        parts.push(stem.to_string());
    }
    parts
}

fn is_module_root(rel: &Path) -> bool {
    matches!(
        rel.file_name().and_then(|n| n.to_str()),
        Some("mod.rs") | Some("lib.rs")
    )
}

/// Splits `a::b::{c, d::e}` into full paths [a::b::c, a::b::d::e] (one level of braces
/// is enough for a path's first segments, which are all the check needs).
fn expand(prefix: &[String], rest: &str) -> Vec<Vec<String>> {
    let mut path = prefix.to_vec();
    let mut s = rest;
    loop {
        let s_trim = s.trim_start();
        if let Some(inner) = s_trim.strip_prefix('{') {
            let mut depth = 1;
            let mut end = 0;
            for (k, ch) in inner.char_indices() {
                match ch {
                    '{' => depth += 1,
                    '}' => {
                        depth -= 1;
                        if depth == 0 {
                            end = k;
                            break;
                        }
                    }
                    _ => {}
                }
            }
            let body = &inner[..end];
            let mut out = Vec::new();
            let mut depth = 0;
            let mut start = 0;
            for (k, ch) in body.char_indices() {
                match ch {
                    '{' => depth += 1,
                    '}' => depth -= 1,
                    ',' if depth == 0 => {
                        out.extend(expand(&path, &body[start..k]));
                        start = k + 1;
                    }
                    _ => {}
                }
            }
            out.extend(expand(&path, &body[start..]));
            return out;
        }
        let ident: String = s_trim
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect();
        if ident.is_empty() {
            return vec![path];
        }
        path.push(ident.clone());
        s = &s_trim[ident.len()..];
        match s.strip_prefix("::") {
            Some(r) => s = r,
            None => return vec![path],
        }
    }
}

/// The inline modules of a file (`mod name { .. }`), outermost first: (the byte where the
/// `mod` keyword is, the byte of its closing brace, its name).
fn inline_modules(code: &str) -> Vec<(usize, usize, String)> {
    let b = code.as_bytes();
    let mut out = Vec::new();
    let mut from = 0;
    while let Some(k) = code[from..].find("mod ") {
        let at = from + k;
        from = at + 4;
        if at > 0 && (b[at - 1].is_ascii_alphanumeric() || b[at - 1] == b'_') {
            continue;
        }
        let name: String = code[at + 4..]
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect();
        let after = code[at + 4 + name.len()..].trim_start();
        if name.is_empty() || !after.starts_with('{') {
            continue;
        }
        let open = code.len() - after.len();
        if let Some(close) = closing(b, open) {
            out.push((at, close, name));
        }
    }
    out
}

/// The absolute module paths a file names.
fn named_paths(
    code: &str,
    here: &[String],
    root: bool,
    children: &BTreeSet<String>,
) -> Vec<Vec<String>> {
    let mut out = Vec::new();
    let bytes = code.as_bytes();
    let starts_ident = |k: usize| {
        k > 0
            && (bytes[k - 1].is_ascii_alphanumeric()
                || bytes[k - 1] == b'_'
                || bytes[k - 1] == b':'
                || bytes[k - 1] == b'$')
    };
    let inline = inline_modules(code);
    // The module at byte `at`: this file's, inside the inline modules around `at`.
    let module_at = |at: usize| {
        let mut m = here.to_vec();
        m.extend(
            inline
                .iter()
                .filter(|(s, e, _)| *s < at && at < *e)
                .map(|(_, _, name)| name.clone()),
        );
        m
    };
    for kw in ["crate::", "super::", "self::"] {
        let mut from = 0;
        while let Some(k) = code[from..].find(kw) {
            let at = from + k;
            from = at + kw.len();
            if starts_ident(at) {
                continue;
            }
            let mut base = match kw {
                "crate::" => Vec::new(),
                // The parent of the module this occurrence is in.
                "super::" => {
                    let mut p = module_at(at);
                    p.pop();
                    p
                }
                _ => module_at(at),
            };
            let mut rest = &code[from..];
            // super::super::...
            while let Some(r) = rest.strip_prefix("super::") {
                base.pop();
                rest = r;
            }
            out.extend(expand(&base, rest));
        }
    }
    if root {
        // A module file may name its children directly: `use engine::X;`, `pub use x::Y`.
        for line in code.lines() {
            let t = line.trim_start();
            let t = t.strip_prefix("pub ").unwrap_or(t);
            let t = t.strip_prefix("pub(crate) ").unwrap_or(t);
            if let Some(rest) = t.strip_prefix("use ") {
                let first: String = rest
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                    .collect();
                if children.contains(&first) {
                    out.extend(expand(here, rest));
                }
            }
        }
    }
    out
}

struct Crate {
    /// Module path -> file (relative to src).
    files: BTreeMap<Vec<String>, PathBuf>,
}

impl Crate {
    /// The file that defines the longest prefix of `path` that is a module file.
    fn resolve(&self, path: &[String]) -> Option<&PathBuf> {
        (1..=path.len())
            .rev()
            .find_map(|n| self.files.get(&path[..n]))
    }
}

struct Graph {
    /// File -> files it names (parents naming their own children excluded).
    file_edges: BTreeMap<PathBuf, BTreeSet<PathBuf>>,
    /// Top-level module -> (module it names, a file that names it).
    module_edges: BTreeMap<String, BTreeMap<String, PathBuf>>,
}

fn top(rel: &Path) -> String {
    module_path(rel)
        .first()
        .cloned()
        .unwrap_or_else(|| "lib".into())
}

fn build() -> Graph {
    let root = src_root();
    let mut all = Vec::new();
    rust_files(&root, &mut all);
    let rels: Vec<PathBuf> = all
        .iter()
        .map(|p| p.strip_prefix(&root).expect("under src").to_path_buf())
        .collect();
    let mut files = BTreeMap::new();
    for rel in &rels {
        if rel.starts_with("bin") {
            continue; // the binary's files are their own crate
        }
        files.insert(module_path(rel), rel.clone());
    }
    let krate = Crate { files };
    let mut g = Graph {
        file_edges: BTreeMap::new(),
        module_edges: BTreeMap::new(),
    };
    for (abs, rel) in all.iter().zip(&rels) {
        if rel.starts_with("bin") {
            continue;
        }
        let src =
            std::fs::read_to_string(abs).unwrap_or_else(|e| panic!("read {}: {e}", abs.display()));
        let code = code_only(&src);
        let here = module_path(rel);
        let root_file = is_module_root(rel);
        let children: BTreeSet<String> = krate
            .files
            .keys()
            .filter(|k| k.len() == here.len() + 1 && k[..here.len()] == here[..])
            .map(|k| k[here.len()].clone())
            .collect();
        let from_top = top(rel);
        for path in named_paths(&code, &here, root_file, &children) {
            let Some(target) = krate.resolve(&path) else {
                continue; // a path into another crate, or an item of lib.rs
            };
            if let Some(t) = path.first() {
                let fixture = is_test_file(rel) && TEST_FIXTURES.contains(&t.as_str());
                if *t != from_top && !fixture && krate.files.contains_key(&vec![t.clone()]) {
                    g.module_edges
                        .entry(from_top.clone())
                        .or_default()
                        .entry(t.clone())
                        .or_insert_with(|| rel.clone());
                }
            }
            if target == rel {
                continue;
            }
            let target_path = module_path(target);
            let is_own_child = root_file
                && target_path.len() > here.len()
                && target_path[..here.len()] == here[..];
            if is_own_child {
                continue;
            }
            g.file_edges
                .entry(rel.clone())
                .or_default()
                .insert(target.clone());
        }
    }
    g
}

/// A cycle among files, if there is one (depth-first search, colours).
fn find_cycle(edges: &BTreeMap<PathBuf, BTreeSet<PathBuf>>) -> Option<Vec<PathBuf>> {
    #[derive(Clone, Copy, PartialEq)]
    enum Colour {
        White,
        Grey,
        Black,
    }
    fn visit(
        n: &PathBuf,
        edges: &BTreeMap<PathBuf, BTreeSet<PathBuf>>,
        colour: &mut BTreeMap<PathBuf, Colour>,
        stack: &mut Vec<PathBuf>,
    ) -> Option<Vec<PathBuf>> {
        colour.insert(n.clone(), Colour::Grey);
        stack.push(n.clone());
        for m in edges.get(n).into_iter().flatten() {
            match colour.get(m).copied().unwrap_or(Colour::White) {
                Colour::Grey => {
                    let at = stack
                        .iter()
                        .position(|s| s == m)
                        .expect("grey is on the stack");
                    let mut cycle = stack[at..].to_vec();
                    cycle.push(m.clone());
                    return Some(cycle);
                }
                Colour::White => {
                    if let Some(c) = visit(m, edges, colour, stack) {
                        return Some(c);
                    }
                }
                Colour::Black => {}
            }
        }
        stack.pop();
        colour.insert(n.clone(), Colour::Black);
        None
    }
    let mut colour = BTreeMap::new();
    for n in edges.keys() {
        if colour.get(n).copied().unwrap_or(Colour::White) == Colour::White {
            let mut stack = Vec::new();
            if let Some(c) = visit(n, edges, &mut colour, &mut stack) {
                return Some(c);
            }
        }
    }
    None
}

#[test]
fn modules_name_only_the_modules_below_them() {
    let g = build();
    let allowed: BTreeMap<&str, BTreeSet<&str>> = ALLOWED
        .iter()
        .map(|(m, deps)| (*m, deps.iter().copied().collect()))
        .collect();
    let mut report = String::new();
    let mut violations = Vec::new();
    for (module, names) in &g.module_edges {
        let list: Vec<&str> = names.keys().map(String::as_str).collect();
        report.push_str(&format!("{module:>9} -> {}\n", list.join(", ")));
        let Some(ok) = allowed.get(module.as_str()) else {
            if module != "lib" {
                violations.push(format!(
                    "module {module} is not in the architecture table (tests/tests/architecture.rs ALLOWED and ARCHITECTURE.md)"
                ));
            }
            continue;
        };
        for (dep, file) in names {
            if !ok.contains(dep.as_str()) {
                violations.push(format!(
                    "{module} must not know {dep}: daemon/src/{} names crate::{dep}",
                    file.display()
                ));
            }
        }
    }
    println!("import graph (module -> modules it names):\n{report}");
    assert!(
        violations.is_empty(),
        "dependencies against the flow:\n  {}\n(report:\n{report})",
        violations.join("\n  ")
    );
    // Every module of the table exists, so the table cannot silently go stale.
    for (m, _) in ALLOWED {
        let root = src_root();
        assert!(
            root.join(format!("{m}.rs")).exists() || root.join(m).join("mod.rs").exists(),
            "ALLOWED names module {m}, which is not in daemon/src"
        );
    }
}

#[test]
fn no_two_files_depend_on_each_other() {
    let g = build();
    if let Some(cycle) = find_cycle(&g.file_edges) {
        let names: Vec<String> = cycle.iter().map(|p| p.display().to_string()).collect();
        panic!("files in a dependency cycle: {}", names.join(" -> "));
    }
}

#[test]
fn the_checker_sees_the_forms_a_dependency_takes() {
    // The check is only as good as its parser: each form must be found, and text in
    // comments and strings must not be.
    let here = vec!["io".to_string(), "engine".to_string()];
    let code = code_only(
        "use crate::store::{codec::FrameDecoder, Store};\n\
         // crate::model::Llama in a comment\n\
         let s = \"crate::engine::X\"; let c = '\"'; fn f<'a>(x: &'a u8) {}\n\
         use super::uring::UringReader;\n\
         let e = crate::backend::BackendError::Alloc;\n\
         mod avx2 { use super::simd::Dot; mod deep { use super::super::lanes::L; } }\n\
         use self::after::A;\n",
    );
    let paths: BTreeSet<String> = named_paths(&code, &here, false, &BTreeSet::new())
        .into_iter()
        .map(|p| p.join("::"))
        .collect();
    let want: BTreeSet<String> = [
        "store::codec::FrameDecoder",
        "store::Store",
        "io::uring::UringReader",
        "backend::BackendError::Alloc",
        // Inside an inline module, super:: is that module's parent.
        "io::engine::simd::Dot",
        "io::engine::lanes::L",
        "io::engine::after::A",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    assert_eq!(paths, want);
    let mut edges = BTreeMap::new();
    edges.insert(
        PathBuf::from("a.rs"),
        BTreeSet::from([PathBuf::from("b.rs")]),
    );
    edges.insert(
        PathBuf::from("b.rs"),
        BTreeSet::from([PathBuf::from("a.rs")]),
    );
    assert!(find_cycle(&edges).is_some());
    edges.remove(&PathBuf::from("b.rs"));
    assert!(find_cycle(&edges).is_none());
}
