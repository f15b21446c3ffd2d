//! The memory planner: given the device budget, the host cache
//! budget, the batch and context limits and the manifest, decide what is resident, what
//! streams and through how many slots, and what the host keeps decompressed.
//!
//! Order of reservation: KV cache and workspace first (a step cannot run without them),
//! then streaming slots (at least 2: one computing, one loading), then whole units
//! resident, chosen to minimise the bytes streamed per pass, then the host cache.

use crate::model::decoder::{kv_cache_bytes, workspace_bytes};
use crate::model::ModelOptions;
use crate::store::format::{ExpertRange, Manifest, UnitKind, BLOB_ALIGN};
use crate::util::fmt_bytes;
use std::ops::Range;

/// For tests: a plan input with no budgets (everything resident), f32 KV and exact
/// numerics.
#[cfg(test)]
pub(crate) fn test_input(
    max_context: usize,
    kv_slots: usize,
    max_batch_tokens: usize,
) -> PlanInput {
    PlanInput {
        device_budget: None,
        host_cache_budget: 0,
        opts: ModelOptions {
            max_context,
            kv_slots,
            max_batch_tokens,
            kv_dtype: crate::model::KvDtype::F32,
            exact: true,
        },
        prefetch: None,
        expert_cache: None,
        expert_profile: None,
        backend_reserved: 0,
        host: Default::default(),
    }
}

#[cfg(test)]
mod tests;
use serde::Serialize;

/// Device allocations are rounded to this (the CPU arena's granularity; CUDA's is finer).
const ALLOC_ALIGN: u64 = 4096;
/// Streaming slots at least: one unit computes while the next uploads.
pub const STREAM_SLOTS_MIN: usize = 2;
/// Units requested from the I/O engine ahead of the one computing (host staging slots,
/// not device memory): enough to keep the disk and the decompression workers busy.
pub const PREFETCH_DEFAULT: usize = 4;
/// Bytes a store read straight into its staging slots should have requested ahead, where
/// memory allows: a disk's rate grows with the bytes in flight (this project's VM: 0.8 GB/s
/// at 8 MiB, 1.6 at 64, 2.0 at 256), so small units need many ahead. On SmolLM2 (2.1 MiB
/// units, 22 streamed) every streamed unit ahead read 0.84 of fio against 0.46 with four,
/// in six alternating rounds. Deeper staging only wins a tie on bytes streamed: it never
/// takes memory from resident units (`choose_residency`).
const STREAM_AHEAD_BYTES: u64 = 64 << 20;
/// Staging slots at most, whatever the bytes ahead ask.
const STAGING_MAX: usize = 64;

fn round(b: u64) -> u64 {
    b.div_ceil(ALLOC_ALIGN) * ALLOC_ALIGN
}

#[derive(Clone, Debug)]
pub struct PlanInput {
    /// Device memory the plan may use; None: whatever keeps every unit resident.
    pub device_budget: Option<u64>,
    /// Host memory for decompressed units that stream (0: none).
    pub host_cache_budget: u64,
    pub opts: ModelOptions,
    /// Units requested ahead of the one computing (default PREFETCH_DEFAULT).
    pub prefetch: Option<usize>,
    /// Slots of the expert cache when a mixture's experts stream (`--expert-cache`); None:
    /// as many as the memory the split leaves holds.
    pub expert_cache: Option<usize>,
    /// An expert profile (routing counts of an earlier run) will be loaded, which wants
    /// this many experts resident (`ExpertProfile::hot_set`): unless `expert_cache` says
    /// otherwise, the split leaves room for them and a step's loads in the expert cache
    /// before whole layers stay resident, and the hottest hold their slots for good
    /// (`Plan::expert_hot_slots`). When that cannot fit, the plan is made without it.
    pub expert_profile: Option<usize>,
    /// Device bytes the backend keeps for itself (CUDA: kernel metadata, cuBLAS scratch
    /// and workspace; CPU: 0), reserved before anything else.
    pub backend_reserved: u64,
    /// The host side: its budget and what is already spent.
    pub host: HostInput,
}

/// What the plan needs to know of the host.
#[derive(Clone, Debug)]
pub struct HostInput {
    /// Memory the whole process may use (`--host-memory`); None: the host side is planned
    /// and reported but not limited.
    pub budget: Option<u64>,
    /// Where the budget came from, for the plan table (`--host-memory`, or the default's
    /// sentence from `hostmem::default_host_budget`).
    pub budget_source: String,
    /// Bytes in use before the plan allocates anything: the process's resident set at
    /// start (code, tokenizer, runtime) and a margin (`hostmem::overhead_now`).
    pub overhead: u64,
    /// Device memory is host memory (the CPU backend): the device arena counts against
    /// the host budget, streamed units run straight from their staging slots (no device
    /// streaming slots, no copy) and a host cache is pointless (it would be resident).
    pub unified: bool,
    /// Bytes the read buffers may hold at most, and the largest read.
    pub reads_max_bytes: u64,
    pub request_bytes_max: u64,
    /// Bytes of reads the engine keeps out at once at most (`IoConfig::in_flight_bytes`).
    pub in_flight_max_bytes: u64,
    /// Decompression workers (each has scratch of the largest frame).
    pub workers: usize,
    /// What the compute threads keep for themselves outside the device arena (the CPU
    /// backend's, `CpuBackend::scratch_bytes`; 0 for CUDA, whose scratch is on the device).
    pub compute_scratch: u64,
}

impl Default for HostInput {
    fn default() -> Self {
        HostInput {
            budget: None,
            budget_source: "no host budget".into(),
            overhead: 0,
            unified: false,
            // The I/O engine's `sluiced run` preset (16 reads of 4 MiB); the runners set the
            // engine's actual shape.
            reads_max_bytes: 64 << 20,
            request_bytes_max: 4 << 20,
            in_flight_max_bytes: 32 << 20,
            workers: 1,
            compute_scratch: 0,
        }
    }
}

/// The host side of a plan: every role the process allocates on the host.
#[derive(Clone, Debug, Serialize)]
pub struct HostPlan {
    /// The budget (None: not limited).
    pub budget: Option<u64>,
    pub budget_source: String,
    /// Resident set at start plus margin (see HostInput::overhead).
    pub overhead_bytes: u64,
    /// The I/O engine's read buffers: count x size (the bytes reads may have in flight);
    /// none for a store whose units are stored as raw (read straight into staging slots).
    pub read_buffers: usize,
    pub request_bytes: u64,
    /// Reads the engine may have in flight: one per read buffer, or for a store read into
    /// its staging slots, enough for `HostInput::reads_max_bytes` (they cost no memory
    /// beyond the slots); either way no more than `HostInput::in_flight_max_bytes` of
    /// them (read buffers past that hold what has landed until a worker decodes it).
    pub reads_in_flight: usize,
    /// Staging slots the streamed units decompress into (on a unified backend their
    /// compute reads them there).
    pub staging_slots: usize,
    pub staging_slot_bytes: u64,
    /// Decompression workers' scratch (a frame each) and the loader's bounce buffers.
    pub scratch_bytes: u64,
    /// The compute threads' own scratch (HostInput::compute_scratch).
    pub compute_scratch_bytes: u64,
    /// A streamed embedding's lookup: the gathered rows, a frame's read buffer and its
    /// decoded bytes (0 when the embedding is resident).
    pub gather_bytes: u64,
    pub host_cache_bytes: u64,
    /// The device arena when device memory is host memory (0 otherwise).
    pub arena_bytes: u64,
    /// Extra bytes held only while resident units load at start (CUDA: the loader's
    /// staging), 0 once running.
    pub load_transient_bytes: u64,
    /// The most the plan holds at once: overhead + everything above (the larger of the
    /// loading and the running phase).
    pub total_bytes: u64,
}

