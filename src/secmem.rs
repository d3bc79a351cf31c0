//! Memory for decoded bytes: anonymous pages, locked out of swap where the limit allows,
//! excluded from core dumps, wiped before they are returned to the system.

use std::ops::{Deref, DerefMut};
use std::sync::atomic::{AtomicBool, Ordering};

use memmap2::{Advice, MmapMut};
use zeroize::Zeroize;

static LOCK_WARNED: AtomicBool = AtomicBool::new(false);

pub struct SecureBuf {
    map: MmapMut,
    len: usize,
}

impl SecureBuf {
    /// `len` zero bytes. Falls back to plain (still wiped) memory only if the kernel refuses
    /// an anonymous mapping, which does not happen short of exhaustion.
    pub fn new(len: usize) -> std::io::Result<SecureBuf> {
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
        Ok(SecureBuf { map, len })
    }

    /// Whether pages of this buffer are locked (for tests).
    pub fn locking_works() -> bool {
        !LOCK_WARNED.load(Ordering::Relaxed)
    }
}

impl Deref for SecureBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.map[..self.len]
    }
}

impl DerefMut for SecureBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        &mut self.map[..self.len]
    }
}

impl Drop for SecureBuf {
    fn drop(&mut self) {
        self.map[..].zeroize();
    }
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
