//! A request's sampling settings as the command lines take them: `sluice generate`,
//! `chat` and `batch`, `sluiced run`, `sluice chat`'s `/set` and the parameters `sluice
//! batch` keeps beside its output all use this one list, and its one mapping to the
//! request's `SamplingParams`.

use crate::v1::SamplingParams;

/// The sampling settings a caller may give; each one left out (None) is the model's
/// recommended one. With the `cli` feature, a clap argument group and serializable.
#[cfg_attr(feature = "cli", derive(clap::Args, serde::Serialize))]
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SamplingArgs {
    /// Sampling temperature in [0, 2]; 0 is greedy. Each sampling setting left out is the
    /// model's recommended one (its generation_config.json or GGUF metadata), else
    /// temperature 0.8, top-k 40, top-p 0.95, min-p 0.05, repetition penalty 1.05.
    #[cfg_attr(feature = "cli", arg(long))]
    pub temperature: Option<f32>,
    /// Nucleus sampling: keep the most likely tokens up to this probability mass (1 or 0:
    /// off; default: the model's, else 0.95).
    #[cfg_attr(feature = "cli", arg(long))]
    pub top_p: Option<f32>,
    /// Keep only the k most likely tokens (0: off; default: the model's, else 40).
    #[cfg_attr(feature = "cli", arg(long))]
    pub top_k: Option<u32>,
    /// Drop tokens less likely than this fraction of the most likely one (0: off; default:
    /// the model's, else 0.05).
    #[cfg_attr(feature = "cli", arg(long))]
    pub min_p: Option<f32>,
    /// Seed of the sampler: the same seed and prompt give the same text.
    #[cfg_attr(feature = "cli", arg(long, default_value_t = 0))]
    pub seed: u64,
    /// Divide positive logits (multiply negative ones) of tokens already in the prompt or
    /// the text by this (transformers' repetition_penalty; 1 or 0: off; default: the
    /// model's, else 1.05).
    #[cfg_attr(feature = "cli", arg(long))]
    pub repetition_penalty: Option<f32>,
    /// Subtract this from the logit of every token generated so far (OpenAI's; 0: off).
    #[cfg_attr(
        feature = "cli",
        arg(long, default_value_t = 0.0, allow_negative_numbers = true)
    )]
    pub presence_penalty: f32,
    /// Subtract this once per time a token was generated (OpenAI's; 0: off).
    #[cfg_attr(
        feature = "cli",
        arg(long, default_value_t = 0.0, allow_negative_numbers = true)
    )]
    pub frequency_penalty: f32,
}

impl SamplingArgs {
    /// The settings' names, as `set` takes them.
    pub const NAMES: [&'static str; 8] = [
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "seed",
        "repetition_penalty",
        "presence_penalty",
        "frequency_penalty",
    ];

    /// Sets setting `name` from text; "model" or "default" puts an optional one back to
    /// the model's. The ranges are the daemon's to check.
    pub fn set(&mut self, name: &str, value: &str) -> Result<(), String> {
        fn num<T: std::str::FromStr>(name: &str, v: &str) -> Result<T, String> {
            v.parse()
                .map_err(|_| format!("{name}: {v:?} is not a number of the right kind"))
        }
        fn opt<T: std::str::FromStr>(name: &str, v: &str) -> Result<Option<T>, String> {
            if v == "model" || v == "default" {
                return Ok(None);
            }
            num(name, v).map(Some)
        }
        match name {
            "temperature" => self.temperature = opt(name, value)?,
            "top_p" => self.top_p = opt(name, value)?,
            "top_k" => self.top_k = opt(name, value)?,
            "min_p" => self.min_p = opt(name, value)?,
            "seed" => self.seed = num(name, value)?,
            "repetition_penalty" => self.repetition_penalty = opt(name, value)?,
            "presence_penalty" => self.presence_penalty = num(name, value)?,
            "frequency_penalty" => self.frequency_penalty = num(name, value)?,
            other => {
                return Err(format!(
                    "{other}: no such sampling setting (the settings: {})",
                    Self::NAMES.join(", ")
                ))
            }
        }
        Ok(())
    }

    /// Every setting, "name value" in `NAMES` order ("model's" where left to the model).
    pub fn describe(&self) -> String {
        fn or_model<T: std::fmt::Display>(v: Option<T>) -> String {
            v.map_or("model's".to_string(), |v| v.to_string())
        }
        let values = [
            or_model(self.temperature),
            or_model(self.top_p),
            or_model(self.top_k),
            or_model(self.min_p),
            self.seed.to_string(),
            or_model(self.repetition_penalty),
            self.presence_penalty.to_string(),
            self.frequency_penalty.to_string(),
        ];
        let pairs: Vec<String> = Self::NAMES
            .iter()
            .zip(values)
            .map(|(n, v)| format!("{n} {v}"))
            .collect();
        pairs.join(" ")
    }

    /// The settings of a request's `SamplingParams` (its logit biases are not among them).
    pub fn of_request(s: &SamplingParams) -> Self {
        SamplingArgs {
            temperature: s.temperature,
            top_p: s.top_p,
            top_k: s.top_k,
            min_p: s.min_p,
            seed: s.seed,
            repetition_penalty: s.repetition_penalty,
            presence_penalty: s.presence_penalty,
            frequency_penalty: s.frequency_penalty,
        }
    }

    /// The request's `SamplingParams` with these settings (no logit biases).
    pub fn request(&self) -> SamplingParams {
        SamplingParams {
            temperature: self.temperature,
            top_p: self.top_p,
            top_k: self.top_k,
            min_p: self.min_p,
            seed: self.seed,
            repetition_penalty: self.repetition_penalty,
            presence_penalty: self.presence_penalty,
            frequency_penalty: self.frequency_penalty,
            ..Default::default()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every name `set` takes is in NAMES and in `describe`, and a request round-trips.
    #[test]
    fn every_setting_is_named_set_described_and_carried() {
        let mut a = SamplingArgs::default();
        let values = ["0.7", "0.9", "12", "0.02", "42", "1.1", "-0.5", "0.25"];
        for (n, v) in SamplingArgs::NAMES.iter().zip(values) {
            a.set(n, v).unwrap();
        }
        assert_eq!(
            a.describe(),
            "temperature 0.7 top_p 0.9 top_k 12 min_p 0.02 seed 42 repetition_penalty 1.1 presence_penalty -0.5 frequency_penalty 0.25"
        );
        assert_eq!(SamplingArgs::of_request(&a.request()), a);
        a.set("temperature", "model").unwrap();
        assert_eq!(a.temperature, None);
        assert!(a.set("seed", "model").is_err());
        assert!(a.set("top_k", "1.5").is_err());
        assert!(a
            .set("tempreature", "1")
            .unwrap_err()
            .contains("temperature"));
    }
}
