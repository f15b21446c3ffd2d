//! A self-draft (`--draft self:TYPE`, SubSpec's form): the model drafts for itself, every
//! unit it keeps resident run as it is and every unit it streams replaced by a resident
//! quantized copy. The resident units are shared, not duplicated: the draft's passes read
//! the pipeline's own resident memory, so it costs the quantized copies of the streamed
//! units and a decoder of its own (KV cache and workspace), allocated in the model's
//! memory (`PlanInput::self_draft_reserved`), and no disk read per drafted token.

use super::{Pipeline, PipelineError};
use crate::backend::Backend;
use crate::model::{Decoder, ModelError, ModelOptions, SeqStep};
use crate::store::format::Manifest;
use crate::store::Store;
use std::sync::Arc;

/// A self-draft's decoder and the quantized copies of the units its model streams.
pub struct SelfDraft<B: Backend> {
    decoder: Decoder<B>,
    /// Per unit: the quantized copy, where the model does not keep the unit resident.
    subs: Vec<Option<B::Mem>>,
    /// The store of the copies.
    pub store: Arc<Store>,
    /// Device bytes it holds: the copies, the KV cache and the workspace.
    pub bytes: u64,
    /// Units it runs from the model's own memory.
    pub shared_units: usize,
}

/// Why `q` cannot stand in for `m`'s units: they differ in kind or in tensor names.
fn mismatch(m: &Manifest, q: &Manifest) -> Option<String> {
    if m.units.len() != q.units.len() || m.arch.n_layers != q.arch.n_layers {
        return Some(format!(
            "it has {} units and the model {}",
            q.units.len(),
            m.units.len()
        ));
    }
    m.units.iter().zip(&q.units).find_map(|(a, b)| {
        let names = |u: &crate::store::LayerUnit| -> Vec<String> {
            u.tensors.iter().map(|t| t.name.clone()).collect()
        };
        (a.kind != b.kind || names(a) != names(b))
            .then(|| format!("its {} is not the model's {}", b.kind, a.kind))
    })
}

impl<B: Backend> Pipeline<B> {
    /// The self-draft of this pipeline's model on `q` (the model's units quantized,
    /// `engine::self_draft::quantized_store`): a decoder with `opts` over the pipeline's
    /// resident units and `q`'s copies of the rest, loaded now.
    pub fn self_draft(
        &self,
        q: Arc<Store>,
        opts: ModelOptions,
    ) -> Result<SelfDraft<B>, PipelineError> {
        let m = self.store.manifest();
        if let Some(why) = mismatch(m, q.manifest()) {
            return Err(ModelError::Layout(format!(
                "self-draft store {}: {why}; delete it and it is made again",
                q.dir().display()
            ))
            .into());
        }
        // The model's units where it keeps them resident, the copies' elsewhere.
        let mut mixed = m.clone();
        for (u, unit) in mixed.units.iter_mut().enumerate() {
            if self.resident[u].is_none() {
                *unit = q.units()[u].clone();
            }
        }
        let before = self.backend.budget().used();
        let decoder = Decoder::new(&self.backend, &mixed, opts)?;
        let subs = load_copies(&self.backend, &q, &self.resident)?;
        let shared_units = subs.iter().filter(|s| s.is_none()).count();
        Ok(SelfDraft {
            decoder,
            subs,
            store: q,
            bytes: self.backend.budget().used() - before,
            shared_units,
        })
    }