impl HostPlan {
    /// Bytes of the I/O engine's read buffers.
    pub fn read_bytes(&self) -> u64 {
        self.read_buffers as u64 * self.request_bytes
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Placement {
    Resident,
    Streamed,
    /// Streamed to the device from a decompressed host copy (no disk, no decompression).
    HostCached,
}

#[derive(Clone, Debug, Serialize)]
pub struct UnitPlan {
    pub unit: String,
    pub placement: Placement,
    pub raw_bytes: u64,
    pub stored_bytes: u64,
    /// A streamed layer of a mixture that loads its dense part and only the experts a step
    /// routes to (`Plan::sparse`).
    pub experts_routed: bool,
    /// Such a layer whose dense part is resident: only its experts load.
    pub dense_resident: bool,
    /// A streamed dense layer that loads in pieces (`Plan::pieces`): how many (0: whole).
    pub pieces: usize,
}

/// A decoder layer of a mixture of experts that streams sparsely: its dense part
/// (norms, attention, router) is one load, and each expert a step routes to is a load of
/// its own (`LayerUnit::experts`: one run of frames, a page-aligned raw range).
#[derive(Clone, Debug, Serialize)]
pub struct SparseUnit {
    /// The dense part's frames (the unit's first, up to the first expert's) and raw bytes.
    pub dense_frames: Range<usize>,
    pub dense_raw: u64,
    pub experts: Vec<ExpertRange>,
}

/// Unit `u` as a sparse unit, when it can stream that way: a layer of the mixture whose
/// experts are laid out one run each, after everything else of the layer.
pub fn sparse_unit(m: &Manifest, u: usize) -> Option<SparseUnit> {
    let unit = m.units.get(u)?;
    let UnitKind::Decoder(i) = unit.kind else {
        return None;
    };
    let moe = m.arch.moe.as_ref().filter(|_| m.arch.is_sparse(i))?;
    let experts = unit.experts()?;
    let first = experts.first()?;
    let last = experts.last()?;
    if experts.len() != moe.n_experts as usize
        || first.frames.start == 0
        || last.raw.end != unit.raw_len
    {
        return None;
    }
    Some(SparseUnit {
        dense_frames: 0..first.frames.start,
        dense_raw: first.raw.start,
        experts,
    })
}

pub use crate::model::decoder::LAYER_PHASES;

/// A piece of a dense layer that streams in pieces: a run of its unit's frames holding
/// the whole tensors of consecutive phases (`LAYER_PHASES`), loaded into a staging slot
/// sized for it, and run as soon as it lands.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct LayerPiece {
    pub frames: Range<usize>,
    /// The raw offset in its unit of its first byte.
    pub raw_base: u64,
    pub phases: Range<usize>,
}

/// Unit `u` cut into pieces where a feed-forward projection starts a frame, so that a slot
/// need hold only the largest piece, not the layer: a dense decoder layer (a mixture's
/// layer streams its experts instead) laid out as `lay_out` writes one, its vectors and
/// attention first, then the gate, up and down projections. A store read straight into
/// the slots (stored as raw) is cut only where the frame starts O_DIRECT-aligned in the
/// file. A model with a norm after its feed-forward block (Gemma 2 and 3) keeps the first
/// piece, where that norm lies, until the last has run (`Decoder::first_piece_to_end`).
/// No piece is smaller than `min_bytes` (the plan's largest read request): a load smaller
/// than one read cannot keep the disk busy by itself, and each costs a request and a
/// hand-off (SmolLM2 stored raw at `--host-memory 64MiB`, in pieces of 0.55 MB against
/// layers of 2.1 MB streamed whole: 25.9-28.9 tokens/s against 29.8-36.7, three
/// alternating rounds of `bench-stream`, though it read 7 % less). None where no cut can
/// be made.
pub fn layer_pieces(m: &Manifest, u: usize, min_bytes: u64) -> Option<Vec<LayerPiece>> {
    let unit = m.units.get(u)?;
    let UnitKind::Decoder(i) = unit.kind else {
        return None;
    };
    if m.arch.is_sparse(i) {
        return None;
    }
    let mlp = ["gate_proj", "up_proj", "down_proj"]
        .map(|n| unit.tensor(&format!("model.layers.{i}.mlp.{n}.weight")));
    let [Some(gate), Some(up), Some(down)] = mlp else {
        return None;
    };
    let others_first = unit
        .tensors
        .iter()
        .filter(|t| ![gate, up, down].iter().any(|x| x.name == t.name))
        .all(|t| t.offset + t.len <= gate.offset);
    if !others_first || gate.offset >= up.offset || up.offset >= down.offset {
        return None;
    }
    let direct = unit.stored_as_raw();
    // (first frame, phase) where a piece may start.
    let cuts: Vec<(usize, usize)> = [gate, up, down]
        .iter()
        .enumerate()
        .filter_map(|(k, t)| {
            let f = unit.frames.iter().position(|f| f.raw_offset == t.offset)?;
            let aligned = unit.frames[f].file_offset.is_multiple_of(BLOB_ALIGN);
            (!direct || aligned).then_some((f, k + 1))
        })
        .collect();
    // Cuts that leave every piece `min_bytes` at least.
    let mut starts = vec![(0, 0)];
    for (f, phase) in cuts {
        let at = unit.frames[f].raw_offset;
        let from = unit.frames[starts[starts.len() - 1].0].raw_offset;
        if at - from >= min_bytes && unit.raw_len - at >= min_bytes {
            starts.push((f, phase));
        }
    }
    if starts.len() < 2 {
        return None;
    }
    let pieces = starts
        .iter()
        .enumerate()
        .map(|(j, &(f, phase))| {
            let (f_end, p_end) = starts
                .get(j + 1)
                .copied()
                .unwrap_or((unit.frames.len(), LAYER_PHASES));
            LayerPiece {
                frames: f..f_end,
                raw_base: unit.frames[f].raw_offset,
                phases: phase..p_end,
            }
        })
        .collect();
    Some(pieces)
}

#[derive(Clone, Debug, Serialize)]
pub struct Plan {
    pub device_budget: u64,
    pub kv_cache_bytes: u64,
    pub workspace_bytes: u64,
    /// The backend's own scratch (see PlanInput::backend_reserved).
    pub backend_bytes: u64,
    pub stream_slots: usize,
    pub stream_slot_bytes: u64,
    pub resident_bytes: u64,
    pub host_cache_bytes: u64,
    pub prefetch: usize,
    pub units: Vec<UnitPlan>,
    /// Per forward pass: stored bytes read from disk, raw bytes copied from the host
    /// cache, raw bytes uploaded to the device (on a unified backend: lent to the compute in
    /// their staging slots, not copied). A sparse layer counts its dense part and one
    /// expert per routing choice of a full batch (an estimate: what loads depends on the
    /// routing and the expert cache).
    pub disk_bytes_per_pass: u64,
    pub host_cache_bytes_per_pass: u64,
    pub upload_bytes_per_pass: u64,
    /// Loads of the embedding's unit per pass: a streamed embedding is never loaded for
    /// the lookup (its rows are gathered, see `embedding_gathered`); tied, the head reads
    /// it in `head_parts`, one load each.
    pub embedding_loads_per_pass: usize,
    /// The embedding streams: each step reads only the frames that hold its tokens' rows
    /// (`gather_bytes_per_token` each at most) into a table of `gather_table_bytes`.
    pub embedding_gathered: bool,
    pub gather_bytes_per_token: u64,
    pub gather_table_bytes: u64,
    /// A tied, streamed embedding as the output head: row parts that each fit a slot, and
    /// the rows that straddle two parts (gathered once at start, kept on the device).
    pub head_parts: Vec<crate::store::format::RowPart>,
    pub head_seams: Vec<u64>,
    /// Per unit, its sparse layout when it streams only the experts a step routes to (not
    /// serialized: `UnitPlan::experts_routed` says which).
    #[serde(skip)]
    pub sparse: Vec<Option<SparseUnit>>,
    /// Per unit, the pieces a streamed dense layer loads in, where the slots are smaller
    /// than it (`layer_pieces`; `UnitPlan::pieces` counts them).
    #[serde(skip)]
    pub pieces: Vec<Option<Vec<LayerPiece>>>,
    /// Per unit, a sparse layer whose dense part is resident (its experts still stream),
    /// and their bytes.
    #[serde(skip)]
    pub dense_resident: Vec<bool>,
    pub dense_resident_bytes: u64,
    /// The expert cache: device slots of an expert each, kept across steps (a unified
    /// backend's in the arena; none there is needed, its experts run from staging slots).
    pub expert_cache_slots: usize,
    pub expert_slot_bytes: u64,
    /// Of the expert cache's slots, those that hold the hottest experts of a loaded
    /// profile, loaded at start and never evicted (the resident hot experts); the rest
    /// (at least one a step's expert loads, or one) evict by the policy.
    pub expert_hot_slots: usize,
    /// Expert loads in flight at once (host staging slots beside the prefetched units).
    pub expert_reads: usize,
    /// Experts of the streamed layers, all told (the most the cache can use).
    pub experts_streamed: usize,
    /// Every host role, within the host budget.
    pub host: HostPlan,
}

/// A plan that cannot be made: the device budget or the host budget is too small.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum PlanError {
    #[error(transparent)]
    Device(#[from] DeviceBudgetError),
    #[error(transparent)]
    Host(#[from] HostBudgetError),
}

impl PlanError {
    /// The least budget (of the kind that was short) that runs.
    pub fn need(&self) -> u64 {
        match self {
            PlanError::Device(e) => e.need,
            PlanError::Host(e) => e.need,
        }
    }
}

/// The device budget cannot hold even the smallest streaming plan; the numbers say what
/// it needs and the message what to change.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error(
    "device budget {} ({budget} bytes) is too small: KV cache {} + workspace {} (with backend scratch) + {slots} streaming slots of {} + {} of units larger than a slot kept resident = {} ({need} bytes) at least; raise --device-memory or lower --max-context / --max-batch",
    fmt_bytes(*budget),
    fmt_bytes(*kv_cache),
    fmt_bytes(*workspace),
    fmt_bytes(*slot),
    fmt_bytes(*oversized_resident),
    fmt_bytes(*need)
)]
pub struct DeviceBudgetError {
    pub budget: u64,
    pub kv_cache: u64,
    /// Workspace and the backend's scratch.
    pub workspace: u64,
    pub slots: usize,
    /// Bytes of one streaming slot in the least plan.
    pub slot: u64,
    /// Units larger than that slot, which must stay resident.
    pub oversized_resident: u64,
    /// The least budget that runs.
    pub need: u64,
}

