//! A mixture of experts' routing, on the host: each row's router logits to its top-k
//! experts and their weights, then the whole step's choices grouped by expert, so each
//! chosen expert runs once for every row routed to it (expert-major: what a streamed
//! expert is fetched for is the union of the batch's choices).
//!
//! As transformers (`Qwen3MoeSparseMoeBlock`, `MixtralSparseMoeBlock`) and llama.cpp
//! (`build_moe_ffn` with softmax gating): softmax over every expert in f32, the k most
//! probable (ties to the lower expert index), renormalized to sum to 1 when the model
//! says so; a row's output is the sum over its experts in ascending expert order of
//! weight x expert(row), from zero. gpt-oss (`GptOssTopKRouter`, llama.cpp's
//! `SOFTMAX_WEIGHT` gating): the k largest logits, then softmax over those k.

use crate::backend::{Backend, ExpertCall, RouteGating};
use crate::store::arch::{ArchConfig, Gating, MoeConfig};

/// How one predictor of a mixture's routing fared: the experts it predicted, how many of
/// those the routing then chose, and the experts routed at the layers it predicted for
/// (precision = right / predicted, recall = right / routed).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PredictionScore {
    pub predicted: u64,
    pub right: u64,
    pub routed: u64,
}

impl PredictionScore {
    /// Scores prediction `predicted` against a layer's routing: `chosen` says whether it
    /// routed to an expert, `routed` how many it routed to. Returns how many were right.
    pub fn add(&mut self, predicted: &[u32], chosen: impl Fn(&u32) -> bool, routed: u64) -> u64 {
        let right = predicted.iter().filter(|e| chosen(e)).count() as u64;
        self.predicted += predicted.len() as u64;
        self.right += right;
        self.routed += routed;
        right
    }
}

/// How well a layer's experts are predicted before it routes, by two predictors: the
/// previous step's choices at the layer, and the layer's router applied to the hidden
/// state entering the layer before (the router lookahead; scored only where it ran).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PredictionStats {
    pub previous: PredictionScore,
    pub lookahead: PredictionScore,
}

impl PredictionStats {
    /// The lookahead's score, or the previous step's choices'.
    pub fn by(&mut self, lookahead: bool) -> &mut PredictionScore {
        if lookahead {
            &mut self.lookahead
        } else {
            &mut self.previous
        }
    }
}

/// A mixture's routing state in the decoder, across steps (every list empty for a dense
/// model, a layer's for a dense layer).
pub(super) struct Mixture {
    /// The router logits on the host, and the step's routing.
    pub router_logits: Vec<f32>,
    pub routes: Option<Routes>,
    /// Per decoder layer, tokens routed to each expert since the start.
    pub expert_tokens: Vec<Vec<u64>>,
    /// Per decoder layer, the experts its last routing chose (ascending).
    pub last_routed: Vec<Vec<u32>>,
    /// Per decoder layer, the experts the router lookahead predicted for this step
    /// (`Decoder::lookahead_route`), its routing, and how both predictors fared.
    pub lookahead: Vec<Vec<u32>>,
    pub lookahead_routes: Option<Routes>,
    pub prediction: PredictionStats,
    /// The allocations of the expert call lists (decode, prefill), kept empty between
    /// layers (`recycle`) so a step allocates nothing.
    pub expert_calls: (Vec<ExpertCall<'static, ()>>, Vec<ExpertCall<'static, ()>>),
}

impl Mixture {
    /// The state of model `c`, for steps of at most `tokens` rows.
    pub fn new(c: &ArchConfig, tokens: usize) -> Mixture {
        let layers = c.n_layers as usize;
        let n = c.moe.as_ref().map_or(0, |m| m.n_experts as usize);
        let routes = || c.moe.as_ref().map(|m| Routes::with_capacity(m, tokens));
        Mixture {
            router_logits: Vec::with_capacity(tokens * n),
            routes: routes(),
            expert_tokens: (0..c.n_layers)
                .map(|i| {
                    if c.is_sparse(i) {
                        vec![0; n]
                    } else {
                        Vec::new()
                    }
                })
                .collect(),
            last_routed: vec![Vec::new(); layers],
            lookahead: vec![Vec::new(); layers],
            lookahead_routes: routes(),
            prediction: PredictionStats::default(),
            expert_calls: (Vec::with_capacity(n), Vec::with_capacity(n)),
        }
    }
}

