//! The KV cache across a pipeline's placements: a slot given back, a prefix copied from
//! one slot to another, blocks of positions copied out to the host and back (the prefix
//! cache's tiers). With layers computed elsewhere (`Plan::cpu_layers` on the host,
//! `Plan::devices` on other devices) each part holds its own layers' KV; a block holds
//! them in layer order: the host's, this device's, then each other device's.

use super::Pipeline;
use crate::backend::{Backend, LayerCache};
use crate::model::ModelError;

impl<B: Backend> Pipeline<B> {
    /// Whether a query at `pos` of a slot written up to `written` sees all it attends to,
    /// in every part's layers (`Decoder::can_resume`: a ring may have moved past it).
    pub fn can_resume(&self, pos: usize, written: usize) -> bool {
        self.host
            .as_ref()
            .is_none_or(|h| h.model.can_resume(pos, written))
            && self.model.can_resume(pos, written)
            && self.others.iter().all(|p| p.model.can_resume(pos, written))
    }

    /// Bytes of KV cache the first `n` positions of a slot take, every part's layers
    /// (`Decoder::kv_bytes`).
    pub fn kv_bytes(&self, n: usize) -> u64 {
        self.host.as_ref().map_or(0, |h| h.model.kv_bytes(n))
            + self.model.kv_bytes(n)
            + self.others.iter().map(|p| p.model.kv_bytes(n)).sum::<u64>()
    }

    /// Gives back the memory of `slot`'s KV cache, whose sequence is over
    /// (`Decoder::discard_slot`). Returns the bytes given back.
    pub fn discard_slot(&mut self, slot: usize) -> usize {
        let host = self
            .host
            .as_mut()
            .map_or(0, |h| h.model.discard_slot(&h.backend, slot));
        let others: usize = (self.others.iter_mut())
            .map(|p| p.model.discard_slot(&p.backend, slot))
            .sum();
        host + others + self.model.discard_slot(&self.backend, slot)
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
        for p in &mut self.others {
            p.model
                .copy_kv(&p.backend, slots, positions.clone(), written);
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
        // Layer order: the host's layers (the first ones), this device's, the others'.
        let (mut held, mut bytes) = match &self.host {
            Some(h) => h
                .model
                .export_kv(&h.backend, slot, positions.clone(), written),
            None => (Vec::new(), Vec::new()),
        };
        let mut add = |(h, b): (Vec<bool>, Vec<u8>)| {
            held.extend(h);
            bytes.extend(b);
        };
        add(self
            .model
            .export_kv(&self.backend, slot, positions.clone(), written));
        for p in &self.others {
            add(p
                .model
                .export_kv(&p.backend, slot, positions.clone(), written));
        }
        (held, bytes)
    }

    /// Writes a block `export_kv` gave back into `slot` (`Decoder::import_kv`), each part
    /// its own layers' share of it.
    pub fn import_kv(
        &mut self,
        slot: usize,
        positions: std::ops::Range<usize>,
        block: (&[bool], &[u8]),
        want: &[bool],
    ) -> Result<(), ModelError> {
        if self.host.is_none() && self.others.is_empty() {
            return self
                .model
                .import_kv(&self.backend, slot, positions, block, want);
        }
        let per_layer = positions.len() * self.model.kv_position_bytes();
        let mut cut = Cut {
            block,
            want,
            per_layer,
        };
        if let Some(h) = &mut self.host {
            let (b, w) = cut.take(self.plan.cpu_layers);
            h.model
                .import_kv(&h.backend, slot, positions.clone(), b, w)?;
        }
        let (b, w) = cut.take(self.model.kv_held_layers());
        self.model
            .import_kv(&self.backend, slot, positions.clone(), b, w)?;
        for p in &mut self.others {
            let (b, w) = cut.take(p.model.kv_held_layers());
            p.model
                .import_kv(&p.backend, slot, positions.clone(), b, w)?;
        }
        Ok(())
    }

    /// The host CPU backend that computes `Plan::cpu_layers` (None without such layers).
    pub fn host_backend(&self) -> Option<&crate::backend::cpu::CpuBackend> {
        self.host.as_ref().map(|h| &h.backend)
    }

    /// Every layer's part of the KV cache (its ring, where it has one), in layer order
    /// across the parts: the order `export_kv` writes a block in, whatever the placement.
    pub fn kv_layers(&self) -> Vec<LayerCache> {
        let host = self.host.iter().flat_map(|h| h.model.kv_layers());
        let others = self.others.iter().flat_map(|p| p.model.kv_layers());
        host.chain(self.model.kv_layers())
            .chain(others)
            .copied()
            .collect()
    }

    /// All `slot` holds once it has written up to `written`, on the host: what a query
    /// at `written` and after still attends to, in every layer (a ring's last `cap`
    /// positions, a full layer's all). `import_slot` writes it into another pipeline of
    /// the same model whatever its placement (`engine::replace`: the placement changing
    /// under running sequences).
    pub fn export_slot(&self, slot: usize, written: usize) -> SlotKv {
        let blocks = slot_runs(&self.kv_layers(), written)
            .into_iter()
            .map(|r| {
                let (held, bytes) = self.export_kv(slot, r.clone(), written);
                (r, held, bytes)
            })
            .collect();
        SlotKv { written, blocks }
    }

    /// Writes what `export_slot` took into `slot`.
    pub fn import_slot(&mut self, slot: usize, kv: &SlotKv) -> Result<(), ModelError> {
        for (r, held, bytes) in &kv.blocks {
            self.import_kv(slot, r.clone(), (held, bytes), held)?;
        }
        Ok(())
    }
}

/// A slot's KV on the host (`Pipeline::export_slot`): runs of positions, each with the
/// layers that hold all of it and their K and V rows.
pub struct SlotKv {
    pub written: usize,
    blocks: Vec<(std::ops::Range<usize>, Vec<bool>, Vec<u8>)>,
}

impl SlotKv {
    /// Bytes it takes on the host.
    pub fn bytes(&self) -> usize {
        self.blocks.iter().map(|b| b.2.len()).sum()
    }
}

/// Positions up to `written` cut where a ring's held positions start (`written - cap`)
/// and every `SLOT_RUN` positions: each run held whole or not at all by each layer, so a
/// layer's held positions are exactly the runs it holds.
fn slot_runs(layers: &[LayerCache], written: usize) -> Vec<std::ops::Range<usize>> {
    let mut cuts: Vec<usize> = (0..written).step_by(SLOT_RUN).collect();
    cuts.extend(layers.iter().map(|l| written.saturating_sub(l.cap)));
    cuts.push(written);
    cuts.sort_unstable();
    cuts.dedup();
    cuts.windows(2).map(|w| w[0]..w[1]).collect()
}

/// Positions a run of `slot_runs` takes at most (so that no one copy holds a long
/// context's KV twice over).
const SLOT_RUN: usize = 1024;

/// What is left of a block as each part takes its layers' share, in layer order.
struct Cut<'a> {
    block: (&'a [bool], &'a [u8]),
    want: &'a [bool],
    per_layer: usize,
}

