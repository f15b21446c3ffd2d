//! A step's parts: each sequence's tokens (`SeqStep`), the checks a step passes before it
//! runs, and the token trees' rows (`TreeRows`: ancestors for attention, positions by
//! depth, and the KV moves of accepted paths).

use super::ModelError;
use crate::backend::{AttnStep, Backend, TREE_ROWS_MAX};
use crate::model::ModelOptions;
use std::ops::Range;

/// One sequence's part of a step.
#[derive(Clone, Debug, Default)]
pub struct SeqStep {
    /// KV-cache slot of the sequence.
    pub slot: usize,
    /// Tokens already in its cache (the position of the first new token).
    pub pos: usize,
    pub tokens: Vec<u32>,
    /// A decode token and the drafted tokens after it, to verify: every row of the span
    /// gives logits (not only its last), and the rows take the decode kernels like lone
    /// decode rows, so each row's logits have the bits that row would have decoded alone
    /// (the backends' batch invariance; ARCHITECTURE.md, speculative decoding).
    pub verify: bool,
    /// A chunk of a prompt: its rows take the prefill kernels however few they are (one
    /// included), so a prompt token's K and V have the same bits whichever chunk carried
    /// it, and a prefill after a reused prefix gives what prefilling the whole prompt gives
    /// (the prefix cache; ARCHITECTURE.md). Not with `verify`.
    pub prompt: bool,
    /// A verified span that is a token tree: each row's parent row (`TREE_ROOT` for the
    /// first, the pending token; every other's parent before it). Empty: a chain, each row
    /// after the one before. Row i runs at position `pos + depth(i)` and writes its K and
    /// V at `pos + i` (`AttnStep::row_keys`).
    pub parents: Vec<u16>,
    /// KV positions of this sequence to copy, in order, before the step writes its own:
    /// the accepted path of its last tree, from the rows its nodes ran at to their depths.
    pub kv_moves: Vec<(u32, u32)>,
}

/// `SeqStep::parents` of a tree's root.
pub const TREE_ROOT: u16 = u16::MAX;

impl SeqStep {
    /// Rows of logits this part of a step gives: each of a verified span's, else its last.
    pub fn logit_rows(&self) -> usize {
        if self.verify {
            self.tokens.len()
        } else {
            1
        }
    }
}

/// Checks a step against the model's limits: sequences and slots, context, vocabulary,
/// tokens and logit rows per step, trees and KV moves.
pub(super) fn check_steps(
    steps: &[SeqStep],
    opts: &ModelOptions,
    vocab: u32,
) -> Result<(), ModelError> {
    if steps.is_empty() || steps.len() > opts.kv_slots {
        return Err(ModelError::Step(format!(
            "{} sequences in a step; 1..={} allowed",
            steps.len(),
            opts.kv_slots
        )));
    }
    for (i, s) in steps.iter().enumerate() {
        if s.tokens.is_empty() {
            return Err(ModelError::Step(format!("sequence {i} has no tokens")));
        }
        if s.prompt && s.verify {
            return Err(ModelError::Step(format!(
                "sequence {i} is both a prompt chunk and a verified span"
            )));
        }
        if s.slot >= opts.kv_slots || steps[..i].iter().any(|o| o.slot == s.slot) {
            return Err(ModelError::Step(format!(
                "sequence {i}: KV slot {} is out of range or used twice",
                s.slot
            )));
        }
        if s.pos + s.tokens.len() > opts.max_context {
            return Err(ModelError::Step(format!(
                "sequence {i}: {} + {} tokens exceed the context of {}",
                s.pos,
                s.tokens.len(),
                opts.max_context
            )));
        }
        if let Some(&bad) = s.tokens.iter().find(|&&t| t >= vocab) {
            return Err(ModelError::Step(format!(
                "sequence {i}: token id {bad} is past the vocabulary ({})",
                vocab
            )));
        }
    }
    let total: usize = steps.iter().map(|s| s.tokens.len()).sum();
    if total > opts.max_batch_tokens {
        return Err(ModelError::Step(format!(
            "{total} tokens in a step; at most {}",
            opts.max_batch_tokens
        )));
    }
    let logit_rows: usize = steps.iter().map(SeqStep::logit_rows).sum();
    if logit_rows > opts.logit_rows() {
        return Err(ModelError::Step(format!(
            "{logit_rows} rows of logits in a step; at most {} (one a sequence and {} verified drafts)",
            opts.logit_rows(),
            opts.verify_rows
        )));
    }
    for (i, s) in steps.iter().enumerate() {
        check_tree(s, opts.max_context)
            .map_err(|e| ModelError::Step(format!("sequence {i}: {e}")))?;
    }
    Ok(())
}

