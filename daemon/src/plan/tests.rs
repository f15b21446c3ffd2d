//! The planner on a synthetic store: every unit resident when it fits, a budget-bounded
//! split otherwise (slots sized to the largest streamed unit, the plan within its
//! budget), the least budget in the error, and the host cache.

use super::*;
use crate::dtype::DType;
use crate::import::synth::{self, SynthSpec};
use crate::store::format::BLOB_ALIGN;
use crate::store::writer::{pack, PackOptions};
use crate::store::Store;
use std::ops::Range;

fn store(dir: &std::path::Path, tied: bool) -> Store {
    store_framed(dir, tied, 1 << 20, 2048)
}

fn store_framed(dir: &std::path::Path, tied: bool, frame_size: u32, vocab: u32) -> Store {
    store_shaped(dir, tied, frame_size, vocab, 6)
}

pub(super) fn store_shaped(
    dir: &std::path::Path,
    tied: bool,
    frame_size: u32,
    vocab: u32,
    layers: u32,
) -> Store {
    let mut spec = SynthSpec::llama_like(128, layers, DType::F32);
    // The embedding (1 MiB at 2048 rows) about the size of a layer.
    spec.vocab = vocab;
    let mut model = synth::model(&spec);
    if tied {
        model.arch.tied_embeddings = true;
        model.tensors.remove("lm_head.weight");
    }
    pack_raw(
        &model,
        &dir.join(if tied { "tied" } else { "untied" }),
        frame_size,
    )
}

/// `model` packed raw (codec none) at `out`, opened.
fn pack_raw(model: &crate::import::ImportedModel, out: &std::path::Path, frame_size: u32) -> Store {
    let units = model.units().expect("units");
    let opts = PackOptions {
        auto: None,
        codec: "none".parse().expect("codec"),
        frame_size,
        threads: 1,
        force: true,
        link: false,
    };
    pack(model, &units, out, &opts, |_| {}).expect("pack");
    Store::open(out).expect("open")
}

pub(super) fn input(budget: Option<u64>, host_cache: u64) -> PlanInput {
    PlanInput {
        device_budget: budget,
        host_cache_budget: host_cache,
        ..test_input(64, 2, 32)
    }
}

#[test]
fn everything_is_resident_when_it_fits() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let s = store(tmp.path(), false);
    let p = plan(s.manifest(), &input(None, 0)).expect("plan");
    assert_eq!(p.layers_streamed(), 0);
    assert_eq!((p.stream_slots, p.stream_slot_bytes, p.prefetch), (0, 0, 0));
    assert_eq!(p.disk_bytes_per_pass, 0);
    assert_eq!(p.device_bytes(), p.device_budget);
}

#[test]
fn a_smaller_budget_streams_the_least_and_stays_within_it() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let s = store(tmp.path(), false);
    let m = s.manifest();
    let full = plan(m, &input(None, 0)).expect("plan").device_budget;
    let mut streamed_before = 0;
    for pct in [90u64, 70, 50, 35] {
        let budget = full * pct / 100;
        let p = plan(m, &input(Some(budget), 0)).expect("a plan for this budget");
        assert!(
            p.device_bytes() <= budget,
            "{pct}%: {} > {budget}",
            p.device_bytes()
        );
        assert!(p.layers_streamed() > 0, "{pct}%: something must stream");
        assert!(p.stream_slots >= STREAM_SLOTS_MIN);
        // The untied embedding, the most bytes for the least value per pass (its lookup
        // reads a frame per token), is the first to stream, and needs no slot.
        assert!(p.embedding_gathered, "{pct}%");
        assert_eq!(p.embedding_loads_per_pass, 0, "{pct}%");
        let largest_streamed = (1..m.units.len())
            .filter(|&u| p.placement(u) != Placement::Resident)
            .map(|u| round(m.units[u].raw_len))
            .max()
            .unwrap_or(0);
        assert_eq!(
            p.stream_slot_bytes, largest_streamed,
            "{pct}%: slots fit the largest streamed unit"
        );
        // Less budget never streams less.
        assert!(p.upload_bytes_per_pass >= streamed_before, "{pct}%");
        streamed_before = p.upload_bytes_per_pass;
        let disk: u64 = (1..m.units.len())
            .filter(|&u| p.placement(u) == Placement::Streamed)
            .map(|u| m.units[u].stored_len)
            .sum();
        assert_eq!(p.disk_bytes_per_pass, disk);
        // The most a distinct token's row costs the lookup: a frame (of stored bytes).
        let frame = m.units[0].frames.iter().map(|f| f.stored_len()).max();
        assert_eq!(Some(p.gather_bytes_per_token), frame);
    }
}

