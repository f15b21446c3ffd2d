//! Small shared helpers: byte sizes as people write them, and as people read them; the
//! one pseudo-random generator (`rng`).

pub mod rng;

/// Parses sizes like `1MiB`, `64MiB`, `32GiB`, `4096`, `1.5GB` into bytes.
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: f64 = num.parse().map_err(|_| {
        format!("size {s:?}: expected a number with an optional unit like 64MiB or 32GiB")
    })?;
    let mult: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kib" => 1 << 10,
        "m" | "mib" => 1 << 20,
        "g" | "gib" => 1 << 30,
        "t" | "tib" => 1 << 40,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        "tb" => 1_000_000_000_000,
        u => {
            return Err(format!(
                "size {s:?}: unknown unit {u:?} (use B, KiB, MiB, GiB, TiB, KB, MB, GB, TB)"
            ))
        }
    };
    let bytes = n * mult as f64;
    if !bytes.is_finite() || bytes < 0.0 || bytes > u64::MAX as f64 {
        return Err(format!("size {s:?} is out of range"));
    }
    Ok(bytes.round() as u64)
}

/// A byte count written as a size (`64MiB`, `32GiB`, `4096`): flags and config files
/// parse it with the same `parse_size`; a config file may also give a plain integer.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ByteSize(pub u64);

impl std::str::FromStr for ByteSize {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        parse_size(s).map(ByteSize)
    }
}

impl<'de> serde::Deserialize<'de> for ByteSize {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(serde::Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Bytes(u64),
            Text(String),
        }
        match Raw::deserialize(d)? {
            Raw::Bytes(b) => Ok(ByteSize(b)),
            Raw::Text(s) => parse_size(&s)
                .map(ByteSize)
                .map_err(serde::de::Error::custom),
        }
    }
}

/// Formats bytes with a binary unit, e.g. `98.3 MiB`.
pub fn fmt_bytes(b: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b as f64;
    let mut i = 0;
    while v >= 1024.0 && i < UNITS.len() - 1 {
        v /= 1024.0;
        i += 1;
    }
    if i == 0 {
        format!("{b} B")
    } else {
        format!("{v:.1} {}", UNITS[i])
    }
}

/// The models directory when none is given: $SLUICE_MODELS_DIR, else
/// $XDG_DATA_HOME/sluice/models, else ~/.local/share/sluice/models. The systemd unit's
/// config sets /var/lib/sluice/models.
pub fn default_models_dir() -> Option<std::path::PathBuf> {
    let var = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty());
    if let Some(d) = var("SLUICE_MODELS_DIR") {
        return Some(d.into());
    }
    let data = var("XDG_DATA_HOME")
        .map(std::path::PathBuf::from)
        .or_else(|| var("HOME").map(|h| std::path::PathBuf::from(h).join(".local/share")))?;
    Some(data.join("sluice").join("models"))
}

/// Where sluice keeps what it can make again (compiled kernels, self-draft stores):
/// $SLUICE_CACHE, else ~/.cache/sluice.
pub fn cache_root() -> Option<std::path::PathBuf> {
    let var = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty());
    var("SLUICE_CACHE")
        .map(std::path::PathBuf::from)
        .or_else(|| var("HOME").map(|h| std::path::Path::new(&h).join(".cache/sluice")))
}

/// Writes `data` to `path` whole or not at all (a file of this process beside it, renamed
/// over it), making its directory first.
pub fn write_atomic(path: &std::path::Path, data: &[u8]) -> std::io::Result<()> {
    if let Some(d) = path.parent() {
        std::fs::create_dir_all(d)?;
    }
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    std::fs::write(&tmp, data)?;
    std::fs::rename(&tmp, path)
}

/// A store as the user names it: a path, or (when no such path exists and it is a bare
/// name) the store of that name in the models directory.
pub fn store_path(
    arg: &std::path::Path,
    models_dir: Option<&std::path::Path>,
) -> std::path::PathBuf {
    let bare = arg.components().count() == 1 && !arg.as_os_str().is_empty();
    if !arg.exists() && bare {
        let dir = models_dir
            .map(std::path::Path::to_path_buf)
            .or_else(default_models_dir);
        if let Some(d) = dir {
            let p = d.join(arg);
            if p.exists() {
                return p;
            }
        }
    }
    arg.to_path_buf()
}

/// The first N bytes of `b` as an array, for `from_le_bytes` on a slice whose length the
/// caller has checked (or cut to exactly N).
pub fn array<const N: usize>(b: &[u8]) -> [u8; N] {
    let mut a = [0u8; N];
    a.copy_from_slice(&b[..N]);
    a
}

/// Tells the kernel the cached pages of `file` are not needed again, so that a file read
/// once (the manifest, a linked store's sampled ranges, a resident unit read without
/// O_DIRECT) does not stay charged to this process's memory cgroup.
pub fn drop_cached(file: &std::fs::File) {
    use std::os::fd::AsRawFd;
    // SAFETY: advice on a file descriptor this function borrows; it changes no memory.
    unsafe {
        libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED);
    }
}

/// XXH3-64 (seed 0) of `bytes`: every frame checksum, linked-source sample and cache key
/// sluice writes. twox-hash picks its AVX2 or SSE2 loop when it runs; xxhash-rust, which
/// wrote the checksums of earlier stores, picks at build time and, built for any x86-64,
/// runs the SSE2 loop at about half the AVX2 rate. One function, one value
/// (`tests/tests/store.rs` checks them against each other).
pub fn xxh3(bytes: &[u8]) -> u64 {
    twox_hash::XxHash3_64::oneshot(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_with_binary_and_decimal_units() {
        assert_eq!(parse_size("1MiB").unwrap(), 1 << 20);
        assert_eq!(parse_size("32GiB").unwrap(), 32 << 30);
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert_eq!(parse_size("1.5GB").unwrap(), 1_500_000_000);
        assert!(parse_size("12 parsecs")
            .unwrap_err()
            .contains("unknown unit"));
        assert!(parse_size("MiB").is_err());
    }
}
