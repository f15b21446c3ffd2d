//! `--codec auto`: per tensor, the codec that delivers decompressed bytes fastest from
//! this disk with these decode workers:
//!
//!   effective = min(disk rate / ratio, workers x one core's decode rate)
//!
//! Each candidate's decode rate is measured per dtype on a sample of the model's own
//! tensors (`calibrate`), its ratio per tensor on up to three of the tensor's frames
//! (`Auto::choose_for`). Within 2 % of the best effective rate the smaller ratio wins
//! (fewer bytes read and cached), then the earlier candidate: for the same rates the
//! choice is always the same.

use super::codec::{CodeCensus, Codec, FrameDecoder, FrameEncoder};
use super::float::SharedTables;
use crate::dtype::DType;
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

/// What `--codec auto` chooses among.
pub const CANDIDATES: [Codec; 5] = [
    Codec::None,
    Codec::Lz4,
    Codec::Zstd { level: 1 },
    Codec::Float,
    Codec::FloatFast,
];

/// Bytes of each dtype's calibration sample at most (the writer takes them from the
/// first tensors of the dtype).
pub const SAMPLE_BYTES: usize = 8 << 20;
/// Decoding a sample repeats this long; the fastest pass counts.
const DECODE_TIME: Duration = Duration::from_millis(60);
/// Effective rates this close to the best count as a tie.
const TIE: f64 = 0.02;

/// One candidate on some bytes: stored over raw, and GB/s of decompressed bytes one core
/// decodes.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Rate {
    pub codec: Codec,
    pub ratio: f64,
    pub decode_gbps: f64,
}

/// Decompressed GB/s a codec delivers from a disk of `disk_gbps` with `workers` decode
/// workers.
pub fn effective(disk_gbps: f64, workers: usize, ratio: f64, decode_gbps: f64) -> f64 {
    (disk_gbps / ratio.max(1e-6)).min(workers as f64 * decode_gbps)
}

/// The candidate with the highest effective rate (ties as the module says).
pub fn choose(disk_gbps: f64, workers: usize, rates: &[Rate]) -> Codec {
    let eff = |r: &Rate| effective(disk_gbps, workers, r.ratio, r.decode_gbps);
    let best = rates.iter().map(eff).fold(0f64, f64::max);
    rates
        .iter()
        .filter(|r| eff(r) >= best * (1.0 - TIE))
        .min_by(|a, b| a.ratio.total_cmp(&b.ratio))
        .map_or(Codec::None, |r| r.codec)
}

/// One codec on some frames (raw bytes of `dtype`, each at most `frame_size`): stored over
/// raw, and one core's compress and decompress GB/s (decompressed bytes). Decoding repeats
/// for `decode_time` and the fastest pass counts (a busy machine only ever slows a pass);
/// every frame is checked against its checksum each time.
pub fn measure_codec(
    codec: Codec,
    frames: &[&[u8]],
    dtype: DType,
    frame_size: usize,
    decode_time: Duration,
) -> std::io::Result<(f64, f64, f64)> {
    let mut enc = FrameEncoder::new(codec)?;
    let mut coded = Vec::with_capacity(frames.len());
    let t = Instant::now();
    // The float codec's shared codes, made from these frames as `pack` makes a store's
    // from its small frames; their bytes count as stored bytes (they are the manifest's).
    let shared = if codec.is_float() {
        let mut census = CodeCensus::for_codec(Some(codec));
        frames.iter().for_each(|f| census.add(f, dtype));
        census.codes()
    } else {
        Vec::new()
    };
    enc.set_shared(&shared);
    let shared_bytes = match shared.is_empty() {
        true => 0,
        false => postcard::to_stdvec(&shared).map_or(0, |b| b.len()),
    };
    for raw in frames {
        let e = enc.encode(raw, dtype)?;
        coded.push((e.codec, e.planes, e.bytes.to_vec()));
    }
    let compress = t.elapsed().as_secs_f64();
    let sums: Vec<u64> = frames.iter().map(|r| crate::util::xxh3(r)).collect();
    let tables = SharedTables::new(&shared).map_err(std::io::Error::other)?;
    let mut dec = FrameDecoder::new(frame_size)?.with_shared(std::sync::Arc::new(tables));
    let mut dst = vec![0u8; frame_size];
    let (mut best, t) = (f64::INFINITY, Instant::now());
    while best.is_infinite() || t.elapsed() < decode_time {
        let p = Instant::now();
        for ((c, planes, bytes), (raw, &sum)) in coded.iter().zip(frames.iter().zip(&sums)) {
            dec.decode(*c, planes, sum, bytes, &mut dst[..raw.len()])
                .map_err(|e| std::io::Error::other(format!("{codec} on {}: {e}", dtype.name())))?;
        }
        best = best.min(p.elapsed().as_secs_f64());
    }
    let raw: usize = frames.iter().map(|r| r.len()).sum();
    let stored: usize = coded.iter().map(|c| c.2.len()).sum::<usize>() + shared_bytes;
    let raw = raw as f64;
    Ok((
        stored as f64 / raw.max(1.0),
        raw / compress.max(1e-9) / 1e9,
        raw / best.max(1e-9) / 1e9,
    ))
}

