//! Opening a store and reading layer units. The I/O engine uses `LayerUnit` (frames with
//! file offsets, lengths, codecs and checksums; the tensor table) to schedule its own reads;
//! `read_unit` is the plain pread path for verify, tools and tests.

use super::codec::{FrameDecoder, FrameFault};
use super::float::SharedTables;
use super::format::{LayerUnit, Manifest, MANIFEST_FILE, WEIGHTS_FILE};
use super::StoreError;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Reads a whole file, then drops its pages from the page cache: a file read once (the
/// manifest, with the tokenizer and chat template inside) stays charged to the memory
/// cgroup of whoever read it otherwise, outside the plan.
fn read_uncached(path: &Path) -> std::io::Result<Vec<u8>> {
    use std::io::Read;
    let mut f = File::open(path)?;
    let mut out = Vec::with_capacity(f.metadata().map_or(0, |m| m.len() as usize));
    f.read_to_end(&mut out)?;
    crate::util::drop_cached(&f);
    Ok(out)
}

pub struct Store {
    dir: PathBuf,
    manifest: Manifest,
    weights_path: PathBuf,
    weights_len: u64,
    /// The decoding tables of the manifest's shared codes, built once.
    shared: Arc<SharedTables>,
}

impl Store {
    /// Opens and validates a store directory; a weights.bin shorter than the manifest says
    /// is an error here, before any read.
    pub fn open(dir: &Path) -> Result<Store, StoreError> {
        if dir.is_file() {
            let gguf = std::fs::File::open(dir)
                .and_then(|mut f| {
                    let mut magic = [0u8; 4];
                    std::io::Read::read_exact(&mut f, &mut magic).map(|()| magic)
                })
                .is_ok_and(|m| &m == b"GGUF");
            let what = if gguf { "a GGUF file" } else { "a file" };
            return Err(StoreError::Refused {
                path: dir.to_path_buf(),
                msg: format!(
                    "this is {what}, not a sluice store: pack it first with `sluiced pack {} -o DIR`, then point at DIR",
                    dir.display()
                ),
            });
        }
        let manifest_path = dir.join(MANIFEST_FILE);
        let bytes = read_uncached(&manifest_path).map_err(|e| {
            if e.kind() == std::io::ErrorKind::NotFound && !dir.is_dir() {
                StoreError::io("open store directory", dir, e)
            } else {
                StoreError::io("read", &manifest_path, e)
            }
        })?;
        let manifest = Manifest::decode(&bytes, &manifest_path)?;
        let shared = Arc::new(
            SharedTables::new(&manifest.codes)
                .map_err(|e| StoreError::invalid(&manifest_path, e.to_string()))?,
        );
        if let Some(link) = &manifest.link {
            // A linked store's weights are its source's bytes (`pack --link`).
            super::link::check(link, dir)?;
            return Ok(Store {
                dir: dir.to_path_buf(),
                weights_path: link.path(),
                weights_len: link.len,
                manifest,
                shared,
            });
        }
        let weights_path = dir.join(WEIGHTS_FILE);
        let weights_len = std::fs::metadata(&weights_path)
            .map_err(|e| StoreError::io("stat", &weights_path, e))?
            .len();
        if weights_len < manifest.weights_len {
            let (unit, unit_end) = manifest
                .units
                .iter()
                .map(|u| (u.kind.to_string(), u.file_offset + u.stored_len))
                .find(|&(_, end)| end > weights_len)
                .unwrap_or_else(|| ("padding".into(), manifest.weights_len));
            return Err(StoreError::WeightsTruncated {
                path: weights_path,
                found: weights_len,
                expected: manifest.weights_len,
                unit,
                unit_end,
            });
        }
        Ok(Store {
            dir: dir.to_path_buf(),
            manifest,
            weights_path,
            weights_len,
            shared,
        })
    }

    /// The decoding tables of the store's shared codes (every decoder of its frames needs
    /// them: `frame_decoder`).
    pub fn shared_tables(&self) -> Arc<SharedTables> {
        self.shared.clone()
    }

    /// A frame decoder for this store's frames of up to `frame_raw_max` bytes.
    pub fn frame_decoder(&self, frame_raw_max: usize) -> std::io::Result<FrameDecoder> {
        Ok(FrameDecoder::new(frame_raw_max)?.with_shared(self.shared.clone()))
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }

    /// Frees the manifest's tokenizer description (a GGUF vocabulary is megabytes of
    /// strings) once the tokenizer is built from it, so the process does not keep both;
    /// the manifest's tokenizer is then an empty HF JSON.
    pub fn release_tokenizer_spec(&mut self) {
        self.manifest.tokenizer = super::format::TokenizerSpec::HfJson(String::new());
    }

    pub fn units(&self) -> &[LayerUnit] {
        &self.manifest.units
    }

    /// The file the frames are read from: weights.bin, or a linked store's source.
    pub fn weights_path(&self) -> &Path {
        &self.weights_path
    }

    pub fn weights_len(&self) -> u64 {
        self.weights_len
    }

    pub fn open_weights(&self) -> Result<File, StoreError> {
        File::open(&self.weights_path).map_err(|e| StoreError::io("open", &self.weights_path, e))
    }

    /// The error for a bad frame: names file, layer unit, frame index and file offset.
    pub fn frame_error(&self, unit: usize, frame: usize, fault: FrameFault) -> StoreError {
        let u = &self.manifest.units[unit];
        let f = &u.frames[frame];
        StoreError::Frame {
            path: self.weights_path.clone(),
            unit: u.kind.to_string(),
            frame,
            offset: f.file_offset,
            stored_len: f.stored_len(),
            fault,
        }
    }

    /// Reads unit `idx` with pread and decodes every frame into `dst` (its raw length).
    /// `stored` is a reusable buffer. Stops at the first bad frame.
    pub fn read_unit(
        &self,
        file: &File,
        idx: usize,
        stored: &mut Vec<u8>,
        dst: &mut [u8],
        dec: &mut FrameDecoder,
    ) -> Result<(), StoreError> {
        let u = &self.manifest.units[idx];
        assert_eq!(
            dst.len() as u64,
            u.raw_len,
            "destination sized for {}",
            u.kind
        );
        if self.manifest.link.is_some() {
            // Frames where the source holds them: one read each.
            for (fi, f) in u.frames.iter().enumerate() {
                stored.resize(f.stored_len() as usize, 0);
                file.read_exact_at(stored, f.file_offset)
                    .map_err(|e| self.frame_error(idx, fi, FrameFault::Read(e.to_string())))?;
                let d = f.raw_offset as usize;
                dec.decode(
                    f.codec,
                    &f.planes,
                    f.checksum,
                    stored,
                    &mut dst[d..d + f.raw_len as usize],
                )
                .map_err(|fault| self.frame_error(idx, fi, fault))?;
            }
            return Ok(());
        }
        stored.resize(u.stored_len as usize, 0);
        if let Err(e) = file.read_exact_at(stored, u.file_offset) {
            // Find the first frame the read could not deliver, for the message.
            let frame = u
                .frames
                .iter()
                .position(|f| f.file_offset + f.stored_len() > self.weights_len)
                .unwrap_or(0);
            return Err(self.frame_error(idx, frame, FrameFault::Read(e.to_string())));
        }
        for (fi, f) in u.frames.iter().enumerate() {
            let s = (f.file_offset - u.file_offset) as usize;
            let d = f.raw_offset as usize;
            dec.decode(
                f.codec,
                &f.planes,
                f.checksum,
                &stored[s..s + f.stored_len() as usize],
                &mut dst[d..d + f.raw_len as usize],
            )
            .map_err(|fault| self.frame_error(idx, fi, fault))?;
        }
        Ok(())
    }
}
