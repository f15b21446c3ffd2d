//! The embedding rows a step needs, read from the store without loading the table: a
//! streamed embedding costs a frame per distinct token of the step (read with O_DIRECT,
//! checked and decoded), not the whole table. The rows land in a small table of their
//! own, uploaded to the device; the step's ids are renumbered into it.

use super::PipelineError;
use crate::backend::Backend;
use crate::hostbuf::{AlignedBuf, IO_ALIGN};
use crate::io::IoError;
use crate::model::decoder::TensorLoc;
use crate::model::ModelError;
use crate::plan::Plan;
use crate::store::codec::{FrameDecoder, FrameFault};
use crate::store::format::Frame;
use crate::store::Store;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::sync::Arc;

/// A streamed embedding's lookup: the rows of the step's tokens, gathered from the store
/// (or the host cache), and their table on the device.
pub(super) struct Gathered<M> {
    pub(super) rows: RowGather,
    pub(super) table: M,
    /// A tied head's seam rows (`Plan::head_seams`), gathered once.
    pub(super) seams: M,
}

impl<M> Gathered<M> {
    /// The lookup of embedding `e` (of `store`'s unit 0) for steps of up to `max_rows`
    /// tokens, with the plan's seam rows gathered (from `host_cache` when the embedding
    /// has a host copy).
    pub(super) fn new<B: Backend<Mem = M>>(
        backend: &B,
        store: &Arc<Store>,
        plan: &Plan,
        e: TensorLoc,
        max_rows: usize,
        host_cache: Option<&AlignedBuf>,
    ) -> Result<Self, PipelineError> {
        let row_bytes = e
            .dtype
            .row_bytes(e.cols as u64)
            .ok_or_else(|| ModelError::Layout("embedding rows are not whole blocks".into()))?
            as usize;
        let table = backend.alloc((max_rows * row_bytes).max(1), "gathered embedding rows")?;
        let mut rows = RowGather::new(
            store.clone(),
            0,
            e.offset as u64,
            row_bytes,
            e.rows as u64,
            max_rows.max(plan.head_seams.len()),
        )?;
        // The rows between the head's parts, read once and kept.
        let seam_ids: Vec<u32> = plan.head_seams.iter().map(|&r| r as u32).collect();
        let mut seams = backend.alloc(
            (seam_ids.len() * row_bytes).max(1),
            "embedding rows between head parts",
        )?;
        if !seam_ids.is_empty() {
            rows.gather(&seam_ids, host_cache.map(|b| b.as_slice()))?;
            backend.upload(&mut seams, &rows.table)?;
        }
        Ok(Gathered { rows, table, seams })
    }
}

/// Reads the stored bytes of frame `f` into `bounce` (from the 4096-aligned block before
/// it to the one after, so the read suits O_DIRECT) and returns them.
pub(crate) fn read_frame<'b>(
    file: &File,
    f: &Frame,
    bounce: &'b mut AlignedBuf,
) -> Result<&'b [u8], FrameFault> {
    let align = IO_ALIGN as u64;
    let start = f.file_offset / align * align;
    let end = (f.file_offset + f.stored_len()).div_ceil(align) * align;
    let want = (end - start) as usize;
    let Some(buf) = bounce.as_mut_slice().get_mut(..want) else {
        return Err(FrameFault::Read(format!(
            "frame of {want} bytes with its alignment is larger than the read buffer"
        )));
    };
    let mut got = 0;
    while got < want {
        match file.read_at(&mut buf[got..], start + got as u64) {
            Ok(0) => break,
            Ok(k) => got += k,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(FrameFault::Read(e.to_string())),
        }
    }
    let skip = (f.file_offset - start) as usize;
    let len = f.stored_len() as usize;
    if got < skip + len {
        return Err(FrameFault::Read(format!(
            "short read: {} of {} bytes",
            got.saturating_sub(skip),
            len
        )));
    }
    Ok(&buf[skip..skip + len])
}

/// Bytes of the bounce buffer a frame of `stored_max` bytes needs (alignment at both ends;
/// `plan::gather_host_bytes` counts the same).
pub(crate) fn bounce_len(stored_max: u64) -> usize {
    stored_max as usize + 2 * IO_ALIGN
}

pub(crate) struct RowGather {
    store: Arc<Store>,
    file: File,
    direct: bool,
    unit: usize,
    /// The table's offset in its unit and the bytes of one row.
    offset: u64,
    row_bytes: usize,
    rows: u64,
    bounce: AlignedBuf,
    dec: FrameDecoder,
    frame: Vec<u8>,
    /// The frame `frame` holds, if any.
    decoded: Option<usize>,
    /// The gathered rows (one per distinct id, ascending), and each step row's index
    /// into them.
    pub table: Vec<u8>,
    pub rows_of: Vec<u32>,
    distinct: Vec<u32>,
    /// Stored bytes read so far.
    pub bytes_read: u64,
}

