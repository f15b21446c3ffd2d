//! The planner on a synthetic store: every unit resident when it fits, a budget-bounded
//! split otherwise (slots sized to the largest streamed unit, the plan within its
//! budget), the least budget in the error, and the host cache.

use super::*;
use crate::dtype::DType;
use crate::import::synth::{self, SynthSpec};
use crate::store::writer::{pack, PackOptions};
use crate::store::Store;

fn store(dir: &std::path::Path, tied: bool) -> Store {
    let mut spec = SynthSpec::llama_like(128, 6, DType::F32);
    // The embedding (1 MiB) a little larger than a layer, as in real models.
    spec.vocab = 2048;
    let mut model = synth::model(&spec);
    if tied {
        model.arch.tied_embeddings = true;
        model.tensors.remove("lm_head.weight");
    }
    let units = model.units().expect("units");
    let out = dir.join(if tied { "tied" } else { "untied" });
    let opts = PackOptions {
        codec: "none".parse().expect("codec"),
        frame_size: 1 << 20,
        threads: 1,
        force: true,
    };
    pack(&model, &units, &out, &opts, |_| {}).expect("pack");
    Store::open(&out).expect("open")
}

fn input(budget: Option<u64>, host_cache: u64) -> PlanInput {
    PlanInput {
        device_budget: budget,
        host_cache_budget: host_cache,
        opts: ModelOptions {
            max_context: 64,
            kv_slots: 2,
            max_batch_tokens: 32,
        },
        prefetch: None,
        backend_reserved: 0,
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
        let largest_streamed = (0..m.units.len())
            .filter(|&u| p.placement(u) != Placement::Resident)
            .map(|u| round(m.units[u].raw_len))
            .max()
            .expect("a streamed unit");
        assert_eq!(
            p.stream_slot_bytes, largest_streamed,
            "{pct}%: slots fit the largest streamed unit"
        );
        // Less budget never streams less.
        assert!(p.upload_bytes_per_pass >= streamed_before, "{pct}%");
        streamed_before = p.upload_bytes_per_pass;
        let disk: u64 = (0..m.units.len())
            .filter(|&u| p.placement(u) == Placement::Streamed)
            .map(|u| m.units[u].stored_len)
            .sum();
        assert_eq!(p.disk_bytes_per_pass, disk);
    }
}

#[test]
fn too_small_a_budget_says_the_least_that_runs() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let s = store(tmp.path(), false);
    let m = s.manifest();
    let e = plan(m, &input(Some(4096), 0)).expect_err("4 KiB cannot run a model");
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
fn a_streamed_tied_embedding_loads_twice_and_the_host_cache_takes_streamed_units() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let s = store(tmp.path(), true);
    let m = s.manifest();
    assert!(m.arch.tied_embeddings);
    let need = plan(m, &input(Some(4096), 0)).expect_err("too small").need;
    let p = plan(m, &input(Some(need), 0)).expect("plan");
    // At the least budget the embedding, the largest unit, sizes the slots and streams.
    assert_ne!(p.placement(0), Placement::Resident);
    assert_eq!(p.embedding_loads_per_pass, 2);
    let once: u64 = (0..m.units.len())
        .filter(|&u| p.placement(u) != Placement::Resident)
        .map(|u| m.units[u].raw_len)
        .sum();
    assert_eq!(p.upload_bytes_per_pass, once + m.units[0].raw_len);
    // A host cache as large as the model turns every streamed unit into a cached one.
    let p = plan(m, &input(Some(need), u64::MAX / 2)).expect("plan");
    assert!((0..m.units.len()).all(|u| p.placement(u) != Placement::Streamed));
    assert_eq!(p.disk_bytes_per_pass, 0);
    assert_eq!(p.host_cache_bytes_per_pass, p.upload_bytes_per_pass);
}