/// Routes `rows` rows of a mixture's router logits (on the device, in `logits`): the
/// backend's own top-k where it has one, else on the host from the logits downloaded into
/// `host`.
pub(super) fn route_rows<B: Backend>(
    b: &B,
    c: &ArchConfig,
    logits: &B::Mem,
    rows: usize,
    host: &mut Vec<f32>,
    routes: &mut Routes,
) {
    let moe = c.moe.as_ref().expect("a mixture's layer has its config");
    let (n, k) = (moe.n_experts as usize, moe.top_k as usize);
    let gating = c.arch.recipe().gating;
    let on_device = match gating {
        Gating::SoftmaxTopK => RouteGating::SoftmaxTopK {
            norm: moe.norm_topk_prob,
        },
        Gating::TopKSoftmax => RouteGating::TopKSoftmax,
    };
    if b.route_top_k(logits, (rows, n, k), on_device, routes.chosen_mut()) {
        routes.group(moe);
    } else {
        host.resize(rows * n, 0.0);
        b.download_f32(logits, 0, host);
        routes.route(moe, gating, host, rows);
    }
}

/// One step's routing, grouped by expert: expert e's rows are
/// `rows[starts[e]..starts[e + 1]]` in ascending order, with their weights beside them.
#[derive(Debug, Default, Clone)]
pub struct Routes {
    pub rows: Vec<u32>,
    pub weights: Vec<f32>,
    pub starts: Vec<usize>,
    /// Per row, its k experts and weights (row-major, `top_k` each): the step's choices.
    chosen: Vec<(u32, f32)>,
    probs: Vec<f32>,
}

impl Routes {
    /// Room for `rows` rows of a mixture (nothing grows while routing within it).
    pub fn with_capacity(moe: &MoeConfig, rows: usize) -> Routes {
        let (n, k) = (moe.n_experts as usize, moe.top_k as usize);
        Routes {
            rows: Vec::with_capacity(rows * k),
            weights: Vec::with_capacity(rows * k),
            starts: Vec::with_capacity(n + 1),
            chosen: Vec::with_capacity(rows * k),
            probs: Vec::with_capacity(n),
        }
    }

    /// Expert e's (rows, weights).
    pub fn of(&self, e: usize) -> (&[u32], &[f32]) {
        let r = self.starts[e]..self.starts[e + 1];
        (&self.rows[r.clone()], &self.weights[r])
    }

    /// Row `row`'s k experts and weights, in descending weight.
    pub fn chosen(&self, row: usize, k: usize) -> &[(u32, f32)] {
        &self.chosen[row * k..(row + 1) * k]
    }

    /// Routes `n_rows` rows of router logits (`logits`, `n_experts` per row).
    pub fn route(&mut self, moe: &MoeConfig, gating: Gating, logits: &[f32], n_rows: usize) {
        let (n, k) = (moe.n_experts as usize, moe.top_k as usize);
        debug_assert!(logits.len() >= n_rows * n && (1..=n).contains(&k));
        self.chosen.clear();
        for row in logits.chunks_exact(n).take(n_rows) {
            match gating {
                Gating::SoftmaxTopK => softmax_into(row, &mut self.probs),
                Gating::TopKSoftmax => {
                    self.probs.clear();
                    self.probs.extend_from_slice(row);
                }
            }
            let at = self.chosen.len();
            for _ in 0..k {
                // The most probable expert not taken yet; ties to the lower index.
                let mut best: Option<(usize, f32)> = None;
                for (e, &p) in self.probs.iter().enumerate() {
                    let taken = self.chosen[at..].iter().any(|&(c, _)| c as usize == e);
                    if !taken && best.is_none_or(|(_, b)| p > b || (b.is_nan() && !p.is_nan())) {
                        best = Some((e, p));
                    }
                }
                let (e, p) = best.expect("k <= experts");
                self.chosen.push((e as u32, p));
            }
            if gating == Gating::TopKSoftmax {
                // Softmax over the k logits taken (descending order, as torch's topk).
                let m = self.chosen[at].1;
                let mut sum = 0f32;
                for c in &mut self.chosen[at..] {
                    c.1 = (c.1 - m).exp();
                    sum += c.1;
                }
                for c in &mut self.chosen[at..] {
                    c.1 /= sum;
                }
            } else if moe.norm_topk_prob {
                // Summed in the order taken (descending), as torch sums the top-k.
                let sum: f32 = self.chosen[at..].iter().map(|&(_, w)| w).sum();
                for c in &mut self.chosen[at..] {
                    c.1 /= sum;
                }
            }
        }
        self.group(moe);
    }