impl RowGather {
    /// A gather of rows of `row_bytes` of the table at `offset` in unit `unit`, `rows` of
    /// them, for steps of at most `max_rows` tokens.
    pub(crate) fn new(
        store: Arc<Store>,
        unit: usize,
        offset: u64,
        row_bytes: usize,
        rows: u64,
        max_rows: usize,
    ) -> Result<RowGather, IoError> {
        let path = store.weights_path();
        let (file, direct) = crate::io::open_direct(path)
            .map_err(|e| IoError::Data(crate::store::StoreError::io("open", path, e)))?;
        let m = store.manifest();
        let oom = |what: &str| IoError::Setup {
            path: path.to_path_buf(),
            msg: format!("cannot allocate the embedding gather's {what}"),
        };
        let bounce = AlignedBuf::new(bounce_len(m.frame_stored_len_max()))
            .ok_or_else(|| oom("read buffer"))?;
        let raw_max = m.frame_raw_len_max() as usize;
        let dec = store.frame_decoder(raw_max).map_err(|_| oom("decoder"))?;
        Ok(RowGather {
            file,
            direct,
            unit,
            offset,
            row_bytes,
            rows,
            bounce,
            dec,
            frame: vec![0; raw_max],
            decoded: None,
            table: Vec::with_capacity(max_rows * row_bytes),
            rows_of: Vec::with_capacity(max_rows),
            distinct: Vec::with_capacity(max_rows),
            bytes_read: 0,
            store,
        })
    }

    /// Gathers the rows of `ids` into `table` (distinct ids ascending, so each frame is
    /// read once) and sets `rows_of`: from `cached`, the unit's raw bytes when the host
    /// keeps them, else from the store. Errors name the unit, frame and offset.
    pub(crate) fn gather(&mut self, ids: &[u32], cached: Option<&[u8]>) -> Result<(), IoError> {
        self.distinct.clear();
        self.distinct.extend_from_slice(ids);
        self.distinct.sort_unstable();
        self.distinct.dedup();
        self.rows_of.clear();
        for id in ids {
            let i = self.distinct.partition_point(|d| d < id);
            self.rows_of.push(i as u32);
        }
        let rb = self.row_bytes;
        self.table.clear();
        self.table.resize(self.distinct.len() * rb, 0);
        let store = self.store.clone();
        let frames = &store.units()[self.unit].frames;
        for (k, &id) in self.distinct.iter().enumerate() {
            if id as u64 >= self.rows {
                return Err(IoError::Setup {
                    path: store.weights_path().to_path_buf(),
                    msg: format!("token id {id} past the {} embedding rows", self.rows),
                });
            }
            let (lo, hi) = (
                self.offset + id as u64 * rb as u64,
                self.offset + (id as u64 + 1) * rb as u64,
            );
            if let Some(raw) = cached {
                self.table[k * rb..(k + 1) * rb].copy_from_slice(&raw[lo as usize..hi as usize]);
                continue;
            }
            let mut fi = frames.partition_point(|f| f.raw_offset + f.raw_len as u64 <= lo);
            while fi < frames.len() && frames[fi].raw_offset < hi {
                let f = &frames[fi];
                if self.decoded != Some(fi) {
                    self.decoded = None;
                    let src = read_frame(&self.file, f, &mut self.bounce)
                        .map_err(|fault| IoError::Data(store.frame_error(self.unit, fi, fault)))?;
                    self.bytes_read += f.stored_len();
                    let dst = &mut self.frame[..f.raw_len as usize];
                    self.dec
                        .decode(f.codec, &f.planes, f.checksum, src, dst)
                        .map_err(|fault| IoError::Data(store.frame_error(self.unit, fi, fault)))?;
                    self.decoded = Some(fi);
                }
                let (a, b) = (
                    lo.max(f.raw_offset),
                    hi.min(f.raw_offset + f.raw_len as u64),
                );
                let at = k * rb + (a - lo) as usize;
                let from = (a - f.raw_offset) as usize;
                self.table[at..at + (b - a) as usize]
                    .copy_from_slice(&self.frame[from..from + (b - a) as usize]);
                fi += 1;
            }
        }
        if !self.direct {
            // Read through the page cache: give its pages back (a cgroup would count them).
            crate::hostmem::drop_cached(&self.file);
        }
        Ok(())
    }
}
