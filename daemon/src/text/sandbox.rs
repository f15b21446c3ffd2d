//! Chat templates rendered out of process, under a memory limit. A template comes from the
//! model file, which may be hostile, and minijinja bounds its instructions, its nesting and
//! (see `ChatTemplate::render`) its output, but not the strings it builds on the way:
//! `{% set s = s ~ s %}` thirty times asks for gigabytes in a few instructions. Nothing
//! inside a process can refuse that allocation without aborting, so the daemon renders in
//! a worker process (`sluiced template-worker`) whose address space is capped by
//! RLIMIT_AS: a template that asks for more kills only the worker, its request gets an
//! error saying why, and the next render starts a fresh worker.
//!
//! The wire is a pipe each way: a little-endian u32 length, then that many bytes of JSON.

use super::template::{ChatTemplate, RenderJob, Renderer, TemplateError};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::io::{BufReader, Read, Write};
use std::path::PathBuf;
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::Mutex;

/// Address space of the worker: its binary and heap are tens of MiB; a render's strings
/// are bounded by what is left.
pub const WORKER_ADDRESS_SPACE: u64 = 1 << 30;
/// The subcommand of `sluiced` that runs the worker.
pub const WORKER_COMMAND: &str = "template-worker";
/// A request or an answer larger than this is refused (the request body limit is MiBs).
const FRAME_MAX: usize = 256 << 20;

#[derive(Serialize, Deserialize)]
enum Answer {
    Text(String),
    Error(String),
}

fn write_frame(w: &mut impl Write, bytes: &[u8]) -> std::io::Result<()> {
    let n = u32::try_from(bytes.len())
        .ok()
        .filter(|&n| n as usize <= FRAME_MAX)
        .ok_or_else(|| std::io::Error::other("frame too large"))?;
    w.write_all(&n.to_le_bytes())?;
    w.write_all(bytes)?;
    w.flush()
}

/// One frame, or None at a clean end of the stream.
fn read_frame(r: &mut impl Read) -> std::io::Result<Option<Vec<u8>>> {
    let mut n = [0u8; 4];
    match r.read_exact(&mut n) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e),
    }
    let n = u32::from_le_bytes(n) as usize;
    if n > FRAME_MAX {
        return Err(std::io::Error::other(format!("frame of {n} bytes")));
    }
    let mut b = vec![0u8; n];
    r.read_exact(&mut b)?;
    Ok(Some(b))
}

/// The worker: caps its address space, then renders jobs from stdin until it closes.
/// Templates are compiled once per distinct (source, bos, eos).
pub fn worker_main() -> Result<(), String> {
    let lim = libc::rlimit {
        rlim_cur: WORKER_ADDRESS_SPACE,
        rlim_max: WORKER_ADDRESS_SPACE,
    };
    // SAFETY: plain syscall on a live struct.
    if unsafe { libc::setrlimit(libc::RLIMIT_AS, &lim) } != 0 {
        return Err(format!(
            "setrlimit(RLIMIT_AS): {}",
            std::io::Error::last_os_error()
        ));
    }
    let (mut input, mut output) = (std::io::stdin().lock(), std::io::stdout().lock());
    let mut compiled: HashMap<(String, String, String), ChatTemplate> = HashMap::new();
    while let Some(frame) = read_frame(&mut input).map_err(|e| e.to_string())? {
        let answer = match serde_json::from_slice::<RenderJob>(&frame) {
            Err(e) => Answer::Error(format!("bad request to the template worker: {e}")),
            Ok(job) => {
                let key = (
                    job.source.into_owned(),
                    job.bos.into_owned(),
                    job.eos.into_owned(),
                );
                if !compiled.contains_key(&key) {
                    if compiled.len() >= 16 {
                        compiled.clear();
                    }
                    match ChatTemplate::new(&key.0, key.1.clone(), key.2.clone()) {
                        Ok(t) => {
                            compiled.insert(key.clone(), t);
                        }
                        Err(e) => {
                            let a = Answer::Error(e.to_string());
                            write_answer(&mut output, &a)?;
                            continue;
                        }
                    }
                }
                let rendered = compiled.get_mut(&key).map(|t| {
                    t.set_vars(job.vars.into_owned());
                    t.render_with_tools(&job.messages, &job.tools, job.add_generation_prompt)
                });
                match rendered {
                    Some(r) => match r {
                        Ok(s) => Answer::Text(s),
                        Err(e) => Answer::Error(e.to_string()),
                    },
                    None => Answer::Error("template cache lost its entry".into()),
                }
            }
        };
        write_answer(&mut output, &answer)?;
    }
    Ok(())
}

