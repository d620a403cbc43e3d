//! The global allocator of the `attnscope` binary: large buffers (≥ 8 MiB: weights, activations,
//! attention blocks) are mapped directly and, once freed, kept in a small cache for reuse.
//!
//! Why: a forward pass allocates the same large shapes layer after layer. Fresh pages cost a
//! page fault and zeroing each, and on this project's virtual machines that is slow: loading the
//! default model touched ~750,000 pages (~6 s of system time), and a 2,048-token forward spent
//! seconds faulting in activations it had just freed. Mapping big buffers with `MAP_POPULATE`
//! faults them in one go, and reusing freed mappings of the same size avoids faulting again.
//! Small allocations go to the system allocator unchanged. (Transparent huge pages were
//! measured too: slower here, because of compaction.)

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

const PAGE: usize = 2 << 20;
const THRESHOLD: usize = 4 * PAGE;
/// Freed mappings kept for reuse, at most this many bytes in all.
const CACHE_CAP: usize = 512 << 20;
const SLOTS: usize = 32;

pub struct BigBufferAlloc;

struct Cache {
    lock: AtomicBool,
    /// (address, length) of cached mappings; length 0 = empty slot
    slots: std::cell::UnsafeCell<[(usize, usize); SLOTS]>,
    bytes: AtomicUsize,
}

// SAFETY: `slots` is only touched while `lock` is held.
unsafe impl Sync for Cache {}

static CACHE: Cache = Cache { lock: AtomicBool::new(false), slots: std::cell::UnsafeCell::new([(0, 0); SLOTS]), bytes: AtomicUsize::new(0) };

impl Cache {
    fn with<R>(&self, f: impl FnOnce(&mut [(usize, usize); SLOTS]) -> R) -> R {
        while self.lock.compare_exchange_weak(false, true, Ordering::Acquire, Ordering::Relaxed).is_err() {
            std::hint::spin_loop();
        }
        // SAFETY: the lock is held, so no other thread touches the slots.
        let r = f(unsafe { &mut *self.slots.get() });
        self.lock.store(false, Ordering::Release);
        r
    }

    /// A cached mapping of exactly `len` bytes, if one is free.
    fn take(&self, len: usize) -> Option<*mut u8> {
        self.with(|slots| {
            let s = slots.iter_mut().find(|s| s.1 == len)?;
            let addr = s.0;
            *s = (0, 0);
            self.bytes.fetch_sub(len, Ordering::Relaxed);
            Some(addr as *mut u8)
        })
    }

    /// Keeps a freed mapping if there is room; returns false if the caller must unmap it.
    fn put(&self, p: *mut u8, len: usize) -> bool {
        self.with(|slots| {
            if self.bytes.load(Ordering::Relaxed) + len > CACHE_CAP {
                return false;
            }
            match slots.iter_mut().find(|s| s.1 == 0) {
                Some(s) => {
                    *s = (p as usize, len);
                    self.bytes.fetch_add(len, Ordering::Relaxed);
                    true
                }
                None => false,
            }
        })
    }
}

fn round_up(x: usize, to: usize) -> usize {
    x.div_ceil(to) * to
}

fn is_big(l: &Layout) -> bool {
    l.size() >= THRESHOLD && l.align() <= PAGE
}

#[cfg(target_os = "linux")]
unsafe fn map_big(len: usize) -> *mut u8 {
    // over-map by one page so the start can be aligned to 2 MiB
    let p = libc::mmap(std::ptr::null_mut(), len + PAGE, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_POPULATE, -1, 0);
    if p == libc::MAP_FAILED {
        return std::ptr::null_mut();
    }
    let addr = p as usize;
    let aligned = round_up(addr, PAGE);
    if aligned > addr {
        libc::munmap(p, aligned - addr);
    }
    let tail = addr + len + PAGE - (aligned + len);
    if tail > 0 {
        libc::munmap((aligned + len) as *mut libc::c_void, tail);
    }
    aligned as *mut u8
}

#[cfg(target_os = "linux")]
unsafe fn unmap_big(p: *mut u8, len: usize) {
    libc::munmap(p as *mut libc::c_void, len);
}

#[cfg(not(target_os = "linux"))]
unsafe fn map_big(len: usize) -> *mut u8 {
    System.alloc_zeroed(Layout::from_size_align_unchecked(len, PAGE))
}

#[cfg(not(target_os = "linux"))]
unsafe fn unmap_big(p: *mut u8, len: usize) {
    System.dealloc(p, Layout::from_size_align_unchecked(len, PAGE))
}

unsafe fn alloc_big(size: usize, zeroed: bool) -> *mut u8 {
    let len = round_up(size, PAGE);
    match CACHE.take(len) {
        Some(p) => {
            if zeroed {
                std::ptr::write_bytes(p, 0, size);
            }
            p
        }
        // fresh anonymous mappings are zero already
        None => map_big(len),
    }
}

unsafe fn free_big(p: *mut u8, size: usize) {
    let len = round_up(size, PAGE);
    if !CACHE.put(p, len) {
        unmap_big(p, len);
    }
}

unsafe impl GlobalAlloc for BigBufferAlloc {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        if is_big(&l) { alloc_big(l.size(), false) } else { System.alloc(l) }
    }
    unsafe fn alloc_zeroed(&self, l: Layout) -> *mut u8 {
        if is_big(&l) { alloc_big(l.size(), true) } else { System.alloc_zeroed(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        if is_big(&l) { free_big(p, l.size()) } else { System.dealloc(p, l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, new_size: usize) -> *mut u8 {
        let new = Layout::from_size_align_unchecked(new_size, l.align());
        if !is_big(&l) && !is_big(&new) {
            return System.realloc(p, l, new_size);
        }
        let q = self.alloc(new);
        if !q.is_null() {
            std::ptr::copy_nonoverlapping(p, q, l.size().min(new_size));
            self.dealloc(p, l);
        }
        q
    }
}
