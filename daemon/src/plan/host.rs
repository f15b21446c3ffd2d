//! The host side's shape: read buffers and requests, decoder and compute scratch, the
//! engine's logits and samplers.

use super::costs::UnitCosts;
use super::streamed::Streamed;
use super::{
    round, HostInput, PlanInput, ALLOC_ALIGN, PREFETCH_DEFAULT, STAGING_MAX, STREAM_AHEAD_BYTES,
    STREAM_SLOTS_MIN,
};
use crate::store::format::Manifest;
use crate::util::fmt_bytes;

/// The host roles that do not depend on the split: how units are read (read buffers, or
/// reads that land in the staging slots), how many are wanted ahead, and the decoders'
/// and compute threads' scratch.
pub(super) struct HostShape {
    /// Units requested ahead of the one computing, before the budget has its say.
    pub prefetch_want: usize,
    pub read_buffers: usize,
    pub request_bytes: u64,
    pub reads_in_flight: usize,
    /// Bytes of the read buffers.
    pub reads: u64,
    /// The decompression workers' scratch (and the shared codes' tables).
    pub decoders: u64,
    /// The compute threads' own scratch.
    pub compute: u64,
    /// The engine's host copy of a pass's logits and the sequences' samplers (`sampling`).
    pub sampling: u64,
    /// What the prefix cache's tiers hold in passing (`HostPlan::kv_cache_io_bytes`).
    pub kv_io: u64,
    /// The bytes the disk should have queued: the read buffers, or for reads that land in
    /// the staging slots, a typical unit (one read whole while the one before computes).
    pub in_flight: u64,
}