/// The host budget cannot hold the least plan: every host role with its bytes.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error(
    "host budget {} ({budget} bytes) is too small: process overhead {} + read buffers {} + decoder and compute scratch {} + {} {} + staging slots {}{} = {} ({need} bytes) at least; raise --host-memory, or lower --max-context / --max-batch",
    fmt_bytes(*budget),
    fmt_bytes(*overhead),
    fmt_bytes(*reads),
    fmt_bytes(*scratch),
    if *unified { "device arena (KV cache, workspace, units that must stay resident)" } else { "host cache" },
    fmt_bytes(*device),
    fmt_bytes(*staging),
    if *load_transient > 0 { format!(" + loading staging {}", fmt_bytes(*load_transient)) } else { String::new() },
    fmt_bytes(*need)
)]
pub struct HostBudgetError {
    pub budget: u64,
    pub overhead: u64,
    pub reads: u64,
    pub scratch: u64,
    /// The arena on a unified backend (host cache on a discrete one).
    pub device: u64,
    pub staging: u64,
    pub load_transient: u64,
    pub need: u64,
    pub unified: bool,
}

impl HostBudgetError {
    /// The error for `h`'s budget with these roles: reads, scratch, the arena (unified) or
    /// host cache, staging, loading staging; the need is their sum with the overhead.
    fn new(h: &HostInput, [reads, scratch, held, staging, load_transient]: [u64; 5]) -> Self {
        HostBudgetError {
            budget: h.budget.unwrap_or(0),
            overhead: h.overhead,
            reads,
            scratch,
            device: held,
            staging,
            load_transient,
            need: h.overhead + reads + scratch + held + staging + load_transient,
            unified: h.unified,
        }
    }
}

impl Plan {
    pub fn placement(&self, unit: usize) -> Placement {
        self.units[unit].placement
    }

    pub fn layers_resident(&self) -> usize {
        self.units
            .iter()
            .filter(|u| u.placement == Placement::Resident)
            .count()
    }

    pub fn layers_streamed(&self) -> usize {
        self.units.len() - self.layers_resident()
    }

    /// Device bytes the plan allocates at most.
    pub fn device_bytes(&self) -> u64 {
        self.kv_cache_bytes
            + self.workspace_bytes
            + self.gather_table_bytes
            + self.backend_bytes
            + self.stream_slots as u64 * self.stream_slot_bytes
            + self.resident_bytes
            + self.expert_cache_slots as u64 * self.expert_slot_bytes
            + self.dense_resident_bytes
    }

    /// The plan as a table for the start-up log.
    pub fn table(&self) -> String {
        let mut s = String::new();
        let line = |s: &mut String, k: &str, v: String| s.push_str(&format!("  {k:<28} {v}\n"));
        s.push_str("memory plan\n");
        line(&mut s, "device budget", fmt_bytes(self.device_budget));
        line(&mut s, "KV cache", fmt_bytes(self.kv_cache_bytes));
        line(&mut s, "workspace", fmt_bytes(self.workspace_bytes));
        if self.backend_bytes > 0 {
            line(&mut s, "backend scratch", fmt_bytes(self.backend_bytes));
        }
        line(
            &mut s,
            "streaming slots",
            format!(
                "{} x {}",
                self.stream_slots,
                fmt_bytes(self.stream_slot_bytes)
            ),
        );
        line(
            &mut s,
            "resident weights",
            format!(
                "{} ({} units)",
                fmt_bytes(self.resident_bytes),
                self.layers_resident()
            ),
        );
        if self.embedding_gathered {
            line(
                &mut s,
                "embedding rows",
                format!(
                    "gathered per step (a frame of at most {} per distinct token) into {}",
                    fmt_bytes(self.gather_bytes_per_token),
                    fmt_bytes(self.gather_table_bytes)
                ),
            );
        }
        if !self.head_parts.is_empty() {
            line(
                &mut s,
                "output head (tied)",
                format!(
                    "the embedding in {} row parts of at most {} rows",
                    self.head_parts.len(),
                    self.head_parts
                        .iter()
                        .map(|p| p.rows.end - p.rows.start)
                        .max()
                        .unwrap_or(0)
                ),
            );
        }
        if self.experts_streamed > 0 {
            line(
                &mut s,
                "expert cache",
                format!(
                    "{} x {} (of {} experts in {} streamed layers)",
                    self.expert_cache_slots,
                    fmt_bytes(self.expert_slot_bytes),
                    self.experts_streamed,
                    self.sparse.iter().flatten().count()
                ),
            );
            if self.expert_hot_slots > 0 {
                line(
                    &mut s,
                    "resident hot experts",
                    format!(
                        "{} of the cache's slots, {} (the profile's hottest, never evicted)",
                        self.expert_hot_slots,
                        fmt_bytes(self.expert_hot_slots as u64 * self.expert_slot_bytes)
                    ),
                );
            }
            line(
                &mut s,
                "resident dense parts",
                format!(
                    "{} ({} of the streamed layers: norms, attention, router)",
                    fmt_bytes(self.dense_resident_bytes),
                    self.dense_resident.iter().filter(|&&d| d).count()
                ),
            );
            line(
                &mut s,
                "expert loads in flight",
                format!(
                    "{} (only the experts a step routes to load)",
                    self.expert_reads
                ),
            );
        }
        line(&mut s, "device total", fmt_bytes(self.device_bytes()));
        line(
            &mut s,
            "host cache",
            format!(
                "{} ({} units)",
                fmt_bytes(self.host_cache_bytes),
                self.units
                    .iter()
                    .filter(|u| u.placement == Placement::HostCached)
                    .count()
            ),
        );
        line(&mut s, "prefetch depth", self.prefetch.to_string());
        let h = &self.host;
        s.push_str(
            "  host
",
        );
        line(
            &mut s,
            "  budget",
            match h.budget {
                Some(b) => fmt_bytes(b),
                None => "not limited".into(),
            },
        );
        line(&mut s, "  process overhead", fmt_bytes(h.overhead_bytes));
        if h.read_buffers > 0 {
            line(
                &mut s,
                "  read buffers",
                format!(
                    "{} x {}, up to {} in flight",
                    h.read_buffers,
                    fmt_bytes(h.request_bytes),
                    h.reads_in_flight
                ),
            );
        } else {
            line(
                &mut s,
                "  read buffers",
                format!(
                    "none: reads of {} land in the staging slots, up to {} in flight",
                    fmt_bytes(h.request_bytes),
                    h.reads_in_flight
                ),
            );
        }
        line(
            &mut s,
            "  staging slots",
            format!("{} x {}", h.staging_slots, fmt_bytes(h.staging_slot_bytes)),
        );
        line(&mut s, "  decoder scratch", fmt_bytes(h.scratch_bytes));
        if h.compute_scratch_bytes > 0 {
            line(
                &mut s,
                "  compute scratch",
                fmt_bytes(h.compute_scratch_bytes),
            );
        }
        if h.gather_bytes > 0 {
            line(&mut s, "  embedding row gather", fmt_bytes(h.gather_bytes));
        }
        if h.arena_bytes > 0 {
            line(&mut s, "  device arena (= host)", fmt_bytes(h.arena_bytes));
        }
        if h.host_cache_bytes > 0 {
            line(&mut s, "  host cache", fmt_bytes(h.host_cache_bytes));
        }
        if h.load_transient_bytes > 0 {
            line(
                &mut s,
                "  staging while loading",
                fmt_bytes(h.load_transient_bytes),
            );
        }
        line(&mut s, "  host total", fmt_bytes(h.total_bytes));
        line(
            &mut s,
            "per pass from disk",
            fmt_bytes(self.disk_bytes_per_pass),
        );
        line(
            &mut s,
            "per pass from host cache",
            fmt_bytes(self.host_cache_bytes_per_pass),
        );
        line(
            &mut s,
            "per pass uploaded",
            fmt_bytes(self.upload_bytes_per_pass),
        );
        // Runs of units with the same placement, e.g. "layers 0-11 resident".
        let how = |u: &UnitPlan| match u.pieces {
            0 => format!("{:?}", u.placement),
            n => format!("{:?} in {n} pieces", u.placement),
        };
        let mut i = 0;
        while i < self.units.len() {
            let p = how(&self.units[i]);
            let mut j = i;
            while j + 1 < self.units.len() && how(&self.units[j + 1]) == p {
                j += 1;
            }
            let name = if i == j {
                self.units[i].unit.clone()
            } else {
                format!("{} .. {}", self.units[i].unit, self.units[j].unit)
            };
            s.push_str(&format!("  {name:<28} {p}\n"));
            i = j + 1;
        }
        s
    }
}

