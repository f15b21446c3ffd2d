//! The prefix cache's disk tier (`--kv-cache-dir`, `--kv-cache-disk`): blocks
//! (`kv_block::Block`) as checksummed frame files, `DIR/v1/<model key>/<block name>.kvb`,
//! written in the background by one thread and read back with O_DIRECT on io_uring
//! (`io::files`), kept across restarts within a byte budget (the least recently used file
//! is deleted first).
//!
//! Faults are misses, never wrong tokens: a file that fails its checks (truncated, a flipped
//! bit, another format version, another block's name) is logged, deleted and not used; a
//! failed write (a full disk) is logged and the block is simply not on disk; a directory
//! another daemon holds (an exclusive `flock` on `DIR/lock`) is refused at start, and that
//! daemon runs without a disk tier.

use super::kv_block::{decode_frame, encode_frame, Block, FRAME_VERSION};
use crate::plan::KV_WRITE_QUEUE_BYTES;
use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{sync_channel, SyncSender, TrySendError};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

/// Blocks waiting for the writer at most; more are dropped (counted), never waited for.
const QUEUE: usize = 256;

/// What the disk tier holds and did (Status, /metrics).
#[derive(Clone, Copy, Debug, Default, serde::Serialize)]
pub struct DiskStats {
    pub budget_bytes: u64,
    pub bytes: u64,
    pub blocks: u64,
    pub writes: u64,
    pub write_errors: u64,
    /// Blocks not written because the writer was behind.
    pub dropped: u64,
    /// Files read back whole and checked, and those that failed a check (deleted).
    pub reads: u64,
    pub read_errors: u64,
}

struct Entry {
    len: u64,
    at: u64,
    /// Every layer's KV is in it (a block from a ring's far past has no ring layers).
    full: bool,
}

#[derive(Default)]
struct Index {
    files: HashMap<(u64, u64), Entry>,
    order: BTreeMap<u64, (u64, u64)>,
    used: u64,
    clock: u64,
}

impl Index {
    fn touch(&mut self, id: (u64, u64)) {
        self.clock += 1;
        if let Some(e) = self.files.get_mut(&id) {
            self.order.remove(&e.at);
            e.at = self.clock;
            self.order.insert(self.clock, id);
        }
    }

    fn insert(&mut self, id: (u64, u64), len: u64, full: bool) {
        self.remove(id);
        self.clock += 1;
        self.used += len;
        self.order.insert(self.clock, id);
        self.files.insert(
            id,
            Entry {
                len,
                at: self.clock,
                full,
            },
        );
    }

    /// Forgets `id`; returns whether its file had every layer (None: it was not there).
    fn remove(&mut self, id: (u64, u64)) -> Option<bool> {
        let e = self.files.remove(&id)?;
        self.order.remove(&e.at);
        self.used -= e.len;
        Some(e.full)
    }
}

/// Blocks queued for the writer, and their bytes (at most `KV_WRITE_QUEUE_BYTES`).
#[derive(Default)]
struct Pending {
    blocks: HashMap<(u64, u64), Arc<Block>>,
    bytes: u64,
}

struct Inner {
    root: PathBuf,
    budget: u64,
    index: Mutex<Index>,
    /// Blocks queued for the writer and not yet written: found and read from here, so a
    /// block is never missing between its queueing and its file.
    pending: Mutex<Pending>,
    /// Signalled as the writer takes blocks off `pending`.
    room: Condvar,
    writes: AtomicU64,
    write_errors: AtomicU64,
    dropped: AtomicU64,
    reads: AtomicU64,
    read_errors: AtomicU64,
    /// Held for the daemon's life: the exclusive lock on `DIR/lock`.
    _lock: File,
}

enum Job {
    Write {
        key: u64,
        hash: u64,
        block: Arc<Block>,
        full: bool,
    },
    /// Deletes a model's blocks (every model's: None), after the writes queued before;
    /// answers with the blocks deleted.
    Clear(Option<u64>, SyncSender<usize>),
    /// Answers once the writes queued before are done.
    Flush(SyncSender<()>),
}

