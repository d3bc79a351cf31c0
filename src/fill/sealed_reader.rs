//! How a fill reads a local sealed file: by `O_DIRECT` straight into the copy when the
//! bytes are not in the page cache, else through the page cache, whose pages it lets go
//! once the copy (and the file's hash) no longer needs them.

use std::fs::File;
use std::io;

use parking_lot::Mutex;

/// Reads a sealed file into a fill's memory: with `O_DIRECT` straight into the mapping
/// when the bytes are not in the page cache (no second set of fresh pages for the
/// sealed file's cache, and no copy), else through the page cache.
pub(super) struct SealedReader {
    pub(super) file: File,
    pub(super) direct: Option<File>,
    /// Ranges fetched while the file's hash still had to read them, let go once it has.
    kept: Mutex<Vec<(u64, u64)>>,
}

/// `O_DIRECT` wants offsets, lengths and memory aligned to the device's logical block.
const DIRECT_ALIGN: u64 = 4096;
/// The page cache's unit.
const PAGE: u64 = 4096;

impl SealedReader {
    pub(super) fn new(file: &File) -> io::Result<SealedReader> {
        use std::os::fd::AsRawFd;
        use std::os::unix::fs::OpenOptionsExt;
        // The same open file description, not the path: the file read is the one mounted.
        let again = format!("/proc/self/fd/{}", file.as_raw_fd());
        let direct = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_DIRECT)
            .open(&again)
            .ok();
        Ok(SealedReader {
            file: File::open(&again)?,
            direct,
            kept: Mutex::new(Vec::new()),
        })
    }

    /// Let the page cache's pages of `[off, off + len)` go, now that those sealed bytes are
    /// in the copy, or once the file's hash is done with them (`hashed`, asked under the
    /// lock that [`SealedReader::let_go_kept`] takes after the verdict). The copy replaces
    /// them: kept, they would double the memory the shard takes. And let go as the fill
    /// goes, they are the memory the next chunks of the copy are made of: memory the host
    /// still backs, where fresh memory on a VM with free page reporting costs 2-3 s per GiB
    /// to touch (see `memfs::Pages`).
    pub(super) fn let_go(&self, off: u64, len: u64, hashed: impl FnOnce() -> bool) {
        let mut kept = self.kept.lock();
        if hashed() {
            self.drop_cached(off, len, false);
        } else {
            kept.push((off, len));
        }
    }

    /// Let go of the ranges kept for the file's hash, now that its verdict is in.
    pub(super) fn let_go_kept(&self) {
        for (off, len) in std::mem::take(&mut *self.kept.lock()) {
            self.drop_cached(off, len, false);
        }
    }

    /// `POSIX_FADV_DONTNEED` for the pages of `[off, off + len)`: every one if `whole`, else
    /// all but the first and last, since the unlock of the chunks beside reads the values
    /// the range's edges cut from there (the kernel keeps the folios that hold them).
    pub(super) fn drop_cached(&self, off: u64, len: u64, whole: bool) {
        use std::os::fd::AsRawFd;
        if len == 0 {
            return;
        }
        let (from, to) = match whole {
            true => (off, off + len),
            false => ((off / PAGE + 1) * PAGE, (off + len - 1) / PAGE * PAGE),
        };
        if to > from {
            // SAFETY: advice on an open descriptor; the kernel drops only clean pages no
            // one maps, so any reader still gets the file's bytes (from the disk).
            unsafe {
                libc::posix_fadvise(
                    self.file.as_raw_fd(),
                    from as libc::off_t,
                    (to - from) as libc::off_t,
                    libc::POSIX_FADV_DONTNEED,
                )
            };
        }
    }

    /// Whether `read` brings `[off, off + len)` (into aligned memory) from the disk by
    /// `O_DIRECT`.
    fn reads_direct(&self, off: u64, len: u64) -> bool {
        self.direct.is_some()
            && off.is_multiple_of(DIRECT_ALIGN)
            && len >= DIRECT_ALIGN
            && !self.mostly_cached(off, len)
    }

    pub(super) fn read(&self, off: u64, buf: &mut [u8]) -> io::Result<()> {
        use std::os::unix::fs::FileExt;
        let aligned = (buf.len() as u64 / DIRECT_ALIGN * DIRECT_ALIGN) as usize;
        let direct = self.direct.as_ref().filter(|_| {
            (buf.as_ptr() as u64).is_multiple_of(DIRECT_ALIGN)
                && self.reads_direct(off, buf.len() as u64)
        });
        let done = match direct {
            Some(d) => match d.read_exact_at(&mut buf[..aligned], off) {
                Ok(()) => aligned,
                // A file system without O_DIRECT for this file: through the page cache.
                Err(e) if e.raw_os_error() == Some(libc::EINVAL) => 0,
                Err(e) => return Err(e),
            },
            None => 0,
        };
        self.file.read_exact_at(&mut buf[done..], off + done as u64)
    }

    /// Whether at least half of `[off, off + len)` is in the page cache.
    pub(super) fn mostly_cached(&self, off: u64, len: u64) -> bool {
        crate::source::local::mostly_cached(&self.file, off, len)
    }
}