/// One way to split the units between resident and streamed.
struct Candidate {
    /// Bytes streamed per pass (the tied embedding counts twice).
    streamed: u64,
    resident: Vec<bool>,
    /// Streamed units that load in pieces at this slot size.
    pieced: usize,
    slots: usize,
    slot_bytes: u64,
}

/// The split that streams the fewest bytes per pass, trying every slot size `s` from the
/// largest unit down and each slot count `n` of `counts`; `room(s, n)` is the memory left
/// for resident units with `n` slots of `s` (None: they do not fit). Units larger than the
/// slot must be resident, then units are kept resident greedily by the bytes they save per
/// pass. None when no slot size fits.
fn choose_residency(
    raw: &[u64],
    e: &UnitCosts,
    counts: &[usize],
    room: impl Fn(u64, usize) -> Option<u64>,
) -> Option<Candidate> {
    let value = |u: usize| e.value(raw, u);
    // Among units of equal value, in bit-reversed index order: those left to stream are
    // then spread over the pass (each load overlaps resident units' compute) rather than
    // bunched at its end.
    let bits = usize::BITS - raw.len().max(1).leading_zeros();
    let spread = |u: usize| (u.reverse_bits() >> (usize::BITS - bits), u);
    let mut order: Vec<usize> = (0..raw.len()).collect();
    order.sort_by(|&x, &y| value(y).cmp(&value(x)).then(spread(x).cmp(&spread(y))));
    let mut sizes: Vec<u64> = (0..raw.len()).flat_map(|u| e.needs(raw, u)).collect();
    sizes.sort_unstable_by(|x, y| y.cmp(x));
    sizes.dedup();
    let mut best: Option<Candidate> = None;
    for &s in &sizes {
        for &n_slots in counts {
            let Some(mut left) = room(s, n_slots) else {
                continue;
            };
            let mut res = vec![false; raw.len()];
            // Units that cannot stream through slots of `s` must be resident.
            let mut ok = true;
            for u in 0..raw.len() {
                if !e.streams_at(raw, u, s) {
                    if raw[u] > left {
                        ok = false;
                        break;
                    }
                    left -= raw[u];
                    res[u] = true;
                }
            }
            if !ok {
                continue;
            }
            // A mixture's layer that can stream sparsely is not kept whole: the room is
            // worth more as resident dense parts (all their bytes saved every pass) and
            // expert cache slots (the experts routed most, of every layer) than as one
            // layer's experts, most of which a pass leaves unread.
            for &u in &order {
                if !res[u] && raw[u] <= left && !e.sparse_unit(u) {
                    left -= raw[u];
                    res[u] = true;
                }
            }
            let streamed: u64 = (0..raw.len()).filter(|&u| !res[u]).map(value).sum();
            let pieced = (0..raw.len())
                .filter(|&u| !res[u] && e.need(raw, u) > s)
                .count();
            // Prefer fewer bytes streamed, then whole loads over pieces, then more slots
            // (deeper prefetch).
            let better = best.as_ref().is_none_or(|b| {
                (streamed, pieced, std::cmp::Reverse(n_slots))
                    < (b.streamed, b.pieced, std::cmp::Reverse(b.slots))
            });
            if better {
                best = Some(Candidate {
                    streamed,
                    resident: res,
                    pieced,
                    slots: n_slots,
                    slot_bytes: s,
                });
            }
        }
    }
    best
}

/// For each slot size: (bytes of units that cannot stream through it, which must be
/// resident, the size).
fn oversized(raw: &[u64], e: &UnitCosts) -> Vec<(u64, u64)> {
    let mut sizes: Vec<u64> = (0..raw.len()).flat_map(|u| e.needs(raw, u)).collect();
    sizes.sort_unstable_by(|x, y| y.cmp(x));
    sizes.dedup();
    sizes
        .iter()
        .map(|&s| {
            let big = (0..raw.len())
                .filter(|&u| !e.streams_at(raw, u, s))
                .map(|u| raw[u])
                .sum::<u64>();
            (big, s)
        })
        .collect()
}

/// What streaming a unit costs, where it is not simply its bytes: a sparse layer of a
/// mixture (`SparseUnit`), and the embedding (unit 0). Its lookup reads only the frames that
/// hold the step's rows (a frame per distinct token), so an untied embedding needs no
/// staging slot at all; a tied one is also the output head, read once a pass in row parts
/// that each fit a slot (`LayerUnit::row_parts`).
struct UnitCosts<'m> {
    unit: &'m crate::store::format::LayerUnit,
    /// The table and its row bytes; None: not a decoder's embedding (it stays resident).
    table: Option<(&'m crate::store::format::TensorEntry, u64)>,
    tied: bool,
    /// Parts are read straight into the slots (the unit is stored as raw).
    direct: bool,
    /// Bytes the lookup reads per pass, estimated: a frame per sequence of the batch.
    gather: u64,
    /// Per unit that can stream sparsely: (the slot bytes its largest load needs, the raw
    /// bytes a pass loads of it, estimated as the dense part and one expert per routing
    /// choice of a full batch, all of them at most).
    sparse: Vec<Option<(u64, u64)>>,
    /// Per dense layer that can load in pieces (`layer_pieces`): the slot bytes its
    /// largest piece needs, and the pieces.
    pieced: Vec<Option<(u64, Vec<LayerPiece>)>>,
}

impl<'m> UnitCosts<'m> {
    fn new(
        m: &'m Manifest,
        opts: &ModelOptions,
        sparse: &[Option<SparseUnit>],
        piece_min: u64,
    ) -> Self {
        let unit = &m.units[0];
        let table = unit
            .tensor("model.embed_tokens.weight")
            .filter(|_| unit.kind == UnitKind::Embedding)
            .and_then(|t| {
                let cols = *t.shape.last()?;
                Some((t, t.dtype.row_bytes(cols)?))
            })
            .filter(|&(_, rb)| rb > 0);
        let frame = unit.frame_stored_max();
        let sparse = sparse
            .iter()
            .zip(&m.units)
            .map(|(sp, lu)| {
                let sp = sp.as_ref()?;
                let moe = m.arch.moe.as_ref()?;
                let direct = lu.stored_as_raw();
                let need = sp
                    .experts
                    .iter()
                    .map(|x| round(lu.part_span(x.frames.clone(), direct)))
                    .chain([round(lu.part_span(sp.dense_frames.clone(), direct))])
                    .max()?;
                let n = sp.experts.len() as u64;
                let expert_raw = (lu.raw_len - sp.dense_raw) / n.max(1);
                let routed = (moe.top_k as u64 * opts.kv_slots as u64).min(n);
                Some((need, sp.dense_raw + routed * expert_raw))
            })
            .collect();
        let pieced = (0..m.units.len())
            .map(|u| {
                let pieces = layer_pieces(m, u, piece_min)?;
                let lu = &m.units[u];
                let direct = lu.stored_as_raw();
                let need = pieces
                    .iter()
                    .map(|p| round(lu.part_span(p.frames.clone(), direct)))
                    .max()?;
                Some((need, pieces))
            })
            .collect();
        UnitCosts {
            unit,
            table,
            tied: m.arch.tied_embeddings,
            direct: unit.stored_as_raw(),
            gather: (frame * opts.kv_slots as u64).min(unit.stored_len),
            sparse,
            pieced,
        }
    }

