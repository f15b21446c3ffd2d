//! Structured outputs (OpenAI's `response_format: {"type": "json_schema"}`): a JSON schema
//! compiled to a graph of nodes, and a byte-level automaton over it whose state is `Copy`
//! (as JSON mode's, `json.rs`), so the sampler masks every token that would leave the text
//! no prefix of an instance of the schema.
//!
//! The schemas OpenAI's strict mode and Pydantic models make are taken: `type` object,
//! array, string, number, integer, boolean or null; `properties`, `required`,
//! `additionalProperties` (no other property is written either way), `items`, `minItems`,
//! `maxItems`, `enum`, `const`, `$ref` into `$defs` / `definitions` (recursion up to
//! `DEPTH_MAX` containers), and `anyOf` or a list of types whose branches start with
//! different bytes (a nullable field: the branch is known at the value's first byte).
//! Properties are written in the schema's order, optional ones when the model chooses to.
//! Annotations (`title`, `description`, `default`, `format`, `examples`) change nothing.
//! Every other keyword that constrains a value (`pattern`, `minimum`, `not`, ...) is
//! refused by name: an output the schema would reject is never passed off as conforming.

use super::json::{InStr, Num, StrLex, Ws};
use serde_json::Value;
use std::sync::Arc;

/// Containers open at once at most.
pub const DEPTH_MAX: usize = 12;
/// Values of one `enum`, and properties of one object, at most.
pub const CHOICES_MAX: usize = 64;
/// Nodes of one compiled schema at most.
const NODES_MAX: usize = 4096;

#[derive(Debug)]
enum Node {
    Object {
        /// Each property's name as JSON text (quoted), its node, and whether it is required.
        props: Vec<(Vec<u8>, u16, bool)>,
    },
    Array {
        items: u16,
        min: u32,
        max: u32,
    },
    String,
    Number {
        integer: bool,
    },
    /// One of these JSON texts (enum, const, boolean, null).
    Literals(Vec<Vec<u8>>),
    /// One of these (`anyOf`, or a list of types), told apart by their first byte.
    Union(Vec<u16>),
    /// A `$ref` resolved once every definition is compiled.
    Ref(String),
}

/// A compiled schema.
#[derive(Debug)]
pub struct Schema {
    nodes: Vec<Node>,
    root: u16,
}

const ANNOTATIONS: [&str; 9] = [
    "title",
    "description",
    "default",
    "format",
    "examples",
    "$schema",
    "$id",
    "$comment",
    "strict",
];

/// The bytes a value of `node` can start with.
fn first_bytes(nodes: &[Node], node: u16, depth: usize) -> Result<[bool; 256], String> {
    let mut f = [false; 256];
    match &nodes[node as usize] {
        Node::Object { .. } => f[b'{' as usize] = true,
        Node::Array { .. } => f[b'[' as usize] = true,
        Node::String => f[b'"' as usize] = true,
        Node::Number { .. } => {
            for b in b"-0123456789" {
                f[*b as usize] = true;
            }
        }
        Node::Literals(l) => {
            for t in l {
                if let Some(&b) = t.first() {
                    f[b as usize] = true;
                }
            }
        }
        Node::Union(alts) => {
            if depth > 16 {
                return Err("schema: anyOf nested in itself".into());
            }
            for &a in alts {
                let g = first_bytes(nodes, a, depth + 1)?;
                for b in 0..256 {
                    f[b] |= g[b];
                }
            }
        }
        Node::Ref(_) => return Err("schema: a $ref that only points at itself".into()),
    }
    Ok(f)
}

/// Bytes of one literal (an enum value, a property name) at most.
const LITERAL_MAX: usize = 1024;

/// `v` as JSON text, to be matched byte for byte.
fn literal_text(at: &str, v: &Value) -> Result<Vec<u8>, String> {
    let t = serde_json::to_vec(v).map_err(|e| format!("{at}: {e}"))?;
    if t.len() > LITERAL_MAX {
        return Err(format!(
            "{at}: a value or property name of {} bytes (at most {LITERAL_MAX})",
            t.len()
        ));
    }
    Ok(t)
}

