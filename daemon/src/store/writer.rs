//! `sluiced pack`: writes a store from an imported model, atomically.
//!
//! The store is written into `.NAME.partial` beside the target, every file is fsynced, then
//! the directory is renamed into place and the parent fsynced: an interrupted pack leaves
//! no half-written store at the target (the next pack removes the stale partial directory).

use super::arch::ArchConfig;
use super::codec::{CodeCensus, Codec, FrameEncoder, SHARED_FRAME_BYTES_MAX};
use super::float::SharedCode;
use super::format::{
    expert_of, Frame, LayerUnit, Manifest, TensorEntry, BLOB_ALIGN, MANIFEST_FILE, TENSOR_ALIGN,
    WEIGHTS_FILE,
};
use super::format::{SourceMeta, SpecialTokens, TokenizerSpec, UnitKind};
use super::StoreError;
use crate::dtype::DType;
use std::collections::BTreeMap;
use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

/// Frame sizes must keep every frame a whole number of 4-byte elements and of 256-byte
/// tensor alignment units.
pub const FRAME_SIZE_MIN: u32 = 4096;
pub const FRAME_SIZE_DEFAULT: u32 = 1 << 20;

#[derive(Clone, Debug)]
pub struct PackOptions {
    /// The codec of every frame, unless `auto` chooses per tensor.
    pub codec: Codec,
    /// `--codec auto`: per tensor, the codec that delivers decompressed bytes fastest
    /// from a disk of this many GB/s with this many decode workers (`store::auto`).
    pub auto: Option<AutoFor>,
    pub frame_size: u32,
    /// Compression threads.
    pub threads: usize,
    /// Replace an existing store at the target.
    pub force: bool,
    /// `--link`: write only the manifest, its frames pointing at the source file's own
    /// bytes (`store::link`); refused for a source whose tensors are not there as they are.
    pub link: bool,
}

impl Default for PackOptions {
    fn default() -> Self {
        PackOptions {
            codec: Codec::Zstd { level: 3 },
            auto: None,
            frame_size: FRAME_SIZE_DEFAULT,
            threads: std::thread::available_parallelism().map_or(1, |n| n.get()),
            force: false,
            link: false,
        }
    }
}

#[derive(Debug)]
pub struct PackReport {
    pub units: usize,
    pub frames: usize,
    pub raw_bytes: u64,
    pub stored_bytes: u64,
    /// `--codec auto`'s reasoning, a line per dtype (empty otherwise).
    pub auto: Vec<String>,
    /// The source file a linked store points at (None: the store holds its weights).
    pub linked: Option<PathBuf>,
    /// Bytes of manifest.bin.
    pub manifest_bytes: u64,
}

/// What `--codec auto` chooses for: the disk's read rate and the decode workers.
#[derive(Clone, Copy, Debug)]
pub struct AutoFor {
    pub disk_gbps: f64,
    pub workers: usize,
}

/// The tensors of one layer unit, in blob order.
#[derive(Clone, Debug)]
pub struct UnitSpec {
    pub kind: UnitKind,
    pub tensors: Vec<String>,
}

/// The manifest fields that describe the model rather than its bytes.
#[derive(Clone, Debug)]
pub struct ModelHeader {
    pub arch: ArchConfig,
    pub tokenizer: TokenizerSpec,
    pub special: SpecialTokens,
    pub chat_template: Option<String>,
    /// File name of the source, for `inspect`.
    pub source: String,
    pub meta: SourceMeta,
}

/// Dtype, shape (row-major, last dimension contiguous) and byte length of one tensor.
#[derive(Clone, Debug)]
pub struct TensorLayout {
    pub dtype: DType,
    pub shape: Vec<u64>,
    pub len: u64,
}

/// What `pack` writes, in the store's own terms: an importer provides it, so the store
/// never learns where a model came from.
pub trait PackSource {
    fn header(&self) -> ModelHeader;
    /// The layout of a tensor a unit spec names, or None when the source lacks it.
    fn tensor(&self, name: &str) -> Option<TensorLayout>;
    /// Writes the tensor's bytes, already in the store's canonical layout, into `dst`
    /// (exactly the tensor's `len` bytes).
    fn copy_tensor(&self, name: &str, dst: &mut [u8]);
    /// The one file a linked store may point at (`pack --link`), or why there is none.
    fn link_file(&self) -> Result<PathBuf, String> {
        Err("this source is not one file".into())
    }
    /// Where the tensor's bytes are in `link_file` as they are, or why they are not.
    fn linked(&self, name: &str) -> Result<LinkedTensor, String> {
        Err(format!("{name} is not in a file as it is"))
    }
}

/// A tensor in the file a linked store points at.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LinkedTensor {
    /// Offset of its bytes in the file.
    pub offset: u64,
    /// Its rows are in llama.cpp's rotary order, heads of this many rows (the frames put
    /// them back, `Codec::Source`); 0: as they are.
    pub head_rows: u32,
}