#[test]
fn too_small_a_budget_says_the_least_that_runs() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let s = store(tmp.path(), false);
    let m = s.manifest();
    let PlanError::Device(e) =
        plan(m, &input(Some(4096), 0)).expect_err("4 KiB cannot run a model")
    else {
        panic!("a device budget error");
    };
    assert_eq!(e.budget, 4096);
    assert_eq!(e.slots, STREAM_SLOTS_MIN);
    assert_eq!(
        e.need,
        e.kv_cache + e.workspace + 2 * e.slot + e.oversized_resident
    );
    let msg = e.to_string();
    assert!(
        msg.contains("raise --device-memory")
            && msg.contains(&format!("({} bytes) at least", e.need)),
        "{msg}"
    );
    // The least budget it names does run.
    let p = plan(m, &input(Some(e.need), 0)).expect("the budget the error names runs");
    assert!(p.device_bytes() <= e.need);
    assert!(
        plan(m, &input(Some(e.need - 1), 0)).is_err(),
        "and it is the least"
    );
}

#[test]
fn a_streamed_tied_embedding_is_read_once_in_parts_and_the_host_cache_takes_streamed_units() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let s = store(tmp.path(), true);
    let m = s.manifest();
    assert!(m.arch.tied_embeddings);
    let need = plan(m, &input(Some(4096), 0))
        .expect_err("too small")
        .need();
    let p = plan(m, &input(Some(need), 0)).expect("plan");
    // At the least budget the embedding streams: its lookup gathers rows, and the head
    // reads it once, in parts (here one: the table is a single frame, larger than a
    // layer, so a slot holds that frame).
    assert_ne!(p.placement(0), Placement::Resident);
    assert!(p.embedding_gathered);
    assert_eq!(p.embedding_loads_per_pass, p.head_parts.len());
    assert_eq!(p.head_parts.len(), 1);
    let once: u64 = (0..m.units.len())
        .filter(|&u| p.placement(u) != Placement::Resident)
        .map(|u| m.units[u].raw_len)
        .sum();
    assert_eq!(p.upload_bytes_per_pass, once);
    // A host cache as large as the model turns every streamed unit into a cached one.
    let p = plan(m, &input(Some(need), u64::MAX / 2)).expect("plan");
    assert!((0..m.units.len()).all(|u| p.placement(u) != Placement::Streamed));
    assert_eq!(p.disk_bytes_per_pass, 0);
    assert_eq!(p.host_cache_bytes_per_pass, p.upload_bytes_per_pass);
}

