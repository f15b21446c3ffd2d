//! What the host has and what this process uses of it, from /proc and the memory cgroup:
//! the default host budget, the overhead the plan starts from, and the measured peak.
//! Also reads of small files that leave nothing in the page cache (a cgroup charges the
//! page cache to whoever read it).

use std::path::Path;

/// A `Field:   123 kB` line of a /proc file, in bytes: None when unreadable.
fn kib_field(file: &str, field: &str) -> Option<u64> {
    let s = std::fs::read_to_string(file).ok()?;
    let line = s.lines().find(|l| l.starts_with(field))?;
    let kib: u64 = line[field.len()..]
        .trim_start_matches(':')
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    Some(kib * 1024)
}

/// One field of /proc/self/status in bytes (`VmRSS`, `VmHWM`).
fn status_bytes(field: &str) -> Option<u64> {
    kib_field("/proc/self/status", field)
}

/// The resident set now.
pub fn rss_bytes() -> Option<u64> {
    status_bytes("VmRSS")
}

/// The resident set less its file-backed pages (RssAnon + RssShmem): what the kernel cannot
/// reclaim. The executable's and libraries' text pages (RssFile) are clean page cache that
/// a memory cgroup evicts under its limit and reads back as needed; VmRSS when the split is
/// not reported.
pub fn anon_rss_bytes() -> Option<u64> {
    match (status_bytes("RssAnon"), status_bytes("RssShmem")) {
        (Some(a), Some(s)) => Some(a + s),
        _ => rss_bytes(),
    }
}

/// The resident set's high-water mark (the kernel's own count of every page this process
/// had at once: heap, stacks, buffers and the arena alike).
pub fn peak_rss_bytes() -> Option<u64> {
    status_bytes("VmHWM")
}

/// Bytes the C heap holds for live allocations now (glibc's `mallinfo2`: small blocks in
/// use plus mmapped ones), without the freed space the allocator keeps: a resident set
/// that grows while this stays flat is the allocator's high-water mark, not a leak. None
/// off glibc.
pub fn heap_in_use_bytes() -> Option<u64> {
    mallinfo().map(|m| (m.uordblks + m.hblkhd) as u64)
}

/// glibc's `mallinfo2` (every arena's totals); None off glibc.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn mallinfo() -> Option<libc::mallinfo2> {
    // SAFETY: mallinfo2 takes no arguments and returns a struct by value.
    Some(unsafe { libc::mallinfo2() })
}

