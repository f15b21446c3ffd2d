//! The KV cache's slots beyond a step: what a finished sequence gives back, whether and
//! how a sequence goes on from KV another slot holds (the prefix cache's device tier), and
//! blocks of positions copied to the host and back (its host and disk tiers). Each
//! concerns the layers whose KV this decoder holds (`Decoder::new_part`).

use super::{Decoder, ModelError};
use crate::backend::{Backend, LayerCache};

impl<B: Backend> Decoder<B> {
    /// Tells the backend that `slot`'s part of every layer's KV cache holds nothing
    /// anyone will read (its sequence is over; the next one there writes each position
    /// before a query reads it), so the CPU gives those pages back: a daemon's resident
    /// set then follows the KV in use, not the longest sequence each slot has ever held.
    /// Returns the bytes given back.
    pub fn discard_slot(&mut self, b: &B, slot: usize) -> usize {
        if slot >= self.shape.slots {
            return 0;
        }
        let (width, kvb) = (
            self.shape.kv_heads * self.shape.head_dim,
            self.opts.kv_dtype.bytes(),
        );
        let mut given = 0;
        for l in &self.layers[self.kv_held.clone()] {
            let start = l.cache.at(&self.shape, slot, 0) * kvb;
            let range = start..start + l.cache.cap * width * kvb;
            given += b.discard(&mut self.cache_k, range.clone());
            given += b.discard(&mut self.cache_v, range);
        }
        given
    }

    /// Whether a sequence can go on from position `pos` with the KV a slot holds once it has
    /// written up to `written` (`pos <= written`): every layer still holds what a query at
    /// `pos` attends to (a full-attention layer always does; a ring, when `written` is at
    /// most its capacity past the window's start).
    pub fn can_resume(&self, pos: usize, written: usize) -> bool {
        pos <= written
            && self.layers[self.kv_held.clone()]
                .iter()
                .all(|l| l.cache.sees_all(pos, written))
    }

    /// Bytes of KV cache the first `n` positions of a slot take (K and V, every layer; a
    /// ring holds its last `cap` at most).
    pub fn kv_bytes(&self, n: usize) -> u64 {
        let width = (self.shape.kv_heads * self.shape.head_dim * self.opts.kv_dtype.bytes()) as u64;
        self.layers[self.kv_held.clone()]
            .iter()
            .map(|l| 2 * width * n.min(l.cache.cap) as u64)
            .sum()
    }

    /// Copies positions `positions` of slot `from`'s KV cache (which has written up to
    /// `written`) to slot `to`, in every layer: in a ring only those it still holds, which
    /// are all a query at `positions.end` reads when `can_resume(positions.end, written)`.
    pub fn copy_kv(
        &mut self,
        b: &B,
        (from, to): (usize, usize),
        positions: std::ops::Range<usize>,
        written: usize,
    ) {
        if from == to || positions.is_empty() {
            return;
        }
        for l in &self.layers[self.kv_held.clone()] {
            let start = positions.start.max(written.saturating_sub(l.cache.cap));
            let run = start.min(positions.end)..positions.end;
            b.kv_copy(
                &mut self.cache_k,
                &mut self.cache_v,
                (&self.shape, &l.cache),
                (from, to),
                run,
            );
        }
    }

    /// Each layer's part of the KV cache (its ring, where it has one).
    pub fn kv_layers(&self) -> impl Iterator<Item = &LayerCache> + '_ {
        self.layers[self.kv_held.clone()].iter().map(|l| &l.cache)
    }

    /// Bytes one position's K and V take in one layer.
    /// How many decoder layers this decoder holds the KV cache of (`Decoder::new_part`).
    pub fn kv_held_layers(&self) -> usize {
        self.kv_held.len()
    }

    pub fn kv_position_bytes(&self) -> usize {
        2 * self.shape.kv_heads * self.shape.head_dim * self.opts.kv_dtype.bytes()
    }

    /// Copies the K and V of `positions` of `slot` (which has written up to `written`) to
    /// the host: per layer, whether it still holds all of them (a ring may not), and the
    /// K then V rows of each layer that does, in layer order (a prefix-cache block).
    pub fn export_kv(
        &self,
        b: &B,
        slot: usize,
        positions: std::ops::Range<usize>,
        written: usize,
    ) -> (Vec<bool>, Vec<u8>) {
        let width = self.shape.kv_heads * self.shape.head_dim * self.opts.kv_dtype.bytes();
        let mut held = Vec::with_capacity(self.kv_held.len());
        let mut out = Vec::new();
        for l in &self.layers[self.kv_held.clone()] {
            let runs = l.cache.held_runs(positions.clone(), written);
            let all = runs[0].0 == positions.start && runs[0].1 + runs[1].1 == positions.len();
            held.push(all);
            if !all || slot >= self.shape.slots {
                continue;
            }
            for cache in [&self.cache_k, &self.cache_v] {
                for (first, n) in runs {
                    if n == 0 {
                        continue;
                    }
                    let at = out.len();
                    out.resize(at + n * width, 0);
                    let offset = l.cache.at(&self.shape, slot, first) * self.opts.kv_dtype.bytes();
                    b.kv_read(cache, offset, &mut out[at..]);
                }
            }
        }
        (held, out)
    }

    /// Writes back what `export_kv` gave for `positions` into `slot`, in the layers where
    /// `held` and `want` are both set (others are skipped, their bytes passed over).
    /// Errors when `bytes` is not the size `held` says, or the positions do not fit.
    pub fn import_kv(
        &mut self,
        b: &B,
        slot: usize,
        positions: std::ops::Range<usize>,
        (held, bytes): (&[bool], &[u8]),
        want: &[bool],
    ) -> Result<(), ModelError> {
        let kvb = self.opts.kv_dtype.bytes();
        let width = self.shape.kv_heads * self.shape.head_dim * kvb;
        let per_layer = 2 * positions.len() * width;
        let need = held.iter().filter(|&&h| h).count() * per_layer;
        if held.len() != self.kv_held.len() || bytes.len() != need {
            return Err(ModelError::Step(format!(
                "a KV block of {} bytes over {} layers, this model's is {need} bytes over {}",
                bytes.len(),
                held.len(),
                self.kv_held.len()
            )));
        }
        if slot >= self.shape.slots || positions.end > self.shape.max_context {
            return Err(ModelError::Step(format!(
                "KV block of positions {positions:?} outside slot {slot} of the cache"
            )));
        }
        let mut at = 0;
        for (i, l) in self.layers[self.kv_held.clone()].iter().enumerate() {
            if !held[i] {
                continue;
            }
            let src = &bytes[at..at + per_layer];
            at += per_layer;
            if !want.get(i).copied().unwrap_or(true) {
                continue;
            }
            // A ring shorter than the run keeps its last `cap` positions: the first ones'
            // rows are passed over.
            let half = positions.len() * width;
            for (c, cache) in [&mut self.cache_k, &mut self.cache_v]
                .into_iter()
                .enumerate()
            {
                for (first, n) in l.cache.held_runs(positions.clone(), positions.end) {
                    if n == 0 {
                        continue;
                    }
                    let from = c * half + (first - positions.start) * width;
                    let offset = l.cache.at(&self.shape, slot, first) * kvb;
                    b.kv_write(cache, offset, &src[from..from + n * width]);
                }
            }
        }
        Ok(())
    }
}