/// A compressed frame: codec, planes, stored bytes, checksum of the raw bytes.
#[derive(Clone)]
struct EncodedFrame {
    codec: Codec,
    planes: Vec<super::codec::Plane>,
    bytes: Vec<u8>,
    /// xxh3-64 of the raw bytes.
    checksum: u64,
}

fn align_up(x: u64, a: u64) -> u64 {
    x.div_ceil(a) * a
}

/// `.NAME.partial` beside the target, removed unless the pack completed.
struct PartialDir {
    path: PathBuf,
    parent: PathBuf,
    name: std::ffi::OsString,
    done: bool,
}

impl PartialDir {
    /// Makes a fresh partial directory for `out` (replacing a stale one); refuses an
    /// existing `out` unless `force`.
    fn create(out: &Path, force: bool) -> Result<PartialDir, StoreError> {
        let name = out
            .file_name()
            .ok_or_else(|| StoreError::Refused {
                path: out.to_path_buf(),
                msg: "the output path has no directory name".into(),
            })?
            .to_os_string();
        let parent = match out.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
            _ => PathBuf::from("."),
        };
        if out.exists() && !force {
            return Err(StoreError::Refused {
                path: out.to_path_buf(),
                msg: "already exists; pass --force to replace it, or choose another name (--name) or directory (-o)".into(),
            });
        }
        std::fs::create_dir_all(&parent)
            .map_err(|e| StoreError::io("create directory", &parent, e))?;
        let path = parent.join(format!(".{}.partial", name.to_string_lossy()));
        if path.exists() {
            std::fs::remove_dir_all(&path)
                .map_err(|e| StoreError::io("remove stale partial store", &path, e))?;
        }
        std::fs::create_dir(&path).map_err(|e| StoreError::io("create directory", &path, e))?;
        Ok(PartialDir {
            path,
            parent,
            name,
            done: false,
        })
    }

    /// Renames the finished store to `out` and fsyncs the parent.
    fn commit(&mut self, out: &Path) -> Result<(), StoreError> {
        if out.exists() {
            // --force: move the old store aside first so the rename below cannot fail
            // half-way.
            let old = self
                .parent
                .join(format!(".{}.old", self.name.to_string_lossy()));
            let _ = std::fs::remove_dir_all(&old);
            std::fs::rename(out, &old).map_err(|e| StoreError::io("move aside", out, e))?;
            std::fs::rename(&self.path, out)
                .map_err(|e| StoreError::io("rename into place", out, e))?;
            let _ = std::fs::remove_dir_all(&old);
        } else {
            std::fs::rename(&self.path, out)
                .map_err(|e| StoreError::io("rename into place", out, e))?;
        }
        self.done = true;
        fsync_dir(&self.parent)
    }
}

impl Drop for PartialDir {
    fn drop(&mut self) {
        if !self.done {
            let _ = std::fs::remove_dir_all(&self.path);
        }
    }
}

fn fsync_dir(path: &Path) -> Result<(), StoreError> {
    File::open(path)
        .and_then(|d| d.sync_all())
        .map_err(|e| StoreError::io("fsync directory", path, e))
}

/// Packs `model` into a store at `out`. `on_progress` receives raw bytes done per unit.
/// On any error nothing is left behind: the partial directory is removed, and a store
/// already at `out` (with `force`) is unchanged.
pub fn pack(
    model: &impl PackSource,
    units: &[UnitSpec],
    out: &Path,
    opts: &PackOptions,
    on_progress: impl FnMut(u64),
) -> Result<PackReport, StoreError> {
    pack_into(model, units, out, opts, on_progress).map_err(|e| out_of_space(e, out))
}

/// A full file system (or quota, or file-size limit) says so, and what to do.
fn out_of_space(e: StoreError, out: &Path) -> StoreError {
    match e {
        StoreError::Io { op, path, err }
            if matches!(
                err.raw_os_error(),
                Some(libc::ENOSPC | libc::EDQUOT | libc::EFBIG)
            ) =>
        {
            let kept = if out.exists() {
                format!("the store already at {} is unchanged", out.display())
            } else {
                "no store was made".to_string()
            };
            StoreError::Refused {
                path,
                msg: format!("{op}: {err}: the store does not fit there; free space on that file system or pack to another directory with -o. The partial store was removed and {kept}"),
            }
        }
        e => e,
    }
}