/// The fields read of `mallinfo2`, where there is none.
#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
struct NoMallinfo {
    uordblks: usize,
    hblkhd: usize,
    fordblks: usize,
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn mallinfo() -> Option<NoMallinfo> {
    None
}

/// Bytes the C heap holds free (glibc `mallinfo2().fordblks`, every arena): memory freed
/// by the program that the allocator keeps for later. None off glibc.
pub fn heap_free_bytes() -> Option<u64> {
    mallinfo().map(|m| m.fordblks as u64)
}

/// Free heap the daemon leaves with the allocator before `trim_heap` hands it back.
pub const HEAP_SLACK: u64 = 1 << 20;

/// Hands the free heap back to the kernel (`malloc_trim(0)`: the free pages of every
/// arena, not only the top of the main one) when more than `HEAP_SLACK` is free; returns
/// the bytes the resident set shrank by. glibc keeps what a burst freed (a thread's arena
/// grows to its peak and stays there, and a large block once freed raises the mmap
/// threshold so that later ones stay in the heap), so without this a daemon's resident set
/// steps up with each larger burst and never comes down. The serving daemon calls it
/// every few seconds from its housekeeping thread.
pub fn trim_heap() -> u64 {
    if heap_free_bytes().is_some_and(|f| f <= HEAP_SLACK) {
        return 0;
    }
    let before = rss_bytes().unwrap_or(0);
    // SAFETY: malloc_trim only returns free heap pages to the kernel.
    unsafe {
        libc::malloc_trim(0);
    }
    before.saturating_sub(rss_bytes().unwrap_or(0))
}

/// The most glibc heap arenas a serving daemon keeps (`M_ARENA_MAX`). glibc gives each
/// thread that meets contention an arena of its own, up to 8 per core, and each keeps the
/// pages of its own peaks: with the network, engine, I/O and template threads that makes
/// the resident set climb for minutes and drift after (a 20-minute soak measured the
/// plateau 4 MiB lower at 2 arenas, at the same throughput). Allocation here is not the
/// bottleneck: the hot paths allocate nothing per step.
pub const SERVE_ARENAS: i32 = 2;

/// Caps glibc's heap arenas at `n` unless the user chose with `MALLOC_ARENA_MAX` (which
/// glibc reads itself); call before threads start. Returns whether the cap was set here.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
pub fn limit_arenas(n: i32) -> bool {
    if std::env::var_os("MALLOC_ARENA_MAX").is_some() {
        return false;
    }
    // SAFETY: mallopt only sets an allocator parameter; M_ARENA_MAX takes any positive count.
    unsafe { libc::mallopt(libc::M_ARENA_MAX, n) == 1 }
}

/// No glibc: nothing to cap.
#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
pub fn limit_arenas(_n: i32) -> bool {
    false
}

/// `MemAvailable` of /proc/meminfo.
pub fn mem_available() -> Option<u64> {
    kib_field("/proc/meminfo", "MemAvailable")
}

/// This process's memory cgroup: its directory and whether it is cgroup v2. None when no
/// memory controller is mounted where it is expected.
fn memory_cgroup() -> Option<(std::path::PathBuf, bool)> {
    let groups = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    let mut v2 = None;
    for line in groups.lines() {
        let mut parts = line.splitn(3, ':');
        let (_, controllers, path) = (parts.next()?, parts.next()?, parts.next()?);
        let path = path.trim_start_matches('/');
        if controllers.split(',').any(|c| c == "memory") {
            return Some((Path::new("/sys/fs/cgroup/memory").join(path), false));
        }
        if controllers.is_empty() {
            v2 = Some((Path::new("/sys/fs/cgroup").join(path), true));
        }
    }
    v2.filter(|(dir, _)| dir.join("memory.max").exists())
}

fn read_u64(dir: &Path, file: &str) -> Option<u64> {
    std::fs::read_to_string(dir.join(file))
        .ok()?
        .trim()
        .parse()
        .ok()
}

/// The memory limit of this process's cgroup and what the cgroup uses now (v2
/// `memory.max`/`memory.current`, or v1 `memory.limit_in_bytes`/`memory.usage_in_bytes`);
/// None when there is no limit or no memory controller.
pub fn cgroup_limit() -> Option<(u64, u64)> {
    let (dir, v2) = memory_cgroup()?;
    let (limit_file, usage_file) = if v2 {
        ("memory.max", "memory.current")
    } else {
        ("memory.limit_in_bytes", "memory.usage_in_bytes")
    };
    // "max" (v2) or a page-rounded i64::MAX (v1) do not parse or are absurd: no limit.
    let limit = read_u64(&dir, limit_file).filter(|&l| l < 1 << 60)?;
    Some((limit, read_u64(&dir, usage_file).unwrap_or(0)))
}

/// The host peak as the user should read it, and what measured it. Alone in a memory
/// cgroup with a limit (a systemd unit's `MemoryMax`, a container, `sluiced run` under
/// `systemd-run -p MemoryMax=`), it is the cgroup's own high-water mark (v2 `memory.peak`,
/// v1 `memory.max_usage_in_bytes`): what the kernel charged, page cache included, against
/// the limit it enforces. Otherwise the resident set's high-water mark (VmHWM), which
/// counts the pages of the executable and libraries this process mapped whoever they are
/// charged to.
pub fn host_peak() -> (u64, &'static str) {
    let vm = peak_rss_bytes().unwrap_or(0);
    let Some((dir, v2)) = memory_cgroup() else {
        return (vm, "VmHWM");
    };
    let limited = cgroup_limit().is_some();
    let me = std::process::id().to_string();
    let alone = std::fs::read_to_string(dir.join("cgroup.procs"))
        .is_ok_and(|p| p.split_whitespace().eq(std::iter::once(me.as_str())));
    let peak = read_u64(
        &dir,
        if v2 {
            "memory.peak"
        } else {
            "memory.max_usage_in_bytes"
        },
    );
    match peak {
        Some(p) if limited && alone => (p, "memory cgroup"),
        _ => (vm, "VmHWM"),
    }
}

/// Share of the available memory the default host budget takes: the rest stays for the
/// page cache, other processes and what the kernel needs.
pub const DEFAULT_SHARE_PCT: u64 = 80;

/// The host budget when none is given, and the sentence that says where it came from:
/// `DEFAULT_SHARE_PCT` % of MemAvailable, or of the cgroup's headroom when that is less.
pub fn default_host_budget() -> (Option<u64>, String) {
    let avail = mem_available();
    let cg = cgroup_limit();
    let own = rss_bytes().unwrap_or(0);
    // The cgroup's headroom counts this process's own pages as free: they are part of what
    // the budget covers.
    let cg_room = cg.map(|(limit, used)| limit.saturating_sub(used.saturating_sub(own)));
    let pct = |b: u64| b / 100 * DEFAULT_SHARE_PCT;
    match (avail, cg_room) {
        (Some(a), Some(c)) if c < a => (
            Some(pct(c)),
            format!(
                "host budget {} = {DEFAULT_SHARE_PCT}% of the memory cgroup's room ({} of its {} limit); --host-memory sets it",
                crate::util::fmt_bytes(pct(c)),
                crate::util::fmt_bytes(c),
                crate::util::fmt_bytes(cg.map_or(0, |x| x.0)),
            ),
        ),
        (Some(a), _) => (
            Some(pct(a)),
            format!(
                "host budget {} = {DEFAULT_SHARE_PCT}% of MemAvailable ({}); --host-memory sets it",
                crate::util::fmt_bytes(pct(a)),
                crate::util::fmt_bytes(a)
            ),
        ),
        (None, Some(c)) => (
            Some(pct(c)),
            format!(
                "host budget {} = {DEFAULT_SHARE_PCT}% of the memory cgroup's room ({}); --host-memory sets it",
                crate::util::fmt_bytes(pct(c)),
                crate::util::fmt_bytes(c)
            ),
        ),
        (None, None) => (
            None,
            "no host budget: /proc/meminfo is unreadable and there is no memory cgroup; --host-memory sets one".into(),
        ),
    }
}

/// The pages of the executable and libraries mapped now (RssFile): clean page cache, but a
/// memory cgroup charges it to whoever read it first, and the decode loop needs its code
/// resident: a cold start under a limit of exactly the budget has to hold them too.
pub fn file_rss_bytes() -> Option<u64> {
    status_bytes("RssFile")
}

/// Bytes the plan adds to what is resident at start for what it does not allocate itself
/// and has not touched yet: the code of the decode loop, the I/O engine and the kernels
/// (start-up has not run them when the plan is made), thread stacks as they are touched,
/// the allocator's per-thread arenas, request bookkeeping (logits rows are the caller's
/// `extra`). With the executable's and libraries' pages mapped at start counted (RssFile),
/// SmolLM2 at its least plans (contexts 64-1024, 1-8 sequences, each started cold in a
/// memory cgroup of exactly its budget: `tests/tests/memlimit.rs`) peaked (VmHWM) at
/// least 1.4 MiB under the plan, and a 64-token context still ran with its cgroup 5 MiB smaller (129
/// major faults). With no margin the same run read its code from disk again and again
/// (2,172 major faults in its first 10 s, 0.2 tokens/s); so did the earlier count of
/// anonymous memory plus 8 MiB, which left the executable's pages out (73,000 faults).
pub const OVERHEAD_MARGIN: u64 = 6 << 20;

/// The overhead a plan starts from: what is resident now, anonymous memory and the mapped
/// executable and libraries alike (`anon_rss_bytes`, `file_rss_bytes`), plus
/// `OVERHEAD_MARGIN` and `extra` (bytes the caller knows it will allocate, such as logits
/// rows), rounded up to a whole MiB so that the least budget an error names is the same
/// from one start to the next (the resident set at start varies by a few pages).
pub fn overhead_now(extra: u64) -> u64 {
    // Start-up (manifest decode, tokenizer build) frees more than it keeps: hand the freed
    // heap back to the kernel first, so the resident set is what stays.
    // SAFETY: malloc_trim only returns free heap pages; it has no other effect.
    unsafe {
        libc::malloc_trim(0);
    }
    let resident = anon_rss_bytes().unwrap_or(0) + file_rss_bytes().unwrap_or(0);
    (resident + OVERHEAD_MARGIN + extra).next_multiple_of(1 << 20)
}

pub use crate::util::drop_cached;