    /// The step's choices list, emptied, for a backend that routes itself to fill
    /// (`Backend::route_top_k`: `top_k` valid experts a row); then `group`.
    pub fn chosen_mut(&mut self) -> &mut Vec<(u32, f32)> {
        self.chosen.clear();
        &mut self.chosen
    }

    /// The step's choices grouped by expert, each expert's rows ascending (a counting
    /// sort).
    pub fn group(&mut self, moe: &MoeConfig) {
        let (n, k) = (moe.n_experts as usize, moe.top_k as usize);
        debug_assert!(
            self.chosen.len().is_multiple_of(k) && self.chosen.iter().all(|c| (c.0 as usize) < n)
        );
        self.starts.clear();
        self.starts.resize(n + 1, 0);
        for &(e, _) in &self.chosen {
            self.starts[e as usize + 1] += 1;
        }
        for e in 0..n {
            self.starts[e + 1] += self.starts[e];
        }
        let total = self.chosen.len();
        self.rows.clear();
        self.rows.resize(total, 0);
        self.weights.clear();
        self.weights.resize(total, 0.0);
        // `probs` is reused as each expert's fill position (it has n entries).
        let next = &mut self.probs;
        next.clear();
        next.extend(self.starts[..n].iter().map(|&s| s as f32));
        for (i, &(e, w)) in self.chosen.iter().enumerate() {
            let at = next[e as usize] as usize;
            next[e as usize] += 1.0;
            self.rows[at] = (i / k) as u32;
            self.weights[at] = w;
        }
    }
}