fn pack_into(
    model: &impl PackSource,
    units: &[UnitSpec],
    out: &Path,
    opts: &PackOptions,
    on_progress: impl FnMut(u64),
) -> Result<PackReport, StoreError> {
    check_frame_size(out, opts.frame_size)?;
    let mut partial = PartialDir::create(out, opts.force)?;
    let mut report = PackReport {
        units: 0,
        frames: 0,
        raw_bytes: 0,
        stored_bytes: 0,
        auto: Vec::new(),
        linked: None,
        manifest_bytes: 0,
    };
    let mut auto = match opts.auto {
        Some(a) => Some(
            super::auto::Auto::calibrate(
                &auto_samples(model, units),
                opts.frame_size,
                a.disk_gbps,
                a.workers,
            )
            .map_err(|e| StoreError::io("measure the codecs for", out, e))?,
        ),
        None => None,
    };
    // The float codec's shared codes, from the model's small float tensors (none for a
    // store whose frames cannot use the float codec).
    let mut codes = if opts.codec.is_float() || opts.auto.is_some() {
        let codec = opts.auto.is_none().then_some(opts.codec);
        shared_codes(model, units, out, opts.frame_size, codec)?
    } else {
        Vec::new()
    };
    if let Some(a) = auto.as_mut() {
        a.set_shared(&codes);
        let mut bytes: BTreeMap<DType, u64> = BTreeMap::new();
        for name in units.iter().flat_map(|u| &u.tensors) {
            if let Some(t) = model.tensor(name) {
                *bytes.entry(t.dtype).or_default() += t.len;
            }
        }
        if a.settle_raw(&bytes) {
            // No frame will name a shared code: the decoders need no tables for them.
            codes.clear();
        }
    }
    let header = model.header();
    let linked = link_plan(model, units, opts, auto.as_mut(), &header.source)?;
    let (layer_units, weights_len, link) = match linked {
        Some((src, linked)) => {
            let link = super::link::identify(&src)?;
            let units = link_units(model, units, out, opts, &linked, &mut report, on_progress)?;
            // The source must still be the file whose bytes the frames were made from.
            super::link::check(&link, out)?;
            report.linked = Some(link.path());
            // A linked store's frames are the source's bytes: no plane names a code.
            codes.clear();
            (units, link.len, Some(link))
        }
        None => {
            let (units, len) = write_units(
                model,
                units,
                &partial.path,
                out,
                opts,
                auto.as_mut(),
                &codes,
                &mut report,
                on_progress,
            )?;
            (units, len, None)
        }
    };
    let codec = match (&link, &auto) {
        (Some(_), _) => Codec::Source {
            head_rows: 0,
            row_bytes: 0,
        },
        (None, Some(a)) => a.main_codec().stored(),
        (None, None) => opts.codec.stored(),
    };
    let manifest = Manifest {
        arch: header.arch,
        tokenizer: header.tokenizer,
        chat_template: header.chat_template,
        special: header.special,
        units: layer_units,
        weights_len,
        codec,
        frame_size: opts.frame_size,
        source: header.source,
        link,
        codes,
        meta: header.meta,
    };
    report.manifest_bytes = write_manifest(&partial.path, &manifest)?;
    partial.commit(out)?;
    report.auto = auto.map_or(Vec::new(), |a| a.report());
    Ok(report)
}

/// Whether this pack links its source (`store::link`), and where each tensor is in it if
/// so: only with `--link` (refused, saying why, for a source that is not one file holding
/// every tensor as it is). `--codec auto` packs a copy, which streams faster under a tight
/// host budget; for a source it could link whose copy is all raw, its report says that
/// `--link` would save the disk (`Auto::link_alternative`).
#[allow(clippy::type_complexity)] // (the file, each tensor's place in it)
fn link_plan(
    model: &impl PackSource,
    units: &[UnitSpec],
    opts: &PackOptions,
    auto: Option<&mut super::auto::Auto>,
    source: &str,
) -> Result<Option<(PathBuf, BTreeMap<String, LinkedTensor>)>, StoreError> {
    if !opts.link && !auto.as_ref().is_some_and(|a| a.all_raw) {
        return Ok(None);
    }
    let linked = model.link_file().and_then(|file| {
        let mut at = BTreeMap::new();
        for name in units.iter().flat_map(|u| &u.tensors) {
            at.insert(name.clone(), model.linked(name)?);
        }
        Ok((file, at))
    });
    let (file, at) = match linked {
        Ok(l) => l,
        Err(why) if opts.link => {
            return Err(StoreError::Refused {
                path: PathBuf::from(source),
                msg: format!("--link: {why}; pack a copy with a codec instead (--codec auto)"),
            })
        }
        Err(_) => return Ok(None),
    };
    if let Some(a) = auto {
        a.link_alternative(&file.display().to_string());
    }
    Ok(opts.link.then_some((file, at)))
}

