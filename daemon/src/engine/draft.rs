//! Speculative decoding's drafters: what proposes the tokens a step verifies after a
//! sequence's pending token (ARCHITECTURE.md, speculative decoding).
//!
//! A drafter sees a sequence's text (its prompt, then each token as it is accepted) and
//! proposes up to a given number of tokens to follow. The target model then runs the
//! pending token and the proposal as one span of decode rows (`SeqStep::verify`), and the
//! sequence samples row after row with its own sampler while the proposal agrees with what
//! it sampled (`Sequence::advance`). Each emitted token is therefore the one the sampler
//! draws from the model's own logits for the same text: the drafter decides only how many
//! rows one pass yields, never which tokens. With a seed, a drafted run's tokens are those
//! of a run without drafting, bit for bit; greedy ones always.
//!
//! `ngram` (prompt lookup): the longest suffix of the text, NGRAM_MAX tokens down to one,
//! that occurred before; the tokens that followed its most recent earlier occurrence (for
//! a single token, its first) are the proposal. An index from each n-gram to the end of its latest occurrence, updated as
//! tokens arrive, makes a proposal a few hash lookups however long the text is. It costs
//! no model and no memory to speak of (four index entries a token), and it is what
//! summaries and edits want: they copy names and phrases from their prompt.

use crate::backend::TREE_ROWS_MAX;
use serde::Serialize;
use std::collections::HashMap;
use std::fmt;
use std::str::FromStr;

/// Proposes tokens to follow a sequence's text.
pub trait Drafter: Send {
    /// Tokens appended to the text (the prompt first, then each accepted token).
    fn extend(&mut self, tokens: &[u32]);
    /// Up to `max` tokens to follow the text so far, into `out` (cleared first; left
    /// empty when it has nothing to propose).
    fn propose(&mut self, max: usize, out: &mut Vec<u32>);
    /// A token tree: the chain `propose` gives, then up to `branches` other continuations
    /// where the drafter has them (each up to `max / 2` tokens), into `out`. The default
    /// has none.
    fn propose_tree(&mut self, max: usize, branches: usize, out: &mut Proposal) {
        let _ = branches;
        out.clear();
        self.propose(max, &mut out.tokens);
    }
}

/// `Proposal::parents` of a node that follows the pending token.
pub const FROM_PENDING: u16 = u16::MAX;

/// The edge factor of a node on the drafter's main line (`Proposal::edges`).
pub const MAIN_LINE: f32 = -1.0;

/// A drafted token tree, its nodes in an order where a node's parent comes before it and
/// any prefix is a tree: the drafter's main chain first, then its branches. A chain
/// (`parents` empty) is the common case; each node then follows the one before.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Proposal {
    pub tokens: Vec<u32>,
    /// Each node's parent: a node before it, or FROM_PENDING. Empty: a chain.
    pub parents: Vec<u16>,
    /// Each node's chance of being the token sampled after its parent, relative to the
    /// sequence's acceptance: MAIN_LINE (the acceptance itself), or for an alternative
    /// the share of what the main line misses that it is expected to take. Empty: a chain.
    pub edges: Vec<f32>,
}

impl Proposal {
    pub fn clear(&mut self) {
        self.tokens.clear();
        self.parents.clear();
        self.edges.clear();
    }

    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// Node `k`'s parent (FROM_PENDING for the first of a chain).
    pub fn parent(&self, k: usize) -> u16 {
        match self.parents.get(k) {
            Some(&p) => p,
            None if k == 0 => FROM_PENDING,
            None => (k - 1) as u16,
        }
    }

    /// Whether the first `n` nodes branch anywhere (else they are a chain).
    pub fn branches_in(&self, n: usize) -> bool {
        (0..n.min(self.parents.len())).any(|k| self.parent(k) != k.wrapping_sub(1) as u16)
    }

    /// Adds a node after `parent` (FROM_PENDING or a node), with its edge factor.
    pub fn push(&mut self, token: u32, parent: u16, edge: f32) {
        if self.parents.len() < self.tokens.len() {
            // A chain so far: its parents and edges made explicit.
            let n = self.tokens.len();
            self.parents.clear();
            self.parents.push(FROM_PENDING);
            self.parents.extend((1..n).map(|k| (k - 1) as u16));
            self.edges.clear();
            self.edges.resize(n, MAIN_LINE);
        }
        self.tokens.push(token);
        self.parents.push(parent);
        self.edges.push(edge);
    }

    /// The expected chance that node `k` is accepted, the sequence's acceptance being
    /// `a`: the product of its path's edges (a main-line edge is `a`, an alternative with
    /// share s is (1 - a) s).
    pub fn chance(&self, k: usize, a: f64) -> f64 {
        let mut p = 1.0;
        let mut at = k as u16;
        while at != FROM_PENDING {
            let i = at as usize;
            p *= match self.edges.get(i) {
                Some(&e) if e >= 0.0 => (1.0 - a) * e as f64,
                _ => a,
            };
            at = self.parent(i);
        }
        p
    }

