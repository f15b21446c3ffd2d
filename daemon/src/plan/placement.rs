//! `--placement auto`: how many of the first decoder layers the host CPU computes beside
//! the device (`HostInput::cpu_layers`), chosen from measured rates for the rows a pass
//! carries. Each candidate is planned as it would run (the device memory the host layers
//! free holds more resident layers, so fewer bytes stream) and its pass time predicted:
//!
//!   cpu    = host layers' weight bytes x (1 / cpu.weights + rows / cpu.rows)
//!   device = device units' weight bytes x (1 / device.weights + rows / device.rows)
//!   stream = bytes uploaded per pass / stream rate
//!   pass   = cpu + device + rest - overlap x min(device, rest)
//!   rest   = stream - overlap x min(cpu, what the loads requested ahead stream)
//!
//! A layer's compute is a pass over its weights (memory-bound at one row) plus arithmetic
//! that grows with the rows; the two rates are fitted from a pass at one row and one at
//! many (`engine::placement::calibrate`). The host layers run first in every pass, and the
//! loads of the first streamed units go on meanwhile: up to `prefetch` of them are already
//! requested. `overlap` is measured (`Rates::overlap`): 1 where streaming and compute
//! run on different hardware, less where they share cores. So at one row, where a CPU reads its
//! DDR faster than NVMe and PCIe deliver, the host layers win; at many rows the CPU's
//! arithmetic costs more than the streaming it saves, and every layer goes to the device.

use super::{plan, Placement, Plan, PlanError, PlanInput};
use crate::store::Manifest;
use serde::{Deserialize, Serialize};

/// A backend's compute on one decoder layer: weight bytes per second at one row (reading
/// them), and weight bytes per second per row beyond (the arithmetic).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct ComputeRate {
    pub weight_bytes_per_s: f64,
    pub row_bytes_per_s: f64,
}

impl ComputeRate {
    /// Seconds to compute `bytes` of weights for `rows` rows.
    pub fn seconds(&self, bytes: u64, rows: usize) -> f64 {
        let b = bytes as f64;
        b / self.weight_bytes_per_s.max(1.0) + rows as f64 * b / self.row_bytes_per_s.max(1.0)
    }

    /// The rate whose `seconds` are `t1` at one row and `tn` at `rows` rows for `bytes`
    /// of weights (the arithmetic never negative, the reading never free).
    pub fn fit(bytes: u64, t1: f64, tn: f64, rows: usize) -> ComputeRate {
        let b = bytes.max(1) as f64;
        let per_row = ((tn - t1) / (rows.max(2) - 1) as f64).max(1e-12);
        let read = (t1 - per_row).max(t1 * 0.05).max(1e-12);
        ComputeRate {
            weight_bytes_per_s: b / read,
            row_bytes_per_s: b / per_row,
        }
    }
}

/// What this machine does per second, measured (`engine::placement::calibrate`).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Rates {
    /// Bytes uploaded per second while streaming: disk, decompression and the copy
    /// together, as a pass of streaming alone delivers them.
    pub stream_bytes_per_s: f64,
    /// The device's compute.
    pub device: ComputeRate,
    /// The host CPU's, on the threads it computes host layers with.
    pub cpu: ComputeRate,
    /// How much of the shorter of streaming and compute hides behind the longer: 1 where
    /// they run apart (a GPU computing, host cores decompressing), near 0 where they
    /// share the same cores (the CPU backend on a small machine). Measured from a pass
    /// against its streaming alone and its compute.
    #[serde(default = "one")]
    pub overlap: f64,
}

fn one() -> f64 {
    1.0
}

/// A placement's predicted pass time and its parts (seconds).
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Prediction {
    pub cpu_layers: usize,
    pub cpu_s: f64,
    pub device_s: f64,
    pub stream_s: f64,
    pub pass_s: f64,
}

/// What a plan's pass time depends on: the weight bytes each side computes, the units
/// streamed and the loads requested ahead of them, the bytes uploaded a pass.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PassShape {
    pub cpu_layers: usize,
    pub host_bytes: u64,
    pub device_bytes: u64,
    pub streamed: usize,
    pub prefetch: usize,
    pub upload_bytes: u64,
}

