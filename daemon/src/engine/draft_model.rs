//! Drafting with a model: a second, smaller (or more quantized) model of the same
//! vocabulary, kept whole in memory, proposes each decoding sequence's next tokens by its
//! own greedy decoding; the target then verifies them as it verifies any proposal
//! (`Sequence::advance`), so outputs stay exactly the target's.
//!
//! The draft runs on the same backend as the target, in the same KV slots (its own cache,
//! one slot per target slot). Each sequence remembers the tokens the draft's cache holds
//! (`SeqDraft::fed`); before a step, the part of the sequence's text the draft has not seen
//! (the prompt the first time, then the tokens the last verification accepted and the one
//! it sampled) runs in one batched pass for every drafting sequence at once (prefill
//! chunks within the draft's token budget), then one decode pass per further draft token.
//! A rejected draft token leaves its K and V in the draft's cache past the accepted text;
//! the next catch-up writes over them from the first position that differs, and no query
//! reads past its own position (the target's verified rows work the same way).

use super::sequence::Sequence;
use super::EngineError;
use crate::backend::Backend;
use crate::model::SeqStep;
use crate::pipeline::{Pipeline, SelfDraft};
use crate::text::Tokenizer;
use std::time::Instant;

/// What runs a draft's passes: a pipeline of its own, or a self-draft on the model's
/// pipeline (`pipeline::SelfDraft`).
enum Runner<B: Backend> {
    Model(Box<Pipeline<B>>),
    SelfDraft(Box<SelfDraft<B>>),
}

/// A draft model's pipeline and the buffers of its passes (kept between steps).
pub struct DraftModel<B: Backend> {
    runner: Runner<B>,
    steps: Vec<SeqStep>,
    /// The sequence (index into the caller's list) of each step.
    owner: Vec<usize>,
    logits: Vec<f32>,
    /// Wall time spent drafting, since the start.
    pub seconds: f64,
    /// Draft passes run, since the start.
    pub passes: u64,
}

/// Why a store cannot draft for a model: its vocabulary differs (the first token that
/// does, or the sizes).
pub fn vocab_mismatch(target: &Tokenizer, draft: &Tokenizer) -> Option<String> {
    if target.vocab() != draft.vocab() {
        return Some(format!(
            "its vocabulary has {} tokens and the model's {}",
            draft.vocab(),
            target.vocab()
        ));
    }
    (0..target.vocab())
        .find(|&i| target.token_bytes(i) != draft.token_bytes(i))
        .map(|i| {
            format!(
                "token {i} is {:?} in the model and {:?} in the draft",
                target.piece(i),
                draft.piece(i)
            )
        })
}

/// The draft model of `store` on the backend `make` builds for, planned within `input`'s
/// budgets (its options as the target's, without verify rows) and whole: a draft that
/// would stream is refused, since every drafted token would cost a pass of reads.
pub fn build_draft<B: Backend>(
    make: &super::MakePipeline<B>,
    store: &std::sync::Arc<crate::store::Store>,
    input: &crate::plan::PlanInput,
) -> Result<DraftModel<B>, EngineError> {
    let runner = make(store, &draft_input(input))?;
    resident(store, &runner.plan).map_err(EngineError::Invalid)?;
    Ok(DraftModel::new(runner))
}

/// A draft model built first, and `input` with its bytes out of the budgets: the room
/// the model's placement is chosen in (`--placement auto`, whose passes measure the
/// model beside the draft). A self-draft lives in the model's own pipeline, which a
/// choice of placement would change under it: refused.
pub fn draft_first<B: Backend>(
    make: &super::MakePipeline<B>,
    draft: Option<&DraftSource>,
    input: &crate::plan::PlanInput,
) -> Result<(Option<DraftModel<B>>, crate::plan::PlanInput), EngineError> {
    match draft {
        None => Ok((None, input.clone())),
        Some(DraftSource::Model(ds)) => {
            let d = build_draft(make, ds, input)?;
            let mut room = input.clone();
            if let Some(p) = d.plan() {
                leave_room(&mut room, p);
            }
            Ok((Some(d), room))
        }
        Some(DraftSource::SelfDraft(_)) => Err(EngineError::Invalid(
            "placement auto with a self-draft is not supported yet (the self-draft shares the layers auto would move): give cpu_layers, or a draft model".into(),
        )),
    }
}

