//! The prefix cache's device tier: a prompt's KV is never computed twice while a KV slot
//! still holds it. A finished sequence's slot keeps its KV and the text it is of; a new
//! sequence goes to the free slot whose kept text shares the longest prefix with its
//! prompt (the least recently used slot is given up first when none does), and before
//! every step each prefilling sequence takes the longest prefix of its prompt any slot
//! holds (a kept one, or one a running sequence is filling): in place when it is its own
//! slot, else copied slot to slot on the device (`Pipeline::copy_kv`). A sequence whose
//! prompt shares a prefix with one that is computing it waits for it instead of computing
//! it too (`n` choices, a call of several prompts, a template's long instruction).
//!
//! Reuse is exact: a prompt chunk's rows take the prefill kernels however few they are
//! (`SeqStep::prompt`), each row independent of the others, and the last prompt token always
//! runs (its logits give the first token), so the rows after a reused prefix have the bits
//! a prefill of the whole prompt gives them. A sliding-window layer's ring holds only its
//! last `cap` positions: a prefix is taken only where every layer still holds what the
//! first new query attends to (`Decoder::can_resume`).

use super::kv_tiers::{TierConfig, TierStats, Tiers};
use super::sequence::Sequence;
use crate::backend::Backend;
use crate::pipeline::Pipeline;
use serde::Serialize;

/// What a slot's KV holds once its sequence is over.
struct Kept {
    /// The text whose K and V are at positions 0..tokens.len().
    tokens: Vec<u32>,
    /// Bytes of KV cache they take.
    bytes: u64,
    /// Positions written (a ring's contents end there).
    written: usize,
    /// When it was kept (the least recent goes first).
    at: u64,
}

/// The prefix cache's counts (Status, /metrics).
#[derive(Clone, Copy, Debug, Default, Serialize)]
pub struct PrefixStats {
    pub enabled: bool,
    /// Free slots holding a finished sequence's KV, and the positions they hold.
    pub kept_slots: usize,
    pub kept_tokens: u64,
    /// Bytes of KV cache those positions take.
    pub kept_bytes: u64,
    /// Prompts admitted, those that reused at least one token, prompt tokens in all and
    /// those taken from the cache (not prefilled).
    pub prompts: u64,
    pub hits: u64,
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
    /// Kept slots given to a prompt that shared nothing with them.
    pub evictions: u64,
    /// The host and disk tiers (`kv_tiers`).
    pub tiers: TierStats,
}

/// Tokens a sequence waits for another to compute before it waits rather than computes
/// them beside it (fewer are not worth the pass it may lose).
const WAIT_MIN: usize = 32;

/// The device tier of the prefix cache (see the module doc).
pub struct PrefixCache {
    on: bool,
    /// Per KV slot: what it keeps, while free.
    kept: Vec<Option<Kept>>,
    clock: u64,
    stats: PrefixStats,
    /// Blocks in host memory and on disk, beyond the slots.
    tiers: Option<Tiers>,
}

/// A slot's KV another sequence may take from: its slot, its text, the positions that hold
/// the text's K and V, and the positions written.
struct Source<'a> {
    slot: usize,
    text: Text<'a>,
    valid: usize,
    written: usize,
}

/// A source's text: a running sequence's, or what a slot keeps.
enum Text<'a> {
    Seq(&'a Sequence),
    Kept(&'a [u32]),
}

impl Text<'_> {
    fn token(&self, i: usize) -> Option<u32> {
        match self {
            Text::Seq(s) => s.token(i),
            Text::Kept(t) => t.get(i).copied(),
        }
    }
}

/// Length of the common prefix of `prompt` and the first `valid` tokens of `text`.
fn common(prompt: &[u32], text: &Text<'_>, valid: usize) -> usize {
    prompt
        .iter()
        .take(valid)
        .enumerate()
        .take_while(|&(i, &t)| text.token(i) == Some(t))
        .count()
}

impl PrefixCache {
    pub fn new(slots: usize, on: bool) -> PrefixCache {
        PrefixCache {
            on,
            kept: (0..slots).map(|_| None).collect(),
            clock: 0,
            stats: PrefixStats {
                enabled: on,
                ..PrefixStats::default()
            },
            tiers: None,
        }
    }

    /// With host and disk tiers for `runner`'s model (none when the cache is off or `cfg`
    /// sizes neither).
    pub fn with_tiers<B: Backend>(mut self, runner: &Pipeline<B>, cfg: &TierConfig) -> Self {
        if self.on {
            self.tiers = Tiers::new(runner, cfg);
        }
        self
    }

