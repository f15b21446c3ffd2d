//! Helpers the commands share: value parsers for flags and the progress bar.

use sluice::store::Codec;
use sluice::util::parse_size;

pub fn parse_dtype(s: &str) -> Result<sluice::dtype::DType, String> {
    sluice::dtype::ALL_DTYPES
        .iter()
        .copied()
        .find(|d| d.name() == s)
        .ok_or_else(|| {
            let names: Vec<&str> = sluice::dtype::ALL_DTYPES.iter().map(|d| d.name()).collect();
            format!("unknown dtype {s:?}: expected one of {}", names.join(", "))
        })
}

/// `on` or `off` (also true/false, yes/no, 1/0).
pub fn parse_on_off(s: &str) -> Result<bool, String> {
    match s.to_ascii_lowercase().as_str() {
        "on" | "true" | "yes" | "1" => Ok(true),
        "off" | "false" | "no" | "0" => Ok(false),
        _ => Err(format!("{s:?}: expected on or off")),
    }
}

pub fn parse_codec(s: &str) -> Result<Codec, String> {
    s.parse()
}

pub fn parse_size_u32(s: &str) -> Result<u32, String> {
    let b = parse_size(s)?;
    u32::try_from(b).map_err(|_| format!("{s} is over 4 GiB"))
}

/// A chat template given with `--chat-template FILE` (Jinja, as a model's
/// `tokenizer_config.json` or `chat_template.jinja` holds it).
pub fn read_chat_template(path: &std::path::Path) -> anyhow::Result<String> {
    use anyhow::Context;
    let t = std::fs::read_to_string(path)
        .with_context(|| format!("--chat-template {}: cannot read it", path.display()))?;
    if t.trim().is_empty() {
        anyhow::bail!(
            "--chat-template {}: the file is empty; give a Jinja chat template",
            path.display()
        );
    }
    Ok(t)
}

/// The chat template file a store directory may carry beside its manifest: it gives a
/// store packed without one (a base model) a template, or replaces a wrong one, without
/// repacking; the daemon reads it whenever it loads the store.
pub const CHAT_TEMPLATE_SIDECAR: &str = "chat_template.jinja";

/// The sidecar chat template of the store at `dir`, when it has one.
pub fn chat_template_sidecar(dir: &std::path::Path) -> anyhow::Result<Option<String>> {
    let path = dir.join(CHAT_TEMPLATE_SIDECAR);
    if !path.is_file() {
        return Ok(None);
    }
    read_chat_template(&path).map(Some)
}

/// A store directory's drafting for `serve`, where it differs from the daemon's `draft`: a
/// file of one line, `ngram`, `off`, or a draft model's store (a directory, or a name in the
/// models directory).
pub const DRAFT_SIDECAR: &str = "draft";

/// The drafting the `draft` file in `dir` names: None without the file, Some(None) for
/// `off`.
pub fn draft_sidecar(dir: &std::path::Path) -> anyhow::Result<Option<Option<String>>> {
    use anyhow::Context;
    let path = dir.join(DRAFT_SIDECAR);
    if !path.is_file() {
        return Ok(None);
    }
    let text =
        std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    let d = text.trim();
    if d.is_empty() || d.lines().count() > 1 {
        anyhow::bail!(
            "{}: want one line: `ngram`, `off`, or a draft model's store (a directory or a name in the models directory)",
            path.display()
        );
    }
    Ok(Some((d != "off").then(|| d.to_string())))
}

pub fn progress_bar(total: u64, what: &str) -> indicatif::ProgressBar {
    let pb = indicatif::ProgressBar::new(total);
    let style = indicatif::ProgressStyle::with_template(
        "{msg} [{bar:40}] {bytes}/{total_bytes} {binary_bytes_per_sec} eta {eta}",
    )
    .map(|s| s.progress_chars("=> "))
    .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar());
    pb.set_style(style);
    pb.set_message(what.to_string());
    pb
}

/// `--draft self:TYPE`'s copy of `store`'s units quantized to `to`: found in the cache
/// directory, else made there once by `sluiced pack STORE --quantize TYPE` (`threads`
/// threads) in a child process, so that the quantizing threads' heap (which glibc keeps in
/// their arenas) stays out of this process's resident set, which the plans count.
pub fn self_draft_store(
    store: &sluice::store::Store,
    to: sluice::dtype::DType,
    threads: usize,
) -> anyhow::Result<std::sync::Arc<sluice::store::Store>> {
    use anyhow::Context;
    use sluice::engine::self_draft;
    let cache = sluice::util::cache_root();
    let dir = self_draft::copy_dir(store, to, cache.as_deref())?;
    if !dir.is_dir() {
        let tmp = dir.with_extension(format!("tmp{}", std::process::id()));
        tracing::info!(
            "self-draft: quantizing {} to {to} into {} (once)",
            store.dir().display(),
            dir.display()
        );
        let t0 = std::time::Instant::now();
        let exe = std::env::current_exe().context("self-draft: this executable's path")?;
        let out = std::process::Command::new(exe)
            .arg("pack")
            .arg(store.dir())
            .arg("-o")
            .arg(&tmp)
            .args(["--quantize", to.name(), "--codec", "none", "--force"])
            .args(["--threads", &threads.max(1).to_string()])
            .output()
            .context("self-draft: start `sluiced pack`")?;
        if !out.status.success() {
            let _ = std::fs::remove_dir_all(&tmp);
            anyhow::bail!(
                "--draft self:{to}: quantizing {} failed: {}",
                store.dir().display(),
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        if let Some(p) = dir.parent() {
            std::fs::create_dir_all(p).with_context(|| format!("create {}", p.display()))?;
        }
        // Another process may have made it meanwhile: theirs is as good.
        if std::fs::rename(&tmp, &dir).is_err() && !dir.is_dir() {
            anyhow::bail!(
                "--draft self:{to}: cannot move {} to {}",
                tmp.display(),
                dir.display()
            );
        }
        let _ = std::fs::remove_dir_all(&tmp);
        tracing::info!(
            "self-draft: quantized in {:.1} s",
            t0.elapsed().as_secs_f64()
        );
    }
    let q = self_draft::open_copy(&dir, to)?;
    let raw = |s: &sluice::store::Store| s.units().iter().map(|u| u.raw_len).sum::<u64>();
    if raw(&q) * 10 >= raw(store) * 9 {
        tracing::warn!(
            "self-draft: the {to} copy is {} of the model's {}: its matrices are quantized already, so the draft costs about what the model does; a self-draft pays on a 16- or 32-bit model",
            sluice::util::fmt_bytes(raw(&q)),
            sluice::util::fmt_bytes(raw(store))
        );
    }
    Ok(q)
}