/// Where a model's draft comes from: a store of its own, loaded whole beside the model, or
/// the model's units quantized (`self_draft::quantized_store`), run as a self-draft on the
/// model's own pipeline.
pub enum DraftSource {
    Model(std::sync::Arc<crate::store::Store>),
    SelfDraft(std::sync::Arc<crate::store::Store>),
}

/// Plans a manifest's memory on the backend a `MakePipeline` builds for, without building.
pub type PlanFn<'a> = dyn Fn(&crate::store::Manifest, &crate::plan::PlanInput) -> Result<crate::plan::Plan, EngineError>
    + 'a;

/// The model's pipeline on `store` and its draft from `draft`: a draft model planned first
/// and whole, its bytes out of the model's budgets (`leave_room`); a self-draft reserved in
/// the model's own memory (`self_draft::plan_room`) and built on its pipeline.
pub fn with_draft<B: Backend>(
    make: &super::MakePipeline<B>,
    plan: &PlanFn,
    store: &std::sync::Arc<crate::store::Store>,
    draft: Option<&DraftSource>,
    input: &crate::plan::PlanInput,
) -> Result<(Pipeline<B>, Option<DraftModel<B>>), EngineError> {
    match draft {
        None => Ok((make(store, input)?, None)),
        Some(DraftSource::Model(ds)) => {
            let d = build_draft(make, ds, input)?;
            let mut input = input.clone();
            if let Some(p) = d.plan() {
                leave_room(&mut input, p);
            }
            Ok((make(store, &input)?, Some(d)))
        }
        Some(DraftSource::SelfDraft(q)) => {
            let m = store.manifest();
            let (room, _) = super::self_draft::plan_room(&|i| plan(m, i), q.manifest(), input)?;
            let runner = make(store, &room)?;
            let d = runner.self_draft(q.clone(), draft_input(input).opts)?;
            Ok((runner, Some(DraftModel::new_self(d))))
        }
    }
}

/// The plan `with_draft` makes for the model, made without building anything.
pub fn plan_with_draft(
    plan: &PlanFn,
    m: &crate::store::Manifest,
    draft: Option<&DraftSource>,
    input: &crate::plan::PlanInput,
) -> Result<crate::plan::Plan, EngineError> {
    match draft {
        None => plan(m, input),
        Some(DraftSource::Model(ds)) => {
            let dp = plan(ds.manifest(), &draft_input(input))?;
            resident(ds, &dp).map_err(EngineError::Invalid)?;
            let mut input = input.clone();
            leave_room(&mut input, &dp);
            plan(m, &input)
        }
        Some(DraftSource::SelfDraft(q)) => {
            Ok(super::self_draft::plan_room(&|i| plan(m, i), q.manifest(), input)?.1)
        }
    }
}

/// Refuses a draft whose plan streams: every drafted token would cost a pass of reads.
pub fn resident(store: &crate::store::Store, plan: &crate::plan::Plan) -> Result<(), String> {
    let streamed = plan.layers_streamed();
    if streamed == 0 {
        return Ok(());
    }
    Err(format!(
        "draft {}: it would stream {streamed} of its {} units within this memory; a draft must be resident: give more memory (--host-memory, --device-memory) or a smaller draft (sluiced pack --quantize)",
        store.dir().display(),
        plan.units.len()
    ))
}