impl PassShape {
    pub fn of(m: &Manifest, p: &Plan) -> PassShape {
        let (mut host, mut device, mut streamed) = (0u64, 0u64, 0usize);
        for (u, unit) in m.units.iter().enumerate() {
            match p.placement(u) {
                Placement::Host => host += unit.raw_len,
                Placement::Streamed | Placement::HostCached => {
                    streamed += 1;
                    device += unit.raw_len;
                }
                Placement::Resident | Placement::OtherDevice => device += unit.raw_len,
            }
        }
        PassShape {
            cpu_layers: p.cpu_layers,
            host_bytes: host,
            device_bytes: device,
            streamed,
            prefetch: p.prefetch,
            upload_bytes: p.upload_bytes_per_pass,
        }
    }

    /// Its pass of `rows` rows at `rates`.
    pub fn predict(&self, rates: &Rates, rows: usize) -> Prediction {
        let cpu_s = rates.cpu.seconds(self.host_bytes, rows);
        let device_s = rates.device.seconds(self.device_bytes, rows);
        let stream_s = self.upload_bytes as f64 / rates.stream_bytes_per_s.max(1.0);
        // The loads requested ahead go on while the host computes; the rest beside the
        // device's compute, as far as they overlap at all.
        let o = rates.overlap.clamp(0.0, 1.0);
        let ahead = (self.prefetch as f64 / self.streamed.max(1) as f64).min(1.0);
        let rest = stream_s - o * cpu_s.min(stream_s * ahead);
        let hidden = o * device_s.min(rest);
        Prediction {
            cpu_layers: self.cpu_layers,
            cpu_s,
            device_s,
            stream_s,
            pass_s: cpu_s + device_s + rest - hidden,
        }
    }
}

/// Predicts a pass of `rows` rows through `p` (a plan of `m`) at `rates`.
pub fn predict(m: &Manifest, p: &Plan, rates: &Rates, rows: usize) -> Prediction {
    PassShape::of(m, p).predict(rates, rows)
}

/// The placement chosen for a pass of `rows` rows: its host layers and every candidate's
/// prediction (those that fit the budgets).
#[derive(Clone, Debug, Serialize)]
pub struct Choice {
    pub rows: usize,
    pub cpu_layers: usize,
    pub candidates: Vec<Prediction>,
}

impl Choice {
    /// The chosen candidate's prediction.
    pub fn chosen(&self) -> Option<&Prediction> {
        self.candidates
            .iter()
            .find(|c| c.cpu_layers == self.cpu_layers)
    }
}

/// Chooses how many of `m`'s first decoder layers the host computes for passes of `rows`
/// rows: every count from none to all whose plan fits `input`'s budgets, predicted at
/// `rates`, the fastest taken (within 2 %, the fewer host layers: the device's numbers
/// are the reference ones, and a tie is not worth host memory). The error is the plan's
/// when no count fits.
pub fn choose(
    m: &Manifest,
    input: &PlanInput,
    rates: &Rates,
    rows: usize,
) -> Result<Choice, PlanError> {
    Ok(choose_among(&shapes(m, input)?, rates, rows))
}

/// Every count of host layers from none to all whose plan fits `input`'s budgets, as
/// pass shapes; the plan's error when none fits.
pub fn shapes(m: &Manifest, input: &PlanInput) -> Result<Vec<PassShape>, PlanError> {
    let mut out = Vec::new();
    let mut first_err = None;
    for n in 0..=m.arch.n_layers as usize {
        let mut i = input.clone();
        i.host.cpu_layers = n;
        match plan(m, &i) {
            Ok(p) => out.push(PassShape::of(m, &p)),
            Err(e) => {
                first_err.get_or_insert(e);
            }
        }
    }
    match (out.is_empty(), first_err) {
        (true, Some(e)) => Err(e),
        _ => Ok(out),
    }
}