fn write_answer(w: &mut impl Write, a: &Answer) -> Result<(), String> {
    let b = serde_json::to_vec(a).map_err(|e| e.to_string())?;
    write_frame(w, &b).map_err(|e| e.to_string())
}

struct Worker {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
}

/// The daemon's side: one worker, started on first use and again after it dies; renders
/// take turns (one takes well under a millisecond).
pub struct TemplateSandbox {
    exe: PathBuf,
    worker: Mutex<Option<Worker>>,
}

impl TemplateSandbox {
    /// `exe` is a `sluiced` binary (the daemon passes its own).
    pub fn new(exe: PathBuf) -> TemplateSandbox {
        TemplateSandbox {
            exe,
            worker: Mutex::new(None),
        }
    }

    fn spawn(&self) -> Result<Worker, TemplateError> {
        let mut child = Command::new(&self.exe)
            .arg(WORKER_COMMAND)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .env("RUST_LOG", "error")
            .env("RUST_BACKTRACE", "0")
            .spawn()
            .map_err(|e| {
                TemplateError::new(format!(
                    "cannot start the template worker {}: {e}",
                    self.exe.display()
                ))
            })?;
        match (child.stdin.take(), child.stdout.take()) {
            (Some(stdin), Some(stdout)) => Ok(Worker {
                child,
                stdin,
                stdout: BufReader::new(stdout),
            }),
            _ => {
                let _ = child.kill();
                let _ = child.wait();
                Err(TemplateError::new("the template worker has no pipes"))
            }
        }
    }
}

impl Renderer for TemplateSandbox {
    fn render(&self, job: &RenderJob<'_>) -> Result<String, TemplateError> {
        let job = serde_json::to_vec(job).map_err(|e| TemplateError::new(e.to_string()))?;
        let mut slot = self
            .worker
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if slot.is_none() {
            *slot = Some(self.spawn()?);
        }
        let Some(w) = slot.as_mut() else {
            return Err(TemplateError::new("the template worker did not start"));
        };
        let exchanged = write_frame(&mut w.stdin, &job).and_then(|()| read_frame(&mut w.stdout));
        match exchanged {
            Ok(Some(b)) => match serde_json::from_slice::<Answer>(&b) {
                Ok(Answer::Text(s)) => Ok(s),
                Ok(Answer::Error(e)) => Err(TemplateError::new(
                    e.strip_prefix("chat template: ").unwrap_or(&e).to_string(),
                )),
                Err(e) => Err(TemplateError::new(format!(
                    "the template worker answered nonsense: {e}"
                ))),
            },
            // The worker died: a template that asked for more memory than it has, most
            // likely. Reap it; the next render starts another.
            Ok(None) | Err(_) => {
                let Some(mut w) = slot.take() else {
                    return Err(TemplateError::new("the template worker is gone"));
                };
                drop(w.stdin);
                let _ = w.child.kill();
                let how = match w.child.wait() {
                    Ok(s) => s.to_string(),
                    Err(e) => e.to_string(),
                };
                tracing::warn!("the chat template worker died rendering a request ({how}); the next render starts another");
                Err(TemplateError::new(format!(
                    "rendering took more than the {} MiB its worker process may use, and was stopped ({how}): is the model's chat template hostile?",
                    WORKER_ADDRESS_SPACE >> 20
                )))
            }
        }
    }
}

impl Drop for TemplateSandbox {
    fn drop(&mut self) {
        let slot = self
            .worker
            .get_mut()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(mut w) = slot.take() {
            // Closing stdin ends the worker's loop.
            drop(w.stdin);
            let _ = w.child.wait();
        }
    }
}