/// A linked store's units: the tensors laid out as `write_units` lays them out, each cut
/// into frames that name its bytes in the source (`Codec::Source`; a frame of rows in
/// rotary order holds whole heads), their checksums over the canonical bytes.
fn link_units(
    model: &impl PackSource,
    units: &[UnitSpec],
    out: &Path,
    opts: &PackOptions,
    linked: &BTreeMap<String, LinkedTensor>,
    report: &mut PackReport,
    mut on_progress: impl FnMut(u64),
) -> Result<Vec<LayerUnit>, StoreError> {
    let bug = |msg: String| StoreError::invalid(out, format!("{msg} (a bug in --link)"));
    let frame_max =
        (opts.frame_size as u64).min(super::format::FRAME_RAW_BYTES_MAX as u64 - BLOB_ALIGN);
    let mut layer_units = Vec::with_capacity(units.len());
    let tied = model.header().arch.tied_embeddings;
    let mut blob: Vec<u8> = Vec::new();
    for spec in units {
        let (tensors, raw_len) = lay_out(model, spec, out)?;
        blob.clear();
        blob.resize(raw_len as usize, 0);
        // (A linked frame is the source's bytes, never float-coded.)
        let frame_max = frame_size_of(spec.kind, false, tied, frame_max as u32) as u64;
        let mut frames = Vec::new();
        for (i, t) in tensors.iter().enumerate() {
            let dst = &mut blob[t.offset as usize..(t.offset + t.len) as usize];
            model.copy_tensor(&t.name, dst);
            let lt = linked
                .get(&t.name)
                .ok_or_else(|| bug(format!("no source range for {}", t.name)))?;
            let region_end = tensors.get(i + 1).map_or(raw_len, |n| n.offset);
            let t_end = t.offset + t.len;
            let (row_bytes, step) = if lt.head_rows == 0 {
                (0, frame_max)
            } else {
                let rows = t.shape.first().copied().unwrap_or(0);
                let row_bytes = t.len.checked_div(rows).filter(|r| r * rows == t.len);
                let Some(row_bytes) = row_bytes else {
                    return Err(bug(format!(
                        "{} has {rows} rows of {} bytes",
                        t.name, t.len
                    )));
                };
                let head = lt.head_rows as u64 * row_bytes;
                (row_bytes, (frame_max / head).max(1) * head)
            };
            let mut at = t.offset;
            while at < t_end {
                let n = (t_end - at).min(step);
                // The last frame of a tensor holds the padding after it (decoded as zeros).
                let raw_end = if at + n == t_end { region_end } else { at + n };
                frames.push(Frame {
                    file_offset: lt.offset + (at - t.offset),
                    raw_offset: at,
                    raw_len: (raw_end - at) as u32,
                    checksum: crate::util::xxh3(&blob[at as usize..raw_end as usize]),
                    codec: Codec::Source {
                        head_rows: lt.head_rows,
                        row_bytes: row_bytes as u32,
                    },
                    planes: vec![super::codec::Plane {
                        stored_len: n as u32,
                        compressed: false,
                    }],
                });
                at += n;
            }
        }
        let stored_len: u64 = frames.iter().map(|f| f.stored_len()).sum();
        report.units += 1;
        report.frames += frames.len();
        report.raw_bytes += raw_len;
        report.stored_bytes += stored_len;
        layer_units.push(LayerUnit {
            kind: spec.kind,
            file_offset: frames.first().map_or(0, |f| f.file_offset),
            stored_len,
            raw_len,
            frames,
            tensors,
        });
        on_progress(raw_len);
    }
    Ok(layer_units)
}

/// A store's own units, compressed into weights.bin in `dir`; returns them and the file's
/// length.
#[allow(clippy::too_many_arguments)]
fn write_units(
    model: &impl PackSource,
    units: &[UnitSpec],
    dir: &Path,
    out: &Path,
    opts: &PackOptions,
    mut auto: Option<&mut super::auto::Auto>,
    codes: &[SharedCode],
    report: &mut PackReport,
    mut on_progress: impl FnMut(u64),
) -> Result<(Vec<LayerUnit>, u64), StoreError> {
    let weights_path = dir.join(WEIGHTS_FILE);
    let weights =
        File::create(&weights_path).map_err(|e| StoreError::io("create", &weights_path, e))?;
    let mut w = WeightsWriter {
        out: std::io::BufWriter::with_capacity(8 << 20, weights),
        path: weights_path,
        at: 0,
    };
    let mut layer_units = Vec::with_capacity(units.len());
    let tied = model.header().arch.tied_embeddings;
    let mut blob: Vec<u8> = Vec::new();
    let mut encoders: Vec<Encoders> = (0..opts.threads.max(1))
        .map(|_| Encoders::default())
        .collect();
    let mut codecs = Vec::new();

    for spec in units {
        let (tensors, raw_len) = lay_out(model, spec, out)?;
        blob.clear();
        blob.resize(raw_len as usize, 0);
        for t in &tensors {
            let dst = &mut blob[t.offset as usize..(t.offset + t.len) as usize];
            model.copy_tensor(&t.name, dst);
        }
        codecs.clear();
        for t in &tensors {
            let raw = &blob[t.offset as usize..(t.offset + t.len) as usize];
            codecs.push(match auto.as_deref_mut() {
                Some(a) => a
                    .choose_for(raw, t.dtype, opts.frame_size as usize)
                    .map_err(|e| StoreError::io("choose a codec for", out, e))?,
                None => opts.codec,
            });
        }
        let pieces = frame_pieces(spec.kind, tied, &tensors, &codecs, raw_len, opts.frame_size);
        let encoded = compress(&mut encoders, &pieces, &blob, codes)
            .map_err(|e| StoreError::io("compress frames for", out, e))?;
        let unit = w.write_unit(spec.kind, &pieces, encoded, raw_len, tensors)?;
        report.units += 1;
        report.frames += unit.frames.len();
        report.raw_bytes += raw_len;
        report.stored_bytes += unit.stored_len;
        layer_units.push(unit);
        on_progress(raw_len);
    }
    let file_at = w.at;
    let weights = w
        .out
        .into_inner()
        .map_err(|e| StoreError::io("write", &w.path, e.into_error()))?;
    weights
        .sync_all()
        .map_err(|e| StoreError::io("fsync", &w.path, e))?;
    Ok((layer_units, file_at))
}