/// `choose` among placements already planned (`shapes`, not empty).
pub fn choose_among(shapes: &[PassShape], rates: &Rates, rows: usize) -> Choice {
    let candidates: Vec<Prediction> = shapes.iter().map(|s| s.predict(rates, rows)).collect();
    let best = candidates
        .iter()
        .map(|c| c.pass_s)
        .fold(f64::INFINITY, f64::min);
    let pick = candidates
        .iter()
        .find(|c| c.pass_s <= best * 1.02)
        .map_or(0, |c| c.cpu_layers);
    Choice {
        rows,
        cpu_layers: pick,
        candidates,
    }
}

/// `--placement auto` while serving: the placement follows the rows the passes carry.
/// Each pass, each other placement's predicted time for that pass's rows is weighed
/// against the one in use, and what it would have saved adds to its regret (which never
/// goes below zero: a stretch where it is slower only cancels what it saved before). A
/// placement whose regret reaches what a change costs (`change_s`: the engine stops that
/// long, measured) is moved to, and every regret starts again. The rule is rent-or-buy:
/// a change is bought once staying has cost as much as changing would, so the time a
/// run loses is at most twice what knowing the batch ahead would have lost, and a burst
/// of a few passes (a prompt's prefill at batch 1, one request beside a running one) buys
/// no change.
#[derive(Clone, Debug)]
pub struct Follow {
    shapes: Vec<PassShape>,
    rates: Rates,
    /// Index into `shapes` of the placement in use.
    current: usize,
    regret: Vec<f64>,
    /// Seconds a change costs.
    pub change_s: f64,
}

impl Follow {
    /// Following from the placement with `cpu_layers` host layers (among `shapes`; the
    /// first one if it is not there).
    pub fn new(shapes: Vec<PassShape>, rates: Rates, cpu_layers: usize, change_s: f64) -> Follow {
        let current = shapes
            .iter()
            .position(|s| s.cpu_layers == cpu_layers)
            .unwrap_or(0);
        Follow {
            regret: vec![0.0; shapes.len()],
            shapes,
            rates,
            current,
            change_s,
        }
    }

    /// The host layers of the placement in use.
    pub fn cpu_layers(&self) -> usize {
        self.shapes.get(self.current).map_or(0, |s| s.cpu_layers)
    }

    /// Counts a pass of `rows` rows that took `measured` seconds (None: not measured);
    /// the placement to move to when one has earned it (the choice at those rows, every
    /// candidate's prediction). What a candidate would have saved is its predicted saving
    /// in the measured pass's seconds: the predictions scaled by the measured pass over
    /// the predicted one (within 10x either way), so that savings and a change's cost,
    /// which is measured, are in the same seconds where the rates are off by a factor.
    pub fn observe(&mut self, rows: usize, measured: Option<f64>) -> Option<Choice> {
        let now = self
            .shapes
            .get(self.current)?
            .predict(&self.rates, rows)
            .pass_s;
        let scale = measured
            .filter(|m| m.is_finite() && *m > 0.0 && now > 0.0)
            .map_or(1.0, |m| (m / now).clamp(0.1, 10.0));
        for (r, s) in self.regret.iter_mut().zip(&self.shapes) {
            *r = (*r + (now - s.predict(&self.rates, rows).pass_s) * scale).max(0.0);
        }
        let (at, most) =
            (self.regret.iter().enumerate()).fold((self.current, 0.0), |b, (i, &r)| {
                if r > b.1 {
                    (i, r)
                } else {
                    b
                }
            });
        if at == self.current || most < self.change_s {
            return None;
        }
        let mut c = choose_among(&self.shapes, &self.rates, rows);
        c.cpu_layers = self.shapes[at].cpu_layers;
        Some(c)
    }

    /// The placement with `cpu_layers` host layers is in use now (a change made, or given
    /// up: `cpu_layers` the one kept), the change having taken `took_s`.
    pub fn moved(&mut self, cpu_layers: usize, took_s: f64) {
        if let Some(i) = self.shapes.iter().position(|s| s.cpu_layers == cpu_layers) {
            self.current = i;
        }
        self.regret.iter_mut().for_each(|r| *r = 0.0);
        self.change_s = took_s.max(1e-3);
    }