struct Compiler<'a> {
    root: &'a Value,
    nodes: Vec<Node>,
}

impl<'a> Compiler<'a> {
    fn push(&mut self, n: Node) -> Result<u16, String> {
        if self.nodes.len() >= NODES_MAX {
            return Err(format!("the schema has more than {NODES_MAX} parts"));
        }
        self.nodes.push(n);
        Ok((self.nodes.len() - 1) as u16)
    }

    /// The values of an enum (or a const), each of `ty` where the schema gives one.
    fn literals(&mut self, at: &str, values: &[Value], ty: Option<&Value>) -> Result<u16, String> {
        if values.is_empty() || values.len() > CHOICES_MAX {
            return Err(format!(
                "{at}: an enum of {} values (1 to {CHOICES_MAX} are taken)",
                values.len()
            ));
        }
        let mut texts = Vec::with_capacity(values.len());
        for v in values {
            if let Some(ty) = ty {
                let is = match v {
                    Value::Null => "null",
                    Value::Bool(_) => "boolean",
                    Value::Number(n) if n.is_i64() || n.is_u64() => "integer",
                    Value::Number(_) => "number",
                    Value::String(_) => "string",
                    Value::Array(_) => "array",
                    Value::Object(_) => "object",
                };
                let of = |t: &Value| t == is || (t == "number" && is == "integer");
                let fits = match ty {
                    Value::Array(list) => list.iter().any(of),
                    t => of(t),
                };
                if !fits {
                    return Err(format!("{at}: the enum value {v} is not of type {ty}"));
                }
            }
            texts.push(literal_text(at, v)?);
        }
        self.push(Node::Literals(texts))
    }