/// The float codec's shared codes for `units` (`CodeCensus`): the symbols of every frame
/// of float tensors of at most `SHARED_FRAME_BYTES_MAX` bytes, cut as `frame_pieces` cuts
/// the units with the float codec (with their padding to `TENSOR_ALIGN`), laid out as
/// `codec` lays them (None: `--codec auto`, as either float setting).
fn shared_codes(
    model: &impl PackSource,
    units: &[UnitSpec],
    out: &Path,
    frame_size: u32,
    codec: Option<Codec>,
) -> Result<Vec<SharedCode>, StoreError> {
    let mut census = CodeCensus::for_codec(codec);
    let tied = model.header().arch.tied_embeddings;
    let (mut bytes, mut whole) = (Vec::new(), Vec::new());
    for spec in units {
        let (tensors, raw_len) = lay_out(model, spec, out)?;
        let codecs = vec![Codec::Float; tensors.len()];
        // The tensor in `whole` (a frame may hold a piece of one).
        let mut held = None;
        for p in frame_pieces(spec.kind, tied, &tensors, &codecs, raw_len, frame_size) {
            // (A frame of a larger tensor is left out, even when it is small.)
            let first = tensors.iter().rfind(|t| t.offset <= p.raw_offset);
            if p.len > SHARED_FRAME_BYTES_MAX as u64
                || p.dtype.split_width() < 2
                || first.is_none_or(|t| t.len > SHARED_FRAME_BYTES_MAX as u64)
            {
                continue;
            }
            bytes.clear();
            bytes.resize(p.len as usize, 0);
            let end = p.raw_offset + p.len;
            for (i, t) in tensors.iter().enumerate() {
                let (lo, hi) = (t.offset.max(p.raw_offset), (t.offset + t.len).min(end));
                if lo >= hi {
                    continue;
                }
                if held != Some(i) {
                    whole.resize(t.len as usize, 0);
                    model.copy_tensor(&t.name, &mut whole);
                    held = Some(i);
                }
                bytes[(lo - p.raw_offset) as usize..(hi - p.raw_offset) as usize]
                    .copy_from_slice(&whole[(lo - t.offset) as usize..(hi - t.offset) as usize]);
            }
            census.add(&bytes, p.dtype);
        }
    }
    Ok(census.codes())
}

/// `--codec auto`'s calibration samples: per dtype, up to `auto::SAMPLE_BYTES` of its
/// first tensors.
fn auto_samples(model: &impl PackSource, units: &[UnitSpec]) -> BTreeMap<DType, Vec<u8>> {
    let max = super::auto::SAMPLE_BYTES;
    let mut samples: BTreeMap<DType, Vec<u8>> = BTreeMap::new();
    for name in units.iter().flat_map(|u| &u.tensors) {
        let Some(t) = model.tensor(name) else {
            continue;
        };
        let s = samples.entry(t.dtype).or_default();
        if s.len() >= max || t.len == 0 {
            continue;
        }
        let mut bytes = vec![0u8; t.len as usize];
        model.copy_tensor(name, &mut bytes);
        let take = bytes.len().min(max - s.len());
        s.extend_from_slice(&bytes[..take]);
    }
    samples
}

fn check_frame_size(out: &Path, frame_size: u32) -> Result<(), StoreError> {
    if frame_size < FRAME_SIZE_MIN
        || !frame_size.is_multiple_of(TENSOR_ALIGN as u32)
        || frame_size > super::format::FRAME_RAW_BYTES_MAX
    {
        return Err(StoreError::invalid(
            out,
            format!(
                "frame size {frame_size} must be a multiple of {TENSOR_ALIGN} between {FRAME_SIZE_MIN} and {}",
                super::format::FRAME_RAW_BYTES_MAX
            ),
        ));
    }
    Ok(())
}