    /// Keeps the first nodes, as many as fit: `room` rows (the context and `max_tokens`),
    /// and a tree's rows in one span's mask (`TREE_ROWS_MAX`, the pending token's among
    /// them).
    pub fn fit(&mut self, room: usize) {
        let n = if self.branches_in(self.len()) {
            room.min(TREE_ROWS_MAX - 1)
        } else {
            room
        };
        self.tokens.truncate(n);
        self.parents.truncate(n);
        self.edges.truncate(n);
    }

    /// Node `k`'s children among the first `n` nodes whose token is `token`: the first.
    pub fn child(&self, k: u16, n: usize, token: u32) -> Option<usize> {
        (0..n).find(|&c| self.parent(c) == k && self.tokens[c] == token)
    }
}

/// Which drafter a model runs with (`--draft`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DraftKind {
    /// Prompt lookup over the sequence's own text.
    Ngram,
    /// A draft model's greedy decoding (`draft_model::DraftModel`; `sluiced run --draft
    /// STORE`), which fills the proposals before each step.
    #[serde(skip)]
    Model,
}

impl DraftKind {
    /// The drafter `--draft NAME` names: `ngram`, else a draft model's store.
    pub fn of(name: &str) -> DraftKind {
        if name == "ngram" {
            DraftKind::Ngram
        } else {
            DraftKind::Model
        }
    }
}

impl FromStr for DraftKind {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "ngram" => Ok(DraftKind::Ngram),
            other => Err(format!(
                "unknown drafter {other:?}: `ngram` (prompt lookup) is the one there is"
            )),
        }
    }
}

impl fmt::Display for DraftKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            DraftKind::Ngram => "ngram",
            DraftKind::Model => "model",
        })
    }
}

/// Speculative decoding's settings for a model.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DraftConfig {
    pub kind: DraftKind,
    /// Tokens a sequence drafts for one step at most (`--draft-max`).
    pub max: usize,
    /// Verify every proposal whole (up to `max`) instead of the rows that measured pass
    /// times pay for (`--draft-fixed`: experiments, and tests that must see drafts).
    pub fixed: bool,
    /// Branches a token tree may have besides its main chain (`--draft-branches`; 0:
    /// chains only).
    pub branches: usize,
}

/// A decoding sequence's claim on a step's drafted rows (`Sequence::draft_ask`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DraftAsk {
    /// Its acceptance so far (`SeqDraft::acceptance`).
    pub acceptance: f64,
    /// Drafts it proposes.
    pub proposed: usize,
    /// Its proposal goes in whole, within the pass's cap (`DraftConfig::fixed`).
    pub fixed: bool,
}

/// `--draft-max`'s default: on a 2-core CPU a verified row costs about a decode row's
/// compute, and ngram proposals past eight tokens are rarely accepted whole.
pub const DRAFT_MAX_DEFAULT: usize = 8;

impl DraftConfig {
    /// Nodes a sequence's proposal has at most: the chain and its branches (each up to
    /// max / 2 tokens), a tree within one span's mask.
    pub fn rows(&self) -> usize {
        if self.branches == 0 {
            return self.max;
        }
        (self.max + self.branches * (self.max / 2).max(1)).min(TREE_ROWS_MAX - 1)
    }

    /// Drafted rows one pass may verify over `n` decoding sequences: the rows the plan
    /// reserves (each a vocabulary of logits in the arena and on the host: memory the
    /// model's resident weights give up, so every pass streams more). One sequence's
    /// proposal whole and half of one for each other sequence; every proposal whole with
    /// `fixed`. The row budget gives a pass's rows to the likeliest drafts first, and in a
    /// batch few sequences draft well at once: at batch 8 (SmolLM2 F16 within 192 MiB,
    /// ngram, 2 cores) passes carried 1.3 drafted rows on average on chat and 13-16 on
    /// summaries and code, and reserving every sequence's whole proposal (64 rows) made
    /// the model stream 30 of its units where plain decoding streamed 25-26.
    pub fn verify_rows(&self, n: usize) -> usize {
        let whole = n * self.rows();
        if self.fixed || n <= 1 {
            return whole;
        }
        whole.min(self.rows() + (n - 1) * self.rows().div_ceil(2))
    }

    /// A new drafter for one sequence (None: a draft model fills its proposals).
    pub fn drafter(&self) -> Option<Box<dyn Drafter>> {
        match self.kind {
            DraftKind::Ngram => Some(Box::new(Ngram::default())),
            DraftKind::Model => None,
        }
    }
}

/// Buckets of `SpecStats::tokens_per_step`: 1 to 16 tokens, the last for more.
pub const STEP_TOKENS_BUCKETS: usize = 17;