    fn compile(&mut self, s: &Value, at: &str) -> Result<u16, String> {
        let Some(o) = s.as_object() else {
            return Err(format!("{at} is not a schema object"));
        };
        let known = [
            "type",
            "properties",
            "required",
            "additionalProperties",
            "items",
            "minItems",
            "maxItems",
            "enum",
            "const",
            "anyOf",
            "$ref",
            "$defs",
            "definitions",
        ];
        if let Some(k) = o
            .keys()
            .find(|k| !known.contains(&k.as_str()) && !ANNOTATIONS.contains(&k.as_str()))
        {
            return Err(format!(
                "{at}: the keyword {k:?} is not supported (supported: type, properties, required, additionalProperties, items, minItems, maxItems, enum, const, anyOf, $ref)"
            ));
        }
        if let Some(r) = o.get("$ref") {
            let r = r.as_str().ok_or(format!("{at}: $ref must be a string"))?;
            return self.push(Node::Ref(r.to_string()));
        }
        if let Some(any) = o.get("anyOf") {
            let any = any
                .as_array()
                .filter(|a| !a.is_empty())
                .ok_or(format!("{at}: anyOf must be a list of schemas"))?;
            if let Some(k) = ["type", "enum", "const", "properties", "items"]
                .iter()
                .find(|k| o.contains_key(**k))
            {
                return Err(format!(
                    "{at}: anyOf beside {k:?} is not supported (put it in each branch)"
                ));
            }
            let alts = any
                .iter()
                .enumerate()
                .map(|(i, b)| self.compile(b, &format!("{at}.anyOf[{i}]")))
                .collect::<Result<Vec<u16>, String>>()?;
            return self.push(Node::Union(alts));
        }
        // A list of types: a union of the schema with each.
        if let (Some(Value::Array(types)), None, None) =
            (o.get("type"), o.get("enum"), o.get("const"))
        {
            if types.is_empty() {
                return Err(format!("{at}: an empty list of types"));
            }
            let mut alts = Vec::with_capacity(types.len());
            for t in types {
                let mut one = o.clone();
                one.insert("type".into(), t.clone());
                alts.push(self.compile(&Value::Object(one), &format!("{at}[type {t}]"))?);
            }
            return self.push(Node::Union(alts));
        }
        if let Some(c) = o.get("const") {
            return self.literals(at, std::slice::from_ref(c), o.get("type"));
        }
        if let Some(e) = o.get("enum") {
            let e = e.as_array().ok_or(format!("{at}: enum must be a list"))?;
            return self.literals(at, e, o.get("type"));
        }
        let ty = o.get("type").ok_or(format!(
            "{at} has no type (a schema of any value is not supported)"
        ))?;
        let ty = ty
            .as_str()
            .ok_or(format!("{at}: type must be a name or a list of names"))?;
        match ty {
            "object" => {
                let required: Vec<&str> = match o.get("required") {
                    None => Vec::new(),
                    Some(r) => r
                        .as_array()
                        .and_then(|r| r.iter().map(Value::as_str).collect())
                        .ok_or(format!("{at}: required must be a list of names"))?,
                };
                let empty = serde_json::Map::new();
                let props = match o.get("properties") {
                    None => &empty,
                    Some(p) => p
                        .as_object()
                        .ok_or(format!("{at}: properties must be an object"))?,
                };
                if props.len() > CHOICES_MAX {
                    return Err(format!(
                        "{at}: {} properties (at most {CHOICES_MAX})",
                        props.len()
                    ));
                }
                if let Some(r) = required.iter().find(|r| !props.contains_key(**r)) {
                    return Err(format!("{at}: {r:?} is required but not in properties"));
                }
                let mut out = Vec::with_capacity(props.len());
                for (name, p) in props {
                    let node = self.compile(p, &format!("{at}.properties.{name}"))?;
                    let key = literal_text(at, &Value::String(name.clone()))?;
                    out.push((key, node, required.contains(&name.as_str())));
                }
                self.push(Node::Object { props: out })
            }
            "array" => {
                let items = o
                    .get("items")
                    .ok_or(format!("{at}: an array needs items"))?;
                let items = self.compile(items, &format!("{at}.items"))?;
                let count = |k: &str, default: u32| -> Result<u32, String> {
                    o.get(k).map_or(Ok(default), |v| {
                        v.as_u64()
                            .and_then(|n| u32::try_from(n).ok())
                            .ok_or(format!("{at}: {k} must be a count"))
                    })
                };
                let (min, max) = (count("minItems", 0)?, count("maxItems", u32::MAX)?);
                if min > max {
                    return Err(format!("{at}: minItems {min} > maxItems {max}"));
                }
                self.push(Node::Array { items, min, max })
            }
            "string" => self.push(Node::String),
            "number" => self.push(Node::Number { integer: false }),
            "integer" => self.push(Node::Number { integer: true }),
            "boolean" => self.literals(at, &[Value::Bool(true), Value::Bool(false)], None),
            "null" => self.literals(at, &[Value::Null], None),
            t => Err(format!("{at}: unknown type {t:?}")),
        }
    }

    /// `#/$defs/NAME` (or `#/definitions/NAME`, or `#` itself).
    fn target(&self, r: &str) -> Result<&'a Value, String> {
        if r == "#" {
            return Ok(self.root);
        }
        let path = r.strip_prefix("#/").ok_or(format!(
            "$ref {r:?}: only references inside the schema (#/$defs/...) are supported"
        ))?;
        let mut v = self.root;
        for part in path.split('/') {
            let part = part.replace("~1", "/").replace("~0", "~");
            v = v
                .get(&part)
                .ok_or(format!("$ref {r:?} points at nothing"))?;
        }
        Ok(v)
    }
}

impl Schema {
    /// Compiles a schema given as JSON text (gRPC's `json_schema`, a `--json-schema` file).
    pub fn parse(text: &str) -> Result<Arc<Schema>, String> {
        let v: Value = serde_json::from_str(text).map_err(|e| format!("not JSON: {e}"))?;
        Schema::compile(&v)
    }

