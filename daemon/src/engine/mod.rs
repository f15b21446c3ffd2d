//! The engine: runs forward passes over a model's layer units and generates text.
//! `Runner` owns the backend, the model and where each unit's weights live.

pub mod generate;

use crate::backend::{Backend, BackendError};
use crate::io::{IoConfig, IoEngine, IoError};
use crate::model::{Llama, ModelError, ModelOptions, SeqStep};
use crate::store::Store;
use std::sync::Arc;

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error(transparent)]
    Backend(#[from] BackendError),
    #[error(transparent)]
    Io(#[from] IoError),
    #[error(transparent)]
    Tokenizer(#[from] crate::text::tokenizer::TokenizerError),
    #[error(transparent)]
    Template(#[from] crate::text::template::TemplateError),
    #[error("{0}")]
    Invalid(String),
}

impl EngineError {
    /// True when stored model data is bad (DATA_LOSS for a server).
    pub fn is_data_loss(&self) -> bool {
        matches!(self, EngineError::Io(e) if e.is_data_loss())
    }
}

/// A model with every layer unit resident in device memory.
pub struct Runner<B: Backend> {
    pub backend: B,
    pub model: Llama<B>,
    pub store: Arc<Store>,
    weights: Vec<B::Mem>,
}

impl<B: Backend> Runner<B> {
    /// Reserves KV cache and workspace, then loads every unit through the I/O engine and
    /// uploads it.
    pub fn load_resident(
        backend: B,
        store: Arc<Store>,
        opts: ModelOptions,
        io: IoConfig,
    ) -> Result<Self, EngineError> {
        let model = Llama::new(&backend, store.manifest(), opts)?;
        let engine = IoEngine::new(store.clone(), io)?;
        let n = store.units().len();
        let mut weights = Vec::with_capacity(n);
        // Two requests in flight: the next unit loads while this one uploads.
        let mut pending = std::collections::VecDeque::new();
        let mut next = 0;
        for u in 0..n {
            while next < n && pending.len() < 2 {
                pending.push_back(engine.request(next)?);
                next += 1;
            }
            let ticket = pending.pop_front().expect("requested above");
            let slot = engine.wait(ticket)?;
            let kind = store.units()[u].kind;
            let mut mem = backend.alloc(slot.data().len(), &format!("weights of {kind}"))?;
            backend.upload(&mut mem, slot.data())?;
            weights.push(mem);
        }
        Ok(Runner {
            backend,
            model,
            store,
            weights,
        })
    }

    /// Runs one step over every unit and fills `logits` (one row per sequence).
    pub fn step(&mut self, steps: &[SeqStep], logits: &mut Vec<f32>) -> Result<(), EngineError> {
        self.model.begin(steps)?;
        let head = self.model.lm_head_unit();
        for u in 0..self.weights.len() {
            self.model.forward_unit(
                &self.backend,
                u,
                &self.weights[u],
                Some(&self.weights[head]),
            );
        }
        self.model.logits(&self.backend, logits);
        Ok(())
    }
}
