//! Decoder layers computed on the host CPU beside the device (`Plan::cpu_layers`, the
//! first ones: llama.cpp's `-ngl` habit, `--cpu-layers`): their weights are read once
//! into the host backend's arena, their KV cache lives there (`Decoder::new_part`), and
//! the step's hidden state crosses where the place changes — after the embedding to the
//! host, after the last host layer back to the device. Every other unit runs as planned.

use super::{Pipeline, PipelineError};
use crate::backend::cpu::{CpuBackend, CpuMem};
use crate::backend::Backend;
use crate::io::IoError;
use crate::model::{Decoder, ModelOptions};
use crate::plan::{Placement, Plan};
use crate::store::Store;

pub(super) struct HostPart {
    pub(super) backend: CpuBackend,
    pub(super) model: Decoder<CpuBackend>,
    /// Per unit, its weights where the host computes it.
    weights: Vec<Option<CpuMem>>,
    /// The units it computes: decoder layers 0 .. cpu_layers (units 1 ..= cpu_layers).
    units: std::ops::RangeInclusive<usize>,
    /// The hidden state on its way across (f32, and its bytes).
    across: Vec<f32>,
    bytes: Vec<u8>,
}

impl HostPart {
    /// The host part of `plan` (None when it computes no layer on the host): its backend
    /// on `threads` threads within the plan's arena, its decoder, its layers' weights.
    pub(super) fn new(
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
        let m = store.manifest();
        backend.reserve_scratch(&opts.scratch_shape(&m.arch));
        // KV cache and workspace first, as the plan counts them.
        let model = Decoder::new_part(&backend, m, opts, 0..plan.cpu_layers)?;
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
        let mut stored = Vec::new();
        let mut weights = Vec::with_capacity(store.units().len());
        for (u, unit) in store.units().iter().enumerate() {
            if plan.placement(u) != Placement::Host {
                weights.push(None);
                continue;
            }
            let mut mem =
                backend.alloc(unit.raw_len as usize, &format!("weights of {}", unit.kind))?;
            let dst = backend
                .host_bytes_mut(&mut mem)
                .expect("the host backend's memory is host bytes");
            store
                .read_unit(&file, u, &mut stored, dst, &mut dec)
                .map_err(data)?;
            weights.push(Some(mem));
        }
        Ok(Some(HostPart {
            backend,
            model,
            weights,
            units: 1..=plan.cpu_layers,
            across: Vec::new(),
            bytes: Vec::new(),
        }))
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
        let Some(h) = &self.host else { return };
        for (o, x) in out.iter_mut().zip(h.model.expert_tokens()) {
            for (o, x) in o.iter_mut().zip(x) {
                *o += x;
            }
        }
    }
}

/// `v`'s bytes into `out` (its room kept from step to step).
fn fill_bytes(v: &[f32], out: &mut Vec<u8>) {
    out.clear();
    out.extend(v.iter().flat_map(|f| f.to_le_bytes()));
}
