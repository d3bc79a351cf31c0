//! A read-only mapping of a file that someone else may truncate, or whose pages the disk may
//! fail to give: a read of such a page raises `SIGBUS`, which would kill the daemon and the
//! mount with it. A handler puts a page of zeros where the page was and counts the fault
//! against the mapping, so the read goes on and its caller, seeing the count, throws away
//! what it made and reads the bytes the ordinary way (the same answer the file gives a
//! `pread`: short, or an error). Others map files the same way (EFL's `eina_mmap`, Meta's
//! `indexedlog`).
//!
//! Why map at all: a fill's decode can read a sealed file's bytes straight from the page
//! cache, where a `pread` copies every byte into a buffer first (about 0.14 s of a core per
//! GiB here: docs/PERFORMANCE-LOG.md, "Files in the page cache: read through a mapping").

use std::fs::File;
use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Once, OnceLock};

/// Mappings guarded at once: a fill holds one while it runs, a shard read through FUSE one
/// for the mount's life. Past them a file is read by `pread`. (The handler looks through
/// them all only on a fault.)
const SLOTS: usize = 1024;

/// One guarded mapping: its range (`start` 0: a free slot) and the faults in it.
struct Slot {
    start: AtomicUsize,
    len: AtomicUsize,
    faults: AtomicU64,
}

#[allow(clippy::declare_interior_mutable_const)]
const FREE: Slot = Slot {
    start: AtomicUsize::new(0),
    len: AtomicUsize::new(0),
    faults: AtomicU64::new(0),
};
static GUARDED: [Slot; SLOTS] = [FREE; SLOTS];

static INSTALL: Once = Once::new();
static INSTALLED: AtomicBool = AtomicBool::new(false);
/// The handler before ours (the Rust runtime's, which reports stack overflows), for faults
/// outside every guarded mapping.
static PREVIOUS: OnceLock<libc::sigaction> = OnceLock::new();

/// A read-only shared mapping of a whole file, whose faults are counted instead of fatal.
pub struct GuardedMap {
    map: memmap2::Mmap,
    slot: usize,
}

impl GuardedMap {
    /// Map the first `len` bytes of `file`; `None` where the handler cannot be installed, no
    /// slot is free, or the file cannot be mapped (a caller reads it by `pread` then).
    pub fn new(file: &File, len: u64) -> Option<GuardedMap> {
        if len == 0 || !install() {
            return None;
        }
        // SAFETY: a read-only shared mapping; what another process does to the file shows
        // in its bytes (checked by the caller as for any read) or raises SIGBUS, which the
        // handler below turns into a page of zeros and a fault counted.
        let map = unsafe { memmap2::MmapOptions::new().len(len as usize).map(file) }.ok()?;
        let start = map.as_ptr() as usize;
        let slot = GUARDED.iter().position(|s| {
            s.start
                .compare_exchange(0, usize::MAX, Ordering::AcqRel, Ordering::Relaxed)
                .is_ok()
        })?;
        let s = &GUARDED[slot];
        s.faults.store(0, Ordering::Relaxed);
        s.len.store(len as usize, Ordering::Relaxed);
        s.start.store(start, Ordering::Release);
        Some(GuardedMap { map, slot })
    }

    /// `read` given bytes `[off, off + len)` of the file, and what it made; `None` if any page
    /// of the mapping failed before or while it read (then its bytes may hold zeros that are
    /// not the file's, and the caller reads the range the ordinary way). The pages are
    /// unmapped after (mapped again if read again): the page cache may then let them go (it
    /// keeps pages that are mapped), and they never count in the daemon's memory.
    pub fn read<R>(&self, off: u64, len: usize, read: impl FnOnce(&[u8]) -> R) -> Option<R> {
        let bytes = self
            .map
            .get(off as usize..(off as usize).checked_add(len)?)?;
        let faults = &GUARDED[self.slot].faults;
        if faults.load(Ordering::SeqCst) != 0 {
            return None;
        }
        let made = read(bytes);
        let failed = faults.load(Ordering::SeqCst) != 0;
        // SAFETY: a shared file mapping loses nothing: a later read maps the file's pages
        // again.
        let _ = unsafe {
            self.map
                .unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, off as usize, len)
        };
        (!failed).then_some(made)
    }

    /// Whether a page of the mapping has failed: nothing read from it counts any more.
    pub fn failed(&self) -> bool {
        GUARDED[self.slot].faults.load(Ordering::SeqCst) != 0
    }
}

impl Drop for GuardedMap {
    fn drop(&mut self) {
        // Out of the table before the unmapping: while listed, the range is this mapping's,
        // never another's that the kernel placed there since.
        GUARDED[self.slot].start.store(0, Ordering::Release);
    }
}

