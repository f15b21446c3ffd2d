//! Whole small files read at once, for the prefix cache's disk tier: each file opened with
//! O_DIRECT where its file system takes it (`open_direct`), read into an aligned buffer,
//! all the reads in flight together on one io_uring; a pread each where io_uring is
//! unavailable (seccomp, `kernel.io_uring_disabled`).

use super::api::open_direct;
use crate::hostbuf::AlignedBuf;
use io_uring::{opcode, types, IoUring};
use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::PathBuf;

/// How the last `read_files` read: "io_uring" or "pread", and with O_DIRECT or not.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ReadWay {
    pub uring: bool,
    pub direct: bool,
}

struct Open {
    file: File,
    buf: AlignedBuf,
    len: usize,
}

fn open_one(path: &std::path::Path) -> std::io::Result<(Open, bool)> {
    let (file, direct) = open_direct(path)?;
    let len = file.metadata()?.len() as usize;
    let buf = AlignedBuf::new(len.next_multiple_of(4096).max(4096))
        .ok_or_else(|| std::io::Error::other("out of memory for a read buffer"))?;
    Ok((Open { file, buf, len }, direct))
}

/// Reads each of `paths` whole; per file its bytes or the error (a file that fails does not
/// fail the others).
pub fn read_files(paths: &[PathBuf]) -> (Vec<std::io::Result<Vec<u8>>>, ReadWay) {
    let mut way = ReadWay::default();
    let mut open: Vec<std::io::Result<Open>> = paths
        .iter()
        .map(|p| {
            open_one(p).map(|(o, d)| {
                way.direct |= d;
                o
            })
        })
        .collect();
    let mut done: Vec<Option<std::io::Result<usize>>> = (0..paths.len()).map(|_| None).collect();
    let live: Vec<usize> = (0..open.len()).filter(|&i| open[i].is_ok()).collect();
    if !live.is_empty() {
        way.uring = uring_reads(&mut open, &live, &mut done).is_ok();
    }
    let out = open
        .into_iter()
        .zip(done)
        .map(|(o, d)| {
            let mut o = o?;
            let n = match d {
                Some(r) => r?,
                // Not read by io_uring: a pread.
                None => pread_all(&o.file, o.buf.as_mut_slice())?,
            };
            if n < o.len {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::UnexpectedEof,
                    format!("read {n} of {} bytes", o.len),
                ));
            }
            Ok(o.buf.as_slice()[..o.len].to_vec())
        })
        .collect();
    (out, way)
}

fn pread_all(file: &File, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut at = 0;
    while at < buf.len() {
        match std::os::unix::fs::FileExt::read_at(file, &mut buf[at..], at as u64)? {
            0 => break,
            n => at += n,
        }
    }
    Ok(at)
}

/// Reads the `live` files on one ring, all in flight together. Err: io_uring is not
/// available (the caller preads); a read's own failure is its `done` entry.
fn uring_reads(
    open: &mut [std::io::Result<Open>],
    live: &[usize],
    done: &mut [Option<std::io::Result<usize>>],
) -> std::io::Result<()> {
    let entries = live.len().next_power_of_two().clamp(1, 256) as u32;
    let mut ring: IoUring = IoUring::builder().build(entries)?;
    for part in live.chunks(entries as usize) {
        for &i in part {
            let Ok(o) = &mut open[i] else { continue };
            let read = opcode::Read::new(
                types::Fd(o.file.as_raw_fd()),
                o.buf.as_ptr(),
                o.buf.len() as u32,
            )
            .offset(0)
            .build()
            .user_data(i as u64);
            // SAFETY: the buffer and the file outlive the ring's use of them: every entry
            // is waited for below before this function returns.
            unsafe { ring.submission().push(&read) }
                .map_err(|_| std::io::Error::other("io_uring submission queue full"))?;
        }
        let mut left = part.len();
        while left > 0 {
            match ring.submit_and_wait(1) {
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                r => r?,
            };
            for c in ring.completion() {
                let i = c.user_data() as usize;
                let r = c.result();
                done[i] = Some(if r < 0 {
                    Err(std::io::Error::from_raw_os_error(-r))
                } else {
                    Ok(r as usize)
                });
                left -= 1;
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn files_are_read_whole_and_a_missing_one_fails_alone() {
        let dir = std::env::temp_dir().join(format!("sluice-read-files-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let a: Vec<u8> = (0..12288u32).map(|i| (i * 7) as u8).collect();
        let b: Vec<u8> = (0..5000u32).map(|i| (i * 3) as u8).collect();
        std::fs::write(dir.join("a"), &a).unwrap();
        std::fs::write(dir.join("b"), &b).unwrap();
        let paths = [dir.join("a"), dir.join("missing"), dir.join("b")];
        let (r, _) = read_files(&paths);
        assert_eq!(r[0].as_ref().unwrap(), &a);
        assert!(r[1].is_err());
        assert_eq!(r[2].as_ref().unwrap(), &b);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
