//! The engine: runs forward passes over a model's layer units and generates text.
//! `Runner` owns the backend, the model and where each unit's weights live.

pub mod generate;
pub mod scheduler;

use crate::backend::cpu::CpuBackend;
use crate::backend::BackendError;
use crate::io::IoConfig;
use crate::io::IoError;
use crate::model::ModelError;
use crate::plan::PlanInput;
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
    #[error(transparent)]
    Plan(#[from] crate::plan::PlanError),
    #[error("{0}")]
    Invalid(String),
}

impl EngineError {
    /// True when stored model data is bad (DATA_LOSS for a server).
    pub fn is_data_loss(&self) -> bool {
        matches!(self, EngineError::Io(e) if e.is_data_loss())
    }
}

/// The runner of forward passes: the streaming pipeline (with every unit resident when
/// the plan says so).
pub type Runner<B> = crate::pipeline::Pipeline<B>;

/// Plans memory for `store` and builds a CPU runner whose arena is exactly the planned
/// device budget (so the budget is enforced, as on a GPU).
pub fn cpu_runner(
    store: Arc<Store>,
    input: &PlanInput,
    threads: usize,
    io: IoConfig,
) -> Result<Runner<CpuBackend>, EngineError> {
    let plan = crate::plan::plan(store.manifest(), input)?;
    let backend = CpuBackend::new(plan.device_budget, threads)?;
    Runner::new(backend, store, plan, input.opts, io)
}