impl HostShape {
    /// With reads of at most `1 / reads_share` of the host budget.
    pub fn new(
        m: &Manifest,
        input: &PlanInput,
        costs: &UnitCosts,
        raw: &[u64],
        reads_share: u64,
    ) -> Self {
        let h = &input.host;
        let frame_stored_max = m.frame_stored_len_max();
        // A typical load: the median size (the decoder layers, not the embedding; a sparse
        // layer's largest load).
        let mut sizes: Vec<u64> = (0..raw.len()).map(|u| costs.need(raw, u)).collect();
        sizes.sort_unstable();
        let median = sizes.get(sizes.len() / 2).copied().unwrap_or(0);
        let into_slots = m.units.iter().all(|u| u.stored_as_raw());
        // Units ahead: the caller's, or for reads that land in the slots as many as hold
        // STREAM_AHEAD_BYTES (within the reads the engine may have in flight).
        let prefetch_want = match input.prefetch {
            Some(p) => p.max(1),
            None if into_slots && h.unified => {
                let ahead = STREAM_AHEAD_BYTES.min(h.reads_max_bytes);
                (1 + ahead.div_ceil(median.max(1)) as usize)
                    .clamp(PREFETCH_DEFAULT, STAGING_MAX - 1)
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
        let frame = u64::from(m.frame_raw_len_max()) + frame_stored_max + 2 * ALLOC_ALIGN;
        // The shared codes' decoding tables: one set, all decoders' (`Store::shared_tables`).
        let shared = (m.codes.len() * crate::store::float::TABLES_BYTES) as u64;
        let decoders = round(
            h.workers.max(1) as u64 * (frame + crate::store::codec::FrameDecoder::EXTRA_BYTES)
                + shared,
        );
        let in_flight = if read_buffers > 0 {
            reads
        } else {
            (reads_in_flight as u64 * request_bytes).min(median)
        };
        HostShape {
            prefetch_want,
            read_buffers,
            request_bytes,
            reads_in_flight,
            reads,
            decoders,
            compute: round(h.compute_scratch),
            sampling: sampling(m, input),
            kv_io: 0,
            in_flight,
        }
    }

    /// Decoder and compute scratch, the sampling's, and the prefix cache tiers' transients.
    pub fn scratch(&self) -> u64 {
        self.decoders + self.compute + self.sampling + self.kv_io
    }

    /// What the host holds whatever the split: the overhead, the reads and the scratch.
    pub fn fixed(&self, h: &HostInput) -> u64 {
        h.overhead + self.reads + self.scratch()
    }
}

/// What the engine holds on the host to pick tokens, each a vocabulary long: a pass's
/// logits as the backend hands them over (every logit row, verified tree rows included,
/// f32), and per sequence its sampler's penalized row (f32) and candidates ((f32, u32))
/// where it may keep them (`HostInput::sampler_rows`). Gemma 3's 262,144 tokens make that
/// 1 MiB a logit row and 3 MiB a sequence. Where requests may be constrained
/// (`HostInput::grammars`), the vocabulary's grammar structures too: built on the first
/// constrained request, `GRAMMAR_BYTES_PER_TOKEN` a token.
pub fn sampling(m: &Manifest, input: &PlanInput) -> u64 {
    let vocab = m.arch.vocab as u64;
    let rows = input.opts.logit_rows() as u64;
    let seqs = if input.host.sampler_rows {
        input.opts.kv_slots as u64
    } else {
        0
    };
    let grammars = if input.host.grammars {
        GRAMMAR_BYTES_PER_TOKEN
    } else {
        0
    };
    round(vocab * (4 * rows + 12 * seqs + grammars))
}

/// What llguidance's token trie and lexer slices hold a token, bounded: measured as the
/// peak a first JSON-mode request adds, 22 MB for SmolLM2's 49,152 tokens and 116 MB for
/// Gemma 3's 262,144 (447 and 443 bytes a token).
pub const GRAMMAR_BYTES_PER_TOKEN: u64 = 512;

/// The host staging slots streamed units load into, and the units requested ahead.
pub(super) struct Staging {
    pub slots: usize,
    pub prefetch: usize,
    pub bytes: u64,
}

impl Staging {
    /// The split's slots where it chose them (unified), else `prefetch_want + 1`, fewer
    /// when the host budget is short (one computing, one loading at least); no more than
    /// a pass loads, and an expert load's each beside them. `host_fixed`: what the host
    /// holds besides.
    pub fn settle(
        h: &HostInput,
        chosen: Option<usize>,
        prefetch_want: usize,
        host_fixed: u64,
        st: &Streamed,
    ) -> Self {
        let (slots, prefetch) = match chosen {
            Some(n) => {
                let n = n.min(st.loads + 1).max(STREAM_SLOTS_MIN);
                (n, n.saturating_sub(1).max(1))
            }
            None => {
                let mut p = prefetch_want;
                if let Some(b) = h.budget {
                    let extra = (1 + st.expert_reads) as u64;
                    while p > 1 && host_fixed + (p as u64 + extra) * st.slot_bytes > b {
                        p -= 1;
                    }
                }
                (p + 1, p)
            }
        };
        // Expert loads have staging slots of their own beside the units requested ahead:
        // an expert is requested only once its layer has routed, while the loads ahead
        // hold theirs, so sharing them could wait forever.
        let (slots, prefetch) = if st.through_slots {
            (slots + st.expert_reads, prefetch)
        } else {
            (0, 0)
        };
        Staging {
            slots,
            prefetch,
            bytes: slots as u64 * st.slot_bytes,
        }
    }
}

/// The host cache (discrete devices only): decompressed copies of streamed units, most
/// bytes first, within what the host budget leaves; and what loading the resident and
/// cached units holds for a while.
pub(super) struct HostCache {
    /// Per unit, kept decompressed on the host.
    pub cached: Vec<bool>,
    pub bytes: u64,
    /// The discrete loader's staging beyond the streaming staging, while units load.
    pub load_transient: u64,
}

impl HostCache {
    /// `held`: what the host holds besides (fixed roles, staging, the arena).
    pub fn new(
        m: &Manifest,
        input: &PlanInput,
        raw: &[u64],
        resident: &[bool],
        held: u64,
        staged: u64,
    ) -> Self {
        let h = &input.host;
        let mut budget = if h.unified {
            0
        } else {
            input.host_cache_budget
        };
        if let Some(b) = h.budget {
            let room = b.saturating_sub(held);
            if budget > room {
                tracing::warn!(
                    "host cache {} cut to {}: the host budget {} leaves no more",
                    fmt_bytes(budget),
                    fmt_bytes(room),
                    fmt_bytes(b)
                );
                budget = room;
            }
        }
        if h.unified && input.host_cache_budget > 0 {
            tracing::info!("--host-cache is not used on this backend: its device memory is host memory, so what fits is resident");
        }
        let mut cached = vec![false; raw.len()];
        let mut left = budget;
        let mut order: Vec<usize> = (0..raw.len()).filter(|&u| !resident[u]).collect();
        order.sort_by(|&x, &y| raw[y].cmp(&raw[x]).then(x.cmp(&y)));
        for u in order {
            if m.units[u].raw_len <= left {
                left -= m.units[u].raw_len;
                cached[u] = true;
            }
        }
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
        HostCache {
            cached,
            bytes: budget - left,
            load_transient,
        }
    }
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
pub(super) fn read_shape(
    h: &HostInput,
    frame_stored_max: u64,
    unit: u64,
    share: u64,
) -> (usize, u64) {
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
pub(super) fn into_slots_shape(h: &HostInput, unit: u64) -> (u64, usize) {
    let request = request_size(h, unit / 4);
    let in_flight = h.reads_max_bytes.min(h.in_flight_max_bytes);
    let ops = (in_flight / request).clamp(2, 256) as usize;
    (request, ops)
}