#[test]
fn a_tied_embedding_larger_than_a_layer_streams_through_layer_sized_slots_in_row_parts() {
    let tmp = tempfile::tempdir().expect("tempdir");
    // 64 KiB frames: the 2 MiB table is 32 of them, a layer (~1 MiB) holds 16.
    let s = store_framed(tmp.path(), true, 64 << 10, 4096);
    let m = s.manifest();
    let emb = m.units[0].raw_len;
    let layer = m.units[1].raw_len;
    assert!(emb > layer, "the table is the largest unit");
    let need = plan(m, &input(Some(4096), 0))
        .expect_err("too small")
        .need();
    let p = plan(m, &input(Some(need), 0)).expect("plan");
    assert_ne!(p.placement(0), Placement::Resident);
    // Slots hold a layer, not the table, and the least budget keeps nothing resident.
    assert_eq!(p.stream_slot_bytes, round(layer));
    assert_eq!(p.resident_bytes, 0);
    assert!(p.head_parts.len() >= 2, "{:?}", p.head_parts);
    // The parts are disjoint runs of frames in order, each within a slot and its rows
    // whole inside its bytes; with the seam rows between them they cover every row once.
    let t = m.units[0]
        .tensor("model.embed_tokens.weight")
        .expect("table");
    let rb = t.dtype.row_bytes(t.shape[1]).expect("row bytes");
    let mut frame = 0;
    let mut rows: Vec<u64> = p.head_seams.clone();
    for part in &p.head_parts {
        assert_eq!(part.frames.start, frame, "{:?}", p.head_parts);
        frame = part.frames.end;
        assert!(part.rows.end > part.rows.start);
        assert!(m.units[0].part_span(part.frames.clone(), true) <= p.stream_slot_bytes);
        assert!(t.offset + part.rows.start * rb >= part.raw_base);
        assert!(t.offset + part.rows.end * rb <= part.raw_base + part.raw_len);
        rows.extend(part.rows.clone());
    }
    assert_eq!(frame, m.units[0].frames.len());
    rows.sort_unstable();
    assert_eq!(rows, (0..t.shape[0]).collect::<Vec<_>>());
    // f32 rows of 512 bytes: 64 KiB frames hold whole rows, so no row straddles.
    assert!(p.head_seams.is_empty());
    // The table is read once a pass, not twice.
    let parts_raw: u64 = p.head_parts.iter().map(|q| q.raw_len).sum();
    assert_eq!(parts_raw, emb);
    let layers: u64 = (1..m.units.len()).map(|u| m.units[u].raw_len).sum();
    assert_eq!(p.upload_bytes_per_pass, layers + parts_raw);
}

/// A unified backend (the CPU) under a host budget: overhead and reads first, then the
/// arena and the staging slots the streamed units run from, every role within the budget.
fn unified(budget: Option<u64>) -> PlanInput {
    let mut i = input(None, 0);
    i.host = HostInput {
        budget,
        overhead: 1 << 20,
        unified: true,
        compute_scratch: 300 << 10,
        ..HostInput::default()
    };
    i
}

#[test]
fn a_host_budget_bounds_every_host_role_of_a_unified_backend() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let s = store(tmp.path(), false);
    let m = s.manifest();
    let free = plan(m, &unified(None)).expect("plan");
    assert_eq!(free.layers_streamed(), 0);
    assert_eq!(free.host.arena_bytes, free.device_bytes());
    assert_eq!(free.host.compute_scratch_bytes, 300 << 10);
    // The engine's logits and samplers: a vocabulary (2048) of f32 per logit row, 12 bytes
    // a token per sequence, the grammar structures' 512 a token; a tree's verified rows
    // count like any other.
    let rows = |i: &PlanInput| {
        (i.opts.logit_rows() * 4 * 2048 + i.opts.kv_slots * 12 * 2048 + 512 * 2048) as u64
    };
    assert_eq!(free.host.sampling_bytes, rows(&unified(None)));
    let mut plain = unified(None);
    plain.host.grammars = false;
    let p = plan(m, &plain).expect("plan without constraints");
    assert_eq!(free.host.sampling_bytes - p.host.sampling_bytes, 512 * 2048);
    let mut tree = unified(None);
    tree.opts.verify_rows = 63;
    let wide = plan(m, &tree).expect("plan with tree rows");
    assert_eq!(wide.host.sampling_bytes, rows(&tree));
    assert_eq!(
        wide.host.total_bytes - free.host.total_bytes,
        wide.host.sampling_bytes - free.host.sampling_bytes
            + (wide.host.arena_bytes - free.host.arena_bytes)
    );
    // Below the arena plus the overhead something must stream, whatever the reads take.
    let full = free.host.arena_bytes + free.host.overhead_bytes;
    let least = plan(m, &unified(Some(1 << 20)))
        .expect_err("too small")
        .need();
    assert!(least < full, "the least plan ({least}) streams");
    for k in (0..=4u64).rev() {
        let pct = k * 25;
        let budget = least + (full - least) * k / 4;
        let p = plan(m, &unified(Some(budget))).expect("a plan for this budget");
        let h = &p.host;
        assert!(
            h.total_bytes <= budget,
            "{pct}%: {} > {budget}",
            h.total_bytes
        );
        assert_eq!(
            h.total_bytes,
            h.overhead_bytes
                + h.read_bytes()
                + h.scratch_bytes
                + h.compute_scratch_bytes
                + h.sampling_bytes
                + h.gather_bytes
                + h.arena_bytes
                + h.staging_slots as u64 * h.staging_slot_bytes,
            "{pct}%: the total is the sum of the roles"
        );
        assert_eq!(h.arena_bytes, p.device_bytes(), "{pct}%");
        // Streamed units run from staging: no device slots, no host cache.
        assert_eq!((p.stream_slots, p.host_cache_bytes), (0, 0));
        assert!(p.layers_streamed() > 0, "{pct}%: something must stream");
        // The untied embedding streams first, gathered (no staging slot); at the top of
        // the range it may be all that streams.
        assert!(p.embedding_gathered && h.gather_bytes > 0, "{pct}%");
        if p.layers_streamed() > 1 {
            assert!(h.staging_slots >= STREAM_SLOTS_MIN, "{pct}%");
            assert_eq!(p.prefetch, h.staging_slots - 1);
            // (Streamed bytes need not grow as the budget shrinks: a larger budget may
            // spend some of it on reads in flight, an 8th of it instead of a 32nd.)
            assert!(p.disk_bytes_per_pass > 0, "{pct}%");
        } else {
            assert_eq!((h.staging_slots, p.disk_bytes_per_pass), (0, 0), "{pct}%");
        }
    }
}

