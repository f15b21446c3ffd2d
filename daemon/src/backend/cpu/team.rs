//! The CPU backend's compute threads: a fork-join team of the calling thread and
//! `threads - 1` workers.
//!
//! A decode step is a few hundred short ops back to back (eight parallel ones a layer, many
//! of them tens of microseconds). A general pool's workers go to sleep within microseconds
//! of running dry, so each op would start with a futex wake whose latency is comparable to
//! the op. Here an op publishes its tasks with one atomic store; the workers, spinning
//! between ops, claim task indices from the same word as the caller, and the caller returns
//! once every task has run. A worker spins for the team's spin time after its last task,
//! then sleeps on a condition variable until the next op, so an idle daemon, or a pass
//! waiting on the disk, does not hold a core.
//!
//! Which thread runs which task is not fixed (the first to claim it does); the ops' tasks
//! are independent and each writes its own outputs, so results do not depend on it.

use std::any::Any;
use std::cell::Cell;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Tasks one publication holds (the 15-bit field of the state word); a larger op runs its
/// indices in runs of consecutive ones per task.
const MAX_TASKS: usize = 0x7fff;

/// How long a worker spins for the next op before it sleeps, unless `SLUICE_SPIN_US` says.
const DEFAULT_SPIN: Duration = Duration::from_micros(200);

thread_local! {
    /// Set on the team's workers, and on a caller while it runs an op's tasks: an op begun
    /// from inside a task runs in order on that thread instead of waiting on the team.
    static IN_TEAM: Cell<bool> = const { Cell::new(false) };
}

/// The state word: generation (32 bits) | broadcast (1) | tasks (15) | next unclaimed
/// task (16). A broadcast is published with every task claimed: worker w runs task w.
fn pack(generation: u32, broadcast: bool, tasks: usize, next: usize) -> u64 {
    ((generation as u64) << 32) | ((broadcast as u64) << 31) | ((tasks as u64) << 16) | next as u64
}

fn generation(v: u64) -> u32 {
    (v >> 32) as u32
}

fn is_broadcast(v: u64) -> bool {
    v & (1 << 31) != 0
}

fn tasks(v: u64) -> usize {
    ((v >> 16) & 0x7fff) as usize
}

fn next(v: u64) -> usize {
    (v & 0xffff) as usize
}

/// One op's tasks, on the caller's stack for the length of the op.
struct Job<'a> {
    f: &'a (dyn Fn(usize) + Sync),
    /// Every thread runs task (its index) once: thread 0 the caller, worker w task w.
    broadcast: bool,
}

struct Shared {
    state: AtomicU64,
    /// The current generation's `Job` (type-erased; read only by a thread that has claimed
    /// a task of that generation, which keeps the caller, and so the job, waiting).
    job: AtomicPtr<()>,
    /// Tasks of the current generation run to their end (panicked ones included).
    done: AtomicUsize,
    /// The first panic of a task of the current op, resumed on the caller.
    panic: Mutex<Option<Box<dyn Any + Send>>>,
    /// Workers asleep, and what they sleep on.
    sleeping: AtomicUsize,
    lock: Mutex<()>,
    wake: Condvar,
    quit: AtomicBool,
    spin: Duration,
}

pub struct Team {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
    /// One op at a time: a second thread's op waits for the first.
    caller: Mutex<()>,
}

impl Team {
    /// A team of `threads` (at least 1): the caller and `threads - 1` workers named
    /// `sluice-cpu-N`.
    pub fn new(threads: usize) -> std::io::Result<Team> {
        let spin = std::env::var("SLUICE_SPIN_US")
            .ok()
            .and_then(|s| s.parse::<u64>().ok())
            .map_or(DEFAULT_SPIN, Duration::from_micros);
        Team::with_spin(threads, spin)
    }

