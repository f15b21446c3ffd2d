//! The KV cache across a pipeline's placements: a slot given back, a prefix copied from
//! one slot to another, blocks of positions copied out to the host and back (the prefix
//! cache's tiers). With layers computed on the host (`Plan::cpu_layers`) each part holds
//! its own layers' KV, the host's first in a block's layer order.

use super::Pipeline;
use crate::backend::Backend;
use crate::model::ModelError;

impl<B: Backend> Pipeline<B> {
    /// Whether a query at `pos` of a slot written up to `written` sees all it attends to,
    /// in every part's layers (`Decoder::can_resume`: a ring may have moved past it).
    pub fn can_resume(&self, pos: usize, written: usize) -> bool {
        self.host
            .as_ref()
            .is_none_or(|h| h.model.can_resume(pos, written))
            && self.model.can_resume(pos, written)
    }

    /// Bytes of KV cache the first `n` positions of a slot take, every part's layers
    /// (`Decoder::kv_bytes`).
    pub fn kv_bytes(&self, n: usize) -> u64 {
        self.host.as_ref().map_or(0, |h| h.model.kv_bytes(n)) + self.model.kv_bytes(n)
    }

    /// Gives back the memory of `slot`'s KV cache, whose sequence is over
    /// (`Decoder::discard_slot`). Returns the bytes given back.
    pub fn discard_slot(&mut self, slot: usize) -> usize {
        let host = self
            .host
            .as_mut()
            .map_or(0, |h| h.model.discard_slot(&h.backend, slot));
        host + self.model.discard_slot(&self.backend, slot)
    }

    /// Copies the KV of `positions` from slot `from` (written up to `written`) to slot `to`
    /// (`Decoder::copy_kv`): a prefix another sequence computed.
    pub fn copy_kv(
        &mut self,
        slots: (usize, usize),
        positions: std::ops::Range<usize>,
        written: usize,
    ) {
        if let Some(h) = &mut self.host {
            h.model
                .copy_kv(&h.backend, slots, positions.clone(), written);
        }
        self.model.copy_kv(&self.backend, slots, positions, written);
    }

    /// The K and V of `positions` of `slot` on the host (`Decoder::export_kv`).
    pub fn export_kv(
        &self,
        slot: usize,
        positions: std::ops::Range<usize>,
        written: usize,
    ) -> (Vec<bool>, Vec<u8>) {
        // Layer order: the host's layers (the first ones), then the device's.
        let (mut held, mut bytes) = match &self.host {
            Some(h) => h
                .model
                .export_kv(&h.backend, slot, positions.clone(), written),
            None => (Vec::new(), Vec::new()),
        };
        let (dev_held, dev_bytes) = self
            .model
            .export_kv(&self.backend, slot, positions, written);
        held.extend(dev_held);
        bytes.extend(dev_bytes);
        (held, bytes)
    }

    /// Writes a block `export_kv` gave back into `slot` (`Decoder::import_kv`).
    pub fn import_kv(
        &mut self,
        slot: usize,
        positions: std::ops::Range<usize>,
        block: (&[bool], &[u8]),
        want: &[bool],
    ) -> Result<(), ModelError> {
        let (held, bytes) = block;
        let Some(h) = &mut self.host else {
            return self
                .model
                .import_kv(&self.backend, slot, positions, block, want);
        };
        // The host's layers first (`export_kv`), their bytes those of the layers held.
        let n = self.plan.cpu_layers.min(held.len());
        let per_layer = positions.len() * self.model.kv_position_bytes();
        let cut = (held[..n].iter().filter(|&&x| x).count() * per_layer).min(bytes.len());
        let (want_host, want_dev) = want.split_at(n.min(want.len()));
        h.model.import_kv(
            &h.backend,
            slot,
            positions.clone(),
            (&held[..n], &bytes[..cut]),
            want_host,
        )?;
        self.model.import_kv(
            &self.backend,
            slot,
            positions,
            (&held[n..], &bytes[cut..]),
            want_dev,
        )
    }

    /// The host CPU backend that computes `Plan::cpu_layers` (None without such layers).
    pub fn host_backend(&self) -> Option<&crate::backend::cpu::CpuBackend> {
        self.host.as_ref().map(|h| &h.backend)
    }
}