    pub fn enabled(&self) -> bool {
        self.on
    }

    /// The host tier's budget, the plan in use's (a change of placement); a cache with
    /// no host tier has none to set.
    pub fn set_host_budget(&mut self, budget: u64) {
        if let Some(t) = &mut self.tiers {
            let n = t.set_host_budget(budget);
            if n > 0 {
                tracing::info!("prefix cache: {n} blocks given up to the host tier's new budget");
            }
        }
    }

    /// The free slots whose kept KV may be taken, and the positions each has written.
    pub fn kept_slots(&self) -> impl Iterator<Item = (usize, usize)> + '_ {
        (self.kept.iter().enumerate()).filter_map(|(slot, k)| k.as_ref().map(|k| (slot, k.written)))
    }

    pub fn stats(&self) -> PrefixStats {
        let mut s = self.stats;
        s.kept_slots = self.kept.iter().flatten().count();
        s.kept_tokens = self
            .kept
            .iter()
            .flatten()
            .map(|k| k.tokens.len() as u64)
            .sum();
        s.kept_bytes = self.kept.iter().flatten().map(|k| k.bytes).sum();
        if let Some(t) = &self.tiers {
            s.tiers = t.stats();
        }
        s
    }

    /// The prefix of `prompt` a slot's KV gives: its common prefix with the slot's text,
    /// short of the whole prompt, where every layer still holds what the next query reads
    /// (0 where not).
    fn usable<B: Backend>(runner: &Pipeline<B>, prompt: &[u32], src: &Source<'_>) -> usize {
        let n = common(prompt, &src.text, src.valid).min(prompt.len() - 1);
        if n > 0 && runner.can_resume(n, src.written) {
            n
        } else {
            0
        }
    }

    fn kept_source(&self, slot: usize) -> Option<Source<'_>> {
        let k = self.kept.get(slot)?.as_ref()?;
        Some(Source {
            slot,
            text: Text::Kept(&k.tokens),
            valid: k.tokens.len(),
            written: k.written,
        })
    }

    /// Which of the `free` slots a new sequence of `prompt` takes (an index into `free`):
    /// the one whose kept KV gives the longest prefix, else one that keeps nothing, else
    /// the least recently kept (its KV is given up).
    pub fn choose_slot<B: Backend>(
        &mut self,
        runner: &Pipeline<B>,
        free: &[usize],
        prompt: &[u32],
    ) -> usize {
        let last = free.len().saturating_sub(1);
        if !self.on || prompt.is_empty() {
            return last;
        }
        let reuse = |slot: usize| {
            self.kept_source(slot)
                .map_or(0, |s| Self::usable(runner, prompt, &s))
        };
        let best = (0..free.len()).max_by_key(|&i| (reuse(free[i]), i));
        if let Some(i) = best.filter(|&i| reuse(free[i]) > 0) {
            return i;
        }
        if let Some(i) = (0..free.len())
            .rev()
            .find(|&i| self.kept[free[i]].is_none())
        {
            return i;
        }
        self.stats.evictions += 1;
        (0..free.len())
            .min_by_key(|&i| self.kept[free[i]].as_ref().map_or(0, |k| k.at))
            .unwrap_or(last)
    }

    /// A sequence of a `prompt_len`-token prompt was admitted.
    pub fn admitted(&mut self, prompt_len: usize) {
        self.stats.prompts += 1;
        self.stats.prompt_tokens += prompt_len as u64;
    }

    /// Before a step: each prefilling sequence takes the longest prefix of its prompt that
    /// any slot holds past what it has (its own slot's kept KV in place, else a copy from
    /// the other slot), then waits where another prefilling sequence ahead of it is
    /// computing more of its prompt (see the module doc). A slot copied into keeps nothing
    /// from then on (its kept text's KV is overwritten), and slots in use keep nothing after.
    pub fn before_step<B: Backend, S: AsRef<Sequence> + AsMut<Sequence>>(
        &mut self,
        runner: &mut Pipeline<B>,
        seqs: &mut [S],
    ) {
        if !self.on {
            return;
        }
        for i in 0..seqs.len() {
            if !seqs[i].as_ref().prefilling() {
                continue;
            }
            let best = self.best_source(runner, seqs, i);
            let s = seqs[i].as_mut();
            let beat = best.map_or(0, |b| b.1).max(s.prefilled());
            let first = s.cached() == 0;
            let from_tiers = match &mut self.tiers {
                Some(t) => t.take(runner, s, beat),
                None => 0,
            };
            if from_tiers > 0 {
                self.stats.hits += first as u64;
                self.stats.cached_tokens += from_tiers as u64;
                continue;
            }
            if let Some((slot, at, written)) = best.filter(|b| b.1 > s.prefilled()) {
                if slot != s.slot() {
                    runner.copy_kv((slot, s.slot()), s.prefilled()..at, written);
                    // Its slot no longer holds what it kept, for the sequences after it.
                    if let Some(k) = self.kept.get_mut(s.slot()) {
                        *k = None;
                    }
                }
                if s.cached() == 0 {
                    self.stats.hits += 1;
                }
                self.stats.cached_tokens += (at - s.prefilled()) as u64;
                let written = written.max(s.written());
                s.resume_at(at, written);
            }
        }
        for s in seqs.iter() {
            if let Some(k) = self.kept.get_mut(s.as_ref().slot()) {
                *k = None;
            }
        }
        for i in 0..seqs.len() {
            let waits = Self::waits(seqs, i);
            seqs[i].as_mut().waiting = waits;
        }
    }

    /// The slot holding the longest prefix of sequence `i`'s prompt: (slot, tokens,
    /// positions that slot has written).
    fn best_source<B: Backend, S: AsRef<Sequence>>(
        &self,
        runner: &Pipeline<B>,
        seqs: &[S],
        i: usize,
    ) -> Option<(usize, usize, usize)> {
        let me = seqs[i].as_ref();
        let prompt = me.prompt();
        let running = seqs
            .iter()
            .enumerate()
            .filter(|&(j, _)| j != i)
            .map(|(_, o)| {
                let o = o.as_ref();
                Source {
                    slot: o.slot(),
                    text: Text::Seq(o),
                    valid: o.kv_valid(),
                    written: o.written(),
                }
            });
        let kept = (0..self.kept.len()).filter_map(|slot| self.kept_source(slot));
        running
            .chain(kept)
            .map(|src| (src.slot, Self::usable(runner, prompt, &src), src.written))
            .max_by_key(|&(slot, n, _)| (n, slot == me.slot()))
    }

    /// Whether prefilling sequence `i` waits: another prefilling sequence ahead of it (more
    /// of its prompt in, or as much and a lower slot) has a prompt that shares at least
    /// WAIT_MIN tokens past what `i` holds and has not computed them yet.
    fn waits<S: AsRef<Sequence>>(seqs: &[S], i: usize) -> bool {
        let me = seqs[i].as_ref();
        if !me.prefilling() {
            return false;
        }
        let key = |s: &Sequence| (s.prefilled(), std::cmp::Reverse(s.slot()));
        seqs.iter().enumerate().any(|(j, o)| {
            let o = o.as_ref();
            if j == i || !o.prefilling() || key(o) <= key(me) {
                return false;
            }
            let shared =
                common(me.prompt(), &Text::Kept(o.prompt()), usize::MAX).min(me.prompt().len() - 1);
            shared >= me.prefilled() + WAIT_MIN && o.prefilled() < shared
        })
    }

    /// Sequence `seq` is over: its slot keeps its KV and text (nothing when the cache is
    /// off, or when its KV may be wrong: `valid` false after a failed step).
    pub fn release<B: Backend>(&mut self, runner: &Pipeline<B>, (seq, valid): (&Sequence, bool)) {
        let slot = seq.slot();
        if !self.on || slot >= self.kept.len() {
            return;
        }
        self.clock += 1;
        let n = if valid { seq.kv_valid() } else { 0 };
        let tokens: Vec<u32> = (0..n).filter_map(|i| seq.token(i)).collect();
        if let Some(t) = &mut self.tiers {
            t.export(runner, &tokens, slot, seq.written());
        }
        self.kept[slot] = (n > 0).then(|| Kept {
            tokens,
            bytes: runner.kv_bytes(n),
            written: seq.written(),
            at: self.clock,
        });
    }

    /// Empties every tier (`sluice cache clear`); returns the positions given up (the
    /// slots' and the blocks').
    pub fn clear(&mut self) -> u64 {
        let mut n = self.stats().kept_tokens;
        for k in &mut self.kept {
            *k = None;
        }
        if let Some(t) = &mut self.tiers {
            n += (t.clear() * super::kv_block::BLOCK_TOKENS) as u64;
        }
        n
    }
}