/// The disk tier (see the module doc). One per daemon, shared by its models.
pub struct DiskTier {
    inner: Arc<Inner>,
    jobs: Mutex<Option<SyncSender<Job>>>,
    writer: Mutex<Option<std::thread::JoinHandle<()>>>,
}

fn lock<T>(i: &Mutex<T>) -> MutexGuard<'_, T> {
    i.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl Inner {
    fn path(&self, id: (u64, u64), full: bool) -> PathBuf {
        block_path(&self.root, id, full)
    }

    /// Deletes the least recently used files until `room` more bytes fit the budget.
    fn make_room(&self, room: u64) {
        loop {
            let victim = {
                let mut ix = lock(&self.index);
                if ix.used + room <= self.budget {
                    return;
                }
                let Some((_, &id)) = ix.order.first_key_value() else {
                    return;
                };
                (id, ix.remove(id).unwrap_or(true))
            };
            let _ = std::fs::remove_file(self.path(victim.0, victim.1));
        }
    }

    fn write(&self, key: u64, hash: u64, block: &Block, full: bool) {
        self.write_file(key, hash, block, full);
        let mut p = lock(&self.pending);
        if let Some(b) = p.blocks.remove(&(key, hash)) {
            p.bytes -= b.size();
        }
        drop(p);
        self.room.notify_all();
    }

    fn write_file(&self, key: u64, hash: u64, block: &Block, full: bool) {
        if lock(&self.index)
            .files
            .get(&(key, hash))
            .is_some_and(|e| e.full || !full)
        {
            return;
        }
        let frame = encode_frame(key, hash, block);
        let len = frame.len() as u64;
        if len > self.budget {
            return;
        }
        self.make_room(len);
        let path = self.path((key, hash), full);
        let tmp = path.with_extension("tmp");
        let r = (|| {
            if let Some(dir) = path.parent() {
                std::fs::create_dir_all(dir)?;
            }
            std::fs::write(&tmp, &frame)?;
            std::fs::rename(&tmp, &path)
        })();
        match r {
            Ok(()) => {
                self.writes.fetch_add(1, Ordering::Relaxed);
                let mut ix = lock(&self.index);
                if ix.remove((key, hash)) == Some(false) && full {
                    // The block without its ring layers, which this one replaces.
                    let _ = std::fs::remove_file(self.path((key, hash), false));
                }
                ix.insert((key, hash), len, full);
            }
            Err(e) => {
                let _ = std::fs::remove_file(&tmp);
                let n = self.write_errors.fetch_add(1, Ordering::Relaxed) + 1;
                // The first failure and then every power of two: a full disk is one line
                // now and then, not one a block.
                if n.is_power_of_two() {
                    tracing::warn!(
                        "KV cache: writing {} failed ({e}; {n} failed writes so far): the block is not kept on disk, a later prompt that needs it prefills it",
                        path.display()
                    );
                }
            }
        }
    }

    fn clear(&self, key: Option<u64>) -> usize {
        let gone: Vec<((u64, u64), bool)> = {
            let mut ix = lock(&self.index);
            let ids: Vec<_> = ix
                .files
                .keys()
                .copied()
                .filter(|id| key.is_none_or(|k| id.0 == k))
                .collect();
            ids.into_iter()
                .map(|id| (id, ix.remove(id).unwrap_or(true)))
                .collect()
        };
        for &(id, full) in &gone {
            let _ = std::fs::remove_file(self.path(id, full));
        }
        gone.len()
    }
}

/// A block's file under `root`: `.kvb` with every layer, `.kvp` without its ring layers.
fn block_path(root: &Path, (key, hash): (u64, u64), full: bool) -> PathBuf {
    let ext = if full { "kvb" } else { "kvp" };
    root.join(format!("{key:016x}"))
        .join(format!("{hash:016x}.{ext}"))
}

/// How long `take_lock` waits for a lock this process's own id holds.
const OWN_LOCK_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