    /// Unit `u` is a mixture's layer that can stream sparsely.
    fn sparse_unit(&self, u: usize) -> bool {
        matches!(self.sparse.get(u), Some(Some(_)))
    }

    /// The slot bytes unit `u` needs to stream (its sparse loads' largest, else the unit).
    fn need(&self, raw: &[u64], u: usize) -> u64 {
        match self.sparse.get(u) {
            Some(Some((need, _))) => *need,
            _ => raw[u],
        }
    }

    /// The slot sizes unit `u` can stream through: whole (`need`), and in pieces.
    fn needs(&self, raw: &[u64], u: usize) -> impl Iterator<Item = u64> {
        let pieced = self.pieced.get(u).and_then(|p| p.as_ref()).map(|p| p.0);
        [Some(self.need(raw, u)), pieced].into_iter().flatten()
    }

    /// The slot bytes unit `u` needs to stream through slots of `s` bytes: whole where it
    /// fits, else in pieces where those fit (None: neither).
    fn need_at(&self, raw: &[u64], u: usize, s: u64) -> Option<u64> {
        self.needs(raw, u).find(|&n| n <= s)
    }

    /// The pieces unit `u` loads in through slots of `s` bytes (None: it loads whole).
    fn pieces_at(&self, raw: &[u64], u: usize, s: u64) -> Option<Vec<LayerPiece>> {
        match self.pieced.get(u) {
            Some(Some((need, pieces))) if self.need(raw, u) > s && *need <= s => {
                Some(pieces.clone())
            }
            _ => None,
        }
    }

    /// The tied head's row parts through slots of `cap` bytes and the rows between them
    /// (None: the frames cannot be cut to fit).
    fn parts(&self, cap: u64) -> Option<(Vec<crate::store::format::RowPart>, Vec<u64>)> {
        let (t, rb) = self.table?;
        self.unit.row_parts(t, rb, cap, self.direct)
    }

    /// Unit `u` can stream through slots of `s` bytes.
    fn streams_at(&self, raw: &[u64], u: usize, s: u64) -> bool {
        if u != 0 || self.table.is_none() {
            return self.need_at(raw, u, s).is_some();
        }
        !self.tied || self.parts(s).is_some()
    }

    /// Bytes a pass streams if unit `u` is not resident (the planner keeps the most
    /// valuable units resident).
    fn value(&self, raw: &[u64], u: usize) -> u64 {
        match (u, self.table, self.sparse.get(u)) {
            (0, Some(_), _) => self.gather + if self.tied { raw[0] } else { 0 },
            (_, _, Some(Some((_, pass)))) => *pass,
            _ => raw[u],
        }
    }
}

/// The least device budget that runs: for some slot size, `slots` slots (2 on a discrete
/// device, 0 where units run from host staging) plus every unit larger than a slot kept
/// resident.
fn least_budget_error(
    raw: &[u64],
    e: &UnitCosts,
    budget: u64,
    kv: u64,
    workspace: u64,
    slots: usize,
) -> PlanError {
    let fixed = kv + workspace;
    let (need, slot) = oversized(raw, e)
        .into_iter()
        .map(|(big, s)| (fixed + slots as u64 * s + big, s))
        .min()
        .unwrap_or((fixed, 0));
    PlanError::Device(DeviceBudgetError {
        budget,
        kv_cache: kv,
        workspace,
        slots,
        slot,
        oversized_resident: need - fixed - slots as u64 * slot,
        need,
    })
}

/// Host bytes a streamed embedding's row gather holds (the pipeline's `RowGather`): a
/// frame's read buffer with its O_DIRECT alignment at both ends, the decoded frame and
/// the gathered rows.
pub fn gather_host_bytes(frame_stored_max: u64, frame_raw_max: u64, table_bytes: u64) -> u64 {
    frame_stored_max + 2 * ALLOC_ALIGN + frame_raw_max + table_bytes
}

/// The smallest read request the plan makes.
const REQUEST_MIN: u64 = 128 << 10;

/// A read request of about `want` bytes: the largest power of two not above it, within
/// [REQUEST_MIN, the caller's maximum].
fn request_size(h: &HostInput, want: u64) -> u64 {
    let cap = h.request_bytes_max.max(ALLOC_ALIGN);
    let pow2 = 1u64 << (63 - want.max(REQUEST_MIN).leading_zeros());
    pow2.clamp(REQUEST_MIN.min(cap), cap)
}

/// Reads sized in bytes in flight, not in units: at most the caller's maximum; under a
/// host budget, a typical unit's worth (`unit`, so one is read whole while the one before
/// computes) within a 32nd and `1 / share` of the budget (plan tries 8, then 32); in requests small enough that at
/// least eight are in flight (a small unit is then several parallel reads), and enough
/// buffers to hold the largest frame at once (the engine's own rule). (Measured on the
/// 1.2 GB Llama at 512 MiB: 16 MiB in flight ran 1.2 tokens/s, 64 MiB 1.75.)
fn read_shape(h: &HostInput, frame_stored_max: u64, unit: u64, share: u64) -> (usize, u64) {
    let mut in_flight = h.reads_max_bytes.max(REQUEST_MIN);
    if let Some(b) = h.budget {
        let want = unit.clamp(b / 32, b / share.max(1));
        in_flight = in_flight.min(want.max(2 * REQUEST_MIN));
    }
    let request = request_size(h, in_flight / 8);
    let least = (frame_stored_max + 2 * ALLOC_ALIGN).div_ceil(request) + 1;
    let n = (in_flight / request).max(least).max(2);
    (n as usize, request)
}

/// Reads of a store whose units are stored as raw, which land in the staging slots: a
/// quarter of a typical unit each (so one unit is several reads in flight), within
/// [128 KiB, the caller's maximum], and as many in flight as `reads_max_bytes` and
/// `in_flight_max_bytes` allow (bounded in practice by the units requested ahead).
/// (1.2 GB Llama at 256 MiB, through 8 read buffers of 1 MiB: streaming-only 1.12 GB/s
/// against fio's 3.0.)
fn into_slots_shape(h: &HostInput, unit: u64) -> (u64, usize) {
    let request = request_size(h, unit / 4);
    let in_flight = h.reads_max_bytes.min(h.in_flight_max_bytes);
    let ops = (in_flight / request).clamp(2, 256) as usize;
    (request, ops)
}

/// Plans memory for `m` within the budgets of `input`. A host budget error names the least
/// host budget that runs (the reads scale with the budget, so the least is searched from
/// the first shortfall up).
pub fn plan(m: &Manifest, input: &PlanInput) -> Result<Plan, PlanError> {
    match (plan_with(m, input), input.expert_profile) {
        // A profile's hot experts are worth room, not a failed start.
        (Err(_), Some(_)) if input.expert_cache.is_none() => plan_with(
            m,
            &PlanInput {
                expert_profile: None,
                ..input.clone()
            },
        ),
        (p, _) => p,
    }
}

fn plan_with(m: &Manifest, input: &PlanInput) -> Result<Plan, PlanError> {
    // Reads of up to an eighth of the host budget first; when that does not fit, up to a
    // 32nd (see read_shape).
    if input.host.budget.is_some() {
        if let Ok(p) = plan_once(m, input, 8) {
            return Ok(p);
        }
    }
    match plan_once(m, input, 32) {
        Err(PlanError::Host(first)) => {
            let mut try_input = input.clone();
            let mut need = first.need;
            for _ in 0..16 {
                try_input.host.budget = Some(need);
                match plan_once(m, &try_input, 32) {
                    Ok(_) => return Err(PlanError::Host(HostBudgetError { need, ..first })),
                    Err(PlanError::Host(e)) if e.need > need => need = e.need,
                    Err(PlanError::Host(_)) => need += ALLOC_ALIGN,
                    Err(e) => return Err(e),
                }
            }
            Err(PlanError::Host(first))
        }
        r => r,
    }
}