    /// Compiles `schema`; the message names the part that is not supported.
    pub fn compile(schema: &Value) -> Result<Arc<Schema>, String> {
        let mut c = Compiler {
            root: schema,
            nodes: Vec::new(),
        };
        let root = c.compile(schema, "schema")?;
        // References: each target compiled once (a target's own references are met later
        // in the same walk).
        let mut done: std::collections::HashMap<String, u16> = Default::default();
        let mut i = 0;
        while i < c.nodes.len() {
            if let Node::Ref(r) = &c.nodes[i] {
                if let std::collections::hash_map::Entry::Vacant(e) = done.entry(r.clone()) {
                    let r = e.key();
                    let t = if r == "#" {
                        root
                    } else {
                        let v = c.target(r)?;
                        c.compile(v, r)?
                    };
                    e.insert(t);
                }
            }
            i += 1;
        }
        let nodes = &c.nodes;
        let resolve = |mut i: u16| -> Result<u16, String> {
            for _ in 0..=nodes.len() {
                match &nodes[i as usize] {
                    Node::Ref(r) => i = done[r],
                    _ => return Ok(i),
                }
            }
            Err("schema: a $ref that only points at itself".into())
        };
        let map = (0..nodes.len() as u16)
            .map(resolve)
            .collect::<Result<Vec<u16>, String>>()?;
        let root = map[root as usize];
        for node in &mut c.nodes {
            match node {
                Node::Object { props } => props.iter_mut().for_each(|p| p.1 = map[p.1 as usize]),
                Node::Array { items, .. } => *items = map[*items as usize],
                Node::Union(alts) => alts.iter_mut().for_each(|a| *a = map[*a as usize]),
                _ => {}
            }
        }
        // A union's branches must be told apart by the first byte of a value.
        for node in &c.nodes {
            if let Node::Union(alts) = node {
                let mut seen = [false; 256];
                for &a in alts {
                    let first = first_bytes(&c.nodes, a, 0)?;
                    if let Some(b) = (0..256).find(|&b| first[b] && seen[b]) {
                        return Err(format!(
                            "schema: anyOf branches (or types) that can both start with {:?} are not supported: sluice tells them apart by their first byte",
                            b as u8 as char
                        ));
                    }
                    for b in 0..256 {
                        seen[b] |= first[b];
                    }
                }
            }
        }
        if !matches!(c.nodes[root as usize], Node::Object { .. }) {
            return Err("schema: the top level must be an object (type \"object\")".into());
        }
        Ok(Arc::new(Schema {
            nodes: c.nodes,
            root,
        }))
    }

