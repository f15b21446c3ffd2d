//! The memory planner: given the device budget, the host cache
//! budget, the batch and context limits and the manifest, decide what is resident, what
//! streams and through how many slots, and what the host keeps decompressed.
//!
//! Order of reservation: KV cache and workspace first (a step cannot run without them),
//! then streaming slots (at least 2: one computing, one loading), then whole units
//! resident, chosen to minimise the bytes streamed per pass, then the host cache.

use crate::model::ModelOptions;
use crate::store::format::Manifest;

mod costs;
pub mod devices;
mod error;
mod experts;
mod host;
mod layout;
pub mod placement;
mod split;
mod streamed;
mod table;

pub use costs::gather_host_bytes;
use costs::{FixedCosts, Gather, UnitCosts};
pub use devices::{DeviceInput, DeviceSpan};
pub use error::{DeviceBudgetError, HostBudgetError, PlanError};
use experts::{ExpertReserve, ExpertResidency};
use host::{HostCache, HostShape, Staging};
pub use layout::{layer_pieces, sparse_unit, LayerPiece, SparseUnit, LAYER_PHASES};
use split::{Split, SplitInput};
use streamed::Streamed;

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
            verify_rows: 0,
        },
        prefetch: None,
        expert_cache: None,
        expert_profile: None,
        backend_reserved: 0,
        self_draft_reserved: 0,
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
    /// Device bytes a self-draft (`--draft self:TYPE`) holds in the model's own memory,
    /// reserved beside the backend's: its KV cache and workspace, and the quantized copies
    /// of the units this plan streams (`engine::self_draft::plan_room` settles them).
    pub self_draft_reserved: u64,
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
    /// Whether the sequences' samplers may keep vocabulary-long rows (`host::sampling`):
    /// a server's requests may ask for any sampling; a greedy run without penalties,
    /// biases or JSON keeps none.
    pub sampler_rows: bool,
    /// Whether requests may be constrained (JSON mode, schemas, regexes, grammars, tool
    /// calls): the vocabulary's grammar structures (`text::grammar::Grammars`) are then
    /// counted in `host::sampling`. A server's may; a run without such a flag's may not.
    pub grammars: bool,
    /// The prefix cache's host tier (`--kv-cache-host`).
    pub kv_tier: KvHostTier,
    /// The prefix cache has a disk tier (`--kv-cache-dir`): its write queue is counted.
    pub kv_disk: bool,
    /// Decoder layers computed on the host CPU from host memory, the first ones
    /// (`--cpu-layers`, llama.cpp's habit): their weights, KV cache and a workspace are
    /// host memory, the device holds none of them.
    pub cpu_layers: usize,
    /// The host CPU backend's own scratch for those layers (`CpuBackend::scratch_bytes`).
    pub cpu_scratch: u64,
    /// Devices beside the first (`--devices`): each computes a span of the later layers,
    /// resident within its own budget (`devices::spans`).
    pub devices: Vec<DeviceInput>,
    /// The share of the layers after the host's each device computes, the first device's
    /// first (`--split`; one per device).
    pub split: Vec<f64>,
}

/// What the prefix cache's host tier may take (`--kv-cache-host`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum KvHostTier {
    /// No host tier (`sluiced run`, benchmarks, `--prefix-cache off`).
    #[default]
    Off,
    /// A quarter of what the host budget leaves once the plan's other roles are in, at
    /// most `KV_HOST_AUTO_MAX` (that much without a budget).
    Auto,
    /// This many bytes, or what the budget leaves where that is less (a warning says so).
    Bytes(u64),
}

/// The host tier `KvHostTier::Auto` takes at most.
pub const KV_HOST_AUTO_MAX: u64 = 1 << 30;
/// KV a finished sequence copies out of its slot at once for the prefix cache's tiers
/// (`Tiers::export` splits longer runs); the copy and its blocks are held together.
pub const KV_EXPORT_RUN_BYTES: u64 = 2 << 20;
/// Blocks waiting for the disk tier's writer at most (`DiskTier::write` waits beyond);
/// with a disk tier the plan also counts one KV slot for a prompt's blocks read back.
pub const KV_WRITE_QUEUE_BYTES: u64 = 8 << 20;