/// Takes the exclusive lock on `dir/lock` (writing this process's id in it), or says which
/// process holds it. A lock that names this process is one of its own tiers on the way
/// out — or its descriptor, which a child forked meanwhile holds until it execs: waited
/// for, up to OWN_LOCK_WAIT (a tier reopened in one process, as tests do, otherwise fails
/// when another thread happens to spawn a process just then).
fn take_lock(dir: &Path) -> Result<File, String> {
    let path = dir.join("lock");
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&path)
        .map_err(|e| format!("open {}: {e}", path.display()))?;
    let t0 = std::time::Instant::now();
    // SAFETY: flock on a descriptor this function owns.
    while unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
        let holder = std::fs::read_to_string(&path).unwrap_or_default();
        let ours = holder.trim() == std::process::id().to_string();
        if ours && t0.elapsed() < OWN_LOCK_WAIT {
            std::thread::sleep(std::time::Duration::from_millis(5));
            continue;
        }
        let who = if ours {
            "this process already".to_string()
        } else {
            format!("another sluiced (pid {})", holder.trim())
        };
        return Err(format!(
            "{} is in use by {who}: give each daemon its own --kv-cache-dir",
            dir.display(),
        ));
    }
    f.set_len(0)
        .and_then(|_| {
            std::os::unix::fs::FileExt::write_at(&f, std::process::id().to_string().as_bytes(), 0)
        })
        .map_err(|e| format!("write {}: {e}", path.display()))?;
    Ok(f)
}

/// The files under `root` (`<key>/<name>.kvb`), oldest first; left-over temporary files
/// of an interrupted write are deleted.
fn scan(root: &Path) -> Vec<((u64, u64), u64, std::time::SystemTime, bool)> {
    let mut found = Vec::new();
    let Ok(keys) = std::fs::read_dir(root) else {
        return found;
    };
    for k in keys.flatten() {
        let Some(key) = k
            .file_name()
            .to_str()
            .and_then(|s| u64::from_str_radix(s, 16).ok())
        else {
            continue;
        };
        let Ok(files) = std::fs::read_dir(k.path()) else {
            continue;
        };
        for f in files.flatten() {
            let p = f.path();
            match p.extension().and_then(|e| e.to_str()) {
                Some("tmp") => {
                    let _ = std::fs::remove_file(&p);
                }
                Some(ext @ ("kvb" | "kvp")) => {
                    let hash = p
                        .file_stem()
                        .and_then(|s| s.to_str())
                        .and_then(|s| u64::from_str_radix(s, 16).ok());
                    if let (Some(hash), Ok(m)) = (hash, f.metadata()) {
                        let when = m.modified().unwrap_or(std::time::UNIX_EPOCH);
                        found.push(((key, hash), m.len(), when, ext == "kvb"));
                    }
                }
                _ => {}
            }
        }
    }
    found.sort_by_key(|f| f.2);
    found
}

