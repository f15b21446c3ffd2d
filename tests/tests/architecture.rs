//! The architecture rule, checked: data flows NVMe -> io -> pipeline -> backend -> model ->
//! engine -> server, and each module of `daemon/src` names (`crate::X`) only the modules
//! ARCHITECTURE.md says it may know. No two files depend on each other in a cycle either.
//!
//! The check reads the source text (comments and string literals removed) for paths that
//! start with `crate::`, `super::` or `self::`, and for a module file's `use child::...`.

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

fn is_test_file(rel: &Path) -> bool {
    rel.file_name()
        .and_then(|n| n.to_str())
        .is_some_and(|n| n == "tests.rs" || n.ends_with("_tests.rs") || n.starts_with("test_"))
}

fn src_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../daemon/src")
}

/// Every .rs file under `dir`, sorted.
fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let mut entries: Vec<_> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("read {}: {e}", dir.display()))
        .map(|e| e.expect("directory entry").path())
        .collect();
    entries.sort();
    for p in entries {
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// The source with comments, string literals and char literals blanked out, so a path
/// inside a doc comment or an error message is not taken for a dependency.
fn code_only(src: &str) -> String {
    let b = src.as_bytes();
    let mut out = String::with_capacity(src.len());
    let mut i = 0;
    while i < b.len() {
        let c = b[i];
        if c == b'/' && b.get(i + 1) == Some(&b'/') {
            while i < b.len() && b[i] != b'\n' {
                i += 1;
            }
        } else if c == b'/' && b.get(i + 1) == Some(&b'*') {
            let mut depth = 0;
            while i < b.len() {
                if b[i] == b'/' && b.get(i + 1) == Some(&b'*') {
                    depth += 1;
                    i += 2;
                } else if b[i] == b'*' && b.get(i + 1) == Some(&b'/') {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    i += 1;
                }
            }
            out.push(' ');
        } else if c == b'r'
            && (b.get(i + 1) == Some(&b'"') || b.get(i + 1) == Some(&b'#'))
            && (i == 0 || !(b[i - 1].is_ascii_alphanumeric() || b[i - 1] == b'_'))
        {
            // Raw string r"..." or r#"..."#.
            let mut j = i + 1;
            let mut hashes = 0;
            while b.get(j) == Some(&b'#') {
                hashes += 1;
                j += 1;
            }
            if b.get(j) != Some(&b'"') {
                out.push('r');
                i += 1;
                continue;
            }
            j += 1;
            loop {
                if j >= b.len() {
                    break;
                }
                if b[j] == b'"'
                    && b[j + 1..]
                        .iter()
                        .take(hashes)
                        .filter(|&&h| h == b'#')
                        .count()
                        == hashes
                {
                    j += 1 + hashes;
                    break;
                }
                j += 1;
            }
            out.push_str("\"\"");
            i = j;
        } else if c == b'"' {
            i += 1;
            while i < b.len() && b[i] != b'"' {
                if b[i] == b'\\' {
                    i += 1;
                }
                i += 1;
            }
            i += 1;
            out.push_str("\"\"");
        } else if c == b'\'' {
            // A char literal ('x', '\n', '\u{..}') or a lifetime ('a).
            if b.get(i + 1) == Some(&b'\\') {
                let mut j = i + 2;
                while j < b.len() && b[j] != b'\'' {
                    j += 1;
                }
                i = j + 1;
                out.push_str("' '");
            } else if b.get(i + 2) == Some(&b'\'') {
                i += 3;
                out.push_str("' '");
            } else {
                out.push('\'');
                i += 1;
            }
        } else {
            out.push(c as char);
            i += 1;
        }
    }
    out
}

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
    for (kw, base) in [
        ("crate::", Vec::<String>::new()),
        ("super::", {
            // The parent of this file's module.
            let mut p = here.to_vec();
            p.pop();
            p
        }),
        ("self::", here.to_vec()),
    ] {
        let mut from = 0;
        while let Some(k) = code[from..].find(kw) {
            let at = from + k;
            from = at + kw.len();
            if starts_ident(at) {
                continue;
            }
            let mut base = base.clone();
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
         let e = crate::backend::BackendError::Alloc;\n",
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