/// A unit's tensors at aligned offsets in its decompressed blob, and the blob's length:
/// its vectors first (`is_vector`: norms, biases that are not an expert's), in the spec's
/// order, then the rest in the spec's order. The vectors then lie together, and
/// `frame_pieces` cuts those of one dtype into one frame: a layer's norms are a few KiB
/// each, and a frame apiece made the float codec build its streams, and the I/O engine
/// check a frame, for a few hundred elements.
fn lay_out(
    model: &impl PackSource,
    spec: &UnitSpec,
    out: &Path,
) -> Result<(Vec<TensorEntry>, u64), StoreError> {
    let mut tensors = Vec::with_capacity(spec.tensors.len());
    let mut raw_at = 0u64;
    let (vectors, rest): (Vec<&String>, Vec<&String>) = spec
        .tensors
        .iter()
        .partition(|n| model.tensor(n).is_some_and(|t| is_vector(n, &t.shape)));
    for name in vectors.into_iter().chain(rest) {
        let t = model.tensor(name).ok_or_else(|| {
            StoreError::invalid(
                out,
                format!(
                    "{}: the source has no tensor {name:?} (a bug in the unit spec)",
                    spec.kind
                ),
            )
        })?;
        // Each expert of a mixture (its gate, up and down, in that order, with their
        // biases) starts a page of its own: read straight into a slot, it is one O_DIRECT
        // read. So does each projection of a dense feed-forward block: a layer that
        // streams in pieces (`plan::layer_pieces`) is cut there.
        let dense_projection = ["gate_proj", "up_proj", "down_proj"]
            .iter()
            .any(|p| name.ends_with(&format!(".mlp.{p}.weight")));
        let align = if dense_projection
            || expert_of(name).is_some_and(|(_, part)| part == "gate_proj.weight")
        {
            BLOB_ALIGN
        } else {
            TENSOR_ALIGN
        };
        raw_at = align_up(raw_at, align);
        tensors.push(TensorEntry {
            name: name.clone(),
            dtype: t.dtype,
            shape: t.shape,
            offset: raw_at,
            len: t.len,
        });
        raw_at += t.len;
    }
    Ok((tensors, align_up(raw_at, TENSOR_ALIGN)))
}

/// A tensor `lay_out` puts first and `frame_pieces` may join with its neighbours: one
/// dimension, and not part of an expert (an expert's tensors stay one run, which a step
/// reads alone).
fn is_vector(name: &str, shape: &[u64]) -> bool {
    shape.len() == 1 && expert_of(name).is_none()
}

/// One frame's place in the blob, and its codec.
struct Piece {
    raw_offset: u64,
    len: u64,
    codec: Codec,
    /// Its tensor's dtype (the byte split, the float codec).
    dtype: DType,
}

/// Frames of an untied embedding table are at most this size unless the float codec codes
/// them: a step whose embedding streams reads a whole frame per distinct token
/// (`pipeline::gather`), and a row is small (a few KiB at most), so 1 MiB frames read 1 MiB
/// a distinct token (at batch 8 on a q4_1 table cut this way, 3.4 MB a pass become 0.5).
/// A float-coded table keeps the store's frame size: each frame with a code of its own
/// builds its decoding tables, which small frames pay for. So does a tied table: it
/// streams whole each pass as the head anyway, and the plan reserves a seam row per frame
/// of it (`plan`'s gather table), which small frames would multiply.
pub const EMBEDDING_FRAME_MAX: u32 = 64 << 10;

/// The frame size of a tensor in a unit of `kind`, float-coded or not (the float codec
/// named for a float dtype), of a model whose embeddings are `tied` or not.
fn frame_size_of(kind: UnitKind, float_coded: bool, tied: bool, frame_size: u32) -> u32 {
    if kind == UnitKind::Embedding && !float_coded && !tied {
        frame_size.min(EMBEDDING_FRAME_MAX)
    } else {
        frame_size
    }
}

/// Each tensor's region (its bytes and the padding after them) in pieces of its frame
/// size (`frame_size_of`), so a frame holds one dtype and the byte split applies. Vectors
/// (`is_vector`) next to each other with one dtype and codec share a frame while it has
/// room: a frame then holds several tensors' regions, whole.
fn frame_pieces(
    kind: UnitKind,
    tied: bool,
    tensors: &[TensorEntry],
    codecs: &[Codec],
    raw_len: u64,
    frame_size: u32,
) -> Vec<Piece> {
    let mut pieces: Vec<Piece> = Vec::new();
    // The last piece is vectors' and may take the next vector's region.
    let mut open = false;
    for ((i, t), &codec) in tensors.iter().enumerate().zip(codecs) {
        let end = tensors.get(i + 1).map_or(raw_len, |n| n.offset);
        let float_coded = codec.is_float() && t.dtype.split_width() >= 2;
        let size = frame_size_of(kind, float_coded, tied, frame_size) as u64;
        let vector = is_vector(&t.name, &t.shape);
        if let Some(last) = pieces.last_mut().filter(|p| {
            open && vector
                && p.dtype == t.dtype
                && p.codec == codec
                && p.raw_offset + p.len == t.offset
                && end - p.raw_offset <= size
        }) {
            last.len = end - last.raw_offset;
            continue;
        }
        let mut at = t.offset;
        while at < end {
            let len = (end - at).min(size);
            pieces.push(Piece {
                raw_offset: at,
                len,
                codec,
                dtype: t.dtype,
            });
            at += len;
        }
        // A vector cut into several frames has filled its last one's room already.
        open = vector && end - t.offset <= size;
    }
    pieces
}