impl DiskTier {
    /// Opens (creating it) the cache directory `dir` with a budget of `budget` bytes: takes
    /// its lock, indexes the blocks an earlier run left (deleting the oldest past the
    /// budget) and starts the writer. Err: why the daemon runs without a disk tier.
    pub fn open(dir: &Path, budget: u64) -> Result<Arc<DiskTier>, String> {
        std::fs::create_dir_all(dir).map_err(|e| format!("create {}: {e}", dir.display()))?;
        let lock_file = take_lock(dir)?;
        let root = dir.join(format!("v{FRAME_VERSION}"));
        std::fs::create_dir_all(&root).map_err(|e| format!("create {}: {e}", root.display()))?;
        if let Ok(entries) = std::fs::read_dir(dir) {
            for e in entries.flatten() {
                let name = e.file_name().to_string_lossy().into_owned();
                let other = name
                    .strip_prefix('v')
                    .is_some_and(|v| v.parse::<u32>().is_ok_and(|v| v != FRAME_VERSION));
                if other {
                    tracing::warn!(
                        "KV cache: {} was written by another version of sluice (block format {}, this one uses {FRAME_VERSION}): not read; delete it to free its space",
                        e.path().display(),
                        &name[1..]
                    );
                }
            }
        }
        let mut index = Index::default();
        for (id, len, _, full) in scan(&root) {
            // A block both with and without its ring layers (a stop between writing the one
            // and deleting the other): the whole one stays.
            match index.files.get(&id).map(|e| e.full) {
                Some(true) if !full => {
                    let _ = std::fs::remove_file(block_path(&root, id, false));
                    continue;
                }
                Some(false) if full => {
                    let _ = std::fs::remove_file(block_path(&root, id, false));
                }
                _ => {}
            }
            index.insert(id, len, full);
        }
        let inner = Arc::new(Inner {
            root,
            budget,
            index: Mutex::new(index),
            pending: Mutex::new(Pending::default()),
            room: Condvar::new(),
            writes: AtomicU64::new(0),
            write_errors: AtomicU64::new(0),
            dropped: AtomicU64::new(0),
            reads: AtomicU64::new(0),
            read_errors: AtomicU64::new(0),
            _lock: lock_file,
        });
        inner.make_room(0);
        let (tx, rx) = sync_channel::<Job>(QUEUE);
        let w = inner.clone();
        let writer = std::thread::Builder::new()
            .name("sluice-kv-writer".into())
            .spawn(move || {
                for job in rx {
                    match job {
                        Job::Write {
                            key,
                            hash,
                            block,
                            full,
                        } => w.write(key, hash, &block, full),
                        Job::Clear(key, done) => {
                            let _ = done.send(w.clear(key));
                        }
                        Job::Flush(done) => {
                            let _ = done.send(());
                        }
                    }
                }
            })
            .map_err(|e| format!("start the KV cache writer: {e}"))?;
        let st = inner.stats_now();
        tracing::info!(
            "KV cache on disk: {} ({} blocks, {} MiB of {} MiB)",
            dir.display(),
            st.0,
            st.1 >> 20,
            budget >> 20
        );
        Ok(Arc::new(DiskTier {
            inner,
            jobs: Mutex::new(Some(tx)),
            writer: Mutex::new(Some(writer)),
        }))
    }

    /// Whether block `hash` of model `key` is on disk: Some(true) with every layer.
    pub fn has(&self, key: u64, hash: u64) -> Option<bool> {
        if let Some(b) = lock(&self.inner.pending).blocks.get(&(key, hash)) {
            return Some(b.held.iter().all(|&h| h));
        }
        lock(&self.inner.index)
            .files
            .get(&(key, hash))
            .map(|e| e.full)
    }

