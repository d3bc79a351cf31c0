//! Memory for decoded bytes: anonymous pages, locked out of swap where the limit allows,
//! excluded from core dumps, wiped before they are returned to the system.

use std::ops::{Deref, DerefMut};
use std::sync::atomic::{AtomicBool, Ordering};

use memmap2::{Advice, MmapMut};
use parking_lot::Mutex;

static LOCK_WARNED: AtomicBool = AtomicBool::new(false);

/// Wiped mappings kept for reuse: a cache miss then costs no mmap, mlock or page faults.
static POOL: Mutex<Vec<MmapMut>> = Mutex::new(Vec::new());
const POOL_MAX: usize = 16;

/// Overwrite `bytes` with zeros in a way the compiler may not elide, at memset speed.
pub fn wipe(bytes: &mut [u8]) {
    // SAFETY: explicit_bzero writes exactly `len` bytes of a live, exclusive slice.
    unsafe { libc::explicit_bzero(bytes.as_mut_ptr().cast(), bytes.len()) };
}

/// A heap buffer wiped when dropped (reads on their way to the kernel).
pub struct Wiped(pub Vec<u8>);

impl Wiped {
    pub fn zeroed(len: usize) -> Wiped {
        Wiped(vec![0u8; len])
    }
}

impl Deref for Wiped {
    type Target = Vec<u8>;
    fn deref(&self) -> &Vec<u8> {
        &self.0
    }
}

impl DerefMut for Wiped {
    fn deref_mut(&mut self) -> &mut Vec<u8> {
        &mut self.0
    }
}

impl Drop for Wiped {
    fn drop(&mut self) {
        wipe(&mut self.0);
    }
}

pub struct SecureBuf {
    /// Always `Some` until dropped, when the mapping goes back to the pool.
    map: Option<MmapMut>,
    len: usize,
}

impl SecureBuf {
    /// `len` zero bytes. Falls back to plain (still wiped) memory only if the kernel refuses
    /// an anonymous mapping, which does not happen short of exhaustion.
    pub fn new(len: usize) -> std::io::Result<SecureBuf> {
        let reused = {
            let mut pool = POOL.lock();
            pool.iter()
                .position(|m| m.len() == len.max(1))
                .map(|i| pool.swap_remove(i))
        };
        if let Some(map) = reused {
            return Ok(SecureBuf {
                map: Some(map),
                len,
            });
        }
        let map = MmapMut::map_anon(len.max(1))?;
        // Excluded from core dumps (the daemon is also marked not dumpable).
        let _ = map.advise(Advice::DontDump);
        if let Err(e) = map.lock() {
            if !LOCK_WARNED.swap(true, Ordering::Relaxed) {
                log::warn!(
                    "cannot lock decoded data in memory ({e}); it may reach swap. Raise RLIMIT_MEMLOCK (ulimit -l) above --cache-size to prevent that"
                );
            }
        }
        Ok(SecureBuf {
            map: Some(map),
            len,
        })
    }

    /// Whether pages of this buffer are locked (for tests).
    pub fn locking_works() -> bool {
        !LOCK_WARNED.load(Ordering::Relaxed)
    }
}

impl Deref for SecureBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.map.as_ref().expect("live buffer")[..self.len]
    }
}

impl DerefMut for SecureBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        &mut self.map.as_mut().expect("live buffer")[..self.len]
    }
}

impl Drop for SecureBuf {
    fn drop(&mut self) {
        if let Some(mut map) = self.map.take() {
            wipe(&mut map[..]);
            let mut pool = POOL.lock();
            if pool.len() < POOL_MAX {
                pool.push(map);
            }
        }
    }
}

/// Unmap the wiped buffers kept for reuse, to give memory back under pressure; returns
/// their bytes.
pub fn drain_pool() -> u64 {
    let drained = std::mem::take(&mut *POOL.lock());
    drained.iter().map(|m| m.len() as u64).sum()
}

/// Lock small long-lived secrets (the secret files) into memory; failure is not an error.
pub fn lock_slice(bytes: &[u8]) {
    if bytes.is_empty() {
        return;
    }
    // SAFETY: mlock only pins the pages of a live slice; it does not touch its contents.
    let rc = unsafe { libc::mlock(bytes.as_ptr().cast(), bytes.len()) };
    if rc != 0 && !LOCK_WARNED.swap(true, Ordering::Relaxed) {
        log::warn!(
            "cannot lock secret files in memory ({}); they may reach swap",
            std::io::Error::last_os_error()
        );
    }
}

/// Make this process impossible to core-dump or ptrace-attach by other users, before any
/// secret is read.
pub fn harden_process() {
    // SAFETY: prctl and setrlimit with constant, valid arguments.
    unsafe {
        libc::prctl(libc::PR_SET_DUMPABLE, 0, 0, 0, 0);
        let none = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        libc::setrlimit(libc::RLIMIT_CORE, &none);
    }
}