impl KvHostTier {
    /// The bytes it takes where `room` is left of the host budget (None: no budget).
    fn bytes(self, room: Option<u64>) -> u64 {
        match (self, room) {
            (KvHostTier::Off, _) => 0,
            (KvHostTier::Auto, None) => KV_HOST_AUTO_MAX,
            (KvHostTier::Auto, Some(r)) => (r / 4).min(KV_HOST_AUTO_MAX),
            (KvHostTier::Bytes(b), None) => b,
            (KvHostTier::Bytes(b), Some(r)) => {
                if b > r {
                    tracing::warn!(
                        "--kv-cache-host {} cut to {}: the host budget leaves no more",
                        crate::util::fmt_bytes(b),
                        crate::util::fmt_bytes(r)
                    );
                }
                b.min(r)
            }
        }
    }
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
            sampler_rows: true,
            grammars: true,
            kv_tier: KvHostTier::Off,
            kv_disk: false,
            cpu_layers: 0,
            cpu_scratch: 0,
            devices: Vec::new(),
            split: Vec::new(),
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
    /// The engine's logits and samplers on the host, with the grammar structures where
    /// requests may be constrained (`host::sampling`).
    pub sampling_bytes: u64,
    /// A streamed embedding's lookup: the gathered rows, a frame's read buffer and its
    /// decoded bytes (0 when the embedding is resident).
    pub gather_bytes: u64,
    pub host_cache_bytes: u64,
    /// The prefix cache's host tier: KV blocks of finished prompts (`KvHostTier`).
    pub kv_cache_host_bytes: u64,
    /// What its tiers hold in passing: a finished sequence's copy out of its slot (and
    /// the blocks made of it), the disk tier's write queue.
    pub kv_cache_io_bytes: u64,
    /// The device arena when device memory is host memory (0 otherwise).
    pub arena_bytes: u64,
    /// Extra bytes held only while resident units load at start (CUDA: the loader's
    /// staging), 0 once running.
    pub load_transient_bytes: u64,
    /// The layers computed on the host CPU (`HostInput::cpu_layers`): their weights, KV
    /// cache, workspace and compute scratch.
    pub cpu_layers_bytes: u64,
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
    /// Computed on the host CPU from host memory (`HostInput::cpu_layers`).
    Host,
    /// Computed on a device beside the first, resident there (`Plan::devices`).
    OtherDevice,
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

#[derive(Clone, Debug, Serialize)]
pub struct Plan {
    pub device_budget: u64,
    /// The device's KV cache: its layers' (not those computed on the host).
    pub kv_cache_bytes: u64,
    /// Decoder layers computed on the host CPU, the first ones (`HostInput::cpu_layers`),
    /// and what they hold there: weights, KV cache, a workspace (the host backend's arena,
    /// `cpu_arena_bytes`).
    pub cpu_layers: usize,
    /// The devices beside the first and the layers each computes (`HostInput::devices`).
    pub devices: Vec<DeviceSpan>,
    pub cpu_weights_bytes: u64,
    pub cpu_kv_cache_bytes: u64,
    pub cpu_workspace_bytes: u64,
    pub workspace_bytes: u64,
    /// The backend's own scratch (see PlanInput::backend_reserved).
    pub backend_bytes: u64,
    /// A self-draft's share of the device memory (see PlanInput::self_draft_reserved).
    pub self_draft_bytes: u64,
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
        self.units
            .iter()
            .filter(|u| matches!(u.placement, Placement::Streamed | Placement::HostCached))
            .count()
    }

    /// The host CPU backend's arena for the layers it computes (0 without such layers).
    pub fn cpu_arena_bytes(&self) -> u64 {
        self.cpu_weights_bytes + self.cpu_kv_cache_bytes + self.cpu_workspace_bytes
    }

    /// Device bytes the plan allocates at most.
    pub fn device_bytes(&self) -> u64 {
        self.kv_cache_bytes
            + self.workspace_bytes
            + self.gather_table_bytes
            + self.backend_bytes
            + self.self_draft_bytes
            + self.stream_slots as u64 * self.stream_slot_bytes
            + self.resident_bytes
            + self.expert_cache_slots as u64 * self.expert_slot_bytes
            + self.dense_resident_bytes
    }
}