/// One plan with reads of at most `1 / reads_share` of the host budget.
fn plan_once(m: &Manifest, input: &PlanInput, reads_share: u64) -> Result<Plan, PlanError> {
    let a = &m.arch;
    let opts = input.opts;
    let h = &input.host;
    if opts.max_context > a.max_context as usize {
        tracing::warn!(
            "context {} is beyond the model's trained context {}",
            opts.max_context,
            a.max_context
        );
    }
    // K and V are one allocation each.
    let kv = 2 * round(kv_cache_bytes(a, &opts) / 2);
    let ws = round(workspace_bytes(a, &opts));
    let backend = round(input.backend_reserved);
    let raw: Vec<u64> = m.units.iter().map(|u| round(u.raw_len)).collect();
    let fixed = kv + ws + backend;
    let all_resident = fixed + raw.iter().sum::<u64>();
    let tied = a.tied_embeddings;

    // Layers of a mixture that can stream only their routed experts.
    let sparse_all: Vec<Option<SparseUnit>> =
        (0..m.units.len()).map(|u| sparse_unit(m, u)).collect();
    let emb = UnitCosts::new(m, &opts, &sparse_all, h.request_bytes_max);
    // Host roles that do not depend on the split.
    let frame_stored_max = m.frame_stored_len_max();
    // A typical load: the median size (the decoder layers, not the embedding; a sparse
    // layer's largest load).
    let mut sizes: Vec<u64> = (0..raw.len()).map(|u| emb.need(&raw, u)).collect();
    sizes.sort_unstable();
    let median = sizes.get(sizes.len() / 2).copied().unwrap_or(0);
    let into_slots = m.units.iter().all(|u| u.stored_as_raw());
    // Units ahead: the caller's, or for reads that land in the slots as many as hold
    // STREAM_AHEAD_BYTES (within the reads the engine may have in flight).
    let prefetch_want = match input.prefetch {
        Some(p) => p.max(1),
        None if into_slots && h.unified => {
            let ahead = STREAM_AHEAD_BYTES.min(h.reads_max_bytes);
            (1 + ahead.div_ceil(median.max(1)) as usize).clamp(PREFETCH_DEFAULT, STAGING_MAX - 1)
        }
        None => PREFETCH_DEFAULT,
    };
    let (read_buffers, request_bytes, reads_in_flight) = if into_slots {
        let (request, ops) = into_slots_shape(h, median);
        (0, request, ops)
    } else {
        let (n, request) = read_shape(h, frame_stored_max, median, reads_share);
        let out = (h.in_flight_max_bytes / request).max(1) as usize;
        (n, request, n.min(out))
    };
    let reads = read_buffers as u64 * request_bytes;
    // Each worker: a frame's split planes and a frame spanning two reads; the unified
    // loader's threads (as many, gone before the streaming engine starts): a frame's
    // stored bytes and a decoder each.
    let frame = u64::from(m.frame_raw_len_max()) + frame_stored_max + 2 * 4096;
    // The shared codes' decoding tables: one set, all decoders' (`Store::shared_tables`).
    let shared = (m.codes.len() * crate::store::fpsplit::TABLES_BYTES) as u64;
    let decoders = round(
        h.workers.max(1) as u64 * (frame + crate::store::codec::FrameDecoder::EXTRA_BYTES) + shared,
    );
    let compute = round(h.compute_scratch);
    let scratch = decoders + compute;
    let host_fixed = h.overhead + reads + scratch;

    // The bytes the disk should have queued: the read buffers, or for reads that land in
    // the staging slots, a typical unit (one read whole while the one before computes).
    let in_flight = if read_buffers > 0 {
        reads
    } else {
        (reads_in_flight as u64 * request_bytes).min(median)
    };
    // A streamed embedding's lookup: a device table of a step's rows, and on the host the
    // rows, a frame's read buffer and its decoded bytes (reserved in every streaming plan,
    // dropped below when the embedding stays resident).
    let gather = match emb.table {
        Some((_, rb)) => {
            // A step's rows, and for a tied head the seam rows between its parts (at
            // most a row per frame boundary), kept on the device.
            let seams = if tied {
                m.units[0].frames.len() as u64
            } else {
                0
            };
            let table = (opts.max_batch_tokens as u64 + seams) * rb;
            (
                round(table),
                round(gather_host_bytes(
                    frame_stored_max,
                    u64::from(m.frame_raw_len_max()),
                    table,
                )),
            )
        }
        None => (0, 0),
    };
    // A mixture's experts, should its layers stream: the expert cache's slots the split
    // must leave room for (`--expert-cache`, else one on a discrete device, whose experts
    // run from there; none on a unified one, whose experts can run from staging) and the
    // staging slots of the expert loads in flight.
    let expert_max = emb
        .sparse
        .iter()
        .zip(&sparse_all)
        .filter_map(|(c, sp)| c.and(sp.as_ref()))
        .flat_map(|sp| sp.experts.iter().map(|x| round(x.raw.end - x.raw.start)))
        .max()
        .unwrap_or(0);
    let experts_all: usize = emb
        .sparse
        .iter()
        .zip(&sparse_all)
        .filter_map(|(c, sp)| c.and(sp.as_ref()))
        .map(|sp| sp.experts.len())
        .sum();
    let loads_min = a.moe.as_ref().map_or(1, |moe| {
        (2 * moe.top_k as usize)
            .min(moe.n_experts as usize)
            .clamp(1, 16)
    });
    // The slots the split leaves room for; without --expert-cache, a profile's hot set
    // and a step's loads too, but those come after the dense parts below (`cache_base`).
    let cache_base = match input.expert_cache {
        Some(n) => n.min(experts_all),
        None if h.unified => 0,
        None => 1,
    };
    let cache_min = match (input.expert_cache, input.expert_profile) {
        (None, Some(hot)) => (hot + loads_min).min(experts_all).max(cache_base),
        _ => cache_base,
    };
    let expert_reserve = (
        cache_min as u64 * expert_max,
        match &a.moe {
            Some(moe) if expert_max > 0 => (2 * moe.top_k as usize)
                .min(moe.n_experts as usize)
                .clamp(1, 16),
            _ => 0,
        },
    );
    let split = if h.unified {
        plan_unified(
            &raw,
            &emb,
            input,
            (kv, fixed),
            (reads, scratch, in_flight),
            gather,
            prefetch_want,
            all_resident,
            expert_reserve,
        )?
    } else {
        plan_discrete(
            &raw,
            &emb,
            input,
            (kv, fixed),
            gather,
            all_resident,
            expert_reserve.0,
        )?
    };
    let Split {
        resident,
        slots,
        cap,
        staging,
        device_budget: budget,
    } = split;
    let streams = resident.iter().any(|r| !r);
    let gathered = streams && !resident[0];
    let (gather_dev, gather_host) = if gathered { gather } else { (0, 0) };
    // Slots hold the largest streamed unit (the embedding never whole: its lookup gathers
    // rows, a tied head reads it in parts), and each head part; parts are cut to fit
    // slots of that size where they can, else of the size the split chose.
    // A dense layer larger than the slot the split chose loads in pieces.
    let pieces: Vec<Option<Vec<LayerPiece>>> = (0..raw.len())
        .map(|u| {
            (!resident[u] && u != 0)
                .then(|| emb.pieces_at(&raw, u, cap))
                .flatten()
        })
        .collect();
    let largest_streamed = (0..raw.len())
        .filter(|&u| !resident[u] && u != 0)
        .map(|u| {
            emb.need_at(&raw, u, cap)
                .expect("the split streams only units whose loads fit its slots")
        })
        .max()
        .unwrap_or(0);
    // The streamed layers of a mixture load their dense part and the routed experts.
    let sparse: Vec<Option<SparseUnit>> = sparse_all
        .into_iter()
        .enumerate()
        .map(|(u, sp)| sp.filter(|_| !resident[u]))
        .collect();
    let experts_streamed: usize = sparse.iter().flatten().map(|sp| sp.experts.len()).sum();
    let expert_slot_bytes = sparse
        .iter()
        .flatten()
        .flat_map(|sp| sp.experts.iter().map(|x| round(x.raw.end - x.raw.start)))
        .max()
        .unwrap_or(0);
    // Expert loads in flight: a step's choices for one row and as many again (a batch's
    // union, the predicted ones), within the experts there are.
    let expert_reads = match (&a.moe, experts_streamed) {
        (Some(moe), 1..) => (2 * moe.top_k as usize)
            .min(moe.n_experts as usize)
            .clamp(1, 16),
        _ => 0,
    };
    let (head_parts, head_seams) = if gathered && tied {
        emb.parts(largest_streamed)
            .or_else(|| emb.parts(cap))
            .expect("the split streams the embedding only where its parts fit")
    } else {
        (Vec::new(), Vec::new())
    };
    let part_max = head_parts
        .iter()
        .map(|p| round(m.units[0].part_span(p.frames.clone(), emb.direct)))
        .max()
        .unwrap_or(0);
    let slot_bytes = largest_streamed.max(part_max);
    let staging_slot_bytes = slot_bytes;
    // Nothing streams through slots when only an untied embedding streams.
    let streams = largest_streamed > 0 || !head_parts.is_empty();
    let slots = if streams { slots } else { 0 };
    let host_fixed = host_fixed + gather_host;
    // Discrete devices stage prefetch + 1 units on the host; fewer when the host budget is
    // short (one computing, one loading at least).
    // Loads a pass makes through the slots: no more can be requested ahead of one.
    let loads = (1..raw.len())
        .filter(|&u| !resident[u])
        .map(|u| pieces[u].as_ref().map_or(1, |p| p.len()))
        .sum::<usize>()
        + head_parts.len();
    let (staging, prefetch) = match staging {
        Some(n) => {
            let n = n.min(loads + 1).max(STREAM_SLOTS_MIN);
            (n, n.saturating_sub(1).max(1))
        }
        None => {
            let mut p = prefetch_want;
            if let Some(b) = h.budget {
                let extra = (1 + expert_reads) as u64;
                while p > 1 && host_fixed + (p as u64 + extra) * staging_slot_bytes > b {
                    p -= 1;
                }
            }
            (p + 1, p)
        }
    };
    // Expert loads have staging slots of their own beside the units requested ahead: an
    // expert is requested only once its layer has routed, while the loads ahead hold
    // theirs, so sharing them could wait forever.
    let (staging, prefetch) = if streams {
        (staging + expert_reads, prefetch)
    } else {
        (0, 0)
    };
    let staged = staging as u64 * staging_slot_bytes;
    let resident_bytes: u64 = (0..raw.len())
        .filter(|&u| resident[u])
        .map(|u| raw[u])
        .sum();
    // The expert cache: the slots asked for, else what the budgets leave after the split
    // (on a discrete device at least one, which its experts run from), never more than
    // there are streamed experts.
    let dev_used = fixed
        + gather_dev
        + resident_bytes
        + if h.unified {
            0
        } else {
            slots as u64 * slot_bytes
        };
    // What the split leaves: first the dense parts of the streamed sparse layers stay
    // resident (each saves all its bytes every pass, more than an expert slot can), then
    // the expert cache takes the rest (the slots reserved for it are kept for it).
    let dev_left = match (h.unified, input.device_budget) {
        (true, None) => None,
        _ => Some(budget.saturating_sub(dev_used)),
    };
    let host_left = match (h.unified, h.budget) {
        (true, Some(b)) => Some(b.saturating_sub(host_fixed + staged + dev_used)),
        _ => None,
    };
    let left = [dev_left, host_left].into_iter().flatten().min();
    let cache_kept = match input.expert_cache {
        Some(asked) => asked,
        None => cache_base,
    }
    .min(experts_streamed) as u64
        * expert_slot_bytes;
    let mut room = left.map(|l| l.saturating_sub(cache_kept));
    let dense_resident: Vec<bool> = sparse
        .iter()
        .map(|sp| {
            let Some(sp) = sp else { return false };
            let need = round(sp.dense_raw);
            let fits = room.is_none_or(|r| need <= r);
            if fits {
                room = room.map(|r| r - need);
            }
            fits
        })
        .collect();
    let dense_resident_bytes: u64 = sparse
        .iter()
        .zip(&dense_resident)
        .filter(|(_, &d)| d)
        .filter_map(|(sp, _)| sp.as_ref().map(|sp| round(sp.dense_raw)))
        .sum();
    let expert_cache_slots = match (experts_streamed, input.expert_cache) {
        (0, _) => 0,
        (n, Some(asked)) => asked.min(n),
        (n, None) => {
            let fits = room.map_or(n, |l| (l / expert_slot_bytes.max(1)) as usize);
            (fits + cache_base).min(n)
        }
    };
    let expert_cache_bytes = expert_cache_slots as u64 * expert_slot_bytes;
    // With a profile, the cache keeps room for one step's expert loads to come and go; the
    // rest holds the profile's hottest experts for good.
    let expert_hot_slots = if input.expert_profile.is_some() {
        expert_cache_slots.saturating_sub(expert_reads.max(1))
    } else {
        0
    };
    let arena = if h.unified {
        dev_used + dense_resident_bytes + expert_cache_bytes
    } else {
        0
    };
    // Without --device-memory a unified backend's device budget is its arena, the expert
    // cache included.
    let budget = if h.unified && input.device_budget.is_none() {
        arena
    } else {
        budget
    };

    // Host cache (discrete devices only): decompressed copies of streamed units, most
    // bytes-per-pass first, within what the host budget leaves.
    let mut cache_budget = if h.unified {
        0
    } else {
        input.host_cache_budget
    };
    if let Some(b) = h.budget {
        let room = b.saturating_sub(host_fixed + staged + arena);
        if cache_budget > room {
            tracing::warn!(
                "host cache {} cut to {}: the host budget {} leaves no more",
                fmt_bytes(cache_budget),
                fmt_bytes(room),
                fmt_bytes(b)
            );
            cache_budget = room;
        }
    }
    if h.unified && input.host_cache_budget > 0 {
        tracing::info!("--host-cache is not used on this backend: its device memory is host memory, so what fits is resident");
    }
    let mut cached = vec![false; raw.len()];
    let mut host_left = cache_budget;
    let mut streamed_order: Vec<usize> = (0..raw.len()).filter(|&u| !resident[u]).collect();
    streamed_order.sort_by(|&x, &y| raw[y].cmp(&raw[x]).then(x.cmp(&y)));
    for u in streamed_order {
        if m.units[u].raw_len <= host_left {
            host_left -= m.units[u].raw_len;
            cached[u] = true;
        }
    }
    let host_cache_bytes = cache_budget - host_left;
    // The discrete loader stages two kept units at a time through its own engine (the
    // streaming engine's buffers do not exist yet).
    let kept_max = (0..raw.len())
        .filter(|&u| resident[u] || cached[u])
        .map(|u| raw[u])
        .max()
        .unwrap_or(0);
    let load_transient = if h.unified {
        0
    } else {
        (2 * kept_max).saturating_sub(staged)
    };
    let host_total = host_fixed + staged + arena + host_cache_bytes + load_transient;
    if let Some(b) = h.budget {
        if host_total > b {
            let held = if h.unified { arena } else { host_cache_bytes };
            return Err(PlanError::Host(HostBudgetError::new(
                h,
                [reads, scratch + gather_host, held, staged, load_transient],
            )));
        }
    }

    let mut units = Vec::with_capacity(raw.len());
    let (mut disk, mut host, mut upload) = (0u64, 0u64, 0u64);
    for (u, lu) in m.units.iter().enumerate() {
        let placement = if resident[u] {
            Placement::Resident
        } else if cached[u] {
            Placement::HostCached
        } else {
            Placement::Streamed
        };
        // Stored and raw bytes one pass loads of the unit: the embedding's head parts
        // (their shared frames twice), or the unit once.
        let (stored, raw_loaded) = if u == 0 {
            head_parts.iter().fold((0, 0), |(st, rw), p| {
                let fs = &lu.frames[p.frames.clone()];
                (
                    st + fs.iter().map(|f| f.stored_len()).sum::<u64>(),
                    rw + p.raw_len,
                )
            })
        } else if let (Some(sp), Some(Some((_, pass)))) = (&sparse[u], emb.sparse.get(u)) {
            // A sparse layer: its dense part (unless resident) and a full batch's routed
            // experts, estimated (stored bytes in the unit's own ratio).
            let pass = if dense_resident[u] {
                pass - sp.dense_raw
            } else {
                *pass
            };
            let stored = (lu.stored_len as u128 * pass as u128 / lu.raw_len.max(1) as u128) as u64;
            (stored, pass)
        } else {
            (lu.stored_len, lu.raw_len)
        };
        match placement {
            Placement::Resident => {}
            Placement::Streamed => {
                disk += stored;
                // Bytes handed to the compute per pass: copied to the device, or on a unified
                // backend lent in their staging slot (PassStats::bytes_uploaded counts the
                // same).
                upload += raw_loaded;
            }
            Placement::HostCached => {
                host += raw_loaded;
                upload += raw_loaded;
            }
        }
        units.push(UnitPlan {
            unit: lu.kind.to_string(),
            placement,
            raw_bytes: lu.raw_len,
            stored_bytes: lu.stored_len,
            experts_routed: sparse[u].is_some(),
            dense_resident: dense_resident[u],
            pieces: pieces[u].as_ref().map_or(0, |p| p.len()),
        });
    }
    let plan = Plan {
        device_budget: budget,
        kv_cache_bytes: kv,
        workspace_bytes: ws,
        backend_bytes: backend,
        stream_slots: slots,
        stream_slot_bytes: if slots > 0 { slot_bytes } else { 0 },
        resident_bytes,
        host_cache_bytes,
        prefetch,
        embedding_loads_per_pass: head_parts.len(),
        embedding_gathered: gathered,
        gather_bytes_per_token: if gathered {
            m.units[0].frame_stored_max()
        } else {
            0
        },
        gather_table_bytes: gather_dev,
        head_parts,
        head_seams,
        sparse,
        pieces,
        dense_resident,
        dense_resident_bytes,
        expert_cache_slots,
        expert_slot_bytes,
        expert_hot_slots,
        expert_reads,
        experts_streamed,
        units,
        disk_bytes_per_pass: disk,
        host_cache_bytes_per_pass: host,
        upload_bytes_per_pass: upload,
        host: HostPlan {
            budget: h.budget,
            budget_source: h.budget_source.clone(),
            overhead_bytes: h.overhead,
            read_buffers,
            request_bytes,
            reads_in_flight,
            staging_slots: staging,
            staging_slot_bytes,
            scratch_bytes: decoders,
            compute_scratch_bytes: compute,
            gather_bytes: gather_host,
            host_cache_bytes,
            arena_bytes: arena,
            load_transient_bytes: load_transient,
            total_bytes: host_total,
        },
    };
    // Assert in pairs: the plan fits the budgets it was made for.
    assert!(
        plan.device_bytes() <= budget,
        "plan of {} bytes exceeds its budget {budget}",
        plan.device_bytes()
    );
    assert!(h.budget.is_none_or(|b| host_total <= b));
    Ok(plan)
}