/// Speculative decoding's counts over a run or a daemon's life (Status, /metrics,
/// `run --json`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct SpecStats {
    /// Drafted tokens that went into steps to verify.
    pub drafted_tokens: u64,
    /// Of those, the ones the sequence's own sampling agreed with.
    pub accepted_tokens: u64,
    /// Decode steps of a sequence by the tokens each yielded: `[i]` counts steps that
    /// yielded i + 1 (the last bucket: 17 or more).
    pub tokens_per_step: [u64; STEP_TOKENS_BUCKETS],
    /// A draft model's passes and their wall time (0 for ngram: a few hash lookups a
    /// step, inside the engine's step time).
    pub draft_passes: u64,
    pub draft_seconds: f64,
}

impl SpecStats {
    /// A sequence's decode step verified `drafted` tokens and yielded `emitted`.
    pub fn record(&mut self, drafted: usize, emitted: usize) {
        self.drafted_tokens += drafted as u64;
        self.accepted_tokens += emitted.saturating_sub(1).min(drafted) as u64;
        if emitted > 0 {
            self.tokens_per_step[(emitted - 1).min(STEP_TOKENS_BUCKETS - 1)] += 1;
        }
    }

    /// Adds another run's counts.
    pub fn add(&mut self, o: &SpecStats) {
        self.drafted_tokens += o.drafted_tokens;
        self.accepted_tokens += o.accepted_tokens;
        for (a, b) in self.tokens_per_step.iter_mut().zip(o.tokens_per_step) {
            *a += b;
        }
        self.draft_passes += o.draft_passes;
        self.draft_seconds += o.draft_seconds;
    }

    /// The tokens a decode step yielded on average.
    pub fn tokens_per_step_mean(&self) -> f64 {
        let steps: u64 = self.tokens_per_step.iter().sum();
        let tokens: u64 = self
            .tokens_per_step
            .iter()
            .enumerate()
            .map(|(i, &n)| (i as u64 + 1) * n)
            .sum();
        tokens as f64 / steps.max(1) as f64
    }
}

/// A sequence's acceptance before its first verified step.
const ACCEPTANCE_PRIOR: f64 = 0.5;

/// How many drafted rows a pass verifies, chosen from what passes measured: a pass costs
/// the longer of its streaming and its compute, and compute grows with the rows it carries
/// (a least-squares line through recent passes' compute against their rows, older passes
/// weighing less). A row whose expected yield (its sequence's acceptance to the power of
/// its depth: every draft before it must be accepted too) raises the expected tokens per
/// second of the pass goes in, best first: while the pass waits for its loads, rows are
/// free; past that, each must be worth its compute.
///
/// Where the compute runs on the cores that also read and decompress the streamed layers
/// (the CPU backend), a pass's wait for loads does not hide compute: a row then costs its
/// compute on top of the wait (`serial`). Measured on this 2-core machine: taken as free,
/// drafted rows at batch 8 cost 10-20 % of the tokens/s of plain decoding.
///
/// A mixture's rows route to experts, and a row that routes to one no other row needs
/// makes the pass load it: the wait for loads then grows with the rows. A second line,
/// the wait against the rows, gives each row that cost too (its slope; zero where loads do
/// not depend on the rows, as a dense model's), so drafts never make a pass read more
/// experts than the tokens they yield are worth.
#[derive(Clone, Debug, Default)]
pub struct RowBudget {
    /// Compute and loads share the cores: a pass takes their sum, not the longer.
    pub serial: bool,
    /// Compute seconds against rows, and the wait for loads against rows.
    compute: Fit,
    loads: Fit,
    /// The last pass's time waiting for loads (its streaming beyond its compute).
    stall_s: f64,
}

/// A least-squares line through (rows, seconds) of recent passes, older passes weighing
/// less: decayed sums of weight, rows, seconds, rows^2 and rows x seconds.
#[derive(Clone, Copy, Debug, Default)]
struct Fit {
    w: f64,
    x: f64,
    y: f64,
    xx: f64,
    xy: f64,
}

/// How much of the old fit a new pass leaves.
const FIT_DECAY: f64 = 0.95;

impl Fit {
    fn observe(&mut self, x: f64, y: f64) {
        self.w = FIT_DECAY * self.w + 1.0;
        self.x = FIT_DECAY * self.x + x;
        self.y = FIT_DECAY * self.y + y;
        self.xx = FIT_DECAY * self.xx + x * x;
        self.xy = FIT_DECAY * self.xy + x * y;
    }

    /// (intercept, per row), neither below zero. Until the passes' rows have varied, a
    /// row is taken to cost nothing beyond the pass.
    fn line(&self) -> (f64, f64) {
        if self.w == 0.0 {
            return (0.0, 0.0);
        }
        let (mx, my) = (self.x / self.w, self.y / self.w);
        let var = self.xx / self.w - mx * mx;
        if var < 0.25 {
            return (my, 0.0);
        }
        let slope = ((self.xy / self.w - mx * my) / var).max(0.0);
        ((my - slope * mx).max(0.0), slope)
    }
}