impl<'a> Cut<'a> {
    /// The next `layers` layers' share: their flags, the bytes of those held, what is
    /// wanted of them.
    fn take(&mut self, layers: usize) -> ((&'a [bool], &'a [u8]), &'a [bool]) {
        let (held, bytes) = self.block;
        let n = layers.min(held.len());
        let len = (held[..n].iter().filter(|&&x| x).count() * self.per_layer).min(bytes.len());
        let (want, rest) = self.want.split_at(n.min(self.want.len()));
        self.block = (&held[n..], &bytes[len..]);
        self.want = rest;
        ((&held[..n], &bytes[..len]), want)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layer(cap: usize, window: Option<usize>) -> LayerCache {
        LayerCache {
            base: 0,
            cap,
            window,
        }
    }

    #[test]
    fn a_slots_runs_are_each_held_whole_or_not_at_all_by_every_layer() {
        // A full layer (cap the context), rings of 71 and 300 positions.
        let layers = [layer(4096, None), layer(71, Some(8)), layer(300, Some(200))];
        for written in [0, 1, 70, 71, 72, 78, 299, 300, 1023, 1024, 2500] {
            let runs = slot_runs(&layers, written);
            // The runs tile 0..written in order.
            let mut at = 0;
            for r in &runs {
                assert!(r.start == at && r.end > r.start, "{written}: {runs:?}");
                assert!(r.len() <= SLOT_RUN, "{written}: {runs:?}");
                at = r.end;
            }
            assert_eq!(at, written, "{runs:?}");
            // Each run lies wholly inside or wholly before each layer's held positions.
            for l in &layers {
                let first = written.saturating_sub(l.cap);
                for r in &runs {
                    assert!(
                        r.end <= first || r.start >= first,
                        "{written}: {r:?}, {first}"
                    );
                }
            }
        }
    }
}