/// A draft's plan input beside a target planned with `input`: the same options and
/// budgets, without verify rows, an expert profile or layers computed on the host or
/// other devices.
pub fn draft_input(input: &crate::plan::PlanInput) -> crate::plan::PlanInput {
    let mut di = input.clone();
    di.opts.verify_rows = 0;
    di.expert_profile = None;
    // The target's layers computed on the host or other devices are its own placement:
    // the draft stays whole on the first device.
    di.host.cpu_layers = 0;
    di.host.devices.clear();
    di.host.split.clear();
    di
}

/// `input` with what a draft's plan holds taken out of its host and device budgets.
pub fn leave_room(input: &mut crate::plan::PlanInput, draft: &crate::plan::Plan) {
    let host = draft
        .host
        .total_bytes
        .saturating_sub(draft.host.overhead_bytes);
    input.host.budget = input.host.budget.map(|b| b.saturating_sub(host));
    input.device_budget = input
        .device_budget
        .map(|b| b.saturating_sub(draft.device_bytes()));
}

/// Where the draft of one sequence stands in a `propose` call.
struct Drafting {
    /// Index of the sequence in the caller's list.
    seq: usize,
    /// Tokens of its text the draft has yet to run.
    todo: Vec<u32>,
    /// Tokens it is to propose.
    want: usize,
    /// Its text's length: where the chain's first drafted token runs.
    base: usize,
    /// The tokens drafted on after the likeliest branch's first (`extend_branch`).
    ext: Vec<u32>,
    /// Branches its tree may have, and the candidates: (the chain node it is an
    /// alternative to, its token, the draft's probability of it, its share of what the
    /// chain's token leaves).
    branches: usize,
    alts: Vec<(usize, u32, f32, f32)>,
}

/// A draft's runner-up below this probability is no branch.
const BRANCH_MIN_P: f32 = 0.05;

impl Drafting {
    /// The next token of the chain from the draft's row, its runner-up kept as a
    /// candidate branch when the tree has room for branches.
    fn next(&mut self, proposal: &mut super::draft::Proposal, row: &[f32]) {
        let (best, second) = top2(row);
        if self.branches > 0 && second != best {
            // Their probabilities, only where the tree may branch: the row's softmax from
            // the logits within 20 of the best (each of the rest weighs under e^-20: a
            // 262k vocabulary of them moves the sum by 5e-4 at most).
            let m = row[best as usize];
            let sum: f32 = row
                .iter()
                .filter(|&&v| v > m - 20.0)
                .map(|&v| (v - m).exp())
                .sum();
            let (p1, p2) = (1.0 / sum, (row[second as usize] - m).exp() / sum);
            if p2 >= BRANCH_MIN_P && p1 < 1.0 {
                let share = (p2 / (1.0 - p1)).min(1.0);
                self.alts.push((proposal.len(), second, p2, share));
            }
        }
        proposal.tokens.push(best);
    }

    /// Ranks the candidate branches of a chain of `chain` nodes, the likeliest first
    /// (shallower on equal odds).
    fn rank(&mut self, chain: usize) {
        self.alts.retain(|a| a.0 < chain);
        self.alts
            .sort_by(|x, y| y.2.total_cmp(&x.2).then(x.0.cmp(&y.0)));
    }

    /// Tokens drafted on after the likeliest branch's first: up to half the chain's
    /// length in all, as ngram's branches (the rows `DraftConfig::rows` plans).
    fn ext_max(&self) -> usize {
        if self.branches == 0 || self.alts.is_empty() {
            return 0;
        }
        (self.want / 2).saturating_sub(1)
    }

    /// The best candidates as branches of the chain (`rank`), each beside the chain node
    /// it is an alternative to; the likeliest goes on with the tokens drafted after it.
    fn branch(&mut self, proposal: &mut super::draft::Proposal) {
        use super::draft::{FROM_PENDING, MAIN_LINE};
        self.rank(proposal.len());
        for (i, &(k, token, _, share)) in self.alts.iter().take(self.branches).enumerate() {
            let parent = if k == 0 { FROM_PENDING } else { (k - 1) as u16 };
            proposal.push(token, parent, share);
            if i == 0 {
                for &t in &self.ext {
                    proposal.push(t, (proposal.len() - 1) as u16, MAIN_LINE);
                }
            }
        }
    }
}