/// Which units are resident and how the rest stream.
struct Split {
    resident: Vec<bool>,
    /// Device streaming slots (0 on a unified backend).
    slots: usize,
    /// The slot size the split was chosen for (the slots may shrink to what streams).
    cap: u64,
    /// Host staging slots when the split chose them (unified), else None.
    staging: Option<usize>,
    device_budget: u64,
}

/// A discrete device (CUDA): the device budget decides the split, with two or three
/// device slots; the host stages `prefetch + 1` units.
fn plan_discrete(
    raw: &[u64],
    e: &UnitCosts,
    input: &PlanInput,
    (kv, fixed): (u64, u64),
    (gather, _): (u64, u64),
    all_resident: u64,
    expert_cache: u64,
) -> Result<Split, PlanError> {
    let budget = input.device_budget.unwrap_or(all_resident);
    if all_resident <= budget {
        return Ok(Split {
            resident: vec![true; raw.len()],
            slots: 0,
            cap: 0,
            staging: None,
            device_budget: budget,
        });
    }
    // A third slot lets an asynchronous backend upload one unit ahead. The streamed
    // embedding's gathered rows are charged only where the split streams it (see
    // plan_unified).
    let counts = [STREAM_SLOTS_MIN + 1, STREAM_SLOTS_MIN];
    let search = |gather: u64| {
        let fixed = fixed + gather + expert_cache;
        choose_residency(raw, e, &counts, |s, n| {
            budget.checked_sub(fixed + n as u64 * s)
        })
    };
    let c = match search(0) {
        Some(c) if c.resident[0] || gather == 0 => Some(c),
        _ => search(gather),
    };
    let fixed = fixed + gather + expert_cache;
    let c =
        c.ok_or_else(|| least_budget_error(raw, e, budget, kv, fixed - kv, STREAM_SLOTS_MIN))?;
    Ok(Split {
        resident: c.resident,
        slots: c.slots,
        cap: c.slot_bytes,
        staging: None,
        device_budget: budget,
    })
}

