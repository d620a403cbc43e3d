//! The bytes behind a GGUF file ([`Backing`]): what the reader (`gguf.rs`, which re-exports it)
//! maps and the weights (`weights/`, whose quantized tensors stay in it) hold, below both.

use memmap2::Mmap;

/// The bytes behind a GGUF file: a read-only memory map, or a buffer (tests, fuzzing).
pub enum Backing {
    Map(Mmap),
    Bytes(Vec<u8>),
}

impl std::ops::Deref for Backing {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            Backing::Map(m) => m,
            Backing::Bytes(b) => b,
        }
    }
}

impl Backing {
    /// Drops resident pages of `start..start + len` (a no-op for buffers).
    pub fn release(&self, start: usize, len: usize) {
        if let Backing::Map(m) = self {
            // SAFETY: read-only file-backed mapping: MADV_DONTNEED only drops pages that are
            // read back from the file on the next access; no data can be lost.
            let _ =
                unsafe { m.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, start, len) };
        }
    }
}