/// The tokens of the two largest logits of a row, the first of equals first (the runner-up
/// is the token itself for a row of one).
fn top2(row: &[f32]) -> (u32, u32) {
    let (mut a, mut b) = (0usize, usize::MAX);
    for (i, &v) in row.iter().enumerate().skip(1) {
        if v > row[a] {
            (a, b) = (i, a);
        } else if b == usize::MAX || v > row[b] {
            b = i;
        }
    }
    (a as u32, if b == usize::MAX { a } else { b } as u32)
}

impl<B: Backend> DraftModel<B> {
    /// A draft on `runner`, whose options (slots, context) match the target's and which
    /// keeps every unit resident.
    pub fn new(runner: Pipeline<B>) -> DraftModel<B> {
        Self::on(Runner::Model(Box::new(runner)))
    }

    /// The self-draft `d` of the model whose pipeline each call passes.
    pub fn new_self(d: SelfDraft<B>) -> DraftModel<B> {
        Self::on(Runner::SelfDraft(Box::new(d)))
    }

    fn on(runner: Runner<B>) -> DraftModel<B> {
        DraftModel {
            runner,
            steps: Vec::new(),
            owner: Vec::new(),
            logits: Vec::new(),
            seconds: 0.0,
            passes: 0,
        }
    }

    /// The draft's own plan: a separate draft model's (None for a self-draft, whose
    /// memory is in the model's plan).
    pub fn plan(&self) -> Option<&crate::plan::Plan> {
        match &self.runner {
            Runner::Model(p) => Some(&p.plan),
            Runner::SelfDraft(_) => None,
        }
    }

    /// What the draft is and holds, for the start-up log.
    pub fn describe(&self) -> String {
        match &self.runner {
            Runner::Model(p) => format!("draft model {}:\n{}", p.store.dir().display(), p.plan.table()),
            Runner::SelfDraft(d) => format!(
                "self-draft {}: {} units shared with the model, {} units from its quantized copy; {} in the model's memory\n",
                d.store.dir().display(),
                d.shared_units,
                d.store.units().len() - d.shared_units,
                crate::util::fmt_bytes(d.bytes),
            ),
        }
    }

    /// Gives back the memory of `slot`'s draft KV cache, whose sequence is over (`target`:
    /// the model's pipeline, a self-draft's backend).
    pub fn discard_slot(&mut self, target: &Pipeline<B>, slot: usize) {
        match &mut self.runner {
            Runner::Model(p) => {
                p.discard_slot(slot);
            }
            Runner::SelfDraft(d) => {
                d.discard_slot(&target.backend, slot);
            }
        }
    }

    /// Fills the proposal of every sequence of `seqs` that drafts with a model and asks for
    /// tokens (`Sequence::model_draft`): the draft catches up on its text, then decodes
    /// greedily, every sequence in the same passes.
    pub fn propose<S: AsMut<Sequence>>(
        &mut self,
        target: &mut Pipeline<B>,
        seqs: &mut [S],
    ) -> Result<(), EngineError> {
        let t0 = Instant::now();
        let mut active = Self::asking(seqs);
        self.catch_up(target, seqs, &mut active)?;
        self.decode(target, seqs, &mut active)?;
        self.seconds += t0.elapsed().as_secs_f64();
        Ok(())
    }

    /// The sequences that ask for drafts, each with the text its draft cache lacks (its
    /// record of the cache cut back to where it agrees with the text).
    fn asking<S: AsMut<Sequence>>(seqs: &mut [S]) -> Vec<Drafting> {
        let mut active: Vec<Drafting> = Vec::new();
        for (i, s) in seqs.iter_mut().enumerate() {
            let Some(d) = s.as_mut().model_draft() else {
                continue;
            };
            if d.want == 0 {
                continue;
            }
            let same = d
                .draft
                .fed
                .iter()
                .zip(d.text())
                .take_while(|(a, b)| **a == *b)
                .count();
            d.draft.fed.truncate(same);
            active.push(Drafting {
                seq: i,
                todo: d.text().skip(same).collect(),
                want: d.want,
                base: d.text().count(),
                ext: Vec::new(),
                branches: d.draft.branches(),
                alts: Vec::new(),
            });
        }
        active
    }