/// A split that keeps the embedding resident is not charged for the rows a streamed one
/// gathers: at the least budget that keeps a tied embedding (8 MiB, layers of 1)
/// resident, the plan spends all of it, on a unified backend (a host budget) and a
/// discrete one (a device budget). Were the gather charged, that budget would exceed the
/// plan by the gather's bytes, as it did when SmolLM2 at 64 MiB streamed its tied
/// embedding in row parts every step.
#[test]
fn keeping_the_embedding_resident_charges_no_row_gather() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let s = store_framed(tmp.path(), true, 256 << 10, 16384);
    let m = s.manifest();
    let unified_in = |b: Option<u64>| unified(b);
    let discrete_in = |b: Option<u64>| input(b, 0);
    let spent_unified = |p: &Plan| p.host.total_bytes;
    let spent_discrete = |p: &Plan| p.device_bytes();
    type Case<'a> = (
        &'a str,
        &'a dyn Fn(Option<u64>) -> PlanInput,
        &'a dyn Fn(&Plan) -> u64,
    );
    let cases: [Case; 2] = [
        ("unified", &unified_in, &spent_unified),
        ("discrete", &discrete_in, &spent_discrete),
    ];
    for (name, make, spent) in cases {
        let resident = |b: u64| {
            plan(m, &make(Some(b)))
                .ok()
                .filter(|p| p.placement(0) == Placement::Resident)
        };
        let mut lo = plan(m, &make(Some(1 << 20))).expect_err("too small").need();
        let streamed = plan(m, &make(Some(lo))).expect("the least plan");
        assert!(
            streamed.embedding_gathered,
            "{name}: the least plan streams the embedding"
        );
        // The tied head streams in row parts too, its logits gathered on the host: a
        // vocabulary of f32 more for each verified row.
        let mut wide = make(Some(lo + (4 << 20)));
        wide.opts.verify_rows += 8;
        let wide = plan(m, &wide).expect("a plan with tree rows");
        assert!(wide.embedding_gathered, "{name}");
        assert_eq!(
            wide.host.gather_bytes - streamed.host.gather_bytes,
            4 * 8 * 16384,
            "{name}: the gather holds the head's logits"
        );
        let mut hi = spent(&plan(m, &make(None)).expect("plan"));
        assert!(resident(hi).is_some() && resident(lo).is_none(), "{name}");
        while hi - lo > 1 {
            let mid = (lo + hi) / 2;
            if resident(mid).is_some() {
                hi = mid;
            } else {
                lo = mid;
            }
        }
        let p = resident(hi).expect("resident at the threshold");
        assert!(
            p.layers_streamed() > 0,
            "{name}: the threshold streams layers"
        );
        assert_eq!(
            (p.embedding_gathered, p.host.gather_bytes),
            (false, 0),
            "{name}"
        );
        assert_eq!(
            spent(&p),
            hi,
            "{name}: the threshold plan spends its whole budget"
        );
    }
}

