//! The fallback reader: a pool of threads doing pread, for when io_uring is unavailable
//! (seccomp, kernel.io_uring_disabled, old kernels) or O_DIRECT is refused. Completions come
//! back as messages, so the engine loop is the same for both readers.

use super::reader::{Msg, Reader, Target, Waker};
use std::fs::File;
use std::os::fd::AsRawFd;
use std::sync::mpsc::{sync_channel, Receiver, RecvTimeoutError, SyncSender};
use std::sync::{Arc, Mutex};
use std::time::Duration;

struct ReadJob {
    op: usize,
    ptr: usize,
    len: usize,
    offset: u64,
}

pub(super) struct PreadReader {
    jobs: SyncSender<ReadJob>,
}

impl PreadReader {
    pub(super) fn new(
        file: &File,
        threads: usize,
        queue_depth: usize,
        waker: Waker,
    ) -> std::io::Result<(PreadReader, Vec<std::thread::JoinHandle<()>>)> {
        let file = Arc::new(file.try_clone()?);
        // At most `queue_depth` reads are in flight: the queue never fills.
        let (tx, rx) = sync_channel::<ReadJob>(queue_depth);
        let rx = Arc::new(Mutex::new(rx));
        let mut handles = Vec::with_capacity(threads);
        for i in 0..threads {
            let (file, rx, waker) = (file.clone(), rx.clone(), waker.clone());
            handles.push(
                std::thread::Builder::new()
                    .name(format!("sluice-pread-{i}"))
                    .spawn(move || loop {
                        let job = match rx
                            .lock()
                            .unwrap_or_else(std::sync::PoisonError::into_inner)
                            .recv()
                        {
                            Ok(j) => j,
                            Err(_) => return,
                        };
                        // SAFETY: the engine keeps the target buffer region alive and untouched until
                        // this op's completion is handled; ptr/len lie inside one read buffer.
                        let n = unsafe {
                            libc::pread(
                                file.as_raw_fd(),
                                job.ptr as *mut libc::c_void,
                                job.len,
                                job.offset as libc::off_t,
                            )
                        };
                        if n > 0 {
                            // Without O_DIRECT the pages stay cached and charged to this
                            // process's memory cgroup: drop them (no-op under O_DIRECT).
                            // SAFETY: advice on our own descriptor; changes no memory.
                            unsafe {
                                libc::posix_fadvise(
                                    file.as_raw_fd(),
                                    job.offset as libc::off_t,
                                    n as libc::off_t,
                                    libc::POSIX_FADV_DONTNEED,
                                );
                            }
                        }
                        let res = if n < 0 {
                            -std::io::Error::last_os_error()
                                .raw_os_error()
                                .unwrap_or(libc::EIO)
                        } else {
                            n as i32
                        };
                        waker.send(Msg::ReadDone { op: job.op, res });
                    })?,
            );
        }
        Ok((PreadReader { jobs: tx }, handles))
    }
}

impl Reader for PreadReader {
    fn push(
        &mut self,
        op: usize,
        _target: Target,
        ptr: *mut u8,
        len: usize,
        offset: u64,
    ) -> std::io::Result<()> {
        self.jobs
            .send(ReadJob {
                op,
                ptr: ptr as usize,
                len,
                offset,
            })
            .map_err(|_| std::io::Error::other("pread pool stopped"))
    }

    fn wait(
        &mut self,
        rx: &Receiver<Msg>,
        msgs: &mut Vec<Msg>,
        _done: &mut Vec<(usize, i32)>,
        timeout: Option<Duration>,
    ) -> std::io::Result<()> {
        let closed = || std::io::Error::other("engine channel closed");
        let m = match timeout {
            None => rx.recv().map_err(|_| closed())?,
            Some(t) => match rx.recv_timeout(t) {
                Ok(m) => m,
                Err(RecvTimeoutError::Timeout) => return Ok(()),
                Err(RecvTimeoutError::Disconnected) => return Err(closed()),
            },
        };
        msgs.push(m);
        while let Ok(m) = rx.try_recv() {
            msgs.push(m);
        }
        Ok(())
    }
}
