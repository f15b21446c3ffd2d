//! Linked stores (`sluiced pack --link`): the manifest's frames point at byte ranges of the
//! source file itself (a GGUF whose quantized blocks no codec shrinks), so the model is
//! not on disk twice. The store records how to recognise that file (`format::Link`): its
//! length, modification time and the checksums of sampled ranges; opening the store
//! refuses a file that changed since, before a single frame is read. Every frame still has
//! its own checksum, checked as it is decoded.

use super::format::{Link, LinkSample};
use super::StoreError;
use std::fs::File;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::Path;

/// Sampled ranges: this many, spread evenly over the file (the first at its start, the
/// GGUF header and metadata; the last at its end).
const SAMPLES: u64 = 16;
const SAMPLE_BYTES: u64 = 4096;

/// The identity of `path` as a linked store records it (the path made absolute).
pub fn identify(path: &Path) -> Result<Link, StoreError> {
    let abs = std::fs::canonicalize(path).map_err(|e| StoreError::io("resolve", path, e))?;
    let file = File::open(&abs).map_err(|e| StoreError::io("open", &abs, e))?;
    let meta = file
        .metadata()
        .map_err(|e| StoreError::io("stat", &abs, e))?;
    let len = meta.len();
    let mut samples = Vec::with_capacity(SAMPLES as usize);
    let mut buf = vec![0u8; SAMPLE_BYTES as usize];
    for offset in sample_offsets(len) {
        let n = SAMPLE_BYTES.min(len - offset) as usize;
        let checksum = sample_checksum(&file, offset, n, &mut buf)
            .map_err(|e| StoreError::io("read", &abs, e))?;
        samples.push(LinkSample {
            offset,
            len: n as u32,
            checksum,
        });
    }
    crate::util::drop_cached(&file);
    use std::os::unix::ffi::OsStrExt;
    Ok(Link {
        path: abs.as_os_str().as_bytes().to_vec(),
        len,
        mtime_s: meta.mtime(),
        mtime_ns: meta.mtime_nsec() as u32,
        samples,
    })
}

/// Where the samples of a file of `len` bytes are.
fn sample_offsets(len: u64) -> Vec<u64> {
    let last = len.saturating_sub(SAMPLE_BYTES);
    let mut v: Vec<u64> = (0..SAMPLES)
        .map(|i| (last * i / (SAMPLES - 1).max(1)) / SAMPLE_BYTES * SAMPLE_BYTES)
        .collect();
    if let Some(l) = v.last_mut() {
        *l = last;
    }
    v.dedup();
    v
}

/// Checks that the linked file is the one `store` was packed from; the error names the
/// file, what changed and what to do.
pub fn check(link: &Link, store: &Path) -> Result<(), StoreError> {
    let path = link.path();
    let refuse = |what: String| {
        StoreError::Refused {
        path: path.clone(),
        msg: format!(
            "{what} since the linked store {} was packed from it: a linked store reads its weights from this file and would read other bytes. Put the original file back, or pack it again (`sluiced pack --link {} -o {} --force`)",
            store.display(),
            path.display(),
            store.display()
        ),
    }
    };
    let file = match File::open(&path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(refuse("the file is gone".into()))
        }
        Err(e) => return Err(StoreError::io("open the linked source", &path, e)),
    };
    let meta = file
        .metadata()
        .map_err(|e| StoreError::io("stat", &path, e))?;
    if meta.len() != link.len {
        return Err(refuse(format!(
            "its size changed from {} to {} bytes",
            link.len,
            meta.len()
        )));
    }
    if (meta.mtime(), meta.mtime_nsec() as u32) != (link.mtime_s, link.mtime_ns) {
        return Err(refuse(format!(
            "it was modified (mtime {}.{:09} s, packed at {}.{:09} s)",
            meta.mtime(),
            meta.mtime_nsec(),
            link.mtime_s,
            link.mtime_ns
        )));
    }
    let mut buf = vec![0u8; SAMPLE_BYTES as usize];
    let mut bad = None;
    for s in &link.samples {
        let sum = sample_checksum(&file, s.offset, s.len as usize, &mut buf)
            .map_err(|e| StoreError::io("read", &path, e))?;
        if sum != s.checksum {
            bad = Some(s.offset);
            break;
        }
    }
    crate::util::drop_cached(&file);
    if let Some(offset) = bad {
        return Err(refuse(format!(
            "its {SAMPLE_BYTES} bytes at offset {offset} changed"
        )));
    }
    Ok(())
}

/// xxh3-64 of `len` (at most `buf`'s length) bytes of `file` at `offset`.
fn sample_checksum(file: &File, offset: u64, len: usize, buf: &mut [u8]) -> std::io::Result<u64> {
    let n = len.min(buf.len());
    let b = &mut buf[..n];
    file.read_exact_at(b, offset)?;
    Ok(crate::util::xxh3(b))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn samples_cover_start_and_end_and_stay_inside_small_files() {
        let v = sample_offsets(1 << 20);
        assert_eq!(v.len(), 16);
        assert_eq!(v[0], 0);
        assert_eq!(*v.last().expect("samples"), (1 << 20) - 4096);
        assert!(v.windows(2).all(|w| w[0] < w[1]));
        assert_eq!(sample_offsets(100), vec![0]);
        assert_eq!(sample_offsets(0), vec![0]);
    }

    #[test]
    fn a_changed_file_is_refused_by_size_time_or_sampled_bytes() {
        let dir = tempfile::tempdir().expect("tempdir");
        let src = dir.path().join("model.gguf");
        let bytes: Vec<u8> = (0..200_000u32).map(|i| (i * 7 % 251) as u8).collect();
        std::fs::write(&src, &bytes).expect("write");
        let link = identify(&src).expect("identify");
        check(&link, dir.path()).expect("unchanged");
        // Same size and mtime, a sampled byte changed: the samples see it.
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(&src)
            .expect("open");
        let at = link.samples[3].offset + 10;
        f.write_all_at(&[bytes[at as usize] ^ 1], at)
            .expect("write");
        f.set_modified(
            std::time::SystemTime::UNIX_EPOCH
                + std::time::Duration::new(link.mtime_s as u64, link.mtime_ns),
        )
        .expect("restore mtime");
        let e = check(&link, dir.path())
            .expect_err("changed bytes")
            .to_string();
        assert!(
            e.contains("model.gguf") && e.contains(&format!("offset {}", link.samples[3].offset)),
            "{e}"
        );
        // Restored bytes, a new mtime.
        f.write_all_at(&[bytes[at as usize]], at).expect("write");
        f.set_modified(std::time::SystemTime::now()).expect("touch");
        let e = check(&link, dir.path()).expect_err("touched").to_string();
        assert!(e.contains("modified"), "{e}");
        // Another size.
        f.set_len(100).expect("truncate");
        let e = check(&link, dir.path()).expect_err("truncated").to_string();
        assert!(e.contains("size changed from 200000 to 100"), "{e}");
        std::fs::remove_file(&src).expect("rm");
        let e = check(&link, dir.path()).expect_err("gone").to_string();
        assert!(e.contains("gone") && e.contains("--link"), "{e}");
    }
}