#[test]
fn too_small_a_host_budget_names_every_role_and_the_least_that_runs() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let s = store(tmp.path(), false);
    let m = s.manifest();
    let PlanError::Host(e) = plan(m, &unified(Some(2 << 20))).expect_err("2 MiB is too small")
    else {
        panic!("a host budget error");
    };
    assert_eq!(e.budget, 2 << 20);
    assert!(e.unified);
    let msg = e.to_string();
    for part in [
        "process overhead",
        "read buffers",
        "logits and samplers",
        "device arena",
        "staging slots",
        "raise --host-memory",
    ] {
        assert!(msg.contains(part), "{part}: {msg}");
    }
    let p = plan(m, &unified(Some(e.need))).expect("the budget the error names runs");
    assert!(p.host.total_bytes <= e.need);
    assert!(plan(m, &unified(Some(e.need / 2))).is_err());
    // --device-memory caps the arena inside the host budget.
    let mut capped = unified(Some(u64::MAX / 4));
    capped.device_budget = Some(p.device_bytes());
    let c = plan(m, &capped).expect("plan");
    assert!(c.device_bytes() <= p.device_bytes() && c.layers_streamed() > 0);
}

#[test]
fn small_units_read_into_their_slots_queue_many_ahead_only_where_memory_allows() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let s = store_shaped(tmp.path(), false, 1 << 20, 2048, 24);
    let m = s.manifest();
    assert!(m.units.iter().all(|u| u.stored_as_raw()));
    let free = plan(m, &unified(None)).expect("plan");
    // The device budget binds (half the weights), the host does not: every load of a
    // pass may be requested ahead (the units are far smaller than STREAM_AHEAD_BYTES).
    let mut deep = unified(None);
    deep.device_budget = Some(free.device_bytes() - free.resident_bytes / 2);
    let p = plan(m, &deep).expect("plan");
    let loads = p
        .units
        .iter()
        .skip(1)
        .filter(|u| u.placement != Placement::Resident)
        .count()
        + p.head_parts.len();
    assert!(
        loads > PREFETCH_DEFAULT + 1,
        "{loads} loads: the test needs more"
    );
    assert_eq!(
        p.host.staging_slots,
        loads + 1,
        "one computing, every other load ahead"
    );
    assert_eq!(p.prefetch, loads);
    // An explicit --prefetch is kept.
    let mut asked = deep.clone();
    asked.prefetch = Some(2);
    let q = plan(m, &asked).expect("plan");
    assert_eq!((q.host.staging_slots, q.prefetch), (3, 2));
    assert_eq!(q.disk_bytes_per_pass, p.disk_bytes_per_pass);
    // Under a host budget that binds, depth never costs a resident unit: the plan streams
    // no more than with the old depth (PREFETCH_DEFAULT ahead) would.
    let tight = p.host.total_bytes - p.host.staging_slots as u64 * p.host.staging_slot_bytes
        + 3 * p.host.staging_slot_bytes;
    let mut host = unified(Some(tight));
    let h = plan(m, &host).expect("plan");
    host.prefetch = Some(PREFETCH_DEFAULT);
    let old = plan(m, &host).expect("plan");
    assert!(h.host.total_bytes <= tight);
    assert!(
        h.disk_bytes_per_pass <= old.disk_bytes_per_pass,
        "{} streamed against {} with {PREFETCH_DEFAULT} ahead",
        h.disk_bytes_per_pass,
        old.disk_bytes_per_pass
    );
    assert!(h.host.staging_slots < p.host.staging_slots);
}