    fn node(&self, i: u16) -> &Node {
        &self.nodes[i as usize]
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    /// After `{`: a key or `}`.
    ObjOpen,
    /// After `,` in an object: a key.
    ObjNext,
    /// After a key: `:`.
    Colon,
    /// After `:`: the property's value.
    ObjValue,
    /// After a property's value: `,` or `}`.
    ObjAfter,
    /// After `[`: an item or `]`.
    ArrOpen,
    /// After `,` in an array: an item.
    ArrNext,
    /// After an item: `,` or `]`.
    ArrAfter,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Frame {
    node: u16,
    /// Object: the next property that may be written; array: items so far.
    idx: u32,
    /// Object: the property being written.
    cur: u16,
    phase: Phase,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Lex {
    None,
    /// A string value.
    Str(StrLex),
    Num {
        part: Num,
        integer: bool,
    },
    /// Matching literal texts (a key when `key`): the candidates left and bytes matched.
    Lit {
        node: u16,
        cand: u64,
        at: u16,
        key: bool,
    },
}

/// Where a text stands in an instance of a schema.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SchemaState {
    frames: [Frame; DEPTH_MAX],
    depth: u8,
    lex: Lex,
    ws: Ws,
    started: bool,
    done: bool,
}

impl Default for SchemaState {
    fn default() -> Self {
        SchemaState::new()
    }
}

impl SchemaState {
    pub const fn new() -> SchemaState {
        SchemaState {
            frames: [Frame {
                node: 0,
                idx: 0,
                cur: 0,
                phase: Phase::ObjOpen,
            }; DEPTH_MAX],
            depth: 0,
            lex: Lex::None,
            ws: Ws::NONE,
            started: false,
            done: false,
        }
    }

    pub fn is_done(&self) -> bool {
        self.done
    }

    pub fn in_plain_string(&self) -> bool {
        matches!(self.lex, Lex::Str(lex) if lex.is_plain())
    }

    /// Matching a key or a literal (enum, const, boolean, null).
    pub fn in_literal(&self) -> bool {
        matches!(self.lex, Lex::Lit { .. })
    }

    pub fn feed(mut self, s: &Schema, bytes: &[u8]) -> Option<SchemaState> {
        for &b in bytes {
            self = self.step(s, b)?;
        }
        Some(self)
    }

    fn top(&mut self) -> &mut Frame {
        &mut self.frames[self.depth as usize - 1]
    }

    /// The node of the value the top frame expects next.
    fn value_node(&self, s: &Schema) -> u16 {
        let f = self.frames[self.depth as usize - 1];
        match s.node(f.node) {
            Node::Object { props } => props[f.cur as usize].1,
            Node::Array { items, .. } => *items,
            _ => 0,
        }
    }

    /// A value just ended.
    fn value_done(mut self) -> SchemaState {
        self.lex = Lex::None;
        if self.depth == 0 {
            self.done = true;
            return self;
        }
        let f = self.top();
        f.phase = match f.phase {
            Phase::ArrOpen | Phase::ArrNext => {
                f.idx += 1;
                Phase::ArrAfter
            }
            _ => Phase::ObjAfter,
        };
        self
    }

    /// The start of a value of `node`.
    fn value(mut self, s: &Schema, node: u16, b: u8) -> Option<SchemaState> {
        match s.node(node) {
            Node::Object { .. } if b == b'{' => self.open(node, Phase::ObjOpen),
            Node::Array { .. } if b == b'[' => self.open(node, Phase::ArrOpen),
            Node::String if b == b'"' => {
                self.lex = Lex::Str(StrLex::default());
                Some(self)
            }
            Node::Number { integer } => {
                self.lex = Lex::Num {
                    part: Num::start(b)?,
                    integer: *integer,
                };
                Some(self)
            }
            Node::Union(alts) => alts.iter().find_map(|&a| self.value(s, a, b)),
            Node::Literals(l) => {
                let all = if l.len() == 64 {
                    u64::MAX
                } else {
                    (1u64 << l.len()) - 1
                };
                self.lex = Lex::Lit {
                    node,
                    cand: all,
                    at: 0,
                    key: false,
                };
                self.lit(s, b)
            }
            _ => None,
        }
    }

    fn open(mut self, node: u16, phase: Phase) -> Option<SchemaState> {
        if self.depth as usize >= DEPTH_MAX {
            return None;
        }
        self.frames[self.depth as usize] = Frame {
            node,
            idx: 0,
            cur: 0,
            phase,
        };
        self.depth += 1;
        Some(self)
    }

    fn close(mut self) -> Option<SchemaState> {
        self.depth -= 1;
        Some(self.value_done())
    }

    /// The properties that may come next in an object at `idx`: from it on, up to and
    /// with the first required one.
    fn next_keys(props: &[(Vec<u8>, u16, bool)], idx: u32) -> u64 {
        let mut m = 0u64;
        for (i, p) in props.iter().enumerate().skip(idx as usize) {
            m |= 1 << i;
            if p.2 {
                break;
            }
        }
        m
    }

    fn may_close(props: &[(Vec<u8>, u16, bool)], idx: u32) -> bool {
        props.iter().skip(idx as usize).all(|p| !p.2)
    }

    /// One byte of a literal (or key) match.
    fn lit(mut self, s: &Schema, b: u8) -> Option<SchemaState> {
        let Lex::Lit {
            node,
            cand,
            at,
            key,
        } = self.lex
        else {
            return None;
        };
        let text = |i: usize| -> &[u8] {
            match s.node(node) {
                Node::Literals(l) => &l[i],
                Node::Object { props } => &props[i].0,
                _ => &[],
            }
        };
        let mut next = 0u64;
        let mut whole = None;
        let mut c = cand;
        while c != 0 {
            let i = c.trailing_zeros() as usize;
            c &= c - 1;
            let t = text(i);
            if t.get(at as usize) == Some(&b) {
                next |= 1 << i;
            } else if t.len() == at as usize {
                whole = Some(i);
            }
        }
        if next != 0 {
            self.lex = Lex::Lit {
                node,
                cand: next,
                at: at + 1,
                key,
            };
            // A key ends with its quote: once one is matched whole, it is chosen.
            if key {
                let chosen =
                    (0..64).find(|&i| next >> i & 1 == 1 && text(i).len() == at as usize + 1);
                if let Some(i) = chosen {
                    let f = self.top();
                    f.cur = i as u16;
                    f.idx = i as u32 + 1;
                    f.phase = Phase::Colon;
                    self.lex = Lex::None;
                }
            }
            return Some(self);
        }
        // The byte belongs to what follows a literal matched whole.
        match whole {
            Some(_) if !key => self.value_done().step(s, b),
            _ => None,
        }
    }

    pub fn step(mut self, s: &Schema, b: u8) -> Option<SchemaState> {
        if self.done {
            return None;
        }
        match self.lex {
            Lex::Lit { .. } => return self.lit(s, b),
            Lex::Str(lex) => {
                return match lex.step(b)? {
                    InStr::Goes(lex) => {
                        self.lex = Lex::Str(lex);
                        Some(self)
                    }
                    InStr::Ends => Some(self.value_done()),
                }
            }
            Lex::Num { part, integer } => {
                return match part.next(b, integer) {
                    Some(part) => {
                        self.lex = Lex::Num { part, integer };
                        Some(self)
                    }
                    // The number ended; the byte belongs to what follows it.
                    None if part.complete() => self.value_done().step(s, b),
                    None => None,
                };
            }
            Lex::None => {}
        }
        // Between tokens.
        if Ws::is_ws(b) {
            self.ws = self.ws.push(b)?;
            return Some(self);
        }
        self.ws = Ws::default();
        if !self.started {
            self.started = true;
            return if b == b'{' {
                self.open(s.root, Phase::ObjOpen)
            } else {
                None
            };
        }
        if self.depth == 0 {
            return None;
        }
        let f = self.frames[self.depth as usize - 1];
        match (s.node(f.node), f.phase) {
            (Node::Object { props }, Phase::ObjOpen | Phase::ObjNext) => {
                if b == b'}' && f.phase == Phase::ObjOpen && SchemaState::may_close(props, f.idx) {
                    return self.close();
                }
                let cand = SchemaState::next_keys(props, f.idx);
                if cand == 0 {
                    return None;
                }
                self.lex = Lex::Lit {
                    node: f.node,
                    cand,
                    at: 0,
                    key: true,
                };
                self.lit(s, b)
            }
            (Node::Object { .. }, Phase::Colon) => (b == b':').then(|| {
                self.top().phase = Phase::ObjValue;
                self
            }),
            (Node::Object { props }, Phase::ObjAfter) => match b {
                b',' if (f.idx as usize) < props.len() => {
                    self.top().phase = Phase::ObjNext;
                    Some(self)
                }
                b'}' if SchemaState::may_close(props, f.idx) => self.close(),
                _ => None,
            },
            (Node::Object { .. }, Phase::ObjValue) => {
                let node = self.value_node(s);
                self.value(s, node, b)
            }
            (Node::Array { min, .. }, Phase::ArrOpen) if b == b']' => {
                (*min == 0).then(|| self.close())?
            }
            (Node::Array { .. }, Phase::ArrOpen | Phase::ArrNext) => {
                let node = self.value_node(s);
                self.value(s, node, b)
            }
            (Node::Array { min, max, .. }, Phase::ArrAfter) => match b {
                b',' if f.idx < *max => {
                    self.top().phase = Phase::ArrNext;
                    Some(self)
                }
                b']' if f.idx >= *min => self.close(),
                _ => None,
            },
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn refused(schema: Value) -> String {
        Schema::compile(&schema).expect_err("refused")
    }

    #[test]
    fn what_is_not_enforced_is_refused_by_name() {
        for (schema, says) in [
            (
                json!({"type": "object", "properties": {"a": {"type": "string", "pattern": "x"}}}),
                "\"pattern\"",
            ),
            (
                json!({"type": "object", "properties": {"a": {"anyOf": [{"type": "object"}, {"type": "object", "properties": {"b": {"type": "null"}}}]}}}),
                "both start with '{'",
            ),
            (
                json!({"type": "object", "properties": {"a": {"type": ["number", "integer"]}}}),
                "both start with '-'",
            ),
            (
                json!({"type": "object", "properties": {"a": {"anyOf": [{"type": "string"}], "type": "string"}}}),
                "anyOf beside \"type\"",
            ),
            (
                json!({"type": "object", "properties": {"a": {"not": {"type": "string"}}}}),
                "\"not\"",
            ),
            (
                json!({"type": "object", "properties": {"a": {}}}),
                "no type",
            ),
            (
                json!({"type": "object", "properties": {"a": {"type": "integer", "minimum": 0}}}),
                "\"minimum\"",
            ),
            (
                json!({"type": "array", "items": {"type": "string"}}),
                "top level",
            ),
            (
                json!({"type": "object", "required": ["b"], "properties": {"a": {"type": "string"}}}),
                "\"b\" is required",
            ),
            (
                json!({"type": "object", "properties": {"a": {"$ref": "other.json#/x"}}}),
                "inside the schema",
            ),
            (
                json!({"type": "object", "properties": {"a": {"$ref": "#/$defs/nope"}}}),
                "points at nothing",
            ),
            (
                json!({"type": "object", "properties": {"a": {"$ref": "#/$defs/a"}}, "$defs": {"a": {"$ref": "#/$defs/a"}}}),
                "itself",
            ),
            (
                json!({"type": "object", "properties": {"a": {"enum": (0..65).collect::<Vec<_>>()}}}),
                "65 values",
            ),
            (
                json!({"type": "object", "properties": {"a": {"type": "array", "items": {"type": "null"}, "minItems": 3, "maxItems": 2}}}),
                "minItems 3 > maxItems 2",
            ),
        ] {
            let m = refused(schema.clone());
            assert!(m.contains(says), "{schema}: {m}");
        }
        // Annotations change nothing.
        assert!(
            Schema::compile(&json!({"type": "object", "title": "T", "description": "d",
            "properties": {"when": {"type": "string", "format": "date-time", "default": "x"}}}))
            .is_ok()
        );
    }

    fn state(s: &Schema, text: &[u8]) -> Option<SchemaState> {
        SchemaState::new().feed(s, text)
    }

    /// Nullable fields, as OpenAI's strict mode (a list of types) and Pydantic (`anyOf`
    /// with null) write them, and a union of an object and a list.
    #[test]
    fn unions_take_each_branch_and_nothing_else() {
        let s = Schema::compile(&json!({
            "type": "object",
            "properties": {
                "a": {"type": ["string", "null"]},
                "b": {"anyOf": [{"$ref": "#/$defs/n"}, {"type": "null"}], "title": "B"},
                "c": {"anyOf": [{"type": "object", "properties": {"x": {"type": "boolean"}}, "required": ["x"]},
                                {"type": "array", "items": {"type": "integer"}}]},
                "d": {"type": ["integer", "boolean"], "enum": [1, true]}
            },
            "required": ["a", "b", "c", "d"],
            "$defs": {"n": {"type": "number"}}
        }))
        .unwrap();
        for ok in [
            r#"{"a":"s","b":1.5,"c":{"x":true},"d":1}"#,
            r#"{"a":null,"b":null,"c":[1,2],"d":true}"#,
        ] {
            assert!(
                state(&s, ok.as_bytes()).is_some_and(|st| st.is_done()),
                "{ok}"
            );
        }
        for (bad, good_len) in [
            (r#"{"a":1"#, 5),
            (r#"{"a":null,"b":"x"#, 14),
            (r#"{"a":null,"b":null,"c":""#, 23),
            (r#"{"a":null,"b":null,"c":[true"#, 24),
            (r#"{"a":null,"b":null,"c":[],"d":2"#, 30),
        ] {
            let bad = bad.as_bytes();
            assert!(
                state(&s, &bad[..good_len]).is_some(),
                "{:?}",
                String::from_utf8_lossy(bad)
            );
            assert_eq!(
                state(&s, &bad[..good_len + 1]),
                None,
                "{:?} at {good_len}",
                String::from_utf8_lossy(bad)
            );
        }
    }

    #[test]
    fn instances_are_whole_and_other_texts_stop_where_they_leave_the_schema() {
        let s = Schema::compile(&json!({
            "type": "object",
            "properties": {
                "a": {"type": "integer"},
                "b": {"enum": ["x", "xy", 1, 12, null]},
                "c": {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 2},
                "d": {"type": "string"},
                "e": {"$ref": "#/$defs/e"}
            },
            "required": ["a", "b", "c", "e"],
            "$defs": {"e": {"type": "object", "properties": {"f": {"type": "number"}}, "required": ["f"]}}
        }))
        .unwrap();
        for ok in [
            r#"{"a":1,"b":"x","c":[true],"e":{"f":1.5e3}}"#,
            r#"{"a":-20,"b":12,"c":[false,true],"d":"é\n","e":{"f":0}}"#,
            "{\n  \"a\": 0,\n  \"b\": null,\n  \"c\": [ true ],\n  \"e\": { \"f\": -0.5 }\n}",
            r#"{"a":1,"b":1,"c":[true],"e":{"f":1}}"#,
        ] {
            let ok = ok.as_bytes();
            assert!(state(&s, ok).is_some_and(|st| st.is_done()), "{ok:?}");
            for cut in 0..ok.len() {
                assert!(
                    state(&s, &ok[..cut]).is_some_and(|st| !st.is_done()),
                    "{:?}",
                    &ok[..cut]
                );
            }
        }
        for (bad, good_len) in [
            (r#"{"b":"x"}"#, 2),                                       // a is required first
            (r#"{"a":1.5}"#, 6),                                       // an integer
            (r#"{"a":1,"b":"z"}"#, 12),                                // not in the enum
            (r#"{"a":1,"b":"x","c":[]}"#, 20),                         // minItems 1
            (r#"{"a":1,"b":"x","c":[true,true,true]}"#, 29),           // maxItems 2
            (r#"{"a":1,"b":"x","c":[true],"z":1}"#, 27),               // no such property
            (r#"{"a":1,"b":"x","c":[true]}"#, 25),                     // e is required
            (r#"{"a":1,"b":"x","c":[true],"e":{"f":1},"d":"s"}"#, 37), // d after e: out of order
        ] {
            let bad = bad.as_bytes();
            let show = String::from_utf8_lossy(bad);
            assert!(
                state(&s, &bad[..good_len]).is_some(),
                "{show}: {:?}",
                &bad[..good_len]
            );
            assert_eq!(
                state(&s, &bad[..good_len + 1]),
                None,
                "{show} at {good_len}"
            );
        }
    }
}
