//! Several devices (`--devices`, `--split`): the decoder layers after the host's are
//! split among the devices in the proportions given, in device order, so the first
//! device (the one the plan streams on, which also holds the embedding and the head)
//! computes the first share and each other device a span of later layers. Each other
//! device holds its span resident, with that span's KV cache and a workspace, within its
//! own budget (its memory less its headroom): a span that does not fit is refused with
//! its numbers. The hidden state crosses to a device before its span and back after it.

use super::{PlanError, PlanInput};
use crate::model::decoder::{kv_cache_bytes_of, workspace_bytes};
use crate::store::Manifest;
use crate::util::fmt_bytes;
use serde::Serialize;
use std::ops::Range;

/// A device beside the first (`PlanInput::devices`).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct DeviceInput {
    /// As the user names it ("cuda:1"; in tests "emulated:1").
    pub name: String,
    /// Its ordinal among the backend's devices.
    pub ordinal: usize,
    /// Memory it may use.
    pub budget: u64,
    /// What its backend keeps for itself (CUDA's scratch), counted first.
    pub reserved: u64,
}

/// What one device beside the first computes and holds.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct DeviceSpan {
    pub name: String,
    /// Its decoder layers (units `layers.start + 1 ..= layers.end`).
    pub layers: Range<usize>,
    pub budget: u64,
    pub weights_bytes: u64,
    pub kv_cache_bytes: u64,
    pub workspace_bytes: u64,
    pub backend_bytes: u64,
}

impl DeviceSpan {
    /// Bytes it allocates at most.
    pub fn total(&self) -> u64 {
        self.weights_bytes + self.kv_cache_bytes + self.workspace_bytes + self.backend_bytes
    }

    /// Whether it computes unit `u`.
    pub fn runs(&self, u: usize) -> bool {
        u > self.layers.start && u <= self.layers.end
    }
}

/// Layers per device of `layers` layers split in the proportions `split` (one per device,
/// the first device's first): each share rounded down, what rounding leaves to the
/// devices with the largest remainders, earlier first.
pub fn shares(layers: usize, split: &[f64]) -> Vec<usize> {
    let total: f64 = split.iter().sum();
    if split.is_empty() || total.is_nan() || total <= 0.0 {
        return vec![layers];
    }
    let exact: Vec<f64> = split.iter().map(|w| layers as f64 * w / total).collect();
    let mut counts: Vec<usize> = exact.iter().map(|x| x.floor() as usize).collect();
    let mut order: Vec<usize> = (0..split.len()).collect();
    order.sort_by(|&a, &b| (exact[b] - exact[b].floor()).total_cmp(&(exact[a] - exact[a].floor())));
    let left = layers - counts.iter().sum::<usize>();
    for &i in order.iter().take(left) {
        counts[i] += 1;
    }
    counts
}

/// The first device's decoder layers: from the host's to where the other devices' spans
/// begin (all of them after the host's without other devices).
pub fn first_layers(m: &Manifest, input: &PlanInput) -> Range<usize> {
    let n = m.arch.n_layers as usize;
    let h = input.host.cpu_layers.min(n);
    if input.host.devices.is_empty() {
        return h..n;
    }
    let counts = shares(n - h, &input.host.split);
    h..h + counts[0]
}

/// The spans of the devices beside the first, each checked against its budget; the split
/// checked against the devices.
pub fn spans(m: &Manifest, input: &PlanInput) -> Result<Vec<DeviceSpan>, PlanError> {
    if input.host.devices.is_empty() {
        return Ok(Vec::new());
    }
    let a = &m.arch;
    let n = a.n_layers as usize;
    let h = input.host.cpu_layers.min(n);
    let want = input.host.devices.len() + 1;
    if input.host.split.len() != want
        || input
            .host
            .split
            .iter()
            .any(|w| !(w.is_finite() && *w >= 0.0))
    {
        return Err(PlanError::Placement(format!(
            "--split {:?}: give {want} shares, one per device (--devices names {want}), none negative",
            input.host.split
        )));
    }
    if input.host.unified {
        return Err(PlanError::Placement(
            "--devices: the CPU backend is one device, the host; give it with GPUs (--backend cuda)".into(),
        ));
    }
    let counts = shares(n - h, &input.host.split);
    let workspace = workspace_bytes(a, &input.opts);
    let mut start = h + counts[0];
    let mut out = Vec::with_capacity(input.host.devices.len());
    for (d, count) in input.host.devices.iter().zip(&counts[1..]) {
        let layers = start..start + count;
        start = layers.end;
        if layers.is_empty() {
            return Err(PlanError::Placement(format!(
                "--split {:?} gives {} no layer of the {} after the host's: give it a larger share, or leave it out of --devices",
                input.host.split,
                d.name,
                n - h
            )));
        }
        let span = DeviceSpan {
            name: d.name.clone(),
            weights_bytes: (layers.start + 1..=layers.end)
                .map(|u| m.units[u].raw_len)
                .sum(),
            kv_cache_bytes: kv_cache_bytes_of(a, &input.opts, layers.clone()),
            workspace_bytes: workspace,
            backend_bytes: d.reserved,
            budget: d.budget,
            layers,
        };
        if span.total() > d.budget {
            return Err(PlanError::Placement(format!(
                "{} cannot hold its layers {}..{}: they need {} (weights {}, KV cache {}, workspace {}, backend {}) within its budget of {}: give it a smaller share in --split, or it more memory",
                span.name,
                span.layers.start,
                span.layers.end,
                fmt_bytes(span.total()),
                fmt_bytes(span.weights_bytes),
                fmt_bytes(span.kv_cache_bytes),
                fmt_bytes(span.workspace_bytes),
                fmt_bytes(span.backend_bytes),
                fmt_bytes(span.budget),
            )));
        }
        out.push(span);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shares_follow_the_split_and_add_up() {
        assert_eq!(shares(32, &[3.0, 1.0]), [24, 8]);
        assert_eq!(shares(30, &[1.0, 1.0, 1.0]), [10, 10, 10]);
        assert_eq!(shares(7, &[1.0, 1.0]), [4, 3]);
        assert_eq!(shares(5, &[1.0, 0.0]), [5, 0]);
        for (n, split) in [(31, vec![2.0, 1.0, 1.0]), (3, vec![0.1, 0.7, 0.2])] {
            assert_eq!(shares(n, &split).iter().sum::<usize>(), n);
        }
        assert_eq!(shares(4, &[]), [4]);
    }
}