/// Install the handler once; whether it is in.
fn install() -> bool {
    INSTALL.call_once(|| {
        // SAFETY: sigaction with zeroed structs filled as the kernel wants. The previous
        // handler is stored before ours can run: the kernel gives it back here first.
        unsafe {
            let mut previous: libc::sigaction = std::mem::zeroed();
            if libc::sigaction(libc::SIGBUS, std::ptr::null(), &mut previous) != 0 {
                return;
            }
            let _ = PREVIOUS.set(previous);
            let mut action: libc::sigaction = std::mem::zeroed();
            action.sa_sigaction = on_sigbus as *const () as usize;
            action.sa_flags = libc::SA_SIGINFO | libc::SA_NODEFER;
            libc::sigemptyset(&mut action.sa_mask);
            if libc::sigaction(libc::SIGBUS, &action, std::ptr::null_mut()) == 0 {
                INSTALLED.store(true, Ordering::Release);
            } else {
                log::warn!(
                    "no SIGBUS handler ({}): sealed files are read by pread",
                    io::Error::last_os_error()
                );
            }
        }
    });
    INSTALLED.load(Ordering::Acquire)
}

/// A fault in a guarded mapping gets a page of zeros (the read goes on) and is counted; any
/// other goes to the handler before ours, or ends the process as it would have.
extern "C" fn on_sigbus(
    signal: libc::c_int,
    info: *mut libc::siginfo_t,
    context: *mut libc::c_void,
) {
    // SAFETY: the kernel passes a valid siginfo for SA_SIGINFO handlers.
    let addr = unsafe { (*info).si_addr() } as usize;
    for slot in &GUARDED {
        let start = slot.start.load(Ordering::Acquire);
        if start == 0 || start == usize::MAX {
            continue;
        }
        if addr >= start && addr - start < slot.len.load(Ordering::Relaxed) {
            // Counted before the zeros are in place: a thread that reads them without a fault
            // of its own (the same page, read beside this one) then finds the count when it
            // checks after its read.
            slot.faults.fetch_add(1, Ordering::SeqCst);
            let page = addr & !(page_size() - 1);
            // SAFETY: replaces one page inside a mapping this process made and still holds
            // (listed); mmap is a plain system call, safe in a signal handler.
            let zeros = unsafe {
                libc::mmap(
                    page as *mut libc::c_void,
                    page_size(),
                    libc::PROT_READ,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED,
                    -1,
                    0,
                )
            };
            if zeros != libc::MAP_FAILED {
                return;
            }
        }
    }
    // SAFETY: the previous handler, as the kernel gave it, called as it was installed to be.
    unsafe {
        match PREVIOUS.get() {
            Some(p) if p.sa_flags & libc::SA_SIGINFO != 0 && p.sa_sigaction > 1 => {
                let previous: extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut libc::c_void) =
                    std::mem::transmute(p.sa_sigaction);
                previous(signal, info, context);
            }
            Some(p) if p.sa_sigaction > 1 => {
                let previous: extern "C" fn(libc::c_int) = std::mem::transmute(p.sa_sigaction);
                previous(signal);
            }
            _ => {
                // The default action: the fault comes again on return and ends the process.
                libc::signal(libc::SIGBUS, libc::SIG_DFL);
            }
        }
    }
}

fn page_size() -> usize {
    static PAGE: AtomicUsize = AtomicUsize::new(0);
    match PAGE.load(Ordering::Relaxed) {
        0 => {
            // SAFETY: sysconf has no preconditions.
            let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) }.max(4096) as usize;
            PAGE.store(p, Ordering::Relaxed);
            p
        }
        p => p,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn a_truncated_file_counts_a_fault_instead_of_ending_the_process() {
        let mut f = tempfile::tempfile().unwrap();
        f.write_all(&vec![7u8; 64 << 10]).unwrap();
        let map = GuardedMap::new(&f, 64 << 10).expect("mapped");
        assert_eq!(
            map.read(0, 64 << 10, |b| b.iter().all(|&x| x == 7)),
            Some(true)
        );
        f.set_len(8 << 10).unwrap();
        // The pages past the new end raise SIGBUS: the read ends, and is refused.
        let sum = |b: &[u8]| b.iter().map(|&x| u64::from(x)).sum::<u64>();
        assert_eq!(map.read(0, 64 << 10, sum), None);
        assert!(map.failed());
        // Refused from then on, even where the file still has its bytes.
        assert_eq!(map.read(0, 4096, sum), None);
        drop(map);
        // A new mapping of the same file starts clean, within the file's new length.
        let again = GuardedMap::new(&f, 8 << 10).expect("mapped");
        assert_eq!(again.read(0, 8 << 10, sum), Some(7 * (8 << 10)));
        assert_eq!(again.read(4096, 8 << 10, sum), None, "past the mapping");
    }
}
