//! A file written front to back without the page cache (Linux `O_DIRECT`), for captures of many
//! gigabytes: the kernel then moves the data from this process's buffer to the disk instead of
//! copying it into cached pages first. Measured on this project's virtual machine, that copy cost
//! a quarter of all CPU time of a 2,214-token capture (6.6 GB; `copy_folio_from_iter_atomic`),
//! about as much as the forward's attention and norms together.
//!
//! `O_DIRECT` wants whole blocks at block-aligned offsets from block-aligned memory, so the data
//! goes through an aligned buffer and leaves it in whole multiples of [`BLOCK`]; the last partial
//! block is padded, written, and the file then cut to its true length. Where the file system does
//! not take `O_DIRECT` (tmpfs, some network file systems, other systems than Linux), the same
//! writes go through the page cache as usual.

use std::fs::File;
use std::io::{Seek, SeekFrom, Write};

/// Alignment of offsets, lengths and memory (the largest logical block size in common use).
pub const BLOCK: usize = 4096;
/// Bytes gathered before each write: large enough that a write costs little beside its data.
const CAPACITY: usize = 16 << 20;

/// See the module documentation. Writes only at the end (no seeking back), as a safetensors file
/// is written.
pub struct DirectFile {
    file: File,
    raw: Vec<u8>,
    off: usize,
    /// bytes gathered in the buffer
    len: usize,
    /// file offset of the buffer's first byte
    pos: u64,
    direct: bool,
    /// bytes written straight from the caller's memory
    uncopied: u64,
}

impl DirectFile {
    /// Takes over `file` (empty, open for writing), switching it to `O_DIRECT` where it can.
    pub fn new(file: File) -> DirectFile {
        let raw = vec![0u8; CAPACITY + BLOCK];
        let off = (BLOCK - raw.as_ptr() as usize % BLOCK) % BLOCK;
        let direct = set_direct(&file, true);
        DirectFile {
            file,
            raw,
            off,
            len: 0,
            pos: 0,
            direct,
            uncopied: 0,
        }
    }

    /// Whether the writes bypass the page cache.
    pub fn is_direct(&self) -> bool {
        self.direct
    }

    /// Bytes written straight from the caller's memory, without a copy into the buffer.
    pub fn uncopied(&self) -> u64 {
        self.uncopied
    }

    fn buf(&mut self) -> &mut [u8] {
        &mut self.raw[self.off..self.off + CAPACITY]
    }

    /// Writes the first `n` gathered bytes (`n` a multiple of [`BLOCK`] when direct) at `pos`.
    fn write_out(&mut self, n: usize) -> std::io::Result<()> {
        let data = &self.raw[self.off..self.off + n];
        write_at(&self.file, &mut self.direct, data, self.pos)
    }

    /// Writes what is left and cuts the file to the bytes written; returns the file.
    pub fn finish(mut self) -> std::io::Result<File> {
        let n = self.len;
        if n > 0 {
            if self.direct {
                let padded = n.next_multiple_of(BLOCK);
                self.buf()[n..padded].fill(0);
                self.write_out(padded)?;
            } else {
                self.write_out(n)?;
            }
        }
        let end = self.pos + n as u64;
        set_direct(&self.file, false);
        self.file.set_len(end)?;
        self.file.seek(SeekFrom::Start(end))?;
        Ok(self.file)
    }
}

/// Writes `data` at `at` (block-aligned memory, offset and length while `direct`); where the file
/// system refuses `O_DIRECT` after all, turns it off and writes through the cache.
fn write_at(file: &File, direct: &mut bool, data: &[u8], at: u64) -> std::io::Result<()> {
    use std::os::unix::fs::FileExt;
    match file.write_all_at(data, at) {
        Err(e) if *direct && e.raw_os_error() == Some(libc::EINVAL) => {
            *direct = false;
            set_direct(file, false);
            file.write_all_at(data, at)
        }
        r => r,
    }
}

impl Write for DirectFile {
    fn write(&mut self, data: &[u8]) -> std::io::Result<usize> {
        // Large data whose address has the phase of its place in the file: the few bytes up to
        // the file's next block boundary go through the buffer (then written out whole), the
        // whole blocks after them straight from the caller's memory, without a copy (at 2,048
        // tokens, 5.6 GB a capture no longer copies)
        if self.direct && data.len() >= 4 * BLOCK {
            let at = self.pos as usize + self.len;
            let head = (BLOCK - at % BLOCK) % BLOCK;
            let body = (data.len() - head) / BLOCK * BLOCK;
            if (data.as_ptr() as usize + head).is_multiple_of(BLOCK) && self.len + head <= CAPACITY
            {
                let len = self.len;
                self.buf()[len..len + head].copy_from_slice(&data[..head]);
                self.len += head;
                if self.len > 0 {
                    self.write_out(self.len)?;
                    self.pos += self.len as u64;
                    self.len = 0;
                }
                if self.direct {
                    write_at(
                        &self.file,
                        &mut self.direct,
                        &data[head..head + body],
                        self.pos,
                    )?;
                    self.pos += body as u64;
                    self.uncopied += body as u64;
                    return Ok(head + body);
                }
                // the file system refused O_DIRECT just now: the rest goes the plain way
                return Ok(head);
            }
        }
        let take = data.len().min(CAPACITY - self.len);
        let len = self.len;
        self.buf()[len..len + take].copy_from_slice(&data[..take]);
        self.len += take;
        if self.len == CAPACITY {
            self.write_out(CAPACITY)?;
            self.pos += CAPACITY as u64;
            self.len = 0;
        }
        Ok(take)
    }