/// Softmax of `x` into `out` in f32: exp(x - max) over their sum.
fn softmax_into(x: &[f32], out: &mut Vec<f32>) {
    let m = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    out.clear();
    out.extend(x.iter().map(|&v| (v - m).exp()));
    let sum: f32 = out.iter().sum();
    for p in out.iter_mut() {
        *p /= sum;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn moe(n: u32, k: u32, norm: bool) -> MoeConfig {
        MoeConfig {
            n_experts: n,
            top_k: k,
            intermediate: 32,
            norm_topk_prob: norm,
            dense_layers: Vec::new(),
        }
    }

    #[test]
    fn top_k_then_softmax_weighs_the_chosen_logits_only() {
        // gpt-oss: the same experts as softmax-then-top-k (softmax is monotonic), weights
        // the softmax of the k chosen logits, whatever the others are.
        let logits = [1.0, -1.0, 3.0, 0.0, 0.0, 0.5, 2.0, 4.0];
        let m = moe(4, 2, false);
        let mut r = Routes::with_capacity(&m, 2);
        r.route(&m, Gating::TopKSoftmax, &logits, 2);
        for (row, want) in [(0, [(2u32, 3.0f64), (0, 1.0)]), (1, [(3, 4.0), (2, 2.0)])] {
            let c = r.chosen(row, 2);
            let z: f64 = want.iter().map(|&(_, l)| l.exp()).sum();
            for (&(e, w), &(we, l)) in c.iter().zip(&want) {
                assert_eq!(e, we, "row {row}");
                assert!(
                    (w as f64 - l.exp() / z).abs() < 1e-6,
                    "row {row} expert {e}: {w}"
                );
            }
        }
        let mut other = logits;
        other[1] = -30.0;
        other[4] = 1.5;
        let mut r2 = Routes::with_capacity(&m, 2);
        r2.route(&m, Gating::TopKSoftmax, &other, 2);
        assert_eq!(r.chosen(0, 2), r2.chosen(0, 2));
        assert_eq!(r.chosen(1, 2), r2.chosen(1, 2));
    }

    #[test]
    fn rows_go_to_their_top_k_experts_grouped_by_expert() {
        // Row 0 prefers experts 2 then 0; row 1 prefers 3 then 2; row 2 ties 1 and 3 for
        // the first place (the lower index is taken first).
        let logits = [
            1.0, -1.0, 3.0, 0.0, //
            0.0, 0.5, 2.0, 4.0, //
            1.0, 2.0, -3.0, 2.0,
        ];
        for norm in [false, true] {
            let m = moe(4, 2, norm);
            let mut r = Routes::with_capacity(&m, 3);
            r.route(&m, Gating::SoftmaxTopK, &logits, 3);
            let choices: Vec<Vec<u32>> = (0..3)
                .map(|row| r.chosen(row, 2).iter().map(|c| c.0).collect())
                .collect();
            assert_eq!(choices, [vec![2, 0], vec![3, 2], vec![1, 3]]);
            // Weights: the softmax probabilities, renormalized over the two when asked.
            for row in 0..3 {
                let x = &logits[row * 4..row * 4 + 4];
                let e: Vec<f64> = x.iter().map(|&v| (v as f64).exp()).collect();
                let total: f64 = e.iter().sum();
                let c = r.chosen(row, 2);
                let pair: f64 = c.iter().map(|&(i, _)| e[i as usize] / total).sum();
                for &(i, w) in c {
                    let p = e[i as usize] / total;
                    let want = if norm { p / pair } else { p };
                    assert!(
                        (w as f64 - want).abs() < 1e-6,
                        "row {row} expert {i}: {w} vs {want}"
                    );
                }
            }
            // Expert-major: expert 0 has row 0, 1 has row 2, 2 has rows 0 and 1, 3 has rows
            // 1 and 2, each ascending, weights beside them.
            assert_eq!(r.starts, [0, 1, 2, 4, 6]);
            assert_eq!(r.rows, [0, 2, 0, 1, 1, 2]);
            for e in 0..4 {
                let (rows, ws) = r.of(e);
                for (&row, &w) in rows.iter().zip(ws) {
                    let c = r.chosen(row as usize, 2);
                    let mine = c.iter().find(|x| x.0 == e as u32).expect("routed");
                    assert_eq!(mine.1.to_bits(), w.to_bits());
                }
            }
        }
    }

    #[test]
    fn a_row_routes_alike_alone_and_in_a_batch_and_odd_rows_stay_in_bounds() {
        let m = moe(8, 3, true);
        let mut rng = crate::util::rng::Rng::new(7);
        let mut rnd = || rng.unit_f32() * 8.0 - 4.0;
        let mut logits: Vec<f32> = (0..5 * 8).map(|_| rnd()).collect();
        // A row of NaN, one of infinities, one all equal: still k distinct experts each.
        logits[8..16].fill(f32::NAN);
        logits[16..24].copy_from_slice(&[
            f32::INFINITY,
            0.0,
            f32::NEG_INFINITY,
            1.0,
            2.0,
            3.0,
            4.0,
            5.0,
        ]);
        logits[24..32].fill(0.25);
        let mut all = Routes::with_capacity(&m, 5);
        all.route(&m, Gating::SoftmaxTopK, &logits, 5);
        for row in 0..5 {
            let mut one = Routes::with_capacity(&m, 1);
            one.route(&m, Gating::SoftmaxTopK, &logits[row * 8..row * 8 + 8], 1);
            let a: Vec<(u32, u32)> = all
                .chosen(row, 3)
                .iter()
                .map(|&(e, w)| (e, w.to_bits()))
                .collect();
            let b: Vec<(u32, u32)> = one
                .chosen(0, 3)
                .iter()
                .map(|&(e, w)| (e, w.to_bits()))
                .collect();
            assert_eq!(a, b, "row {row}");
            let mut experts: Vec<u32> = a.iter().map(|x| x.0).collect();
            experts.sort_unstable();
            experts.dedup();
            assert_eq!(experts.len(), 3, "row {row}: {a:?}");
            assert!(experts.iter().all(|&e| e < 8));
        }
        assert_eq!(
            all.chosen(3, 3).iter().map(|c| c.0).collect::<Vec<_>>(),
            [0, 1, 2]
        );
        assert_eq!(all.rows.len(), 15);
        assert_eq!(*all.starts.last().expect("starts"), 15);
    }
}
