//! Expert profiles: the tokens each expert of each layer was routed in an earlier run,
//! saved with `--save-expert-profile` and loaded to warm a later run's expert cache.

use crate::store::arch::ArchConfig;
use std::path::{Path, PathBuf};

/// Why an expert profile could not be read or written; each names the file.
#[derive(Debug, thiserror::Error)]
pub enum ProfileError {
    #[error("read expert profile {}: {err}", path.display())]
    Read { path: PathBuf, err: std::io::Error },
    #[error("expert profile {}: {err}", path.display())]
    Parse {
        path: PathBuf,
        err: serde_json::Error,
    },
    #[error("expert profile {} (of model {model:?}) has {layers} layers of {experts} experts; this model's are {want_layers} of {want_experts}: save a profile of this model (--save-expert-profile)", path.display())]
    Mismatch {
        path: PathBuf,
        model: String,
        layers: usize,
        experts: usize,
        want_layers: usize,
        want_experts: usize,
    },
    #[error("write expert profile {}: {err}", path.display())]
    Write { path: PathBuf, err: std::io::Error },
}

/// Of a loaded expert profile, the share of its routed tokens whose experts the plan keeps
/// resident (`ExpertProfile::hot_set`).
pub const PROFILE_HOT_SHARE: f64 = 0.5;

/// The tokens each expert of each decoder layer was routed (empty for a dense layer), as a
/// run measured them: saved to a file and loaded to warm a later run's expert cache.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ExpertProfile {
    /// The model's name as its store gives it (shown in the error when a profile's layers
    /// and experts do not match the model loading it).
    pub model: String,
    pub layers: Vec<Vec<u64>>,
}

impl ExpertProfile {
    /// Reads a profile from `path` (JSON), checked against `cfg`: a layer per decoder
    /// layer, an expert count per expert of each sparse layer, none for a dense one.
    pub fn load(path: &Path, cfg: &ArchConfig) -> Result<ExpertProfile, ProfileError> {
        let path_buf = || path.to_path_buf();
        let text = std::fs::read_to_string(path).map_err(|err| ProfileError::Read {
            path: path_buf(),
            err,
        })?;
        let p: ExpertProfile = serde_json::from_str(&text).map_err(|err| ProfileError::Parse {
            path: path_buf(),
            err,
        })?;
        let want: Vec<usize> = (0..cfg.n_layers)
            .map(|i| match &cfg.moe {
                Some(m) if cfg.is_sparse(i) => m.n_experts as usize,
                _ => 0,
            })
            .collect();
        let got: Vec<usize> = p.layers.iter().map(Vec::len).collect();
        if got != want {
            return Err(ProfileError::Mismatch {
                path: path_buf(),
                model: p.model,
                layers: got.len(),
                experts: got.iter().max().copied().unwrap_or(0),
                want_layers: want.len(),
                want_experts: want.iter().max().copied().unwrap_or(0),
            });
        }
        Ok(p)
    }

    /// The experts worth keeping resident: the fewest of the sparse layers' experts that
    /// together served `share` of the routed tokens (hottest first).
    pub fn hot_set(&self, share: f64) -> usize {
        let mut counts: Vec<u64> = self.layers.iter().flatten().copied().collect();
        counts.sort_unstable_by(|a, b| b.cmp(a));
        let total: u64 = counts.iter().sum();
        let want = (total as f64 * share).ceil() as u64;
        let mut sum = 0;
        counts
            .iter()
            .take_while(|&&c| {
                let short = sum < want && c > 0;
                sum += c;
                short
            })
            .count()
    }

    /// Writes the profile to `path` (JSON, replaced whole).
    pub fn save(&self, path: &Path) -> Result<(), ProfileError> {
        // Counts and a name: serializing them cannot fail.
        let text = serde_json::to_string(self).unwrap_or_default();
        let tmp = path.with_extension("tmp");
        std::fs::write(&tmp, text)
            .and_then(|_| std::fs::rename(&tmp, path))
            .map_err(|err| ProfileError::Write {
                path: path.to_path_buf(),
                err,
            })
    }
}