/// What the prefix cache's tiers hold in passing: a copy out of or into a slot and the
/// blocks made of it (twice `KV_EXPORT_RUN_BYTES`); with a disk tier, its write queue and
/// a prompt's blocks read back until they are in its slot (at most one slot's KV).
fn kv_io(fixed: &FixedCosts, input: &PlanInput) -> u64 {
    let h = &input.host;
    let slot_kv = fixed.kv / input.opts.kv_slots.max(1) as u64;
    match (h.kv_tier != KvHostTier::Off || h.kv_disk, h.kv_disk) {
        (false, _) => 0,
        (true, false) => 2 * KV_EXPORT_RUN_BYTES,
        (true, true) => 2 * KV_EXPORT_RUN_BYTES + KV_WRITE_QUEUE_BYTES + slot_kv,
    }
}

/// What a decoder of `m` with `opts` allocates before any weights (its KV cache,
/// workspace and rotary tables), as a plan counts it, and each unit's bytes as allocated:
/// a self-draft of `m` holds the first and the units its model streams.
pub fn decoder_bytes(m: &Manifest, opts: &ModelOptions) -> (u64, Vec<u64>) {
    let f = FixedCosts::new(
        m,
        &PlanInput {
            device_budget: None,
            host_cache_budget: 0,
            opts: *opts,
            prefetch: None,
            expert_cache: None,
            expert_profile: None,
            backend_reserved: 0,
            self_draft_reserved: 0,
            host: HostInput::default(),
        },
    );
    (f.device, f.raw)
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

/// One plan with reads of at most `1 / reads_share` of the host budget: its phases, each
/// over what the ones before settled.
fn plan_once(m: &Manifest, input: &PlanInput, reads_share: u64) -> Result<Plan, PlanError> {
    let h = &input.host;
    warn_past_context(m, &input.opts);
    check_cpu_layers(m, h)?;
    let devices = devices::spans(m, input)?;
    let fixed = FixedCosts::new(m, input);
    let raw = &fixed.raw;
    // Layers of a mixture that can stream only their routed experts.
    let sparse_all: Vec<Option<SparseUnit>> =
        (0..m.units.len()).map(|u| sparse_unit(m, u)).collect();
    let costs = UnitCosts::new(m, &input.opts, &sparse_all, h.request_bytes_max);
    let mut shape = HostShape::new(m, input, &costs, raw, reads_share);
    shape.kv_io = kv_io(&fixed, input);
    let gather = Gather::new(m, &input.opts, &costs);
    let reserve = ExpertReserve::new(m, input, &costs, &sparse_all);
    let split = split::split(&SplitInput {
        input,
        costs: &costs,
        fixed: &fixed,
        shape: &shape,
        gather,
        experts: &reserve,
    })?;
    let split_shape = (&split.resident[..], split.slots, split.cap);
    let st = Streamed::new(m, &costs, raw, split_shape, sparse_all, gather);
    let host_fixed = shape.fixed(h) + st.gather.host;
    let staging = Staging::settle(h, split.staging, shape.prefetch_want, host_fixed, &st);
    let resident_bytes = split.resident_bytes(raw);
    let dev_used = fixed.device + resident_bytes + st.device_bytes(h.unified);
    let left = left_after_split(
        input,
        split.device_budget,
        dev_used,
        host_fixed + staging.bytes,
    );
    let experts = ExpertResidency::new(input, &reserve, &st, left);
    let arena = if h.unified {
        dev_used + experts.dense_resident_bytes + experts.cache_bytes(&st)
    } else {
        0
    };
    // Without --device-memory a unified backend's device budget is its arena, the expert
    // cache included.
    let budget = if h.unified && input.device_budget.is_none() {
        arena
    } else {
        split.device_budget
    };
    let held = host_fixed + staging.bytes + arena + fixed.cpu.total();
    let cache = HostCache::new(m, input, raw, &split.resident, held, staging.bytes);
    let mut host_total = held + cache.bytes + cache.load_transient;
    if h.budget.is_some_and(|b| host_total > b) {
        let kept = if h.unified { arena } else { cache.bytes };
        let scratch = shape.scratch() + st.gather.host;
        let roles = [
            shape.reads,
            scratch,
            kept,
            staging.bytes,
            cache.load_transient,
            fixed.cpu.total(),
        ];
        return Err(PlanError::Host(HostBudgetError::new(h, roles)));
    }
    // The host tier in what the budget leaves (its transients are in the scratch).
    let kv_host = h
        .kv_tier
        .bytes(h.budget.map(|b| b.saturating_sub(host_total)));
    host_total += kv_host;
    let kv_io = shape.kv_io;
    let settled = Settled {
        resident_bytes,
        fixed,
        shape,
        split,
        st,
        staging,
        experts,
        cache,
        arena,
        device_budget: budget,
        host_total,
        kv_host,
        kv_io,
    };
    let mut plan = assemble(m, h, &costs, settled);
    plan.devices = devices;
    // Assert in pairs: the plan fits the budgets it was made for.
    let dev = plan.device_bytes();
    assert!(
        dev <= budget,
        "plan of {dev} bytes exceeds its budget {budget}"
    );
    assert!(h.budget.is_none_or(|b| host_total <= b));
    Ok(plan)
}

/// `--cpu-layers` within the model's decoder layers, and beside a discrete device (on the
/// CPU backend every layer already runs on the host).
fn check_cpu_layers(m: &Manifest, h: &HostInput) -> Result<(), PlanError> {
    let n = m.arch.n_layers as usize;
    if h.cpu_layers > n {
        return Err(PlanError::Placement(format!(
            "--cpu-layers {} is more than the model's {n} decoder layers",
            h.cpu_layers
        )));
    }
    if h.cpu_layers > 0 && h.unified {
        return Err(PlanError::Placement(format!(
            "--cpu-layers {}: the CPU backend already computes every layer on the host; give it with a GPU (--backend cuda)",
            h.cpu_layers
        )));
    }
    Ok(())
}

fn warn_past_context(m: &Manifest, opts: &ModelOptions) {
    if opts.max_context > m.arch.max_context as usize {
        tracing::warn!(
            "context {} is beyond the model's trained context {}",
            opts.max_context,
            m.arch.max_context
        );
    }
}

/// What the phases of `plan_once` settled, for `assemble`.
struct Settled {
    fixed: FixedCosts,
    shape: HostShape,
    split: Split,
    st: Streamed,
    staging: Staging,
    experts: ExpertResidency,
    cache: HostCache,
    resident_bytes: u64,
    arena: u64,
    device_budget: u64,
    host_total: u64,
    /// The prefix cache's host tier, and its copies and write queue.
    kv_host: u64,
    kv_io: u64,
}

/// The plan from what its phases settled: each unit's placement and the bytes a pass
/// moves of it.
fn assemble(m: &Manifest, h: &HostInput, costs: &UnitCosts, s: Settled) -> Plan {
    let (units, [disk, host, upload]) = pass_bytes(m, costs, &s);
    let Settled {
        fixed,
        shape,
        st,
        staging,
        experts,
        cache,
        ..
    } = s;
    Plan {
        device_budget: s.device_budget,
        kv_cache_bytes: fixed.kv,
        cpu_layers: h.cpu_layers,
        devices: Vec::new(),
        cpu_weights_bytes: fixed.cpu.weights,
        cpu_kv_cache_bytes: fixed.cpu.kv,
        cpu_workspace_bytes: fixed.cpu.workspace,
        workspace_bytes: fixed.workspace,
        backend_bytes: fixed.backend,
        self_draft_bytes: fixed.self_draft,
        stream_slots: st.slots,
        stream_slot_bytes: if st.slots > 0 { st.slot_bytes } else { 0 },
        resident_bytes: s.resident_bytes,
        host_cache_bytes: cache.bytes,
        prefetch: staging.prefetch,
        embedding_loads_per_pass: st.head_parts.len(),
        embedding_gathered: st.gathered,
        gather_bytes_per_token: if st.gathered {
            m.units[0].frame_stored_max()
        } else {
            0
        },
        gather_table_bytes: st.gather.device,
        head_parts: st.head_parts,
        head_seams: st.head_seams,
        sparse: st.sparse,
        pieces: st.pieces,
        dense_resident: experts.dense_resident,
        dense_resident_bytes: experts.dense_resident_bytes,
        expert_cache_slots: experts.cache_slots,
        expert_slot_bytes: st.expert_slot_bytes,
        expert_hot_slots: experts.hot_slots,
        expert_reads: st.expert_reads,
        experts_streamed: st.experts_streamed,
        units,
        disk_bytes_per_pass: disk,
        host_cache_bytes_per_pass: host,
        upload_bytes_per_pass: upload,
        host: HostPlan {
            budget: h.budget,
            budget_source: h.budget_source.clone(),
            overhead_bytes: h.overhead,
            read_buffers: shape.read_buffers,
            request_bytes: shape.request_bytes,
            reads_in_flight: shape.reads_in_flight,
            staging_slots: staging.slots,
            staging_slot_bytes: st.slot_bytes,
            scratch_bytes: shape.decoders,
            compute_scratch_bytes: shape.compute,
            sampling_bytes: shape.sampling,
            gather_bytes: st.gather.host,
            host_cache_bytes: cache.bytes,
            kv_cache_host_bytes: s.kv_host,
            kv_cache_io_bytes: s.kv_io,
            arena_bytes: s.arena,
            load_transient_bytes: cache.load_transient,
            cpu_layers_bytes: fixed.cpu.total(),
            total_bytes: s.host_total,
        },
    }
}

/// Per unit, its placement, and the stored bytes a pass reads from disk, the raw bytes it
/// copies from the host cache and the raw bytes it hands the compute (uploaded, or on a
/// unified backend lent in their staging slot: `PassStats::bytes_uploaded` counts the
/// same).
fn pass_bytes(m: &Manifest, costs: &UnitCosts, s: &Settled) -> (Vec<UnitPlan>, [u64; 3]) {
    let (resident, cached) = (&s.split.resident, &s.cache.cached);
    let dense_resident = &s.experts.dense_resident;
    let mut units = Vec::with_capacity(m.units.len());
    let (mut disk, mut host, mut upload) = (0u64, 0u64, 0u64);
    let on_cpu = |u: usize| (1..=s.fixed.cpu.layers).contains(&u);
    let on_other = |u: usize| u >= s.fixed.others_from && u <= m.arch.n_layers as usize;
    for (u, lu) in m.units.iter().enumerate() {
        let placement = if on_cpu(u) {
            Placement::Host
        } else if on_other(u) {
            Placement::OtherDevice
        } else if resident[u] {
            Placement::Resident
        } else if cached[u] {
            Placement::HostCached
        } else {
            Placement::Streamed
        };
        // Stored and raw bytes one pass loads of the unit: the embedding's head parts
        // (their shared frames twice), or the unit once.
        let (stored, raw_loaded) = if u == 0 {
            s.st.head_parts.iter().fold((0, 0), |(st, rw), p| {
                let fs = &lu.frames[p.frames.clone()];
                (
                    st + fs.iter().map(|f| f.stored_len()).sum::<u64>(),
                    rw + p.raw_len,
                )
            })
        } else if let (Some(sp), Some(Some((_, pass)))) = (&s.st.sparse[u], costs.sparse.get(u)) {
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
            Placement::Resident | Placement::Host | Placement::OtherDevice => {}
            Placement::Streamed => {
                disk += stored;
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
            experts_routed: s.st.sparse[u].is_some(),
            dense_resident: dense_resident[u],
            pieces: s.st.pieces[u].as_ref().map_or(0, |p| p.len()),
        });
    }
    (units, [disk, host, upload])
}

/// The memory the split leaves for a mixture's dense parts and expert cache: the device
/// budget's rest (unless a unified backend has none) and a unified backend's host
/// budget's rest (`host_held`: its fixed roles and staging), the smaller; None where
/// neither limits.
fn left_after_split(
    input: &PlanInput,
    device_budget: u64,
    dev_used: u64,
    host_held: u64,
) -> Option<u64> {
    let h = &input.host;
    let dev_left = match (h.unified, input.device_budget) {
        (true, None) => None,
        _ => Some(device_budget.saturating_sub(dev_used)),
    };
    let host_left = match (h.unified, h.budget) {
        (true, Some(b)) => Some(b.saturating_sub(host_held + dev_used)),
        _ => None,
    };
    [dev_left, host_left].into_iter().flatten().min()
}
