//! The head unit: the final norm of the rows that need logits (each sequence's last, a
//! verified span's every one) and the output projection, whole or in row parts when it
//! streams (`head_norm`, `head_part`, `head_rows`); and the step's logits.

use super::{Decoder, TensorLoc};
use crate::backend::Backend;
use std::ops::Range;

impl<B: Backend> Decoder<B> {
    /// The head unit's work up to the output projection (each sequence's last row, or a
    /// verified span's every row, normed), when the projection then runs in row parts
    /// (`head_part`).
    pub fn head_norm(&mut self, b: &B, mem: &B::Mem) {
        let _span = tracing::trace_span!("unit", unit = self.unit_kinds.len() - 1).entered();
        self.head_prologue(b, mem);
        let n = self.logit_rows.len();
        self.host_logits.clear();
        self.host_logits
            .resize(n * self.cfg.vocab as usize, f32::NAN);
        self.logits_on_host = true;
    }

    /// Logits of vocabulary rows `rows` from part `mem` of the output projection's unit
    /// (whose bytes start at the unit's raw offset `raw_base`), after `head_norm`.
    pub fn head_part(&mut self, b: &B, mem: &B::Mem, raw_base: u64, rows: Range<u64>) {
        debug_assert!(self.logits_on_host, "head_norm first");
        let row_bytes = self
            .lm_head
            .dtype
            .row_bytes(self.lm_head.cols as u64)
            .expect("validated at load") as usize;
        let (r0, r1) = (rows.start as usize, rows.end as usize);
        let loc = TensorLoc {
            offset: self.lm_head.offset + r0 * row_bytes - raw_base as usize,
            rows: r1 - r0,
            ..self.lm_head
        };
        let n = self.logit_rows.len();
        b.matmul_head(&self.ws.last_n, n, loc.at(mem), &mut self.ws.logits);
        let part = &mut self.part_logits;
        part.resize(n * (r1 - r0), 0.0);
        b.download_f32(&self.ws.logits, 0, part);
        let v = self.cfg.vocab as usize;
        for (i, row) in part.chunks_exact(r1 - r0).enumerate() {
            self.host_logits[i * v + r0..i * v + r1].copy_from_slice(row);
        }
    }

    /// Logits of vocabulary rows `rows` (ascending) from `table`, which holds those rows of
    /// the output projection one after another (the rows between head parts), after
    /// `head_norm`.
    pub fn head_rows(&mut self, b: &B, table: &B::Mem, rows: &[u64]) {
        debug_assert!(self.logits_on_host, "head_norm first");
        if rows.is_empty() {
            return;
        }
        let loc = TensorLoc {
            offset: 0,
            rows: rows.len(),
            ..self.lm_head
        };
        let n = self.logit_rows.len();
        b.matmul_head(&self.ws.last_n, n, loc.at(table), &mut self.ws.logits);
        let part = &mut self.part_logits;
        part.resize(n * rows.len(), 0.0);
        b.download_f32(&self.ws.logits, 0, part);
        let v = self.cfg.vocab as usize;
        for (i, got) in part.chunks_exact(rows.len()).enumerate() {
            for (&r, &l) in rows.iter().zip(got) {
                self.host_logits[i * v + r as usize] = l;
            }
        }
    }

    fn head_prologue(&mut self, b: &B, mem: &B::Mem) {
        let h = self.cfg.hidden as usize;
        // Only each sequence's last position needs logits (a verified span's every one).
        // Rows go in the caller's step order, so the logits come out in it.
        for (i, &r) in self.logit_rows.iter().enumerate() {
            b.copy_row(&self.ws.x, r, &mut self.ws.last, i, h);
        }
        let n = self.logit_rows.len();
        b.rms_norm(
            &self.ws.last,
            self.norm.at(mem),
            self.cfg.rms_eps,
            n,
            &mut self.ws.last_n,
        );
    }

    pub(super) fn head(&mut self, b: &B, mem: &B::Mem, lm: &B::Mem) {
        self.head_prologue(b, mem);
        let n = self.logit_rows.len();
        // One row per sequence (a verified span's every row): every row through the decode
        // kernels (batch-invariant), with f32 activations (`matmul_head`).
        b.matmul_head(&self.ws.last_n, n, self.lm_head.at(lm), &mut self.ws.logits);
    }

    /// The logits of the step: one row of `vocab` per sequence in step order, a verified
    /// span's rows one after another (`SeqStep::logit_rows`).
    pub fn logits(&self, b: &B, out: &mut Vec<f32>) {
        let v = self.cfg.vocab as usize;
        out.resize(self.logit_rows.len() * v, 0.0);
        if self.logits_on_host {
            out.copy_from_slice(&self.host_logits);
            return;
        }
        b.download_f32(&self.ws.logits, 0, out);
    }
}