impl RowBudget {
    /// A pass carried `rows` rows, computed for `compute_s` and waited `stall_s` for loads.
    pub fn observe(&mut self, rows: usize, compute_s: f64, stall_s: f64) {
        self.compute.observe(rows as f64, compute_s);
        self.loads.observe(rows as f64, stall_s);
        self.stall_s = stall_s;
    }

    /// Compute seconds of a pass of `rows` rows, as the fit has it: (intercept, per row).
    pub fn line(&self) -> (f64, f64) {
        self.compute.line()
    }

    /// The wait for loads each row adds (a mixture's experts), as the fit has it.
    pub fn load_per_row(&self) -> f64 {
        self.loads.line().1
    }

    /// Drafted rows for each of a step's sequences, into `out` (one count per ask: a
    /// prefix of its proposal): the fixed asks' proposals whole, then the rows that pay,
    /// with the step's other rows `base_rows` (one a sequence, prefill chunks) and at most
    /// `cap` drafted rows in all. `chance(i, k)`: the chance that ask i's node k is
    /// accepted (`Proposal::chance`).
    pub fn allot(
        &self,
        asks: &[DraftAsk],
        (base_rows, cap): (usize, usize),
        chance: impl Fn(usize, usize) -> f64,
        out: &mut Vec<usize>,
    ) {
        out.clear();
        out.resize(asks.len(), 0);
        let mut left = cap;
        for (o, ask) in out.iter_mut().zip(asks).filter(|(_, a)| a.fixed) {
            *o = ask.proposed.min(left);
            left -= *o;
        }
        let (a, b) = self.line();
        let compute = |rows: usize| a + b * rows as f64;
        // The pass as it stands: its compute, or its loads where they take longer; each
        // row past those adds its compute and the loads it brings.
        let first = base_rows + (cap - left);
        let per_row = self.load_per_row();
        let loads = |rows: usize| self.stall_s + per_row * (rows - first) as f64;
        let pass = |rows: usize| {
            let t = if self.serial {
                compute(rows) + loads(rows)
            } else {
                (compute(first) + loads(rows)).max(compute(rows))
            };
            t.max(1e-9)
        };
        let mut tokens = asks.len() as f64;
        let mut time = pass(first);
        // Each row after those the pass already carries.
        for rows in first..first + left {
            // The best next row: the sequence whose next draft is likeliest to be accepted.
            let best = (0..asks.len())
                .filter(|&i| !asks[i].fixed && out[i] < asks[i].proposed)
                .map(|i| (i, chance(i, out[i])))
                .max_by(|x, y| x.1.total_cmp(&y.1));
            let Some((i, gain)) = best else { break };
            let t = pass(rows + 1);
            if (tokens + gain) / t < tokens / time {
                break;
            }
            out[i] += 1;
            tokens += gain;
            time = t;
        }
    }
}

/// The longest n-gram a proposal matches on.
const NGRAM_MAX: usize = 4;

/// Prompt lookup (see the module doc).
#[derive(Default)]
pub struct Ngram {
    text: Vec<u32>,
    /// Hash of an n-gram (n folded in) -> the ends of its first and of its latest
    /// occurrence, for every n-gram that ends before the text does (the text's own suffix
    /// is looked up, never found as itself).
    index: HashMap<u64, (u32, u32)>,
}