/// A unit as `pack` lays it out and cuts it into frames (`packed_frames`).
pub struct PackedUnit {
    pub tensors: Vec<TensorEntry>,
    pub raw_len: u64,
    /// Each frame's raw offset, length and dtype.
    pub frames: Vec<(u64, u64, DType)>,
}

/// The frames `pack` cuts a unit of `model` into when every tensor gets `codec` (for
/// measuring codecs on the frames a store would hold: `sluiced bench-codec`).
pub fn packed_frames(
    model: &impl PackSource,
    spec: &UnitSpec,
    codec: Codec,
    frame_size: u32,
    src: &Path,
) -> Result<PackedUnit, StoreError> {
    check_frame_size(src, frame_size)?;
    let (tensors, raw_len) = lay_out(model, spec, src)?;
    let tied = model.header().arch.tied_embeddings;
    let codecs = vec![codec; tensors.len()];
    let frames = frame_pieces(spec.kind, tied, &tensors, &codecs, raw_len, frame_size)
        .into_iter()
        .map(|p| (p.raw_offset, p.len, p.dtype))
        .collect();
    Ok(PackedUnit {
        tensors,
        raw_len,
        frames,
    })
}

/// One thread's encoders, one per codec its pieces use, made when first needed.
#[derive(Default)]
struct Encoders(Vec<(Codec, FrameEncoder)>);

impl Encoders {
    fn get(&mut self, codec: Codec, shared: &[SharedCode]) -> std::io::Result<&mut FrameEncoder> {
        let i = match self.0.iter().position(|(c, _)| *c == codec) {
            Some(i) => i,
            None => {
                let mut e = FrameEncoder::new(codec)?;
                e.set_shared(shared);
                self.0.push((codec, e));
                self.0.len() - 1
            }
        };
        Ok(&mut self.0[i].1)
    }
}

/// Compresses the pieces of `blob` in parallel, one set of encoders per thread; each
/// result keeps its index.
fn compress(
    encoders: &mut [Encoders],
    pieces: &[Piece],
    blob: &[u8],
    shared: &[SharedCode],
) -> std::io::Result<Vec<EncodedFrame>> {
    let next = AtomicUsize::new(0);
    let results: Mutex<Vec<Option<EncodedFrame>>> = Mutex::new(vec![None; pieces.len()]);
    let failure: Mutex<Option<std::io::Error>> = Mutex::new(None);
    std::thread::scope(|s| {
        for enc in encoders.iter_mut() {
            let (next, results, failure) = (&next, &results, &failure);
            s.spawn(move || loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(p) = pieces.get(i) else {
                    break;
                };
                let raw = &blob[p.raw_offset as usize..(p.raw_offset + p.len) as usize];
                match enc
                    .get(p.codec, shared)
                    .and_then(|e| e.encode(raw, p.dtype))
                {
                    Ok(e) => {
                        let r = EncodedFrame {
                            codec: e.codec,
                            planes: e.planes,
                            bytes: e.bytes.to_vec(),
                            checksum: crate::util::xxh3(raw),
                        };
                        results
                            .lock()
                            .unwrap_or_else(std::sync::PoisonError::into_inner)[i] = Some(r);
                    }
                    Err(e) => {
                        *failure
                            .lock()
                            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(e);
                        break;
                    }
                }
            });
        }
    });
    if let Some(e) = failure
        .into_inner()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
    {
        return Err(e);
    }
    results
        .into_inner()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .into_iter()
        .map(|r| {
            r.ok_or_else(|| {
                std::io::Error::other("a frame was not encoded (an encoder thread stopped)")
            })
        })
        .collect()
}

/// weights.bin as it is written: blobs back to back, each padded to `BLOB_ALIGN`.
struct WeightsWriter {
    out: std::io::BufWriter<File>,
    path: PathBuf,
    /// Bytes written so far (the next blob's offset).
    at: u64,
}

