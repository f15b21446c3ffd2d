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
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: mallinfo2 takes no arguments and returns a struct by value.
        let m = unsafe { libc::mallinfo2() };
        Some((m.uordblks + m.hblkhd) as u64)
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        None
    }
}

/// `MemAvailable` of /proc/meminfo.
pub fn mem_available() -> Option<u64> {
    kib_field("/proc/meminfo", "MemAvailable")
}

/// The memory limit of this process's cgroup and what the cgroup uses now (v2
/// `memory.max`/`memory.current`, or v1 `memory.limit_in_bytes`/`memory.usage_in_bytes`);
/// None when there is no limit or no memory controller.
pub fn cgroup_limit() -> Option<(u64, u64)> {
    let groups = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    for line in groups.lines() {
        let mut parts = line.splitn(3, ':');
        let (_, controllers, path) = (parts.next()?, parts.next()?, parts.next()?);
        let path = path.trim_start_matches('/');
        let (dir, limit_file, usage_file) = if controllers.split(',').any(|c| c == "memory") {
            (
                Path::new("/sys/fs/cgroup/memory").join(path),
                "memory.limit_in_bytes",
                "memory.usage_in_bytes",
            )
        } else if controllers.is_empty() {
            (
                Path::new("/sys/fs/cgroup").join(path),
                "memory.max",
                "memory.current",
            )
        } else {
            continue;
        };
        let read = |f: &str| -> Option<u64> {
            std::fs::read_to_string(dir.join(f))
                .ok()?
                .trim()
                .parse()
                .ok()
        };
        // "max" (v2) or a page-rounded i64::MAX (v1) do not parse or are absurd: no limit.
        if let Some(limit) = read(limit_file).filter(|&l| l < 1 << 60) {
            return Some((limit, read(usage_file).unwrap_or(0)));
        }
    }
    None
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

/// Bytes the plan adds to the resident set measured at start for what it does not
/// allocate itself: thread stacks as they are touched (a few pages each), the allocator's
/// per-thread arenas as they are used, request bookkeeping (logits rows are the caller's
/// `extra`), and room for the pages of code the decode loop keeps touching. Those are page
/// cache, which a memory cgroup charges like the rest: SmolLM2's decode keeps 3-7 MB of the
/// executable and libraries mapped, and with 4 MiB of margin the plans at 64-96 MiB left
/// them too little once the plan counted all of its own scratch (the code was read again
/// every step: 1.5-4 tokens/s instead of 20-47). With 8 MiB each of SmolLM2's plans from
/// 64 to 112 MiB reads what it plans (within 3%). Start-up's own transient (decoding the
/// manifest, building the tokenizer) comes before the plan and peaks lower (27 MiB of
/// anonymous memory on SmolLM2, whose least plan is 35 MiB).
pub const OVERHEAD_MARGIN: u64 = 8 << 20;

/// The overhead a plan starts from: the anonymous resident set now (`anon_rss_bytes`; the
/// margin leaves room for the code pages the hot loop keeps touched) plus `OVERHEAD_MARGIN` and
/// `extra` (bytes the caller knows it will allocate, such as logits rows).
pub fn overhead_now(extra: u64) -> u64 {
    // Start-up (manifest decode, tokenizer build) frees more than it keeps: hand the freed
    // heap back to the kernel first, so the resident set is what stays.
    // SAFETY: malloc_trim only returns free heap pages; it has no other effect.
    unsafe {
        libc::malloc_trim(0);
    }
    anon_rss_bytes().unwrap_or(0) + OVERHEAD_MARGIN + extra
}

pub use crate::util::drop_cached;