    /// The placement with `cpu_layers` host layers could not be built (the backend's own
    /// reservations, memory another process took): it is not tried again.
    pub fn refuse(&mut self, cpu_layers: usize) {
        if let Some(i) = self.shapes.iter().position(|s| s.cpu_layers == cpu_layers) {
            if i != self.current {
                self.shapes.remove(i);
                self.regret.remove(i);
                if i < self.current {
                    self.current -= 1;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::HostInput;

    /// Rates of the workstation the issue names: a Gen4 NVMe with decompression and
    /// PCIe behind it delivering ~5 GB/s, a GPU reading its weights at ~2 TB/s, a CPU
    /// reading DDR5 at ~60 GB/s but doing a row's arithmetic at ~20 GB of weights a
    /// second, 200x slower than the GPU.
    fn workstation() -> Rates {
        Rates {
            stream_bytes_per_s: 5e9,
            device: ComputeRate {
                weight_bytes_per_s: 2e12,
                row_bytes_per_s: 4e12,
            },
            cpu: ComputeRate {
                weight_bytes_per_s: 60e9,
                row_bytes_per_s: 20e9,
            },
            overlap: 1.0,
        }
    }

    /// A synthetic model of eight layers, a device budget four layers short of holding it
    /// all, and one load requested ahead (a large model streams many more layers than it
    /// requests ahead: little of its streaming hides behind the host's compute).
    fn model(dir: &std::path::Path) -> (Manifest, PlanInput) {
        let store = crate::plan::tests::store_shaped(dir, false, 1 << 20, 2048, 8);
        let m = store.manifest().clone();
        let mut input = crate::plan::tests::input(None, 0);
        input.prefetch = Some(1);
        input.host = HostInput {
            cpu_scratch: 1 << 20,
            ..HostInput::default()
        };
        let all = plan(&m, &input).unwrap().device_bytes();
        input.device_budget = Some(all - 4 * m.units[1].raw_len);
        (m, input)
    }

    #[test]
    fn the_cpu_takes_layers_at_one_row_and_none_at_sixteen() {
        let tmp = tempfile::tempdir().unwrap();
        let (m, input) = model(tmp.path());
        let one = choose(&m, &input, &workstation(), 1).unwrap();
        assert!(one.cpu_layers > 0, "{one:?}");
        // It is the fastest prediction, and faster than streaming them all.
        let none = one.candidates.iter().find(|c| c.cpu_layers == 0).unwrap();
        let chosen = one.chosen().unwrap();
        assert!(chosen.pass_s < none.pass_s, "{one:?}");
        assert!(one.candidates.iter().all(|c| c.pass_s >= chosen.pass_s));
        let sixteen = choose(&m, &input, &workstation(), 16).unwrap();
        assert_eq!(sixteen.cpu_layers, 0, "{sixteen:?}");
    }

    #[test]
    fn a_slow_cpu_or_a_fast_stream_keeps_every_layer_on_the_device() {
        let tmp = tempfile::tempdir().unwrap();
        let (m, input) = model(tmp.path());
        let mut slow = workstation();
        slow.cpu.weight_bytes_per_s = 0.2e9;
        assert_eq!(choose(&m, &input, &slow, 1).unwrap().cpu_layers, 0);
        let mut fast = workstation();
        fast.stream_bytes_per_s = 500e9;
        assert_eq!(choose(&m, &input, &fast, 1).unwrap().cpu_layers, 0);
    }

    #[test]
    fn host_layers_free_device_memory_for_resident_ones() {
        let tmp = tempfile::tempdir().unwrap();
        let (m, input) = model(tmp.path());
        let c = choose(&m, &input, &workstation(), 1).unwrap();
        let streamed = |n: usize| c.candidates.iter().find(|p| p.cpu_layers == n).unwrap();
        // Each layer moved to the host streams one layer fewer, until nothing streams.
        assert!(streamed(1).stream_s < streamed(0).stream_s);
        assert_eq!(streamed(8).stream_s, 0.0);
        let ends = m.units[0].raw_len + m.units[9].raw_len;
        assert_eq!(streamed(8).device_s, workstation().device.seconds(ends, 1));
    }

    /// The predicted pass of `rows` rows with `n` host layers.
    fn pass_at(shapes: &[PassShape], rates: &Rates, n: usize, rows: usize) -> f64 {
        let s = shapes.iter().find(|s| s.cpu_layers == n).unwrap();
        s.predict(rates, rows).pass_s
    }

    #[test]
    fn the_placement_follows_a_batch_that_stays_and_not_a_burst() {
        let tmp = tempfile::tempdir().unwrap();
        let (m, input) = model(tmp.path());
        let rates = workstation();
        let shapes = shapes(&m, &input).unwrap();
        let one = choose_among(&shapes, &rates, 1).cpu_layers;
        assert!(one > 0);
        let at = |n: usize, rows: usize| pass_at(&shapes, &rates, n, rows);
        // A change costs what ten passes at 16 rows save by moving every layer to the
        // device.
        let saved = at(one, 16) - at(0, 16);
        assert!(saved > 0.0);
        let mut f = Follow::new(shapes.clone(), rates, one, 10.0 * saved);
        // Passes of 16 rows: the tenth (or the one after, the regret of another count may
        // lead) buys the change, to the placement that is fastest at 16 rows.
        let mut passes = 0;
        let to = loop {
            passes += 1;
            assert!(passes <= 11, "no change after {passes} passes of 16 rows");
            if let Some(c) = f.observe(16, None) {
                break c;
            }
        };
        assert!(passes >= 9, "changed after {passes} passes");
        assert_eq!(to.cpu_layers, 0, "{to:?}");
        assert_eq!(to.rows, 16);
        f.moved(to.cpu_layers, 10.0 * saved);
        assert_eq!(f.cpu_layers(), 0);
        // A burst of single rows (a request alone for a moment) buys nothing, and the
        // batch coming back wipes what it earned.
        for _ in 0..3 {
            assert!(f.observe(1, None).is_none());
        }
        for _ in 0..20 {
            assert!(f.observe(16, None).is_none());
        }
        // Single rows that stay move the layers back to the host once they have saved a
        // change's cost.
        let back = (1..=1000)
            .find_map(|k| f.observe(1, None).map(|c| (k, c)))
            .unwrap();
        let per_pass = at(0, 1) - at(back.1.cpu_layers, 1);
        let needed = (10.0 * saved / per_pass).ceil() as usize;
        assert!(back.0 >= needed, "{} passes, {needed} needed", back.0);
        assert!(back.1.cpu_layers > 0, "{back:?}");
    }

    #[test]
    fn savings_are_counted_in_the_seconds_the_passes_measure() {
        let tmp = tempfile::tempdir().unwrap();
        let (m, input) = model(tmp.path());
        let rates = workstation();
        let shapes = shapes(&m, &input).unwrap();
        let one = choose_among(&shapes, &rates, 1).cpu_layers;
        let at = |n: usize| pass_at(&shapes, &rates, n, 16);
        let saved = at(one) - at(0);
        // Passes measured at twice their prediction save twice the seconds: a change
        // costing ten predicted savings is bought after five.
        let passes = |measured: Option<f64>| {
            let mut f = Follow::new(shapes.clone(), rates, one, 10.0 * saved);
            (1..=100)
                .find(|_| f.observe(16, measured).is_some())
                .unwrap()
        };
        let (plain, doubled) = (passes(None), passes(Some(2.0 * at(one))));
        assert!((9..=11).contains(&plain), "{plain}");
        assert!((4..=6).contains(&doubled), "{doubled}");
        // A measurement off by more than ten times counts as ten.
        assert_eq!(passes(Some(1e6 * at(one))), 1);
    }

    #[test]
    fn a_rate_fitted_from_two_passes_gives_them_back() {
        let r = ComputeRate::fit(1 << 30, 0.02, 0.1, 9);
        assert!((r.seconds(1 << 30, 1) - 0.02).abs() < 1e-9);
        assert!((r.seconds(1 << 30, 9) - 0.1).abs() < 1e-9);
    }
}