#[test]
fn a_dense_layer_is_cut_where_its_projections_start_aligned_and_no_piece_is_below_the_least() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let s = store(tmp.path(), false);
    let m = s.manifest();
    let u = 1;
    let unit = &m.units[u];
    let start = |n: &str| {
        unit.tensor(&format!("model.layers.0.mlp.{n}.weight"))
            .expect("projection")
            .offset
    };
    let (gate, up, down) = (start("gate_proj"), start("up_proj"), start("down_proj"));
    // Attention, gate, up, down: each a run of whole frames, starting where its first
    // tensor does (4096-aligned in the file: pack starts each projection at a block).
    let pieces = layer_pieces(m, u, 0).expect("cut");
    let bases: Vec<u64> = pieces.iter().map(|p| p.raw_base).collect();
    assert_eq!(bases, [0, gate, up, down]);
    let phases: Vec<Range<usize>> = pieces.iter().map(|p| p.phases.clone()).collect();
    assert_eq!(phases, [0..1, 1..2, 2..3, 3..4]);
    assert_eq!(pieces[3].frames.end, unit.frames.len());
    for p in &pieces {
        assert!(unit.frames[p.frames.start]
            .file_offset
            .is_multiple_of(BLOB_ALIGN));
    }
    // No piece below the least: one byte more than the attention piece joins it to the
    // gate, and (the projections being a little smaller still) the up to the down; where
    // every piece would be too small nothing is cut.
    let least = gate + 1;
    assert!(up - gate < least && up - gate == down - up);
    let joined = layer_pieces(m, u, least).expect("cut");
    let phases: Vec<Range<usize>> = joined.iter().map(|p| p.phases.clone()).collect();
    assert_eq!(phases, [0..2, 2..4], "least {least}: {joined:?}");
    assert!(joined
        .iter()
        .all(|p| unit.part_span(p.frames.clone(), false) >= least));
    assert!(layer_pieces(m, u, unit.raw_len).is_none());
    // Read straight into the slots (stored as raw), a projection that does not start a
    // block is not a cut: the unit's bytes 256 further into the file, none does.
    let mut shifted = m.clone();
    let su = &mut shifted.units[u];
    su.file_offset += 256;
    for f in &mut su.frames {
        f.file_offset += 256;
    }
    assert!(shifted.units[u].stored_as_raw());
    assert!(layer_pieces(&shifted, u, 0).is_none());
    // Not a decoder layer.
    assert!(layer_pieces(m, 0, 0).is_none());
}

/// A mixture of experts in every layer (8 experts of 128 rows, top 2), packed raw.
fn store_moe(dir: &std::path::Path) -> Store {
    let mut spec = SynthSpec::llama_like(128, 6, DType::F32);
    spec.vocab = 2048;
    spec.moe = Some(synth::SynthMoe {
        experts: 8,
        top_k: 2,
        intermediate: 128,
        skew: 0.0,
    });
    let model = synth::model(&spec);
    pack_raw(&model, &dir.join("moe"), 1 << 20)
}

#[test]
fn a_mixture_streams_its_experts_within_the_device_budget_down_to_the_least_that_runs() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let s = store_moe(tmp.path());
    let m = s.manifest();
    let full = plan(m, &input(None, 0)).expect("plan").device_budget;
    let PlanError::Device(e) =
        plan(m, &input(Some(4096), 0)).expect_err("4 KiB cannot run a model")
    else {
        panic!("a device budget error");
    };
    assert!(
        e.need < full,
        "the least ({}) is below all-resident ({full})",
        e.need
    );
    let least = plan(m, &input(Some(e.need), 0)).expect("the budget the error names runs");
    assert!(least.device_bytes() <= e.need);
    assert!(
        least.layers_streamed() > 0 && least.expert_cache_slots + least.expert_hot_slots < 48,
        "at the least, layers stream and not every expert is cached: {least:?}"
    );
    assert!(
        plan(m, &input(Some(e.need - 1), 0)).is_err(),
        "one byte less does not run"
    );
    // Every budget in between plans within itself, reading no less per pass as it shrinks.
    let mut read = 0;
    for pct in [95u64, 80, 60, 40, 20] {
        let budget = e.need + (full - e.need) * pct / 100;
        let p = plan(m, &input(Some(budget), 0)).expect("a plan for this budget");
        assert!(
            p.device_bytes() <= budget,
            "{pct}%: {} > {budget}",
            p.device_bytes()
        );
        assert!(
            p.disk_bytes_per_pass >= read,
            "{pct}%: reads less with less memory"
        );
        read = p.disk_bytes_per_pass;
    }
}

