//! Building a pass's step from the running sequences, for `sluiced run` and the scheduler
//! alike: every decoding sequence's token first (decode rows lead the batch), each with
//! the drafts the row budget pays for (`RowBudget`, weighed by the passes it has seen),
//! then prefill chunks in the token budget that is left.

use super::draft::{DraftAsk, RowBudget};
use super::sequence::Sequence;
use crate::model::{ModelOptions, SeqStep};
use crate::pipeline::PassStats;

/// The step under construction and what drafting learned from earlier passes. Its lists
/// keep their capacity, so building a step allocates nothing after the first.
#[derive(Default)]
pub struct StepBuilder {
    rows: RowBudget,
    asks: Vec<DraftAsk>,
    /// The sequence of each ask.
    askers: Vec<usize>,
    allotted: Vec<usize>,
}

impl StepBuilder {
    /// `serial`: the compute shares the cores that read and decompress the streamed layers
    /// (the CPU backend; `RowBudget::serial`).
    pub fn new(serial: bool) -> StepBuilder {
        let mut b = StepBuilder::default();
        b.rows.serial = serial;
        b
    }

    /// Fills the first entries of `steps` (grown as needed) with the next pass over the `n`
    /// sequences `seq(0..n)`, and `owner` with the sequence of each; returns how many.
    pub fn build<'a>(
        &mut self,
        n: usize,
        seq: impl Fn(usize) -> &'a Sequence,
        opts: &ModelOptions,
        steps: &mut Vec<SeqStep>,
        owner: &mut Vec<usize>,
    ) -> usize {
        let mut left = opts.max_batch_tokens;
        self.asks.clear();
        self.askers.clear();
        for i in 0..n {
            if let Some(a) = seq(i).draft_ask() {
                self.asks.push(a);
                self.askers.push(i);
            }
        }
        let decoding = (0..n).filter(|&i| seq(i).is_decoding()).count();
        let cap = opts.verify_rows.min(left.saturating_sub(decoding));
        let askers = &self.askers;
        let chance = |a: usize, k: usize| seq(askers[a]).draft_chance(k);
        self.rows
            .allot(&self.asks, (decoding, cap), chance, &mut self.allotted);
        let mut ask = 0;
        owner.clear();
        for decoding in [true, false] {
            for i in 0..n {
                let s = seq(i);
                if s.is_decoding() != decoding {
                    continue;
                }
                let most = match s.draft_ask() {
                    Some(_) => {
                        ask += 1;
                        left.min(1 + self.allotted[ask - 1])
                    }
                    None => left,
                };
                if owner.len() == steps.len() {
                    steps.push(SeqStep::default());
                }
                if s.fill_step(most, &mut steps[owner.len()]) {
                    left -= steps[owner.len()].tokens.len();
                    owner.push(i);
                }
            }
        }
        owner.len()
    }

    /// The pass of `steps` ran as `pass` says: its compute against its rows, and its wait
    /// for loads, for the row budget of the next steps.
    pub fn ran(&mut self, steps: &[SeqStep], pass: &PassStats) {
        let rows = steps.iter().map(|s| s.tokens.len()).sum();
        self.rows.observe(rows, pass.compute_s, pass.load_stall_s);
    }
}