/// Ratio and decode rate of each candidate on `sample` (elements of `dtype`), cut into
/// frames of `frame_size` as `pack` cuts them.
pub fn measure(sample: &[u8], dtype: DType, frame_size: usize) -> std::io::Result<Vec<Rate>> {
    let frames: Vec<&[u8]> = sample.chunks(frame_size).collect();
    CANDIDATES
        .iter()
        .map(|&codec| {
            let (ratio, _, decode_gbps) =
                measure_codec(codec, &frames, dtype, frame_size, DECODE_TIME)?;
            Ok(Rate {
                codec,
                ratio,
                decode_gbps,
            })
        })
        .collect()
}

/// The decisions of `--codec auto` for one pack: the disk and workers they are for, each
/// dtype's measured rates, and per dtype the tensors and raw bytes each codec got.
pub struct Auto {
    pub disk_gbps: f64,
    pub workers: usize,
    pub rates: BTreeMap<DType, Vec<Rate>>,
    pub chosen: BTreeMap<DType, BTreeMap<String, (usize, u64)>>,
    /// Every tensor is stored raw (`settle_raw`), and why.
    pub all_raw: bool,
    pub raw: Option<String>,
    /// What `pack --link` would save instead (`link_alternative`), when the source could
    /// be linked.
    pub link: Option<String>,
    encoders: Vec<(Codec, FrameEncoder)>,
}

impl Auto {
    /// Measures every dtype on its sample (`samples`: up to `SAMPLE_BYTES` of the first
    /// tensors of each dtype).
    pub fn calibrate(
        samples: &BTreeMap<DType, Vec<u8>>,
        frame_size: u32,
        disk_gbps: f64,
        workers: usize,
    ) -> std::io::Result<Auto> {
        let mut rates = BTreeMap::new();
        for (dtype, s) in samples {
            rates.insert(*dtype, measure(s, *dtype, frame_size as usize)?);
        }
        let encoders = CANDIDATES
            .iter()
            .map(|&c| FrameEncoder::new(c).map(|e| (c, e)))
            .collect::<Result<_, _>>()?;
        Ok(Auto {
            disk_gbps,
            workers: workers.max(1),
            rates,
            chosen: BTreeMap::new(),
            all_raw: false,
            raw: None,
            link: None,
            encoders,
        })
    }

    /// The store's shared codes, for the float codec's ratios (`FrameEncoder::set_shared`).
    pub fn set_shared(&mut self, codes: &[super::float::SharedCode]) {
        for (_, e) in &mut self.encoders {
            e.set_shared(codes);
        }
    }

