//! Fault injection under the I/O engine, for testing what the daemon does when the disk
//! misbehaves: a reader that wraps the real one (io_uring or the pread pool) and, per read,
//! fails it with EIO, cuts it short, or holds its completion back for a while.
//!
//! Off unless `SLUICE_FAULTS` names a control file when the engine starts. The file holds
//! the faults in effect, as `key=value` words, and is read again at most every 20 ms, so a
//! test turns faults on and off under a running daemon by rewriting it:
//!
//! ```text
//! eio=0.05 short=0.2 stall=0.01 stall_ms=3000 seed=7
//! ```
//!
//! `eio`, `short` and `stall` are the chances (0 to 1) that one read gets that fault; an
//! empty or missing file injects nothing. A short read returns half its bytes (rounded to
//! 4096, as O_DIRECT needs); a stalled read completes `stall_ms` after the disk answered.

use super::reader::{Msg, Reader, Target};
use crate::hostbuf::IO_ALIGN;
use crate::util::rng::Rng;
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::mpsc::Receiver;
use std::time::{Duration, Instant};

/// The environment variable naming the control file.
pub(super) const ENV: &str = "SLUICE_FAULTS";
/// How often the control file is read again.
const REREAD: Duration = Duration::from_millis(20);

#[derive(Clone, Debug, Default, PartialEq)]
struct Faults {
    eio: f64,
    short: f64,
    stall: f64,
    stall_for: Duration,
}

impl Faults {
    fn parse(text: &str) -> Result<(Faults, Option<u64>), String> {
        let mut f = Faults {
            stall_for: Duration::from_secs(3),
            ..Faults::default()
        };
        let mut seed = None;
        for word in text.split([' ', ',', '\n', '\t']).filter(|w| !w.is_empty()) {
            let (k, v) = word
                .split_once('=')
                .ok_or_else(|| format!("{word:?}: want key=value"))?;
            let num = |v: &str| -> Result<f64, String> {
                v.parse::<f64>()
                    .ok()
                    .filter(|x| x.is_finite() && *x >= 0.0)
                    .ok_or_else(|| format!("{k}={v}: want a number"))
            };
            let chance = |v: &str| -> Result<f64, String> {
                num(v).and_then(|x| {
                    (x <= 1.0)
                        .then_some(x)
                        .ok_or_else(|| format!("{k}={v}: a chance is between 0 and 1"))
                })
            };
            match k {
                "eio" => f.eio = chance(v)?,
                "short" => f.short = chance(v)?,
                "stall" => f.stall = chance(v)?,
                "stall_ms" => f.stall_for = Duration::from_secs_f64(num(v)?.min(3.6e6) / 1e3),
                "seed" => seed = Some(num(v)? as u64),
                _ => {
                    return Err(format!(
                        "{k:?}: known faults are eio, short, stall, stall_ms, seed"
                    ))
                }
            }
        }
        Ok((f, seed))
    }
}

/// The control file and what it said when last read.
struct Control {
    path: PathBuf,
    read_at: Option<Instant>,
    text: String,
    faults: Faults,
}

impl Control {
    fn refresh(&mut self, rng: &mut Rng) {
        if self.read_at.is_some_and(|t| t.elapsed() < REREAD) {
            return;
        }
        self.read_at = Some(Instant::now());
        let text = std::fs::read_to_string(&self.path).unwrap_or_default();
        if text == self.text {
            return;
        }
        match Faults::parse(&text) {
            Ok((f, seed)) => {
                tracing::warn!(file = %self.path.display(), "injected I/O faults now: {f:?}");
                if let Some(s) = seed {
                    *rng = Rng::new(s);
                }
                self.faults = f;
            }
            Err(e) => {
                tracing::warn!(file = %self.path.display(), "fault control file ignored: {e}");
                self.faults = Faults::default();
            }
        }
        self.text = text;
    }
}

pub(super) struct FaultyReader {
    inner: Box<dyn Reader>,
    control: Control,
    rng: Rng,
    /// Reads failed at submission: their completions, for the next wait.
    failed: Vec<(usize, i32)>,
    /// Reads to hold back when the disk answers them, and for how long.
    to_stall: HashMap<usize, Duration>,
    /// Completions held back, and when each is delivered.
    held: Vec<(Instant, usize, i32)>,
}