    /// Nothing to do: whole blocks are written as they fill, the rest by [`DirectFile::finish`].
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Seek for DirectFile {
    /// Only the current position can be asked for (the file is written front to back).
    fn seek(&mut self, to: SeekFrom) -> std::io::Result<u64> {
        match to {
            SeekFrom::Current(0) => Ok(self.pos + self.len as u64),
            _ => Err(std::io::Error::new(
                std::io::ErrorKind::Unsupported,
                "a direct capture file is written front to back",
            )),
        }
    }
}

/// Turns `O_DIRECT` on or off for an open file; whether it is now on.
#[cfg(target_os = "linux")]
fn set_direct(file: &File, on: bool) -> bool {
    use std::os::fd::AsRawFd;
    let fd = file.as_raw_fd();
    // SAFETY: fcntl on a file descriptor this process owns, integer arguments only.
    unsafe {
        let flags = libc::fcntl(fd, libc::F_GETFL);
        if flags < 0 {
            return false;
        }
        let want = if on {
            flags | libc::O_DIRECT
        } else {
            flags & !libc::O_DIRECT
        };
        libc::fcntl(fd, libc::F_SETFL, want) == 0 && on
    }
}

#[cfg(not(target_os = "linux"))]
fn set_direct(_: &File, _: bool) -> bool {
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Sizes around the block and the buffer: the file holds exactly the bytes written, in
    /// order, whether the directory's file system takes O_DIRECT or not.
    #[test]
    fn the_file_holds_exactly_what_was_written() {
        // the temporary folder, and shared memory (tmpfs, which older kernels refuse O_DIRECT on)
        let mut dirs = vec![tempfile::tempdir().unwrap()];
        if std::path::Path::new("/dev/shm").is_dir() {
            dirs.push(tempfile::tempdir_in("/dev/shm").unwrap());
        }
        let mut seen_direct = false;
        for (i, &total) in [
            0usize,
            1,
            4095,
            4096,
            4097,
            CAPACITY - 3,
            CAPACITY + 5000,
            2 * CAPACITY + 1,
        ]
        .iter()
        .enumerate()
        {
            for d in dirs.iter().map(|d| d.path()) {
                let path = d.join(format!("f{i}"));
                let mut w = DirectFile::new(File::create(&path).unwrap());
                seen_direct |= w.is_direct();
                let data: Vec<u8> = (0..total).map(|j| (j * 31 + j / 4096) as u8).collect();
                // uneven pieces, as a header then tensors arrive
                let mut at = 0;
                let mut piece = 7;
                while at < total {
                    let end = (at + piece).min(total);
                    w.write_all(&data[at..end]).unwrap();
                    assert_eq!(w.stream_position().unwrap(), end as u64);
                    at = end;
                    piece = piece * 3 + 1;
                }
                assert!(w.seek(SeekFrom::Start(0)).is_err());
                let f = w.finish().unwrap();
                drop(f);
                let back = std::fs::read(&path).unwrap();
                assert_eq!(back.len(), total, "{total} bytes in {}", d.display());
                assert!(
                    back == data,
                    "{total} bytes in {}: contents differ",
                    d.display()
                );
            }
        }
        eprintln!("O_DIRECT taken by one of the test folders' file systems: {seen_direct}");
    }

    /// Large pieces whose address has the phase of their place in the file are written from
    /// the caller's memory (a capture's tensors after a header padded to match); others, and
    /// everything where O_DIRECT is refused, are copied: the file is the same either way.
    #[test]
    fn pieces_in_phase_with_the_file_are_written_without_a_copy() {
        let dir = tempfile::tempdir().unwrap();
        let header = 4096 * 3 + 100;
        let big = 3 * BLOCK * 7 + 123;
        let mut mem = vec![0u8; 3 * big + 2 * BLOCK];
        mem.iter_mut()
            .enumerate()
            .for_each(|(j, b)| *b = (j * 7 + j / 4099) as u8);
        // a start in phase with the file position after the header, and one out of phase
        let phase = |at: usize| (at + BLOCK - mem.as_ptr() as usize % BLOCK) % BLOCK;
        let in_phase = phase(header % BLOCK);
        let pieces: Vec<std::ops::Range<usize>> = vec![
            0..header,
            in_phase..in_phase + big,
            // the next piece continues in memory, so it is in phase too
            in_phase + big..in_phase + 2 * big,
            // out of phase by 8 bytes
            in_phase + 2 * big + 8..in_phase + 3 * big,
        ];
        let path = dir.path().join("f");
        let mut w = DirectFile::new(File::create(&path).unwrap());
        let direct = w.is_direct();
        let mut want = Vec::new();
        for r in &pieces {
            w.write_all(&mem[r.clone()]).unwrap();
            want.extend_from_slice(&mem[r.clone()]);
            assert_eq!(w.stream_position().unwrap(), want.len() as u64);
        }
        let uncopied = w.uncopied();
        drop(w.finish().unwrap());
        assert!(std::fs::read(&path).unwrap() == want, "contents differ");
        if direct {
            // the two pieces in phase, less the bytes up to each one's first block boundary
            // and its partial last block
            assert!(
                uncopied >= 2 * (big as u64 - 2 * BLOCK as u64),
                "{uncopied}"
            );
            assert!(uncopied <= 2 * big as u64);
        } else {
            eprintln!("O_DIRECT refused by this file system: only the copy path ran");
            assert_eq!(uncopied, 0);
        }
    }
}