    /// The codec for one tensor (`raw`, of `dtype`): its dtype's decode rates with the
    /// ratios of its first, middle and last frames.
    pub fn choose_for(
        &mut self,
        raw: &[u8],
        dtype: DType,
        frame_size: usize,
    ) -> std::io::Result<Codec> {
        let rates = match self.rates.get(&dtype) {
            Some(r) if !self.all_raw => r,
            _ => {
                self.count(dtype, Codec::None, raw.len());
                return Ok(Codec::None);
            }
        };
        let frames = raw.len().div_ceil(frame_size.max(1)).max(1);
        let mut picks = vec![0, frames / 2, frames - 1];
        picks.dedup();
        let sample: usize = picks
            .iter()
            .map(|&f| raw.len().min((f + 1) * frame_size) - f * frame_size)
            .sum();
        let mut mine = Vec::with_capacity(rates.len());
        for r in rates {
            let Some((_, enc)) = self.encoders.iter_mut().find(|(c, _)| *c == r.codec) else {
                continue;
            };
            let mut stored = 0usize;
            for &f in &picks {
                let piece = &raw[f * frame_size..raw.len().min((f + 1) * frame_size)];
                stored += enc.encode(piece, dtype)?.bytes.len();
            }
            mine.push(Rate {
                ratio: stored as f64 / sample.max(1) as f64,
                ..*r
            });
        }
        let codec = choose(self.disk_gbps, self.workers, &mine);
        self.count(dtype, codec, raw.len());
        Ok(codec)
    }

    /// A tensor of `len` bytes of `dtype` got `codec`.
    fn count(&mut self, dtype: DType, codec: Codec, len: usize) {
        let e = self
            .chosen
            .entry(dtype)
            .or_default()
            .entry(codec.to_string())
            .or_default();
        e.0 += 1;
        e.1 += len as u64;
    }

    /// The share of `bytes` (raw bytes per dtype) that the codecs this disk and these
    /// workers call for save, each dtype at the ratio, on its sample, of the candidate
    /// `choose` picks for it.
    fn saving(&self, bytes: &BTreeMap<DType, u64>) -> f64 {
        let total: u64 = bytes.values().sum();
        let saved: f64 = bytes
            .iter()
            .map(|(d, &b)| {
                let ratio = self.rates.get(d).map_or(1.0, |r| {
                    let c = choose(self.disk_gbps, self.workers, r);
                    r.iter().find(|x| x.codec == c).map_or(1.0, |x| x.ratio)
                });
                b as f64 * (1.0 - ratio).max(0.0)
            })
            .sum();
        saved / total.max(1) as f64
    }

    /// Where the chosen codecs save under `KEEP_RAW_SAVING_MIN` of the model (`bytes`: raw
    /// bytes per dtype), every tensor is stored raw: a unit stored as raw is read straight
    /// into its staging slot, with no read buffers and no decode (a quantized model's few
    /// float norms, coded, saved 0.1 % of SmolLM2 and cost it that path). A codec that
    /// shrinks the bytes a little but decodes slower than the disk reads (zstd on Q8_0
    /// blocks) is not chosen and saves nothing; on a slow disk (`--disk-gbps`) the same
    /// codec pays. The same rates, the same answer.
    pub fn settle_raw(&mut self, bytes: &BTreeMap<DType, u64>) -> bool {
        let frac = self.saving(bytes);
        let min = super::codec::KEEP_RAW_SAVING_MIN;
        self.all_raw = frac < min;
        self.raw = Some(format!(
            "  raw: the codecs chosen here save {:.1} % of {} ({} {:.0} %){}",
            frac * 100.0,
            crate::util::fmt_bytes(bytes.values().sum()),
            if self.all_raw { "under" } else { "at least" },
            min * 100.0,
            if self.all_raw {
                ": every tensor is stored raw, read straight into its staging slot"
            } else {
                ""
            }
        ));
        self.all_raw
    }

    /// For a source a store can link (`pack --link`), after `settle_raw`: where this
    /// store is the source's bytes again, a line saying what `--link` would save.
    /// `--codec auto` never links: a linked store streams slower wherever the host budget
    /// is tight, because the source's tensors sit at offsets the engine's O_DIRECT reads
    /// cannot land in place (every read needs a bounce span and the pipeline one more
    /// staging slot, which a tight `--host-memory` takes from resident layers).
    pub fn link_alternative(&mut self, source: &str) -> bool {
        if self.all_raw {
            self.link = Some(format!(
                "  link: this store is {source} again; `pack --link` would point at it instead of copying it, but streams slower under a tight --host-memory (unaligned tensors: bounce reads and one more staging slot)"
            ));
        }
        self.all_raw
    }