    /// Queues `block` to be written (in the background). While the queue holds
    /// `KV_WRITE_QUEUE_BYTES` (what the plan counts for it) this waits for the writer, up to
    /// a second; then, or when the queue is full of blocks, the block is dropped (counted).
    pub fn write(&self, key: u64, hash: u64, block: Arc<Block>) {
        let full = block.held.iter().all(|&h| h);
        let jobs = self
            .jobs
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let Some(tx) = jobs.as_ref() else { return };
        let size = block.size();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(1);
        let mut pending = lock(&self.inner.pending);
        while pending.bytes > 0 && pending.bytes + size > KV_WRITE_QUEUE_BYTES {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                self.inner.dropped.fetch_add(1, Ordering::Relaxed);
                return;
            }
            pending = self
                .inner
                .room
                .wait_timeout(pending, left)
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .0;
        }
        let job = Job::Write {
            key,
            hash,
            block: block.clone(),
            full,
        };
        match tx.try_send(job) {
            Ok(()) => {
                if let Some(old) = pending.blocks.insert((key, hash), block) {
                    pending.bytes -= old.size();
                }
                pending.bytes += size;
            }
            Err(TrySendError::Full(_)) => {
                self.inner.dropped.fetch_add(1, Ordering::Relaxed);
            }
            Err(TrySendError::Disconnected(_)) => {}
        }
    }

    /// Reads blocks `hashes` of model `key`, all at once: per block, the block or why it is
    /// a miss (a damaged file is logged and deleted).
    pub fn read(&self, key: u64, hashes: &[u64]) -> Vec<Result<Block, String>> {
        let queued: Vec<Option<Arc<Block>>> = {
            let p = lock(&self.inner.pending);
            hashes
                .iter()
                .map(|&h| p.blocks.get(&(key, h)).cloned())
                .collect()
        };
        let on_disk: Vec<u64> = hashes
            .iter()
            .zip(&queued)
            .filter(|(_, q)| q.is_none())
            .map(|(&h, _)| h)
            .collect();
        let mut read = self.read_files(key, &on_disk).into_iter();
        queued
            .into_iter()
            .map(|q| match q {
                Some(b) => Ok(Block::clone(&b)),
                None => read.next().unwrap_or_else(|| Err("not read".into())),
            })
            .collect()
    }

    fn read_files(&self, key: u64, hashes: &[u64]) -> Vec<Result<Block, String>> {
        if hashes.is_empty() {
            return Vec::new();
        }
        let paths: Vec<PathBuf> = {
            let ix = lock(&self.inner.index);
            hashes
                .iter()
                .map(|&h| {
                    let full = ix.files.get(&(key, h)).is_none_or(|e| e.full);
                    self.inner.path((key, h), full)
                })
                .collect()
        };
        let (files, _) = crate::io::files::read_files(&paths);
        files
            .into_iter()
            .zip(hashes)
            .zip(&paths)
            .map(|((f, &hash), path)| {
                let r = f
                    .map_err(|e| format!("read: {e}"))
                    .and_then(|bytes| decode_frame(&bytes, key, hash));
                let mut ix = lock(&self.inner.index);
                match &r {
                    Ok(_) => {
                        self.inner.reads.fetch_add(1, Ordering::Relaxed);
                        ix.touch((key, hash));
                    }
                    Err(e) => {
                        self.inner.read_errors.fetch_add(1, Ordering::Relaxed);
                        ix.remove((key, hash));
                        drop(ix);
                        tracing::warn!(
                            "KV cache: {} is not usable ({e}): deleted; its prompt prefills what it held",
                            path.display()
                        );
                        let _ = std::fs::remove_file(path);
                    }
                }
                r
            })
            .collect()
    }

    /// Deletes model `key`'s blocks (every model's: None) once the writes queued before
    /// are done; returns how many.
    pub fn clear(&self, key: Option<u64>) -> usize {
        let (tx, rx) = sync_channel(1);
        let sent = {
            let jobs = self
                .jobs
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            jobs.as_ref()
                .is_some_and(|j| j.send(Job::Clear(key, tx)).is_ok())
        };
        if sent {
            rx.recv().unwrap_or(0)
        } else {
            self.inner.clear(key)
        }
    }

    /// Waits until the writes queued so far are on disk (tests, shutdown).
    pub fn flush(&self) {
        let (tx, rx) = sync_channel(1);
        let jobs = self
            .jobs
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if jobs
            .as_ref()
            .is_some_and(|j| j.send(Job::Flush(tx)).is_ok())
        {
            drop(jobs);
            let _ = rx.recv();
        }
    }

    pub fn stats(&self) -> DiskStats {
        let (blocks, bytes) = self.inner.stats_now();
        let i = &self.inner;
        DiskStats {
            budget_bytes: i.budget,
            bytes,
            blocks,
            writes: i.writes.load(Ordering::Relaxed),
            write_errors: i.write_errors.load(Ordering::Relaxed),
            dropped: i.dropped.load(Ordering::Relaxed),
            reads: i.reads.load(Ordering::Relaxed),
            read_errors: i.read_errors.load(Ordering::Relaxed),
        }
    }

    /// The file block `hash` of model `key` is in, if it is on disk (tests).
    pub fn path_of(&self, key: u64, hash: u64) -> Option<PathBuf> {
        let full = self.has(key, hash)?;
        Some(self.inner.path((key, hash), full))
    }
}

impl Inner {
    fn stats_now(&self) -> (u64, u64) {
        let ix = lock(&self.index);
        (ix.files.len() as u64, ix.used)
    }
}

impl Drop for DiskTier {
    /// Writes what is queued, then stops the writer.
    fn drop(&mut self) {
        self.jobs
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take();
        if let Some(w) = self
            .writer
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take()
        {
            let _ = w.join();
        }
    }
}

impl std::fmt::Debug for DiskTier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DiskTier")
            .field("root", &self.inner.root)
            .field("budget", &self.inner.budget)
            .finish()
    }
}