    /// A team whose workers spin for `spin` after their last task before they sleep.
    pub fn with_spin(threads: usize, spin: Duration) -> std::io::Result<Team> {
        let shared = Arc::new(Shared {
            state: AtomicU64::new(0),
            job: AtomicPtr::new(std::ptr::null_mut()),
            done: AtomicUsize::new(0),
            panic: Mutex::new(None),
            sleeping: AtomicUsize::new(0),
            lock: Mutex::new(()),
            wake: Condvar::new(),
            quit: AtomicBool::new(false),
            spin,
        });
        let mut team = Team {
            shared: shared.clone(),
            workers: Vec::new(),
            caller: Mutex::new(()),
        };
        for w in 1..threads.max(1) {
            let s = shared.clone();
            let h = std::thread::Builder::new()
                .name(format!("sluice-cpu-{w}"))
                .spawn(move || worker(&s, w))?;
            // On an error here the team built so far is dropped, which stops its workers.
            team.workers.push(h);
        }
        Ok(team)
    }

    /// Threads that run tasks, the caller included.
    pub fn threads(&self) -> usize {
        self.workers.len() + 1
    }

    /// Runs `f(i)` for every i in 0..n across the team, the caller included; returns once
    /// all have run. A panic in any task is resumed here after every task has finished.
    pub fn for_each(&self, n: usize, f: &(dyn Fn(usize) + Sync)) {
        if n == 0 {
            return;
        }
        if n == 1 || self.workers.is_empty() || IN_TEAM.with(Cell::get) {
            (0..n).for_each(f);
            return;
        }
        let per = n.div_ceil(MAX_TASKS);
        let runs = |t: usize| (t * per..((t + 1) * per).min(n)).for_each(f);
        let (f, count): (&(dyn Fn(usize) + Sync), usize) = if per == 1 {
            (f, n)
        } else {
            (&runs, n.div_ceil(per))
        };
        self.publish(
            &Job {
                f,
                broadcast: false,
            },
            count,
        );
    }

    /// Runs `f(t)` once on every thread of the team, t its index (0 the caller).
    pub fn broadcast(&self, f: &(dyn Fn(usize) + Sync)) {
        if self.workers.is_empty() || IN_TEAM.with(Cell::get) {
            f(0);
            return;
        }
        self.publish(&Job { f, broadcast: true }, self.threads());
    }