/// A unified backend (the CPU): one budget holds the arena (KV cache, workspace, resident
/// units) and the staging slots the streamed units run from; `--device-memory`, when
/// given, caps the arena inside it.
#[allow(clippy::too_many_arguments)] // the fixed roles, each a sum the plan table shows
fn plan_unified(
    raw: &[u64],
    e: &UnitCosts,
    input: &PlanInput,
    (kv, fixed): (u64, u64),
    (reads, scratch, in_flight): (u64, u64, u64),
    (gather_dev, gather_host): (u64, u64),
    prefetch_want: usize,
    all_resident: u64,
    (expert_cache, expert_reads): (u64, usize),
) -> Result<Split, PlanError> {
    let h = &input.host;
    let host_fixed = h.overhead + reads + scratch;
    let dev = input.device_budget;
    let host_room = h.budget.map(|b| b.checked_sub(host_fixed));
    let fits = |need: u64| {
        dev.is_none_or(|d| need <= d) && host_room.is_none_or(|r| r.is_some_and(|r| need <= r))
    };
    if fits(all_resident) {
        return Ok(Split {
            resident: vec![true; raw.len()],
            slots: 0,
            cap: 0,
            staging: None,
            device_budget: dev.unwrap_or(all_resident),
        });
    }
    // Streaming: room for the experts' cache and staging, and for the embedding's gathered
    // rows (see plan_once) where it streams. First without the rows, which a split that
    // keeps the embedding resident does not need (charging them anyway pushed SmolLM2's
    // tied embedding out at 64 MiB, to be streamed in row parts every step); again with
    // them only when that split streams the embedding.
    let search = |(gather_dev, gather_host): (u64, u64)| {
        let (fixed, scratch) = (fixed + gather_dev + expert_cache, scratch + gather_host);
        let host_room = h
            .budget
            .map(|b| b.checked_sub(h.overhead + reads + scratch));
        // Staging slots from prefetch + 1 down to two (one computing, one loading). Units are
        // staged ahead in bytes, not in units: first try depths whose slots hold the reads in
        // flight (small units need more of them ahead), then shallower ones.
        let deepest = prefetch_want + 1;
        // One computing, the reads in flight, and one more so the disk has the next unit
        // queued when a unit lands (1.2 GB Llama at 512 MiB: 2 slots 1.33 tokens/s, 3 1.75).
        // Reads that land in the slots count here as much as read buffers do.
        let want =
            |s: u64| (2 + in_flight.div_ceil(s.max(1)) as usize).clamp(STREAM_SLOTS_MIN, deepest);
        let room = |s: u64, n: usize| -> Option<u64> {
            let by_dev = match dev {
                Some(d) => Some(d.checked_sub(fixed)?),
                None => None,
            };
            let by_host = match host_room {
                Some(r) => Some(r?.checked_sub(fixed + (n + expert_reads) as u64 * s)?),
                None => None,
            };
            match (by_dev, by_host) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (Some(a), None) => Some(a),
                (None, Some(b)) => Some(b),
                (None, None) => Some(u64::MAX),
            }
        };
        let deep: Vec<usize> = (STREAM_SLOTS_MIN..=deepest).rev().collect();
        let c = choose_residency(raw, e, &deep, |sz, n| {
            if n >= want(sz) {
                room(sz, n)
            } else {
                None
            }
        })
        .or_else(|| choose_residency(raw, e, &deep, room));
        (c, fixed, scratch)
    };
    let (c, fixed, scratch) = match search((0, 0)) {
        (Some(c), fixed, scratch) if c.resident[0] || (gather_dev, gather_host) == (0, 0) => {
            (Some(c), fixed, scratch)
        }
        _ => search((gather_dev, gather_host)),
    };
    match c {
        Some(c) => {
            let arena = fixed
                + (0..raw.len())
                    .filter(|&u| c.resident[u])
                    .map(|u| raw[u])
                    .sum::<u64>();
            Ok(Split {
                resident: c.resident,
                slots: 0,
                cap: c.slot_bytes,
                staging: Some(c.slots),
                device_budget: dev.unwrap_or(arena),
            })
        }
        None => {
            // The least that runs: for some slot size, units larger than it resident (in
            // the arena, within --device-memory), two staging slots of it and, for a
            // mixture, the slots its expert loads land in (as `room` counts them: without
            // them the least a mixture's error named did not run).
            let least = oversized(raw, e)
                .into_iter()
                .filter(|&(big, _)| dev.is_none_or(|d| fixed + big <= d))
                .map(|(big, s)| (fixed + big, (STREAM_SLOTS_MIN + expert_reads) as u64 * s))
                .min_by_key(|&(arena, staged)| arena + staged);
            match (least, h.budget) {
                (Some((arena, staged)), Some(_)) => Err(PlanError::Host(HostBudgetError::new(
                    h,
                    [reads, scratch, arena, staged, 0],
                ))),
                _ => Err(least_budget_error(
                    raw,
                    e,
                    dev.unwrap_or(0),
                    kv,
                    fixed - kv,
                    0,
                )),
            }
        }
    }
}
