//! Decoder layers computed on another backend beside the device: the first ones on the
//! host CPU (`Plan::cpu_layers`: llama.cpp's `-ngl` habit, `--cpu-layers`), later spans on
//! other devices (`Plan::devices`, `--devices`). Each is a `Part`: its weights read once
//! into its backend, its layers' KV cache there (`Decoder::new_part`), and the step's
//! hidden state crossing where the place changes — from the device before the part's
//! first layer, back after its last. Every other unit runs as planned.

use super::{Pipeline, PipelineError};
use crate::backend::cpu::CpuBackend;
use crate::backend::Backend;
use crate::io::IoError;
use crate::model::{Decoder, ModelOptions};
use crate::plan::Plan;
use crate::store::Store;

/// Layers computed on the host CPU.
pub(super) type HostPart = Part<CpuBackend>;

pub(super) struct Part<C: Backend> {
    pub(super) backend: C,
    pub(super) model: Decoder<C>,
    /// Per unit, its weights where this part computes it.
    weights: Vec<Option<C::Mem>>,
    /// The units it computes: decoder layers `layers` (units `start + 1 ..= end`).
    units: std::ops::RangeInclusive<usize>,
    /// The hidden state on its way across (f32, and its bytes).
    across: Vec<f32>,
    bytes: Vec<u8>,
}

/// The host part of `plan` (None when it computes no layer on the host): its backend on
/// `threads` threads within the plan's arena.
pub(super) fn host_part(
    store: &Store,
    plan: &Plan,
    opts: ModelOptions,
    threads: usize,
) -> Result<Option<HostPart>, PipelineError> {
    if plan.cpu_layers == 0 {
        return Ok(None);
    }
    let backend = CpuBackend::new(plan.cpu_arena_bytes(), threads)?;
    backend.set_int8_activations(!opts.exact);
    backend.reserve_scratch(&opts.scratch_shape(&store.manifest().arch));
    Part::new(store, backend, opts, 0..plan.cpu_layers).map(Some)
}

impl<C: Backend> Part<C> {
    /// The part computing decoder `layers` on `backend` (set up for the model's numerics
    /// and scratch): its KV cache and workspace first, as the plan counts them, then the
    /// layers' weights read once into it.
    pub(super) fn new(
        store: &Store,
        backend: C,
        opts: ModelOptions,
        layers: std::ops::Range<usize>,
    ) -> Result<Part<C>, PipelineError> {
        let m = store.manifest();
        let model = Decoder::new_part(&backend, m, opts, layers.clone())?;
        let units = layers.start + 1..=layers.end;
        let data = |e| PipelineError::Io(IoError::Data(e));
        let file = store.open_weights().map_err(data)?;
        let mut dec = store
            .frame_decoder(m.frame_raw_len_max() as usize)
            .map_err(|e| {
                data(crate::store::StoreError::io(
                    "decoder",
                    store.weights_path(),
                    e,
                ))
            })?;
        let (mut stored, mut raw) = (Vec::new(), Vec::new());
        let mut weights = Vec::with_capacity(store.units().len());
        for (u, unit) in store.units().iter().enumerate() {
            if !units.contains(&u) {
                weights.push(None);
                continue;
            }
            let len = unit.raw_len as usize;
            let mut mem = backend.alloc(len, &format!("weights of {}", unit.kind))?;
            match backend.host_bytes_mut(&mut mem) {
                Some(dst) => store
                    .read_unit(&file, u, &mut stored, dst, &mut dec)
                    .map_err(data)?,
                None => {
                    raw.resize(len, 0);
                    store
                        .read_unit(&file, u, &mut stored, &mut raw, &mut dec)
                        .map_err(data)?;
                    backend.upload(&mut mem, &raw)?;
                }
            }
            weights.push(Some(mem));
        }
        Ok(Part {
            backend,
            model,
            weights,
            units,
            across: Vec::new(),
            bytes: Vec::new(),
        })
    }

    /// Whether unit `u` runs here.
    pub(super) fn runs(&self, u: usize) -> bool {
        self.units.contains(&u)
    }

    /// Runs unit `u` here: the hidden state comes over from `device` before the first
    /// host unit and goes back after the last.
    pub(super) fn run<B: Backend>(
        &mut self,
        u: usize,
        device: &B,
        dev_model: &mut Decoder<B>,
    ) -> Result<(), PipelineError> {
        if u == *self.units.start() {
            let (x, n) = dev_model.hidden();
            self.across.resize(n, 0.0);
            device.download_f32(x, 0, &mut self.across);
            fill_bytes(&self.across, &mut self.bytes);
            self.backend.upload(self.model.hidden_mut(), &self.bytes)?;
        }
        let w = self.weights[u].as_ref().expect("a unit the host runs");
        self.model.forward_unit(&self.backend, u, w, None);
        if u == *self.units.end() {
            let (x, n) = self.model.hidden();
            self.across.resize(n, 0.0);
            self.backend.download_f32(x, 0, &mut self.across);
            fill_bytes(&self.across, &mut self.bytes);
            device.upload(dev_model.hidden_mut(), &self.bytes)?;
        }
        Ok(())
    }
}

impl<B: Backend> Pipeline<B> {
    /// Builds the spans of the devices beside this one (`Plan::devices`), on `backends`,
    /// one per device in order: each holds its span's weights, KV cache and workspace.
    pub fn add_devices(&mut self, backends: Vec<B>) -> Result<(), PipelineError> {
        assert_eq!(
            backends.len(),
            self.plan.devices.len(),
            "one backend per device the plan places layers on"
        );
        let opts = *self.model.options();
        for (b, d) in backends.into_iter().zip(self.plan.devices.clone()) {
            self.others
                .push(Part::new(&self.store, b, opts, d.layers.clone())?);
        }
        Ok(())
    }

    /// The backends of the devices beside this one (`add_devices`), in order.
    pub fn other_backends(&self) -> impl Iterator<Item = &B> {
        self.others.iter().map(|p| &p.backend)
    }

    /// Tokens routed to each expert of each layer so far, into `out` (its room kept from
    /// step to step): each part counts its own layers (`Decoder::expert_tokens`, zeros
    /// elsewhere), so their sum is the model's.
    pub fn expert_tokens_into(&self, out: &mut Vec<Vec<u64>>) {
        let dev = self.model.expert_tokens();
        if out.len() != dev.len() || out.iter().zip(dev).any(|(o, d)| o.len() != d.len()) {
            *out = dev.to_vec();
        } else {
            for (o, d) in out.iter_mut().zip(dev) {
                o.copy_from_slice(d);
            }
        }
        let parts = self.host.iter().map(|h| h.model.expert_tokens());
        for counts in parts.chain(self.others.iter().map(|p| p.model.expert_tokens())) {
            for (o, x) in out.iter_mut().zip(counts) {
                for (o, x) in o.iter_mut().zip(x) {
                    *o += x;
                }
            }
        }
    }
}

/// `v`'s bytes into `out` (its room kept from step to step).
fn fill_bytes(v: &[f32], out: &mut Vec<u8>) {
    out.clear();
    out.extend(v.iter().flat_map(|f| f.to_le_bytes()));
}