/// FNV-1a over the tokens, n folded in.
fn gram_hash(gram: &[u32]) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64 ^ gram.len() as u64;
    for &t in gram {
        for b in t.to_le_bytes() {
            h = (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    h
}

impl Drafter for Ngram {
    fn extend(&mut self, tokens: &[u32]) {
        for &t in tokens {
            // The n-grams ending at the current end become lookable once a token follows.
            let end = self.text.len();
            for n in 1..=NGRAM_MAX.min(end) {
                self.index
                    .entry(gram_hash(&self.text[end - n..end]))
                    .and_modify(|e| e.1 = end as u32)
                    .or_insert((end as u32, end as u32));
            }
            self.text.push(t);
        }
    }

    fn propose(&mut self, max: usize, out: &mut Vec<u32>) {
        out.clear();
        if let Some(&at) = self.matches(1).first() {
            self.continuation(at, max, out);
        }
    }

    /// The chain `propose` gives, then the continuations of other earlier occurrences of
    /// the text's suffix (the other of its first and latest occurrence, then those of
    /// shorter suffixes), each a branch from where it leaves the tree, up to `max / 2`
    /// tokens. An alternative is taken to be sampled a third of the time the main line
    /// is not (an ngram has no probabilities; the acceptance it is weighed by is measured).
    fn propose_tree(&mut self, max: usize, branches: usize, out: &mut Proposal) {
        out.clear();
        let starts = self.matches(1 + branches);
        let Some((&main, others)) = starts.split_first() else {
            return;
        };
        self.continuation(main, max, &mut out.tokens);
        let mut alt = Vec::new();
        for &at in others {
            self.continuation(at, max / 2, &mut alt);
            // Down the tree while it has this continuation's tokens; a branch from there.
            let (mut parent, mut k) = (FROM_PENDING, 0);
            while let Some(c) = alt.get(k).and_then(|&t| out.child(parent, out.len(), t)) {
                parent = c as u16;
                k += 1;
            }
            for (i, &t) in alt.iter().enumerate().skip(k) {
                let edge = if i == k { ALTERNATIVE_SHARE } else { MAIN_LINE };
                out.push(t, parent, edge);
                parent = (out.len() - 1) as u16;
            }
        }
    }
}

/// What `Ngram::propose_tree` takes an alternative continuation's share to be.
const ALTERNATIVE_SHARE: f32 = 0.33;

impl Ngram {
    /// Up to `most` distinct positions where earlier occurrences of the text's suffix end,
    /// the best first: for the longest suffix that occurred before (NGRAM_MAX tokens down to
    /// one), its latest occurrence (for one token, its first: weak evidence, and a word's
    /// first occurrence is where the text introduced it, a document's opening or a name's
    /// first mention, what an answer starts by copying), then its other, then shorter
    /// suffixes' in the same way. Two tokens or more place the passage being copied, and
    /// a copy in progress follows its latest occurrence.
    fn matches(&self, most: usize) -> Vec<usize> {
        let end = self.text.len();
        let mut found = Vec::new();
        for n in (1..=NGRAM_MAX.min(end)).rev() {
            let suffix = &self.text[end - n..];
            let Some(&(first, latest)) = self.index.get(&gram_hash(suffix)) else {
                continue;
            };
            let order = if n > 1 {
                [latest, first]
            } else {
                [first, latest]
            };
            for at in order.map(|a| a as usize) {
                // A hash collision is no match.
                if found.len() < most
                    && at >= n
                    && &self.text[at - n..at] == suffix
                    && !found.contains(&at)
                {
                    found.push(at);
                }
            }
        }
        found
    }

    /// `max` tokens of what followed position `at`, into `out` (cleared first), read on
    /// into themselves where they reach the end of the text (an overlapping copy: a
    /// repeating pattern proposes its next repeats).
    fn continuation(&self, at: usize, max: usize, out: &mut Vec<u32>) {
        out.clear();
        let end = self.text.len();
        for k in 0..max {
            let t = match self.text.get(at + k) {
                Some(&t) => t,
                None => out[at + k - end],
            };
            out.push(t);
        }
    }
}

/// A sequence's drafting: its drafter, the proposal for its next step, and how well its
/// proposals have done: the acceptance `RowBudget` weighs its rows by, and a pause after
/// FAILS_BEFORE_PAUSE verified steps in a row that accepted nothing (1 step, then 2, 4, ...
/// up to 64 while failures go on), so a sequence whose drafts keep failing stops drafting.
/// Proposals are not shortened after failures: replaying the bench's texts, halving them
/// after a failed first draft cost 10-20 % of the tokens a pass yields (1.55 -> 1.41 on a
/// summary, 4.80 -> 4.00 on another), and the row budget already weighs every row by the
/// sequence's acceptance.
pub struct SeqDraft {
    /// Its drafter; None where a draft model proposes (`DraftModel::propose`).
    drafter: Option<Box<dyn Drafter>>,
    /// With a draft model: the tokens its KV cache holds for this sequence (positions
    /// 0..), and how many tokens the next proposal is to have.
    pub fed: Vec<u32>,
    pub want: usize,
    /// Rows the next step's proposal may take (what the context leaves).
    pub rows_room: usize,
    max: usize,
    fixed: bool,
    branches: usize,
    /// Tokens to verify after the pending one in the next step: a chain, or a tree.
    pub proposal: Proposal,
    /// Drafted tokens that went into steps, and those accepted, since the start.
    pub drafted: u64,
    pub accepted: u64,
    /// Verified steps in a row that accepted nothing.
    fails: usize,
    /// Steps left without drafting, and the next pause's length.
    paused: usize,
    pause: usize,
    /// The chance that a draft is accepted given the ones before it were, smoothed over
    /// this sequence's verified steps (what `RowBudget` weighs its rows by).
    pub acceptance: f64,
}

/// Verified steps in a row that accept nothing before a sequence pauses drafting.
const FAILS_BEFORE_PAUSE: usize = 4;

impl SeqDraft {
    pub fn new(cfg: &DraftConfig, prompt: &[u32]) -> SeqDraft {
        let mut drafter = cfg.drafter();
        if let Some(d) = &mut drafter {
            d.extend(prompt);
        }
        SeqDraft {
            drafter,
            fed: Vec::new(),
            want: 0,
            rows_room: 0,
            max: cfg.max,
            fixed: cfg.fixed,
            branches: cfg.branches,
            proposal: Proposal::default(),
            drafted: 0,
            accepted: 0,
            fails: 0,
            paused: 0,
            pause: 1,
            acceptance: ACCEPTANCE_PRIOR,
        }
    }

    /// Branches a proposal may have besides its main chain.
    pub fn branches(&self) -> usize {
        self.branches
    }

    /// The chance that node `k` of the proposal is accepted (`Proposal::chance`).
    pub fn chance(&self, k: usize) -> f64 {
        self.proposal.chance(k, self.acceptance)
    }

    /// Whether a draft model makes its proposals.
    pub fn by_model(&self) -> bool {
        self.drafter.is_none()
    }

    /// Its claim on the next step's drafted rows.
    pub fn ask(&self) -> DraftAsk {
        DraftAsk {
            acceptance: self.acceptance,
            proposed: self.proposal.len(),
            fixed: self.fixed,
        }
    }

    /// Tokens were accepted into the text.
    pub fn extend(&mut self, tokens: &[u32]) {
        if let Some(d) = &mut self.drafter {
            d.extend(tokens);
        }
    }

    /// The outcome of a verified step: `drafted` tokens went in, a path of `accepted` of
    /// them matched what the sequence sampled, and (`rejected`) the token sampled after it
    /// was not among the drafts on offer there.
    pub fn verified(&mut self, drafted: usize, accepted: usize, rejected: bool) {
        self.drafted += drafted as u64;
        self.accepted += accepted as u64;
        // A run of `accepted` successes then (unless the drafts ran out) one failure: the
        // per-draft chance that run measures.
        let tries = (accepted + usize::from(rejected)) as f64;
        let rate = accepted as f64 / tries.max(1.0);
        self.acceptance = 0.7 * self.acceptance + 0.3 * rate;
        if accepted > 0 {
            self.fails = 0;
            self.pause = 1;
            return;
        }
        self.fails += 1;
        if self.fails >= FAILS_BEFORE_PAUSE {
            self.fails = 0;
            self.paused = self.pause;
            self.pause = (self.pause * 2).min(64);
        }
    }

    /// Makes the proposal for the next step: at most `room` tokens deep (what the context
    /// and `max_tokens` leave) and `rows_room` nodes (what the context leaves), none while
    /// paused. With a draft model this only sets `want`: the model fills the proposal
    /// before the step.
    pub fn propose(&mut self, room: usize, rows_room: usize) {
        self.proposal.clear();
        self.want = 0;
        self.rows_room = rows_room;
        if self.paused > 0 {
            self.paused -= 1;
            return;
        }
        match &mut self.drafter {
            Some(d) => {
                d.propose_tree(self.max.min(room), self.branches, &mut self.proposal);
                self.proposal.fit(rows_room);
            }
            None => self.want = self.max.min(room),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ngram(text: &[u32]) -> Ngram {
        let mut d = Ngram::default();
        d.extend(text);
        d
    }

    #[test]
    fn ngram_proposes_what_followed_the_longest_suffix_seen_before() {
        // "1 2 3 4 9 | 5 2 3 4 7 | ... 2 3 4": the 3-gram 2 3 4 last ended before 7.
        let mut d = ngram(&[1, 2, 3, 4, 9, 5, 2, 3, 4, 7, 8, 6, 2, 3, 4]);
        let mut out = Vec::new();
        d.propose(3, &mut out);
        assert_eq!(out, [7, 8, 6]);
        // Past the end of the text the continuation reads on into itself.
        d.propose(10, &mut out);
        assert_eq!(out, [7, 8, 6, 2, 3, 4, 7, 8, 6, 2]);
        d.propose(0, &mut out);
        assert!(out.is_empty());
    }

    #[test]
    fn ngram_falls_back_to_shorter_suffixes_and_proposes_nothing_unseen() {
        let mut out = Vec::new();
        // Only the last token, 5, occurred before (followed by 6).
        ngram(&[5, 6, 7, 1, 5]).propose(2, &mut out);
        assert_eq!(out, [6, 7]);
        ngram(&[1, 2, 3]).propose(4, &mut out);
        assert!(out.is_empty());
        ngram(&[]).propose(4, &mut out);
        assert!(out.is_empty());
        // One token matched: what followed its first occurrence (here the text's opening).
        ngram(&[7, 1, 9, 3, 7, 2, 8, 5, 7]).propose(3, &mut out);
        assert_eq!(out, [1, 9, 3]);
        // A run of one token proposes more of it.
        ngram(&[4, 4, 4]).propose(3, &mut out);
        assert_eq!(out, [4, 4, 4]);
    }

    #[test]
    fn ngram_extends_token_by_token_as_it_does_at_once() {
        let text = [
            3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2, 6, 4, 3,
        ];
        let mut one = Ngram::default();
        let (mut a, mut b) = (Vec::new(), Vec::new());
        for (i, &t) in text.iter().enumerate() {
            one.extend(&[t]);
            one.propose(5, &mut a);
            ngram(&text[..=i]).propose(5, &mut b);
            assert_eq!(a, b, "after {} tokens", i + 1);
        }
    }

    /// `RowBudget::allot` over chains: node k of ask i is accepted with its acceptance to
    /// the power k + 1.
    fn allot(b: &RowBudget, asks: &[DraftAsk], rows: (usize, usize), out: &mut Vec<usize>) {
        b.allot(
            asks,
            rows,
            |i, k| asks[i].acceptance.powi(k as i32 + 1),
            out,
        );
    }

    #[test]
    fn ngram_trees_branch_where_earlier_occurrences_go_on_differently() {
        // After "1 2": "3 4" (its latest occurrence), "7 8" (its first), and for the last
        // token alone "5 6" (its first occurrence; its latest is the same as "1 2"'s).
        let text = [9, 2, 5, 6, 1, 2, 7, 8, 1, 2, 3, 4, 0, 1, 2];
        let mut d = ngram(&text);
        let mut t = Proposal::default();
        d.propose_tree(4, 0, &mut t);
        let mut chain = Vec::new();
        d.propose(4, &mut chain);
        assert_eq!(t.tokens, chain, "no branches: the chain");
        assert!(t.parents.is_empty() && !t.branches_in(4));
        d.propose_tree(4, 3, &mut t);
        // The chain, then each other continuation (2 tokens) from the root.
        assert_eq!(t.tokens, [3, 4, 0, 1, 7, 8, 5, 6]);
        assert_eq!(
            t.parents,
            [FROM_PENDING, 0, 1, 2, FROM_PENDING, 4, FROM_PENDING, 6]
        );
        assert!(t.branches_in(8) && !t.branches_in(4));
        assert_eq!(t.child(FROM_PENDING, 8, 5), Some(6));
        assert_eq!(t.child(FROM_PENDING, 6, 5), None, "only the first 6 nodes");
        assert_eq!(t.child(4, 8, 8), Some(5));
        // A chain node is accepted with the acceptance to its depth; an alternative with
        // what the chain misses, times its share, then the acceptance down its line.
        let a = 0.8;
        assert!((t.chance(1, a) - a * a).abs() < 1e-12);
        let alt = (1.0 - a) * f64::from(ALTERNATIVE_SHARE);
        assert!(
            (t.chance(5, a) - alt * a).abs() < 1e-9,
            "{}",
            t.chance(5, a)
        );
        // A continuation that shares the tree's first tokens branches where it leaves it.
        let mut d = ngram(&[5, 1, 2, 3, 9, 1, 2, 3, 4, 0, 1, 2]);
        d.propose_tree(4, 1, &mut t);
        assert_eq!(t.tokens, [3, 4, 0, 1, 9], "{t:?}");
        assert_eq!(t.parents[4], 0, "after the shared 3");
        // Room cuts a tree to its first nodes, still a tree.
        t.fit(3);
        assert_eq!((t.tokens.len(), t.parents.len(), t.edges.len()), (3, 3, 3));
    }

    fn ask(acceptance: f64, proposed: usize) -> DraftAsk {
        DraftAsk {
            acceptance,
            proposed,
            fixed: false,
        }
    }

    #[test]
    fn the_row_budget_drafts_freely_while_loads_bound_the_pass_and_weighs_rows_after() {
        let mut b = RowBudget::default();
        let mut out = Vec::new();
        // Nothing measured: rows look free, every proposal goes in, within the cap.
        allot(&b, &[ask(0.5, 4), ask(0.9, 8)], (2, 10), &mut out);
        assert_eq!(
            out,
            [2, 8],
            "the likelier sequence's rows first, to the cap"
        );
        // Compute 10 ms + 1 ms a row, measured over passes of 2 to 12 rows.
        for rows in [2, 6, 12, 4, 9, 2, 7] {
            b.observe(rows, 0.010 + 0.001 * rows as f64, 0.0);
        }
        let (a, slope) = b.line();
        assert!(
            (a - 0.010).abs() < 1e-9 && (slope - 0.001).abs() < 1e-9,
            "{a} {slope}"
        );
        // Compute-bound: a row costing 1 ms of a 12 ms pass is worth it only while its
        // chance beats about a twelfth of a token.
        allot(&b, &[ask(0.05, 8)], (1, 16), &mut out);
        assert_eq!(out, [0], "a 5 % draft does not pay for its compute");
        allot(&b, &[ask(0.9, 8)], (1, 16), &mut out);
        assert!(out[0] >= 4, "{out:?}");
        // A fixed ask gets its proposal whole all the same, within the cap.
        let fixed = DraftAsk {
            fixed: true,
            ..ask(0.05, 8)
        };
        allot(&b, &[fixed, ask(0.05, 8)], (2, 6), &mut out);
        assert_eq!(out, [6, 0]);
        // The same pass waiting 50 ms for its loads: rows are free up to the wait.
        b.observe(1, 0.011, 0.050);
        allot(&b, &[ask(0.05, 8)], (1, 16), &mut out);
        assert_eq!(out, [8], "free rows are taken even at 5 %");
        // Where loads and compute share the cores, a row costs its 1 ms on top of the
        // 61 ms pass: worth it at 5 % for one sequence, not for eight (each row must then
        // beat 8 x 1/61 of a token).
        b.serial = true;
        allot(&b, &[ask(0.05, 8)], (1, 16), &mut out);
        assert!(out[0] > 0, "{out:?}");
        allot(&b, &[ask(0.05, 8); 8], (8, 16), &mut out);
        assert_eq!(out, [0; 8]);
    }

    #[test]
    fn rows_that_bring_loads_with_them_cost_those_loads() {
        // A mixture: each row routes to experts the pass then loads, 5 ms of waiting a
        // row on top of 40 ms, and 1 ms of compute a row.
        let mut b = RowBudget::default();
        for rows in [1, 4, 8, 2, 6, 3] {
            let r = rows as f64;
            b.observe(rows, 0.010 + 0.001 * r, 0.040 + 0.005 * r);
        }
        assert!(
            (b.load_per_row() - 0.005).abs() < 1e-9,
            "{}",
            b.load_per_row()
        );
        // The pass waits for its loads, yet a row costs 5 ms of them: a 5 % draft does
        // not pay (a dense model's loads would make it free: the test above).
        let mut out = Vec::new();
        allot(&b, &[ask(0.05, 8)], (1, 16), &mut out);
        assert_eq!(out, [0]);
        allot(&b, &[ask(0.9, 8)], (1, 16), &mut out);
        assert!(out[0] >= 3, "{out:?}");
    }

    #[test]
    fn a_batch_reserves_one_whole_proposal_and_half_of_one_for_each_other_sequence() {
        let chain = DraftConfig {
            kind: DraftKind::Ngram,
            max: 8,
            fixed: false,
            branches: 0,
        };
        assert_eq!(chain.verify_rows(1), 8);
        assert_eq!(chain.verify_rows(2), 12);
        assert_eq!(chain.verify_rows(8), 8 + 7 * 4);
        // Pinned whole proposals are reserved whole.
        let fixed = DraftConfig {
            fixed: true,
            ..chain
        };
        assert_eq!(fixed.verify_rows(8), 64);
        // A tree's nodes: a chain of 8 and two branches of 4.
        let tree = DraftConfig {
            branches: 2,
            ..chain
        };
        assert_eq!(tree.rows(), 16);
        assert_eq!(tree.verify_rows(8), 16 + 7 * 8);
        let odd = DraftConfig { max: 5, ..chain };
        assert_eq!(odd.verify_rows(3), 5 + 2 * 3);
    }

    #[test]
    fn a_failing_sequence_pauses_longer_each_time_and_recovers() {
        let cfg = DraftConfig {
            kind: DraftKind::Ngram,
            max: 8,
            fixed: false,
            branches: 0,
        };
        let mut s = SeqDraft::new(&cfg, &[1, 2, 1, 2, 1, 2]);
        s.propose(100, 100);
        assert_eq!(s.proposal.tokens, [1, 2, 1, 2, 1, 2, 1, 2]);
        // Three failed steps: still drafting, whole proposals.
        for _ in 0..3 {
            s.verified(8, 0, true);
            s.propose(100, 100);
            assert_eq!(s.proposal.len(), 8);
        }
        assert!(s.acceptance < 0.2, "{}", s.acceptance);
        // The fourth pauses drafting for a step; four more, for two.
        s.verified(8, 0, true);
        s.propose(100, 100);
        assert!(s.proposal.is_empty());
        s.propose(100, 100);
        assert_eq!(s.proposal.len(), 8);
        for _ in 0..4 {
            s.verified(8, 0, true);
        }
        for _ in 0..2 {
            s.propose(100, 100);
            assert!(s.proposal.is_empty());
        }
        // An accepted draft ends the run of failures and the pauses' growth.
        s.propose(100, 100);
        s.verified(8, 3, true);
        assert_eq!((s.fails, s.pause), (0, 1));
        assert_eq!((s.drafted, s.accepted), (9 * 8, 3));
        s.propose(1, 1);
        assert_eq!(s.proposal.len(), 1, "room limits the proposal");
    }
}
