//! `--draft self:TYPE`: the model drafts for itself (SubSpec's form, `pipeline::SelfDraft`).
//! Its quantized copy is made once from the model's own store (ggml's reference quantizers
//! through `pack`, `store::quantize`) and kept in the cache directory, keyed by the store's
//! manifest; the plan reserves the draft's memory in the model's own budget, the copies of
//! the units that stream and not of those that stay resident (`plan_room`).

use super::EngineError;
use crate::dtype::quantize::can_quantize;
use crate::dtype::{DType, ALL_DTYPES};
use crate::plan::{Placement, Plan, PlanInput};
use crate::store::format::{Manifest, MANIFEST_FILE};
use crate::store::quantize::{quantizable, Quantized};
use crate::store::source::StoreSource;
use crate::store::writer::{pack, PackOptions};
use crate::store::{Codec, Store};
use std::sync::Arc;

/// The type `--draft self:TYPE` names; None where `name` is another drafter.
pub fn parse(name: &str) -> Option<Result<DType, String>> {
    let t = name.strip_prefix("self:")?;
    Some(
        ALL_DTYPES
            .into_iter()
            .find(|d| d.name().eq_ignore_ascii_case(t) && can_quantize(*d))
            .ok_or_else(|| {
                format!(
                    "--draft {name}: a self-draft is self:TYPE, TYPE one of {}",
                    quantizable().join(", ")
                )
            }),
    )
}

/// Where the copy of `target`'s units quantized to `to` is kept under `cache`
/// (`util::cache_root`): named by a hash of the target's manifest and the type.
pub fn copy_dir(
    target: &Store,
    to: DType,
    cache: Option<&std::path::Path>,
) -> Result<std::path::PathBuf, EngineError> {
    let fail = |what: String| EngineError::Invalid(format!("--draft self:{to}: {what}"));
    let root = cache.ok_or_else(|| {
        fail("no cache directory for its quantized copy: set SLUICE_CACHE or HOME".into())
    })?;
    let manifest_path = target.dir().join(MANIFEST_FILE);
    let manifest = std::fs::read(&manifest_path)
        .map_err(|e| fail(format!("read {}: {e}", manifest_path.display())))?;
    Ok(root.join("self-draft").join(format!(
        "{:016x}-{}",
        crate::util::xxh3(&manifest),
        to.name()
    )))
}

/// The store of `target`'s units quantized to `to` (`copy_dir`): made once here (by
/// `threads` threads) and found there afterwards. (`sluiced` makes it in a `sluiced pack`
/// of the store instead, whose threads' heap then stays out of the serving process, and
/// opens it with `open_copy`.)
pub fn quantized_store(
    target: &Store,
    to: DType,
    threads: usize,
    cache: Option<&std::path::Path>,
) -> Result<Arc<Store>, EngineError> {
    let dir = copy_dir(target, to, cache)?;
    if !dir.is_dir() {
        make_copy(target, to, threads, &dir).map_err(|e| {
            EngineError::Invalid(format!("--draft self:{to}: making its quantized copy: {e}"))
        })?;
    }
    open_copy(&dir, to)
}

/// Quantizes `target`'s units to `to` into `dir`, through a temporary directory beside it.
fn make_copy(
    target: &Store,
    to: DType,
    threads: usize,
    dir: &std::path::Path,
) -> Result<(), String> {
    let t0 = std::time::Instant::now();
    tracing::info!(
        "self-draft: quantizing {} to {to} into {} (once)",
        target.dir().display(),
        dir.display()
    );
    let src = StoreSource::new(target).map_err(|e| e.to_string())?;
    let q = Quantized::new(&src, to, threads)?;
    let tmp = dir.with_extension(format!("tmp{}", std::process::id()));
    let opts = PackOptions {
        // Quantized blocks hardly compress, and the copy is read once a start.
        codec: Codec::None,
        threads,
        force: true,
        ..PackOptions::default()
    };
    let packed = pack(&q, &src.units(), &tmp, &opts, |_| {})
        .map_err(|e| e.to_string())
        .and_then(|_| src.finish().map_err(|e| e.to_string()))
        .and_then(|()| {
            std::fs::rename(&tmp, dir).map_err(|e| format!("rename into {}: {e}", dir.display()))
        });
    match &packed {
        Ok(()) => tracing::info!(
            "self-draft: quantized in {:.1} s",
            t0.elapsed().as_secs_f64()
        ),
        Err(_) => {
            let _ = std::fs::remove_dir_all(&tmp);
        }
    }
    packed
}

/// The quantized copy in `dir` (`copy_dir`), its tokenizer dropped (it is the model's).
pub fn open_copy(dir: &std::path::Path, to: DType) -> Result<Arc<Store>, EngineError> {
    let mut s = Store::open(dir).map_err(|e| {
        EngineError::Invalid(format!(
            "--draft self:{to}: {e}; delete {} and it is made again",
            dir.display()
        ))
    })?;
    s.release_tokenizer_spec();
    Ok(Arc::new(s))
}

/// Plans a model beside its self-draft on `q` (the model's units quantized): the input
/// with the draft's memory reserved (`PlanInput::self_draft_reserved`), and its plan.
/// The draft holds its own decoder (KV cache and workspace, for `draft_opts`) and the
/// copies of the units the plan streams, and which units stream depends on what is
/// reserved: the first round reserves every copy; each next one reserves the copies of the
/// units the last plan streamed, kept while its plan streams no unit more than it
/// reserved for (fewer bytes reserved leave more units resident, so a few rounds settle).
pub fn plan_room(
    plan: &dyn Fn(&PlanInput) -> Result<Plan, EngineError>,
    q: &Manifest,
    input: &PlanInput,
) -> Result<(PlanInput, Plan), EngineError> {
    // The draft's decoder: the model's options, no verified rows.
    let draft_opts = crate::model::ModelOptions {
        verify_rows: 0,
        ..input.opts
    };
    let (fixed, raw) = crate::plan::decoder_bytes(q, &draft_opts);
    let need = |p: &Plan| -> u64 {
        fixed
            + (0..raw.len())
                .filter(|&u| p.placement(u) != Placement::Resident)
                .map(|u| raw[u])
                .sum::<u64>()
    };
    // Its logits on the host: the draft's row per sequence, and the decoder's copy.
    let logits = 2 * 4 * q.arch.vocab as u64 * draft_opts.kv_slots as u64;
    let mut input = input.clone();
    input.host.budget = input.host.budget.map(|b| b.saturating_sub(logits));
    let with = |reserved: u64| PlanInput {
        self_draft_reserved: reserved,
        ..input.clone()
    };
    let first = with(fixed + raw.iter().sum::<u64>());
    let p = plan(&first).map_err(|e| {
        EngineError::Invalid(format!(
            "with a self-draft of {} reserved: {e}",
            crate::util::fmt_bytes(first.self_draft_reserved)
        ))
    })?;
    let mut best = (first, p);
    for _ in 0..4 {
        let want = need(&best.1);
        if want >= best.0.self_draft_reserved {
            break;
        }
        match plan(&with(want)) {
            Ok(p) if need(&p) <= want => best = (with(want), p),
            _ => break,
        }
    }
    Ok(best)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn self_names_a_quantized_type() {
        assert_eq!(parse("self:q8_0"), Some(Ok(DType::Q8_0)));
        assert_eq!(parse("self:Q4_K"), Some(Ok(DType::Q4K)));
        assert!(parse("ngram").is_none());
        let e = parse("self:f16")
            .expect("a self-draft")
            .expect_err("not quantized");
        assert!(e.contains("q8_0"), "{e}");
    }
}
