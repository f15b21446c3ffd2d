//! A packed store as a `PackSource`: its tensors as `pack` asks for them, read and decoded
//! a unit at a time. This is how a store is rewritten: `Quantized` over it makes the
//! quantized copy a self-draft runs on (`engine::self_draft`), unit for unit the store's.

use super::format::TensorEntry;
use super::writer::{ModelHeader, PackSource, TensorLayout, UnitSpec};
use super::{Store, StoreError};
use std::collections::HashMap;
use std::fs::File;
use std::sync::Mutex;

/// The tensors of an open store. Reads that fail are kept (the first one) for `finish`:
/// `PackSource::copy_tensor` cannot fail, so the pack that asked is then discarded.
pub struct StoreSource<'s> {
    store: &'s Store,
    file: File,
    /// Each tensor's unit and entry.
    index: HashMap<String, (usize, TensorEntry)>,
    /// The unit last read, decoded (pack asks for a unit's tensors together).
    unit: Mutex<Option<(usize, Vec<u8>)>>,
    error: Mutex<Option<StoreError>>,
}

impl<'s> StoreSource<'s> {
    /// The tensors of `store`, which must keep its tokenizer (not opened for serving:
    /// `Store::release_tokenizer_spec`), since the pack writes it.
    pub fn new(store: &'s Store) -> Result<Self, StoreError> {
        if matches!(&store.manifest().tokenizer, super::format::TokenizerSpec::HfJson(j) if j.is_empty())
        {
            return Err(StoreError::Refused {
                path: store.dir().to_path_buf(),
                msg: "this store was opened without its tokenizer; open it again to rewrite it"
                    .into(),
            });
        }
        let index = store
            .units()
            .iter()
            .enumerate()
            .flat_map(|(u, unit)| {
                unit.tensors
                    .iter()
                    .map(move |t| (t.name.clone(), (u, t.clone())))
            })
            .collect();
        Ok(StoreSource {
            file: store.open_weights()?,
            store,
            index,
            unit: Mutex::new(None),
            error: Mutex::new(None),
        })
    }

    /// The store's units, tensor for tensor: a pack of them has its units.
    pub fn units(&self) -> Vec<UnitSpec> {
        self.store
            .units()
            .iter()
            .map(|u| UnitSpec {
                kind: u.kind,
                tensors: u.tensors.iter().map(|t| t.name.clone()).collect(),
            })
            .collect()
    }

    /// The first read that failed while packing, if one did.
    pub fn finish(self) -> Result<(), StoreError> {
        match self.error.into_inner() {
            Ok(None) => Ok(()),
            Ok(Some(e)) => Err(e),
            Err(p) => p.into_inner().map_or(Ok(()), Err),
        }
    }

    fn fail(&self, e: StoreError) {
        let mut first = self.error.lock().unwrap_or_else(|p| p.into_inner());
        if first.is_none() {
            *first = Some(e);
        }
    }
}

impl PackSource for StoreSource<'_> {
    fn header(&self) -> ModelHeader {
        let m = self.store.manifest();
        ModelHeader {
            arch: m.arch.clone(),
            tokenizer: m.tokenizer.clone(),
            special: m.special.clone(),
            chat_template: m.chat_template.clone(),
            source: format!("{} ({})", self.store.dir().display(), m.source),
            meta: m.meta.clone(),
        }
    }

    fn tensor(&self, name: &str) -> Option<TensorLayout> {
        self.index.get(name).map(|(_, t)| TensorLayout {
            dtype: t.dtype,
            shape: t.shape.clone(),
            len: t.len,
        })
    }

    fn copy_tensor(&self, name: &str, dst: &mut [u8]) {
        let Some((u, t)) = self.index.get(name) else {
            return;
        };
        let mut cached = self.unit.lock().unwrap_or_else(|p| p.into_inner());
        if cached.as_ref().is_none_or(|c| c.0 != *u) {
            *cached = None;
            let raw = self.store.units()[*u].raw_len as usize;
            let mut data = vec![0u8; raw];
            let read = self
                .store
                .frame_decoder(self.store.manifest().frame_raw_len_max() as usize)
                .map_err(|e| StoreError::io("allocate a frame decoder for", self.store.dir(), e))
                .and_then(|mut dec| {
                    self.store
                        .read_unit(&self.file, *u, &mut Vec::new(), &mut data, &mut dec)
                });
            if let Err(e) = read {
                dst.fill(0);
                return self.fail(e);
            }
            *cached = Some((*u, data));
        }
        if let Some((_, data)) = cached.as_ref() {
            // Inside the unit: the manifest was validated when the store opened.
            let (o, n) = (t.offset as usize, t.len as usize);
            dst.copy_from_slice(&data[o..o + n]);
        }
    }
}