    /// The reasoning, a line per dtype: each candidate's ratio, decode rate and effective
    /// rate on the sample, and what the tensors got.
    pub fn report(&self) -> Vec<String> {
        let mut lines = vec![format!(
            "--codec auto for a disk of {:.2} GB/s and {} decode worker{}: effective = min(disk / ratio, workers x decode rate)",
            self.disk_gbps,
            self.workers,
            if self.workers == 1 { "" } else { "s" }
        )];
        for (dtype, rates) in &self.rates {
            let cands: Vec<String> = rates
                .iter()
                .map(|r| {
                    format!(
                        "{} {:.3}/{:.2}->{:.2}",
                        r.codec,
                        r.ratio,
                        r.decode_gbps,
                        effective(self.disk_gbps, self.workers, r.ratio, r.decode_gbps)
                    )
                })
                .collect();
            let got: Vec<String> = self.chosen.get(dtype).map_or(Vec::new(), |m| {
                m.iter()
                    .map(|(c, (n, b))| {
                        format!(
                            "{c} for {n} tensor{} ({})",
                            if *n == 1 { "" } else { "s" },
                            crate::util::fmt_bytes(*b)
                        )
                    })
                    .collect()
            });
            lines.push(format!(
                "  {}: ratio/GB/s->effective: {}; chose {}",
                dtype.name(),
                cands.join(", "),
                if got.is_empty() {
                    "nothing".to_string()
                } else {
                    got.join(", ")
                }
            ));
        }
        lines.extend(self.raw.clone());
        lines.extend(self.link.clone());
        lines
    }