    /// Catch-up passes: each sequence's unseen text in chunks; the pass that runs a
    /// sequence's last unseen token gives its first draft.
    fn catch_up<S: AsMut<Sequence>>(
        &mut self,
        target: &mut Pipeline<B>,
        seqs: &mut [S],
        active: &mut [Drafting],
    ) -> Result<(), EngineError> {
        let max_tokens = match &self.runner {
            Runner::Model(p) => p.options().max_batch_tokens,
            Runner::SelfDraft(d) => d.options().max_batch_tokens,
        };
        while active.iter().any(|a| !a.todo.is_empty()) {
            let mut left = max_tokens;
            self.steps.clear();
            self.owner.clear();
            for (k, a) in active.iter().enumerate() {
                if a.todo.is_empty() || left == 0 {
                    continue;
                }
                let Some(d) = seqs[a.seq].as_mut().model_draft() else {
                    continue;
                };
                let n = a.todo.len().min(left);
                left -= n;
                self.steps.push(SeqStep {
                    tokens: a.todo[..n].to_vec(),
                    slot: d.slot,
                    pos: d.draft.fed.len(),
                    verify: false,
                    ..Default::default()
                });
                self.owner.push(k);
            }
            if self.steps.is_empty() {
                break;
            }
            self.pass(target)?;
            for (row, (k, step)) in self.owner.iter().zip(&self.steps).enumerate() {
                let a = &mut active[*k];
                let Some(d) = seqs[a.seq].as_mut().model_draft() else {
                    continue;
                };
                d.draft.fed.extend_from_slice(&step.tokens);
                a.todo.drain(..step.tokens.len());
                if a.todo.is_empty() {
                    a.next(
                        &mut d.draft.proposal,
                        logit_row(&self.logits, self.steps.len(), row),
                    );
                }
            }
        }
        Ok(())
    }

    /// Decode passes: each runs every sequence's last draft token and proposes its next;
    /// then each tree's branches.
    fn decode<S: AsMut<Sequence>>(
        &mut self,
        target: &mut Pipeline<B>,
        seqs: &mut [S],
        active: &mut [Drafting],
    ) -> Result<(), EngineError> {
        loop {
            self.steps.clear();
            self.owner.clear();
            for (k, a) in active.iter().enumerate() {
                let Some(d) = seqs[a.seq].as_mut().model_draft() else {
                    continue;
                };
                let Some(&last) = d.draft.proposal.tokens.last() else {
                    continue;
                };
                if d.draft.proposal.len() >= a.want {
                    continue;
                }
                self.steps.push(SeqStep {
                    tokens: vec![last],
                    slot: d.slot,
                    pos: d.draft.fed.len(),
                    verify: false,
                    ..Default::default()
                });
                self.owner.push(k);
            }
            if self.steps.is_empty() {
                break;
            }
            self.pass(target)?;
            for (row, (k, step)) in self.owner.iter().zip(&self.steps).enumerate() {
                let a = &mut active[*k];
                let Some(d) = seqs[a.seq].as_mut().model_draft() else {
                    continue;
                };
                d.draft.fed.extend_from_slice(&step.tokens);
                a.next(
                    &mut d.draft.proposal,
                    logit_row(&self.logits, self.steps.len(), row),
                );
            }
        }
        self.extend_branch(target, seqs, active)?;
        for a in active.iter_mut().filter(|a| a.branches > 0) {
            if let Some(d) = seqs[a.seq].as_mut().model_draft() {
                a.branch(&mut d.draft.proposal);
                d.draft.proposal.fit(d.draft.rows_room);
            }
        }
        Ok(())
    }