    fn publish(&self, job: &Job<'_>, count: usize) {
        let _one = lock(&self.caller);
        let s = &*self.shared;
        s.done.store(0, Ordering::Relaxed);
        s.job
            .store(job as *const Job<'_> as *mut (), Ordering::Release);
        let g = generation(s.state.load(Ordering::Relaxed)).wrapping_add(1);
        let start = if job.broadcast { count } else { 0 };
        // SeqCst with the load of `sleeping` below, as a worker's increment of `sleeping`
        // and its check of the state: either it sees this generation, or this sees it
        // asleep and wakes it.
        s.state
            .store(pack(g, job.broadcast, count, start), Ordering::SeqCst);
        if s.sleeping.load(Ordering::SeqCst) > 0 {
            let _l = lock(&s.lock);
            s.wake.notify_all();
        }
        IN_TEAM.with(|t| t.set(true));
        let mine = if job.broadcast {
            run_task(s, job, 0);
            1
        } else {
            claim_all(s, g, job)
        };
        let mut left = s.done.fetch_add(mine, Ordering::AcqRel) + mine;
        let mut spins = 0u32;
        while left < count {
            // The rest are running on workers: they take microseconds, unless a worker
            // was preempted.
            if spins < 4096 {
                std::hint::spin_loop();
                spins += 1;
            } else {
                std::thread::yield_now();
            }
            left = s.done.load(Ordering::Acquire);
        }
        IN_TEAM.with(|t| t.set(false));
        let panicked = lock(&s.panic).take();
        if let Some(p) = panicked {
            resume_unwind(p);
        }
    }
}

impl Drop for Team {
    fn drop(&mut self) {
        self.shared.quit.store(true, Ordering::SeqCst);
        {
            let _l = lock(&self.shared.lock);
            self.shared.wake.notify_all();
        }
        for h in self.workers.drain(..) {
            // A worker's tasks catch their panics, so a join error is not expected; there
            // is nothing to do with one while dropping.
            let _ = h.join();
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // What these mutexes guard stays valid across a panic (a flag, a payload).
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Runs task `i` of `job`, keeping its panic for the caller; returns 1 (a task done).
fn run_task(s: &Shared, job: &Job<'_>, i: usize) -> usize {
    if let Err(p) = catch_unwind(AssertUnwindSafe(|| (job.f)(i))) {
        lock(&s.panic).get_or_insert(p);
    }
    1
}

/// Claims and runs tasks of generation `g` of `job` until none is left; returns how many
/// it ran.
fn claim_all(s: &Shared, g: u32, job: *const Job<'_>) -> usize {
    let mut ran = 0;
    let mut v = s.state.load(Ordering::Acquire);
    while generation(v) == g && next(v) < tasks(v) {
        match s
            .state
            .compare_exchange_weak(v, v + 1, Ordering::AcqRel, Ordering::Acquire)
        {
            Ok(_) => {
                // SAFETY: a task of generation g is claimed and not yet counted done, so
                // its caller is still waiting with its job alive; `job` was read after
                // generation g was seen, and the caller stores the next job only after
                // every task of g is done, so it is g's job.
                ran += run_task(s, unsafe { &*job }, next(v));
                v = s.state.load(Ordering::Acquire);
            }
            Err(now) => v = now,
        }
    }
    ran
}

fn worker(s: &Shared, index: usize) {
    IN_TEAM.with(|t| t.set(true));
    let mut seen = 0u32;
    while let Some(v) = wait_for_op(s, seen) {
        seen = generation(v);
        // The job of generation `seen` or a later one (stored before the state); only
        // dereferenced while a task of `seen` this thread owns keeps the caller waiting.
        let job = s.job.load(Ordering::Acquire) as *const Job<'_>;
        let ran = if is_broadcast(v) {
            if index < tasks(v) {
                // SAFETY: the caller of a broadcast waits for every thread's task, this
                // one's included, so generation `seen`'s job is alive and still the
                // published one.
                run_task(s, unsafe { &*job }, index)
            } else {
                0
            }
        } else {
            claim_all(s, seen, job)
        };
        if ran > 0 {
            s.done.fetch_add(ran, Ordering::AcqRel);
        }
    }
}

/// Waits for a generation other than `seen`: spins for the team's spin time, then sleeps.
/// None when the team is being dropped.
fn wait_for_op(s: &Shared, seen: u32) -> Option<u64> {
    let start = Instant::now();
    let mut spins = 0u32;
    loop {
        let v = s.state.load(Ordering::Acquire);
        if generation(v) != seen {
            return Some(v);
        }
        if s.quit.load(Ordering::Relaxed) {
            return None;
        }
        spins = spins.wrapping_add(1);
        if !spins.is_multiple_of(256) || start.elapsed() < s.spin {
            std::hint::spin_loop();
            continue;
        }
        let mut g = lock(&s.lock);
        s.sleeping.fetch_add(1, Ordering::SeqCst);
        while generation(s.state.load(Ordering::SeqCst)) == seen && !s.quit.load(Ordering::SeqCst) {
            g = s.wake.wait(g).unwrap_or_else(|e| e.into_inner());
        }
        s.sleeping.fetch_sub(1, Ordering::SeqCst);
        drop(g);
        return if s.quit.load(Ordering::SeqCst) {
            None
        } else {
            Some(s.state.load(Ordering::Acquire))
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU32;

    #[test]
    fn every_task_runs_once_whatever_the_count() {
        for threads in [1, 2, 3, 5] {
            let t = Team::new(threads).expect("team");
            for n in [
                0,
                1,
                2,
                7,
                64,
                1000,
                MAX_TASKS,
                MAX_TASKS + 1,
                3 * MAX_TASKS + 17,
            ] {
                let hits: Vec<AtomicU32> = (0..n).map(|_| AtomicU32::new(0)).collect();
                t.for_each(n, &|i| {
                    hits[i].fetch_add(1, Ordering::Relaxed);
                });
                let wrong: Vec<usize> = (0..n)
                    .filter(|&i| hits[i].load(Ordering::Relaxed) != 1)
                    .collect();
                assert!(
                    wrong.is_empty(),
                    "{threads} threads, {n} tasks: {} not run once, first {:?}",
                    wrong.len(),
                    wrong.first()
                );
            }
        }
    }

    #[test]
    fn workers_share_the_tasks_and_wake_from_sleep() {
        // Workers that sleep at once (no spin) must be woken for each op: every task of an
        // op waits (up to 10 s, on a loaded machine) until a second thread has joined it.
        for spin in [Duration::ZERO, Duration::from_millis(5)] {
            let t = Team::with_spin(3, spin).expect("team");
            for op in 0..100 {
                let threads = Mutex::new(std::collections::HashSet::new());
                let start = Instant::now();
                t.for_each(4, &|_| {
                    lock(&threads).insert(std::thread::current().id());
                    while lock(&threads).len() < 2 && start.elapsed() < Duration::from_secs(10) {
                        std::thread::yield_now();
                    }
                });
                let used = lock(&threads).len();
                assert!(
                    used >= 2,
                    "spin {spin:?}, op {op}: the tasks ran on {used} thread(s)"
                );
                if op % 25 == 0 {
                    // A pause long enough for every worker to go to sleep.
                    std::thread::sleep(Duration::from_millis(20));
                }
            }
        }
    }

    #[test]
    fn a_broadcast_runs_once_on_every_thread() {
        let t = Team::with_spin(4, Duration::ZERO).expect("team");
        for _ in 0..50 {
            let seen = Mutex::new(Vec::new());
            t.broadcast(&|i| lock(&seen).push((i, std::thread::current().id())));
            let mut seen = lock(&seen).clone();
            seen.sort_by_key(|&(i, _)| i);
            let idx: Vec<usize> = seen.iter().map(|&(i, _)| i).collect();
            assert_eq!(idx, vec![0, 1, 2, 3]);
            let ids: std::collections::HashSet<_> = seen.iter().map(|&(_, id)| id).collect();
            assert_eq!(ids.len(), 4, "every index on its own thread");
            assert_eq!(
                seen[0].1,
                std::thread::current().id(),
                "index 0 is the caller"
            );
        }
    }

    #[test]
    fn a_panicking_task_reaches_the_caller_after_the_rest_ran_and_the_team_goes_on() {
        let t = Team::new(2).expect("team");
        for bad in [0, 13, 63] {
            let ran = AtomicU32::new(0);
            let r = catch_unwind(AssertUnwindSafe(|| {
                t.for_each(64, &|i| {
                    ran.fetch_add(1, Ordering::Relaxed);
                    assert!(i != bad, "task {i} fails");
                })
            }));
            let msg = r.expect_err("the panic is resumed on the caller");
            let msg = msg.downcast_ref::<String>().cloned().unwrap_or_default();
            assert_eq!(msg, format!("task {bad} fails"));
            assert_eq!(
                ran.load(Ordering::Relaxed),
                64,
                "every task ran before the resume"
            );
            let after = AtomicU32::new(0);
            t.for_each(100, &|_| {
                after.fetch_add(1, Ordering::Relaxed);
            });
            assert_eq!(after.load(Ordering::Relaxed), 100);
        }
    }

    #[test]
    fn an_op_inside_a_task_and_ops_from_two_threads_do_not_deadlock() {
        let t = Team::new(2).expect("team");
        let total = AtomicU32::new(0);
        t.for_each(8, &|_| {
            t.for_each(8, &|_| {
                total.fetch_add(1, Ordering::Relaxed);
            });
        });
        assert_eq!(total.load(Ordering::Relaxed), 64);
        let total = AtomicU32::new(0);
        std::thread::scope(|s| {
            for _ in 0..3 {
                s.spawn(|| {
                    for _ in 0..200 {
                        t.for_each(10, &|_| {
                            total.fetch_add(1, Ordering::Relaxed);
                        });
                    }
                });
            }
        });
        assert_eq!(total.load(Ordering::Relaxed), 3 * 200 * 10);
    }
}