impl WeightsWriter {
    fn write_unit(
        &mut self,
        kind: UnitKind,
        pieces: &[Piece],
        encoded: Vec<EncodedFrame>,
        raw_len: u64,
        tensors: Vec<TensorEntry>,
    ) -> Result<LayerUnit, StoreError> {
        let unit_offset = self.at;
        let mut frames = Vec::with_capacity(pieces.len());
        for (p, e) in pieces.iter().zip(encoded) {
            self.out
                .write_all(&e.bytes)
                .map_err(|err| StoreError::io("write", &self.path, err))?;
            frames.push(Frame {
                file_offset: self.at,
                raw_offset: p.raw_offset,
                raw_len: p.len as u32,
                checksum: e.checksum,
                codec: e.codec,
                planes: e.planes,
            });
            self.at += e.bytes.len() as u64;
        }
        let stored_len = self.at - unit_offset;
        let padded = align_up(self.at, BLOB_ALIGN);
        self.out
            .write_all(&vec![0u8; (padded - self.at) as usize])
            .map_err(|e| StoreError::io("write", &self.path, e))?;
        self.at = padded;
        Ok(LayerUnit {
            kind,
            file_offset: unit_offset,
            stored_len,
            raw_len,
            frames,
            tensors,
        })
    }
}

/// Checks the manifest as every reader will, then writes and fsyncs it and its directory;
/// returns its length.
fn write_manifest(dir: &Path, manifest: &Manifest) -> Result<u64, StoreError> {
    // Assert in pairs: what we wrote must pass the checks every reader applies.
    manifest.validate().map_err(|e| {
        StoreError::invalid(
            dir,
            format!("packer produced an invalid manifest (a bug): {e}"),
        )
    })?;
    let bytes = manifest
        .encode()
        .map_err(|e| StoreError::invalid(dir, format!("encode manifest: {e}")))?;
    let manifest_path = dir.join(MANIFEST_FILE);
    let mut mf =
        File::create(&manifest_path).map_err(|e| StoreError::io("create", &manifest_path, e))?;
    mf.write_all(&bytes)
        .and_then(|_| mf.sync_all())
        .map_err(|e| StoreError::io("write", &manifest_path, e))?;
    fsync_dir(dir)?;
    Ok(bytes.len() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(name: &str, dtype: DType, shape: &[u64], offset: u64, len: u64) -> TensorEntry {
        TensorEntry {
            name: name.into(),
            dtype,
            shape: shape.to_vec(),
            offset,
            len,
        }
    }

    #[test]
    fn neighbouring_vectors_of_one_dtype_and_codec_share_a_frame_while_it_has_room() {
        let p = "model.layers.0";
        let x = "model.layers.0.mlp.experts.0";
        let f32v = |name: &str, offset: u64| entry(name, DType::F32, &[250], offset, 1000);
        let tensors = vec![
            f32v(&format!("{p}.input_layernorm.weight"), 0),
            f32v(&format!("{p}.post_attention_layernorm.weight"), 1024),
            // A third would pass the 2048-byte frame: a frame of its own.
            f32v(&format!("{p}.self_attn.q_norm.weight"), 2048),
            // Another dtype, then another codec: their own frames.
            entry(
                &format!("{p}.self_attn.k_norm.weight"),
                DType::F16,
                &[256],
                3072,
                512,
            ),
            f32v(&format!("{p}.self_attn.sinks"), 3584),
            f32v(&format!("{p}.self_attn.q_proj.bias"), 4608),
            // A matrix is cut on its own, and a vector after it does not join it.
            entry(
                &format!("{p}.self_attn.o_proj.weight"),
                DType::F32,
                &[2, 500],
                5632,
                4000,
            ),
            f32v(&format!("{p}.mlp.gate.bias"), 9728),
            // An expert's vector stays in its expert's run.
            f32v(&format!("{x}.gate_proj.bias"), 10752),
        ];
        let mut codecs = vec![Codec::Float; tensors.len()];
        codecs[4] = Codec::Zstd { level: 1 };
        let raw_len = 11776;
        let kind = UnitKind::Decoder(0);
        let pieces = frame_pieces(kind, true, &tensors, &codecs, raw_len, 2048);
        let got: Vec<(u64, u64)> = pieces.iter().map(|p| (p.raw_offset, p.len)).collect();
        assert_eq!(
            got,
            [
                (0, 2048),
                (2048, 1024),
                (3072, 512),
                (3584, 1024),
                (4608, 1024),
                (5632, 2048),
                (7680, 2048),
                (9728, 1024),
                (10752, 1024),
            ]
        );
        assert!(is_vector(&tensors[0].name, &tensors[0].shape));
        assert!(!is_vector(&tensors[8].name, &tensors[8].shape));
        // With room, the run of f32 vectors of one codec joins up to the matrix.
        let tensors: Vec<TensorEntry> = tensors
            .into_iter()
            .filter(|t| t.dtype == DType::F32)
            .collect();
        let codecs = vec![Codec::Float; tensors.len()];
        let pieces = frame_pieces(kind, true, &tensors, &codecs, raw_len, 1 << 20);
        let got: Vec<(u64, u64)> = pieces.iter().map(|p| (p.raw_offset, p.len)).collect();
        assert_eq!(got, [(0, 5632), (5632, 4096), (9728, 1024), (10752, 1024)]);
    }
}