    /// The codec that got the most raw bytes (the manifest's summary codec).
    pub fn main_codec(&self) -> Codec {
        let mut total: BTreeMap<String, u64> = BTreeMap::new();
        for m in self.chosen.values() {
            for (c, (_, b)) in m {
                *total.entry(c.clone()).or_default() += b;
            }
        }
        total
            .into_iter()
            .max_by_key(|(_, b)| *b)
            .and_then(|(c, _)| c.parse().ok())
            .unwrap_or(Codec::None)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rate(codec: Codec, ratio: f64, decode_gbps: f64) -> Rate {
        Rate {
            codec,
            ratio,
            decode_gbps,
        }
    }

    #[test]
    fn the_choice_follows_the_bound_and_is_the_same_for_the_same_rates() {
        let bf16 = [
            rate(Codec::None, 1.0, 20.0),
            rate(Codec::Lz4, 0.84, 2.7),
            rate(Codec::Zstd { level: 1 }, 0.687, 1.5),
            rate(Codec::Float, 0.665, 2.6),
        ];
        // A slow disk: the smallest ratio, whatever its speed, as long as the workers keep
        // up (0.5 / 0.665 = 0.75 < 2.6).
        assert_eq!(choose(0.5, 1, &bf16), Codec::Float);
        // 2 GB/s, one worker: none 2.0, lz4 2.38, zstd 1.5, float 2.6.
        assert_eq!(choose(2.0, 1, &bf16), Codec::Float);
        // 7 GB/s and one worker: the disk outruns every decoder: none.
        assert_eq!(choose(7.0, 1, &bf16), Codec::None);
        // 7 GB/s and 8 workers: float delivers 10.5, none 7.
        assert_eq!(choose(7.0, 8, &bf16), Codec::Float);
        // 14 GB/s and 4 workers: lz4 10.8 against float 10.4 and none 14: none.
        assert_eq!(choose(14.0, 4, &bf16), Codec::None);
        // Within 2 % the smaller ratio wins.
        let close = [rate(Codec::None, 1.0, 100.0), rate(Codec::Lz4, 0.8, 1.98)];
        assert_eq!(choose(2.0, 1, &close), Codec::Lz4);
        // Deterministic: the same inputs, the same answer, in any order.
        let mut rev = bf16;
        rev.reverse();
        for disk in [0.1, 0.5, 1.0, 2.0, 3.0, 5.0, 7.0, 14.0] {
            for w in [1, 2, 4, 8, 16] {
                assert_eq!(choose(disk, w, &bf16), choose(disk, w, &rev), "{disk} {w}");
            }
        }
        // Quantized weights that no codec shrinks: none.
        let q = [
            rate(Codec::None, 1.0, 20.0),
            rate(Codec::Lz4, 1.0, 9.0),
            rate(Codec::Zstd { level: 1 }, 1.0, 8.0),
            rate(Codec::Float, 1.0, 20.0),
        ];
        assert_eq!(choose(2.0, 1, &q), Codec::None);
    }

    /// Every tensor is stored raw where the chosen codecs save under 3 % of the bytes,
    /// each dtype weighted by its bytes: a K-quant model with a few float tensors, not a
    /// bf16 one nor one whose float tensors are a fifth of it; the same rates, the same
    /// answer. A linkable source stored raw names `--link` (`write_packed` never links for
    /// `--codec auto`).
    #[test]
    fn every_tensor_is_raw_where_the_chosen_codecs_save_under_3_percent() {
        let auto = |rates: Vec<(DType, Vec<Rate>)>| Auto {
            disk_gbps: 2.0,
            workers: 1,
            rates: rates.into_iter().collect(),
            chosen: BTreeMap::new(),
            all_raw: false,
            raw: None,
            link: None,
            encoders: Vec::new(),
        };
        let quant = vec![
            rate(Codec::None, 1.0, 20.0),
            rate(Codec::Lz4, 0.99, 9.0),
            rate(Codec::Zstd { level: 1 }, 0.98, 1.0),
            rate(Codec::Float, 1.0, 20.0),
        ];
        let bf16 = vec![rate(Codec::None, 1.0, 20.0), rate(Codec::Float, 0.665, 3.5)];
        let f32s = vec![rate(Codec::None, 1.0, 20.0), rate(Codec::Float, 0.80, 3.0)];
        let mut q = auto(vec![
            (DType::Q4K, quant.clone()),
            (DType::F32, f32s.clone()),
        ]);
        let bytes: BTreeMap<DType, u64> = [(DType::Q4K, 1000u64), (DType::F32, 10)].into();
        assert!(q.settle_raw(&bytes));
        // The float tensors the rates would code are stored raw too.
        assert_eq!(
            q.choose_for(&[0u8; 64], DType::F32, 32).expect("choose"),
            Codec::None
        );
        assert!(q.link_alternative("m.gguf"));
        let line = q.link.clone().expect("a reason");
        assert!(line.contains("`pack --link` would point at it"), "{line}");
        let report = q.report();
        assert!(report.iter().any(|l| l == &line));
        assert!(
            report
                .iter()
                .any(|l| l.contains("every tensor is stored raw")),
            "{report:?}"
        );
        // Float tensors that are a fifth of the bytes save 4 %: they are coded.
        let many: BTreeMap<DType, u64> = [(DType::Q4K, 800u64), (DType::F32, 200)].into();
        let mut f = auto(vec![(DType::Q4K, quant.clone()), (DType::F32, f32s)]);
        assert!(!f.settle_raw(&many));
        assert!(!f.link_alternative("m") && f.link.is_none());
        let mut b = auto(vec![(DType::BF16, bf16)]);
        assert!(!b.settle_raw(&[(DType::BF16, 100u64)].into()));
        assert!(b.raw.expect("a reason").contains("at least 3 %"));
        // zstd saves 5 % of Q8_0 blocks but decodes at 1.2 GB/s: from a 2 GB/s disk it is
        // not chosen and the store is raw; from a 0.5 GB/s one it pays.
        let q8 = vec![
            rate(Codec::None, 1.0, 12.0),
            rate(Codec::Zstd { level: 1 }, 0.945, 1.2),
        ];
        let q8_bytes: BTreeMap<DType, u64> = [(DType::Q8_0, 100u64)].into();
        assert!(auto(vec![(DType::Q8_0, q8.clone())]).settle_raw(&q8_bytes));
        let mut slow = auto(vec![(DType::Q8_0, q8)]);
        slow.disk_gbps = 0.5;
        assert!(!slow.settle_raw(&q8_bytes));
        // A dtype with no measured rates saves nothing.
        assert!(auto(vec![]).settle_raw(&[(DType::Q8_0, 5u64)].into()));
    }
}