/// A step's tree and KV moves are well formed: parents before their children, a tree of at
/// most `TREE_ROWS_MAX` rows on a verified span, moves to positions the sequence holds from
/// positions inside the context.
fn check_tree(s: &SeqStep, max_context: usize) -> Result<(), String> {
    let n = s.tokens.len();
    if !s.parents.is_empty() {
        if !s.verify || s.parents.len() != n || n > TREE_ROWS_MAX {
            return Err(format!(
                "a tree of {} parents on {n} tokens (verify {}); a verified span of at most {TREE_ROWS_MAX} rows takes one parent a token",
                s.parents.len(),
                s.verify
            ));
        }
        let ok =
            |(i, &p): (usize, &u16)| (i == 0) == (p == TREE_ROOT) && (i == 0 || (p as usize) < i);
        if let Some((i, p)) = s.parents.iter().enumerate().find(|&x| !ok(x)) {
            return Err(format!(
                "tree row {i} has parent {p}: the first row is the root, every other's parent comes before it"
            ));
        }
    }
    let bad = |m: &&(u32, u32)| m.0 as usize >= max_context || m.1 as usize >= s.pos;
    if let Some(m) = s.kv_moves.iter().find(bad) {
        return Err(format!(
            "KV move {} -> {}: the sequence holds {} positions of a context of {max_context}",
            m.0, m.1, s.pos
        ));
    }
    Ok(())
}

/// A step's token-tree rows: per batch row, its ancestors in its tree (0: a causal row;
/// empty when the step has no tree: `AttnStep::ancestors`), and the KV moves of the
/// sequences that accepted a path of their last tree.
#[derive(Default)]
pub(super) struct TreeRows {
    pub(super) ancestors: Vec<u64>,
    /// Per sequence with moves: its slot and its range of `pairs` (from, to).
    moves: Vec<(usize, Range<usize>)>,
    pairs: Vec<(u32, u32)>,
}

impl TreeRows {
    pub(super) fn clear(&mut self) {
        self.ancestors.clear();
        self.moves.clear();
        self.pairs.clear();
    }

    /// The next span, sequence `s`'s: its rows' positions into `positions` (a tree row's
    /// is its root's plus its depth), its rows' ancestors (where `trees`: the step has a
    /// tree), and its KV moves.
    pub(super) fn push(&mut self, s: &SeqStep, trees: bool, positions: &mut Vec<u32>) {
        if s.parents.is_empty() {
            positions.extend((s.pos..s.pos + s.tokens.len()).map(|p| p as u32));
            if trees {
                self.ancestors
                    .resize(self.ancestors.len() + s.tokens.len(), 0);
            }
        } else {
            // A node's ancestors are its parent's and itself; its depth their count less
            // one.
            let first = self.ancestors.len();
            for (t, &parent) in s.parents.iter().enumerate() {
                let up = match parent {
                    TREE_ROOT => 0,
                    p => self.ancestors[first + p as usize],
                };
                let a = up | 1 << t;
                self.ancestors.push(a);
                positions.push((s.pos + a.count_ones() as usize - 1) as u32);
            }
        }
        if !s.kv_moves.is_empty() {
            let at = self.pairs.len();
            self.pairs.extend_from_slice(&s.kv_moves);
            self.moves.push((s.slot, at..self.pairs.len()));
        }
    }

    /// Makes the step's KV moves in the layer of `step`, before it writes its new rows.
    pub(super) fn move_kv<B: Backend>(
        &self,
        b: &B,
        (cache_k, cache_v): (&mut B::Mem, &mut B::Mem),
        step: &AttnStep<'_>,
    ) {
        for (slot, at) in &self.moves {
            b.kv_move(cache_k, cache_v, step, *slot, &self.pairs[at.clone()]);
        }
    }
}