    /// One pass of the self-draft `d` over `steps`: every unit from the pipeline's resident
    /// memory or `d`'s copy, none read from disk; fills `logits` (a row per step).
    pub fn self_draft_step(
        &mut self,
        d: &mut SelfDraft<B>,
        steps: &[SeqStep],
        logits: &mut Vec<f32>,
    ) -> Result<(), PipelineError> {
        d.decoder.begin(steps)?;
        let mem = |u: usize| -> &B::Mem {
            match (&self.resident[u], &d.subs[u]) {
                (Some(m), _) | (None, Some(m)) => m,
                // `self_draft` made a copy of every unit that is not resident.
                (None, None) => unreachable!("unit {u} has no memory for the self-draft"),
            }
        };
        let tied = self.store.manifest().arch.tied_embeddings;
        let n = self.resident.len();
        for u in 0..n {
            let lm = (tied && u == n - 1).then(|| mem(0));
            d.decoder.forward_unit(&self.backend, u, mem(u), lm);
        }
        d.decoder.logits(&self.backend, logits);
        self.backend.check()?;
        Ok(())
    }
}

/// The units of `q` whose counterparts are not `resident`, each read frame by frame (a
/// frame's bounce buffer and decoded bytes the only transient host memory, O_DIRECT where
/// the file system takes it) and decoded into its allocation, or uploaded frame by frame
/// where device memory is not host memory.
fn load_copies<B: Backend>(
    backend: &B,
    q: &Store,
    resident: &[Option<B::Mem>],
) -> Result<Vec<Option<B::Mem>>, PipelineError> {
    use crate::io::IoError;
    let path = q.weights_path();
    let (file, direct) = crate::io::open_direct(path)
        .map_err(|e| IoError::Data(crate::store::StoreError::io("open", path, e)))?;
    let m = q.manifest();
    let bounce_len = super::gather::bounce_len(m.frame_stored_len_max());
    let raw_max = m.frame_raw_len_max() as usize;
    let no_buffer = |what: &str| {
        IoError::Data(crate::store::StoreError::invalid(
            q.dir(),
            format!("cannot allocate {what} to load the self-draft"),
        ))
    };
    let mut bounce =
        crate::hostbuf::AlignedBuf::new(bounce_len).ok_or_else(|| no_buffer("a read buffer"))?;
    let mut dec = q
        .frame_decoder(raw_max)
        .map_err(|_| no_buffer("a frame decoder"))?;
    let mut frame = Vec::new();
    let mut subs = Vec::with_capacity(resident.len());
    for (u, r) in resident.iter().enumerate() {
        if r.is_some() {
            subs.push(None);
            continue;
        }
        let unit = &q.units()[u];
        let mut mem = backend.alloc(
            unit.raw_len as usize,
            &format!("self-draft copy of {}", unit.kind),
        )?;
        let in_place = backend.host_bytes_mut(&mut mem).is_some();
        if !in_place {
            backend.upload_begin(&mut mem)?;
        }
        for (fi, f) in unit.frames.iter().enumerate() {
            let fault = |fault| IoError::Data(q.frame_error(u, fi, fault));
            let src = super::gather::read_frame(&file, f, &mut bounce).map_err(fault)?;
            let (d, len) = (f.raw_offset as usize, f.raw_len as usize);
            match backend.host_bytes_mut(&mut mem) {
                Some(dst) => dec
                    .decode(f.codec, &f.planes, f.checksum, src, &mut dst[d..d + len])
                    .map_err(fault)?,
                None => {
                    frame.resize(len, 0);
                    dec.decode(f.codec, &f.planes, f.checksum, src, &mut frame)
                        .map_err(fault)?;
                    backend.upload_part(&mut mem, d, &frame)?;
                }
            }
        }
        if !in_place {
            backend.upload_end(&mut mem)?;
            backend.upload_wait(&mem)?;
        }
        subs.push(Some(mem));
    }
    if !direct {
        crate::hostmem::drop_cached(&file);
    }
    Ok(subs)
}

impl<B: Backend> SelfDraft<B> {
    /// Gives back the memory of `slot`'s draft KV cache (`Decoder::discard_slot`).
    pub fn discard_slot(&mut self, backend: &B, slot: usize) -> usize {
        self.decoder.discard_slot(backend, slot)
    }

    pub fn options(&self) -> &ModelOptions {
        self.decoder.options()
    }
}
