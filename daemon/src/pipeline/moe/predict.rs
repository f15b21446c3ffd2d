//! Expert prediction: the experts each streamed sparse layer is predicted to route to
//! before it routes (the router lookahead's or the previous step's choices), and how each
//! predictor has fared so far, which decides whether its predictions are read ahead.

use crate::model::moe::{PredictionScore, PredictionStats};

/// How a layer's experts are predicted before it routes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Prediction {
    /// The next layer's router on this layer's hidden state (after its attention), where
    /// the next layer's dense part is resident, or on a unified backend is the next load
    /// (taken early); elsewhere, the previous step's choices.
    #[default]
    Lookahead,
    /// The previous step's choices at the layer.
    Previous,
    /// None: experts are read once routed.
    Off,
}

impl std::str::FromStr for Prediction {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "lookahead" => Ok(Prediction::Lookahead),
            "previous" => Ok(Prediction::Previous),
            "off" => Ok(Prediction::Off),
            _ => Err(format!("{s:?}: expected lookahead, previous or off")),
        }
    }
}

/// Predictions made before their precision decides whether they are requested.
const PREDICTION_WARMUP: u64 = 64;

/// The experts predicted for each unit before it routes, and how each predictor fared at
/// the streamed layers (one `PredictionScore` each, the decoder's type).
pub(super) struct Predictor {
    pub(super) mode: Prediction,
    /// Per unit, the experts predicted for it this step (before it routed), the pass
    /// that predicted them last, and whether the router lookahead made the prediction.
    predicted: Vec<Vec<u32>>,
    predicted_pass: Vec<u64>,
    by_lookahead: Vec<bool>,
    /// Passes begun (numbers the predictions).
    pass_no: u64,
    scores: PredictionStats,
}

impl Predictor {
    pub(super) fn new(units: usize, mode: Prediction) -> Self {
        Predictor {
            mode,
            predicted: vec![Vec::new(); units],
            predicted_pass: vec![0; units],
            by_lookahead: vec![false; units],
            pass_no: 0,
            scores: PredictionStats::default(),
        }
    }

    pub(super) fn begin_pass(&mut self) {
        self.pass_no += 1;
    }

    /// Whether the router lookahead is to predict unit `n` (it is the mode, and nothing
    /// has predicted `n` this pass).
    pub(super) fn lookahead_wanted(&self, n: usize) -> bool {
        self.mode == Prediction::Lookahead
            && self
                .predicted_pass
                .get(n)
                .is_some_and(|&p| p != self.pass_no)
    }

    /// The router lookahead's `experts` as unit `n`'s prediction this pass: whether it is
    /// to be requested.
    pub(super) fn set_lookahead(&mut self, n: usize, experts: &[u32]) -> bool {
        self.predicted_pass[n] = self.pass_no;
        let p = &mut self.predicted[n];
        p.clear();
        p.extend_from_slice(experts);
        self.by_lookahead[n] = true;
        self.pays(&self.scores.lookahead)
    }

    /// The previous step's choices `experts` as unit `u`'s prediction, once per pass:
    /// None when `u` was already predicted this pass, else whether to request it (never
    /// with prediction off, which predicts nothing).
    pub(super) fn set_previous(&mut self, u: usize, experts: &[u32]) -> Option<bool> {
        if self.predicted_pass[u] == self.pass_no {
            return None;
        }
        self.predicted_pass[u] = self.pass_no;
        let p = &mut self.predicted[u];
        p.clear();
        if self.mode == Prediction::Off {
            return Some(false);
        }
        p.extend_from_slice(experts);
        self.by_lookahead[u] = false;
        Some(self.pays(&self.scores.previous))
    }

    /// Scores unit `u`'s prediction against its routing `routed` (ascending), for the
    /// predictor that made it: (predicted, right).
    pub(super) fn score(&mut self, u: usize, routed: &[u32]) -> (u64, u64) {
        let pred = &self.predicted[u];
        let chosen = |e: &u32| routed.binary_search(e).is_ok();
        let score = self.scores.by(self.by_lookahead[u]);
        let right = score.add(pred, chosen, routed.len() as u64);
        (pred.len() as u64, right)
    }

    /// Unit `u`'s prediction, taken out while it is requested (`put` it back).
    pub(super) fn take(&mut self, u: usize) -> Vec<u32> {
        std::mem::take(&mut self.predicted[u])
    }

    pub(super) fn put(&mut self, u: usize, p: Vec<u32>) {
        self.predicted[u] = p;
    }

    /// Whether a predictor scored `s` has its predictions requested: a wrong one costs a
    /// read the disk could have spent on a routed expert, so only while at least half of
    /// its predictions so far were right (after PREDICTION_WARMUP of them; they are
    /// counted either way).
    fn pays(&self, s: &PredictionScore) -> bool {
        s.predicted < PREDICTION_WARMUP || 2 * s.right >= s.predicted
    }
}
