//! Rotary position embedding: the model's frequencies (with its scaling) and the table
//! of cos/sin the backends' `rope` op reads.

use crate::store::arch::{ArchConfig, RopeScaling};

/// The rotary table: for position p and pair i, cos and sin of p * inv_freq[i] (times
/// YaRN's attention factor, where the model has one), laid out
/// [max_context][head_dim / 2][cos, sin] in f32 (computed in f64, rounded once).
pub fn rope_table(cfg: &ArchConfig, max_context: usize) -> Vec<f32> {
    let half = cfg.head_dim as usize / 2;
    let inv = inv_freq(cfg);
    let m = match &cfg.rope_scaling {
        Some(RopeScaling::Yarn {
            attention_factor, ..
        }) => *attention_factor as f64,
        _ => 1.0,
    };
    let mut t = Vec::with_capacity(max_context * half * 2);
    for p in 0..max_context {
        for f in inv.iter().take(half) {
            let a = p as f64 * *f;
            t.push((a.cos() * m) as f32);
            t.push((a.sin() * m) as f32);
        }
    }
    t
}

/// YaRN's inverse frequencies (transformers' `_compute_yarn_parameters`): each pair's
/// frequency between the interpolated (divided by `factor`) and the extrapolated one, by a
/// linear ramp over the pairs between the correction dims of `beta_fast` and `beta_slow`
/// rotations in the original context.
fn yarn(
    base: &[f64],
    theta: f64,
    dim: f64,
    (factor, original, beta_fast, beta_slow, truncate): (f64, f64, f64, f64, bool),
) -> Vec<f64> {
    let correction = |rotations: f64| {
        dim * (original / (rotations * 2.0 * std::f64::consts::PI)).ln() / (2.0 * theta.ln())
    };
    let (mut lo, mut hi) = (correction(beta_fast), correction(beta_slow));
    if truncate {
        (lo, hi) = (lo.floor(), hi.ceil());
    }
    let (lo, mut hi) = (lo.max(0.0), hi.min(dim - 1.0));
    if lo == hi {
        hi += 0.001;
    }
    base.iter()
        .enumerate()
        .map(|(i, &f)| {
            let ramp = ((i as f64 - lo) / (hi - lo)).clamp(0.0, 1.0);
            let extrapolate = 1.0 - ramp;
            f / factor * (1.0 - extrapolate) + f * extrapolate
        })
        .collect()
}

/// Rotary inverse frequencies with the model's scaling applied (transformers'
/// `_compute_default_rope_parameters`, `_compute_llama3_parameters` and
/// `_compute_yarn_parameters`).
pub fn inv_freq(cfg: &ArchConfig) -> Vec<f64> {
    let d = cfg.head_dim as f64;
    let base: Vec<f64> = (0..cfg.head_dim as usize / 2)
        .map(|i| 1.0 / (cfg.rope_theta as f64).powf(2.0 * i as f64 / d))
        .collect();
    match &cfg.rope_scaling {
        None => base,
        Some(RopeScaling::Linear { factor }) => base.iter().map(|f| f / *factor as f64).collect(),
        Some(RopeScaling::FreqFactors(ff)) => {
            base.iter().zip(ff).map(|(f, s)| f / *s as f64).collect()
        }
        Some(RopeScaling::Yarn {
            factor,
            original_max_position,
            beta_fast,
            beta_slow,
            truncate,
            ..
        }) => yarn(
            &base,
            cfg.rope_theta as f64,
            d,
            (
                *factor as f64,
                *original_max_position as f64,
                *beta_fast as f64,
                *beta_slow as f64,
                *truncate,
            ),
        ),
        Some(RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position,
        }) => {
            let (factor, lo, hi, orig) = (
                *factor as f64,
                *low_freq_factor as f64,
                *high_freq_factor as f64,
                *original_max_position as f64,
            );
            let low_wavelen = orig / lo;
            let high_wavelen = orig / hi;
            base.iter()
                .map(|&f| {
                    let wavelen = 2.0 * std::f64::consts::PI / f;
                    if wavelen < high_wavelen {
                        f
                    } else if wavelen > low_wavelen {
                        f / factor
                    } else {
                        let smooth = (orig / wavelen - lo) / (hi - lo);
                        (1.0 - smooth) * f / factor + smooth * f
                    }
                })
                .collect()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::{CpuBackend, CpuMem};
    use crate::backend::Backend;
    use crate::store::arch::Arch;

    fn mem_f32(b: &CpuBackend, v: &[f32]) -> CpuMem {
        let mut m = b.alloc(v.len() * 4, "test").unwrap();
        m.f32s_mut()[..v.len()].copy_from_slice(v);
        m
    }

    fn cfg(head_dim: u32, rope_scaling: Option<RopeScaling>) -> ArchConfig {
        ArchConfig {
            arch: Arch::Llama,
            name: String::new(),
            n_layers: 1,
            hidden: 64,
            n_heads: 4,
            n_kv_heads: 2,
            head_dim,
            intermediate: 64,
            vocab: 10,
            max_context: 64,
            rope_theta: 500000.0,
            rope_scaling,
            rms_eps: 1e-5,
            tied_embeddings: true,
            qkv_bias: false,
            sliding_window: None,
            ext: Default::default(),
            moe: None,
            swiglu: None,
        }
    }

    #[test]
    fn rope_matches_f64_rotate_half_for_default_and_llama3_scaling() {
        let b = CpuBackend::new(1 << 30, 2).unwrap();
        let mut r = crate::util::rng::Rng::new(3);
        let hd = 16usize;
        let llama3 = RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position: 64,
        };
        for scaling in [None, Some(llama3)] {
            let c = cfg(hd as u32, scaling.clone());
            let table = rope_table(&c, 64);
            let tm = mem_f32(&b, &table);
            let heads = 3;
            let positions = [0u32, 5, 63];
            let x = r.symmetric_vec(positions.len() * heads * hd);
            let mut xm = mem_f32(&b, &x);
            b.rope(&mut xm, positions.len(), heads, hd, &positions, &tm);
            // transformers: inv_freq (with llama3 smoothing), rotate_half.
            let inv: Vec<f64> = inv_freq(&c);
            if scaling.is_some() {
                // The lowest frequencies are divided by the factor, the highest kept.
                let base: Vec<f64> = (0..hd / 2)
                    .map(|i| 1.0 / 500000f64.powf(2.0 * i as f64 / hd as f64))
                    .collect();
                assert_eq!(inv[0], base[0]);
                assert!((inv[hd / 2 - 1] - base[hd / 2 - 1] / 8.0).abs() < 1e-18);
            }
            for (ri, &p) in positions.iter().enumerate() {
                for h in 0..heads {
                    let at = (ri * heads + h) * hd;
                    for i in 0..hd {
                        let (x1, x2) = (
                            x[at + i] as f64,
                            if i < hd / 2 {
                                -(x[at + i + hd / 2] as f64)
                            } else {
                                x[at + i - hd / 2] as f64
                            },
                        );
                        let a = p as f64 * inv[i % (hd / 2)];
                        let want = x1 * a.cos() + x2 * a.sin();
                        assert!(
                            (xm.f32s()[at + i] as f64 - want).abs() <= 1e-5,
                            "pos {p} head {h} dim {i}"
                        );
                    }
                }
            }
        }
    }
}