#[test]
fn a_mixture_on_a_unified_backend_runs_at_the_least_host_budget_it_names() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let s = store_moe(tmp.path());
    let m = s.manifest();
    let PlanError::Host(e) = plan(m, &unified(Some(2 << 20))).expect_err("2 MiB is too small")
    else {
        panic!("a host budget error");
    };
    let p = plan(m, &unified(Some(e.need))).expect("the budget the error names runs");
    assert!(p.host.total_bytes <= e.need);
    assert!(p.layers_streamed() > 0);
    // The least that runs, found by bisection: the named least is at most 10% above it.
    // (It charges the embedding's gathered rows; the least plan keeps the embedding
    // resident instead, which the split's greedy search only finds at some budgets.)
    let (mut lo, mut hi) = (e.need / 2, e.need);
    while lo + 1 < hi {
        let mid = (lo + hi) / 2;
        if plan(m, &unified(Some(mid))).is_ok() {
            hi = mid;
        } else {
            lo = mid;
        }
    }
    assert!(
        plan(m, &unified(Some(hi - 1))).is_err() && e.need - hi <= e.need / 10,
        "the least named {} is more than 10% above the least that runs, {hi}",
        e.need
    );
}

#[test]
fn the_prefix_caches_host_tier_is_a_role_of_the_host_plan_within_its_budget() {
    use crate::plan::{KvHostTier, KV_EXPORT_RUN_BYTES, KV_HOST_AUTO_MAX, KV_WRITE_QUEUE_BYTES};
    let tmp = tempfile::tempdir().expect("tempdir");
    let s = store(tmp.path(), false);
    let m = s.manifest();
    let with_disk = |budget: Option<u64>, tier: KvHostTier, disk: bool| {
        let mut i = unified(budget);
        i.host.kv_tier = tier;
        i.host.kv_disk = disk;
        plan(m, &i).expect("plan")
    };
    let with = |budget: Option<u64>, tier: KvHostTier| with_disk(budget, tier, false);
    let off = with(None, KvHostTier::Off);
    assert_eq!(off.host.kv_cache_host_bytes, 0);
    // Without a budget: auto takes its most, a size what it says; either is in the total.
    let auto = with(None, KvHostTier::Auto);
    assert_eq!(auto.host.kv_cache_host_bytes, KV_HOST_AUTO_MAX);
    // Beside it, a finished sequence's copy out of its slot and the blocks made of it.
    let io = 2 * KV_EXPORT_RUN_BYTES;
    assert_eq!(auto.host.kv_cache_io_bytes, io);
    assert_eq!(
        auto.host.total_bytes,
        off.host.total_bytes + KV_HOST_AUTO_MAX + io
    );
    assert!(auto.table().contains("prefix KV (host tier)"));
    // A disk tier adds its write queue, even without a host tier.
    // A disk tier adds its write queue and one slot's KV read back, even without a host
    // tier.
    let disk = with_disk(None, KvHostTier::Off, true);
    let slot = disk.kv_cache_bytes / unified(None).opts.kv_slots as u64;
    let disk_io = io + KV_WRITE_QUEUE_BYTES + slot;
    assert_eq!(disk.host.kv_cache_io_bytes, disk_io);
    assert_eq!(disk.host.total_bytes, off.host.total_bytes + disk_io);
    // Under a budget: auto is a quarter of what the other roles leave; a size larger than
    // that room is cut to it; the total stays within the budget.
    let budget = off.host.total_bytes + (64 << 20);
    let auto = with(Some(budget), KvHostTier::Auto);
    let room = budget - off.host.total_bytes - io;
    assert_eq!(auto.host.kv_cache_host_bytes, room / 4);
    let big = with(Some(budget), KvHostTier::Bytes(1 << 40));
    assert_eq!(big.host.kv_cache_host_bytes, room);
    assert!(big.host.total_bytes <= budget);
    let small = with(Some(budget), KvHostTier::Bytes(1 << 20));
    assert_eq!(small.host.kv_cache_host_bytes, 1 << 20);
}
