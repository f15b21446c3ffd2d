//! The io_uring reader: O_DIRECT reads into buffers registered with the ring (READ_FIXED),
//! or plain READs into staging slots for units stored as raw, up to `queue_depth` in
//! flight, and a poll on an eventfd so that messages from callers and workers wake the
//! thread that waits on the ring.

use super::reader::{EventFd, Msg, Reader};
use crate::hostbuf::AlignedBuf;
use io_uring::{opcode, types, IoUring};
use std::fs::File;
use std::os::fd::AsRawFd;
use std::sync::mpsc::Receiver;
use std::sync::Arc;
use std::time::Duration;

/// user_data of the eventfd poll; reads use their op index, which is far below.
const POLL_TAG: u64 = u64::MAX;
/// The kernel's limit on registered buffers (IORING_MAX_REG_BUFFERS).
const REGISTERED_BUFFERS_MAX: usize = 1 << 14;

pub(super) struct UringReader {
    ring: IoUring,
    file: File,
    eventfd: Arc<EventFd>,
    rearm: bool,
}

impl UringReader {
    pub(super) fn new(
        file: &File,
        bufs: &[AlignedBuf],
        queue_depth: usize,
    ) -> std::io::Result<(UringReader, Arc<EventFd>)> {
        if bufs.len() > REGISTERED_BUFFERS_MAX {
            return Err(std::io::Error::other(format!(
                "{} read buffers, io_uring registers at most {REGISTERED_BUFFERS_MAX}",
                bufs.len()
            )));
        }
        // One submission entry per read in flight, plus the eventfd poll.
        let entries = (queue_depth + 1).next_power_of_two() as u32;
        let ring = IoUring::builder().build(entries)?;
        // The loop's wait has a deadline (stalled reads are failed after `read_timeout`):
        // io_uring_enter takes one since Linux 5.11. Older kernels get the pread pool.
        if !ring.params().is_feature_ext_arg() {
            return Err(std::io::Error::other(
                "this kernel's io_uring has no timed wait (IORING_FEAT_EXT_ARG, Linux 5.11)",
            ));
        }
        let iovecs: Vec<libc::iovec> = bufs
            .iter()
            .map(|b| libc::iovec {
                iov_base: b.as_ptr() as *mut libc::c_void,
                iov_len: b.len(),
            })
            .collect();
        // SAFETY: the buffers outlive the ring: the engine thread owns both through the Loop,
        // the read buffers through an Arc that is dropped after the ring.
        // No read buffers (a store read straight into its staging slots): nothing to register.
        if !iovecs.is_empty() {
            unsafe { ring.submitter().register_buffers(&iovecs) }.map_err(|e| {
            if e.raw_os_error() == Some(libc::ENOMEM) || e.raw_os_error() == Some(libc::EPERM) {
                std::io::Error::new(e.kind(), format!("registering {} MiB of read buffers: {e}; raise the memory-lock limit (LimitMEMLOCK=infinity in the unit file, or ulimit -l)", iovecs.iter().map(|v| v.iov_len).sum::<usize>() >> 20))
            } else {
                e
            }
        })?;
        }
        let eventfd = Arc::new(EventFd::new()?);
        let mut r = UringReader {
            ring,
            file: file.try_clone()?,
            eventfd: eventfd.clone(),
            rearm: true,
        };
        r.arm_poll()?;
        Ok((r, eventfd))
    }

    fn arm_poll(&mut self) -> std::io::Result<()> {
        let e = opcode::PollAdd::new(types::Fd(self.eventfd.0.as_raw_fd()), libc::POLLIN as u32)
            .build()
            .user_data(POLL_TAG);
        self.push_entry(&e)?;
        self.rearm = false;
        Ok(())
    }

    fn push_entry(&mut self, e: &io_uring::squeue::Entry) -> std::io::Result<()> {
        // SAFETY: every entry we push references either the eventfd (alive as long as the
        // reader) or a registered buffer region that the engine keeps for the op until its
        // completion is reaped.
        if unsafe { self.ring.submission().push(e) }.is_err() {
            self.ring.submit()?;
            // SAFETY: as above.
            unsafe { self.ring.submission().push(e) }
                .map_err(|_| std::io::Error::other("submission queue full after submit"))?;
        }
        Ok(())
    }
}

impl Reader for UringReader {
    fn push(
        &mut self,
        op: usize,
        buf: Option<usize>,
        ptr: *mut u8,
        len: usize,
        offset: u64,
    ) -> std::io::Result<()> {
        let fd = types::Fd(self.file.as_raw_fd());
        let e = match buf {
            Some(b) => opcode::ReadFixed::new(fd, ptr, len as u32, b as u16)
                .offset(offset)
                .build(),
            // A staging slot: not registered (it may be large, and is page-locked by the
            // device where that matters), so a plain read.
            None => opcode::Read::new(fd, ptr, len as u32)
                .offset(offset)
                .build(),
        }
        .user_data(op as u64);
        self.push_entry(&e)
    }

    fn wait(
        &mut self,
        rx: &Receiver<Msg>,
        msgs: &mut Vec<Msg>,
        done: &mut Vec<(usize, i32)>,
        timeout: Option<Duration>,
    ) -> std::io::Result<()> {
        if self.rearm {
            self.arm_poll()?;
        }
        let ts = timeout.map(types::Timespec::from);
        loop {
            let r = match &ts {
                None => self.ring.submit_and_wait(1),
                Some(ts) => {
                    let args = types::SubmitArgs::new().timespec(ts);
                    self.ring.submitter().submit_with_args(1, &args)
                }
            };
            match r {
                Ok(_) => break,
                Err(e) if e.raw_os_error() == Some(libc::EINTR) => continue,
                // The deadline passed with nothing to reap.
                Err(e) if e.raw_os_error() == Some(libc::ETIME) => break,
                // Completion queue full: reap below, then carry on.
                Err(e) if e.raw_os_error() == Some(libc::EBUSY) => break,
                Err(e) => return Err(e),
            }
        }
        for cqe in self.ring.completion() {
            if cqe.user_data() == POLL_TAG {
                self.eventfd.drain();
                self.rearm = true;
            } else {
                done.push((cqe.user_data() as usize, cqe.result()));
            }
        }
        // Messages are drained after the eventfd was reset: one sent after this point
        // signals the eventfd again, and the re-armed poll fires at once.
        while let Ok(m) = rx.try_recv() {
            msgs.push(m);
        }
        Ok(())
    }
}