impl FaultyReader {
    /// Wraps `inner` when `SLUICE_FAULTS` is set.
    pub(super) fn wrap(inner: Box<dyn Reader>) -> Box<dyn Reader> {
        let Some(path) = std::env::var_os(ENV).filter(|p| !p.is_empty()) else {
            return inner;
        };
        let path = PathBuf::from(path);
        tracing::warn!(
            file = %path.display(),
            "{ENV} is set: the I/O engine injects the faults this file names (a test setting)"
        );
        Box::new(FaultyReader {
            inner,
            control: Control {
                path,
                read_at: None,
                text: String::new(),
                faults: Faults::default(),
            },
            rng: Rng::new(1),
            failed: Vec::new(),
            to_stall: HashMap::new(),
            held: Vec::new(),
        })
    }

    /// Moves the completions that are due into `done`.
    fn deliver(&mut self, done: &mut Vec<(usize, i32)>) {
        done.append(&mut self.failed);
        let now = Instant::now();
        self.held.retain(|&(at, op, res)| {
            if at <= now {
                done.push((op, res));
                false
            } else {
                true
            }
        });
    }
}

impl Reader for FaultyReader {
    fn push(
        &mut self,
        op: usize,
        target: Target,
        ptr: *mut u8,
        len: usize,
        offset: u64,
    ) -> std::io::Result<()> {
        self.control.refresh(&mut self.rng);
        let f = self.control.faults.clone();
        if self.rng.chance(f.eio) {
            tracing::info!(offset, len, "injected EIO");
            self.failed.push((op, -libc::EIO));
            return Ok(());
        }
        let mut len = len;
        let half = len / 2 / IO_ALIGN * IO_ALIGN;
        if half > 0 && self.rng.chance(f.short) {
            len = half;
        }
        if self.rng.chance(f.stall) {
            tracing::info!(offset, len, "injected stall of {:?}", f.stall_for);
            self.to_stall.insert(op, f.stall_for);
        }
        self.inner.push(op, target, ptr, len, offset)
    }

    fn wait(
        &mut self,
        rx: &Receiver<Msg>,
        msgs: &mut Vec<Msg>,
        done: &mut Vec<(usize, i32)>,
        timeout: Option<Duration>,
    ) -> std::io::Result<()> {
        let before = done.len();
        self.deliver(done);
        if done.len() > before {
            while let Ok(m) = rx.try_recv() {
                msgs.push(m);
            }
            return Ok(());
        }
        let next_held = self
            .held
            .iter()
            .map(|&(at, _, _)| at.saturating_duration_since(Instant::now()))
            .min();
        let timeout = match (timeout, next_held) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        let from = done.len();
        self.inner.wait(rx, msgs, done, timeout)?;
        let now = Instant::now();
        let mut k = from;
        while k < done.len() {
            let (op, res) = done[k];
            match self.to_stall.remove(&op) {
                Some(d) => {
                    self.held.push((now + d, op, res));
                    done.swap_remove(k);
                }
                None => k += 1,
            }
        }
        self.deliver(done);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_control_file_grammar_is_checked() {
        let (f, seed) =
            Faults::parse("eio=0.5, short=1 stall=0.25 stall_ms=1500 seed=3\n").expect("parse");
        assert_eq!(
            f,
            Faults {
                eio: 0.5,
                short: 1.0,
                stall: 0.25,
                stall_for: Duration::from_millis(1500)
            }
        );
        assert_eq!(seed, Some(3));
        assert_eq!(Faults::parse("").expect("empty").0.eio, 0.0);
        for bad in ["eio=2", "eio", "short=-1", "flood=1", "stall=x"] {
            assert!(Faults::parse(bad).is_err(), "{bad} was accepted");
        }
    }

    #[test]
    fn chances_land_near_their_rate() {
        let mut r = Rng::new(9);
        let hits = (0..100_000).filter(|_| r.chance(0.1)).count();
        assert!((9_000..11_000).contains(&hits), "{hits}");
        assert!(!(0..1000).any(|_| r.chance(0.0)));
        assert!((0..1000).all(|_| r.chance(1.0)));
    }
}