    /// Drafts on along each tree's likeliest branch, every sequence in the same passes:
    /// the branch's first token runs where the chain node it is an alternative to ran, so
    /// the draft's cache then holds the branch, and its record (`SeqDraft::fed`) says so;
    /// the next catch-up goes back to the text from where they differ.
    fn extend_branch<S: AsMut<Sequence>>(
        &mut self,
        target: &mut Pipeline<B>,
        seqs: &mut [S],
        active: &mut [Drafting],
    ) -> Result<(), EngineError> {
        for a in active.iter_mut().filter(|a| a.branches > 0) {
            if let Some(d) = seqs[a.seq].as_mut().model_draft() {
                a.rank(d.draft.proposal.len());
            }
        }
        loop {
            self.steps.clear();
            self.owner.clear();
            for (k, a) in active.iter().enumerate() {
                let Some(&(node, first, _, _)) = a.alts.first() else {
                    continue;
                };
                if a.ext.len() >= a.ext_max() {
                    continue;
                }
                let Some(d) = seqs[a.seq].as_mut().model_draft() else {
                    continue;
                };
                self.steps.push(SeqStep {
                    tokens: vec![a.ext.last().copied().unwrap_or(first)],
                    slot: d.slot,
                    pos: a.base + node + a.ext.len(),
                    verify: false,
                    ..Default::default()
                });
                self.owner.push(k);
            }
            if self.steps.is_empty() {
                return Ok(());
            }
            self.pass(target)?;
            for (row, (k, step)) in self.owner.iter().zip(&self.steps).enumerate() {
                let a = &mut active[*k];
                let Some(d) = seqs[a.seq].as_mut().model_draft() else {
                    continue;
                };
                d.draft.fed.truncate(step.pos);
                d.draft.fed.extend_from_slice(&step.tokens);
                let (best, _) = top2(logit_row(&self.logits, self.steps.len(), row));
                a.ext.push(best);
            }
        }
    }

    fn pass(&mut self, target: &mut Pipeline<B>) -> Result<(), EngineError> {
        match &mut self.runner {
            Runner::Model(p) => p.step(&self.steps, &mut self.logits)?,
            Runner::SelfDraft(d) => target.self_draft_step(d, &self.steps, &mut self.logits)?,
        }
        self.passes += 1;
        Ok(())
    }
}

/// Row `row` of `logits`, rows of `rows`.
fn logit_row(logits: &[f32], rows: usize, row: usize) -> &[f32] {
    let vocab = logits.len() / rows;
    &logits[row * vocab..(row + 1) * vocab]
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::draft::{Proposal, FROM_PENDING, MAIN_LINE};

    fn drafting(branches: usize) -> Drafting {
        Drafting {
            seq: 0,
            todo: Vec::new(),
            want: 8,
            base: 10,
            ext: Vec::new(),
            branches,
            alts: Vec::new(),
        }
    }

    /// The likeliest branch goes on with the tokens drafted after it, the others stay
    /// leaves; parents come before their children.
    #[test]
    fn the_likeliest_branch_goes_on_and_the_others_are_leaves() {
        let mut p = Proposal {
            tokens: vec![1, 2, 3, 1],
            ..Proposal::default()
        };
        let mut d = drafting(2);
        // Alternatives to chain nodes 2 (likeliest) and 0.
        d.alts = vec![(0, 7, 0.1, 0.3), (2, 9, 0.3, 0.6)];
        d.ext = vec![5, 6];
        d.branch(&mut p);
        assert_eq!(p.tokens, vec![1, 2, 3, 1, 9, 5, 6, 7]);
        assert_eq!(
            p.parents,
            vec![FROM_PENDING, 0, 1, 2, 1, 4, 5, FROM_PENDING]
        );
        assert_eq!(p.edges[4..], [0.6, MAIN_LINE, MAIN_LINE, 0.3]);
        assert_eq!(d.ext_max(), 3, "half the chain's length in all");
    }
}
