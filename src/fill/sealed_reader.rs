//! How a fill reads a local sealed file: by `O_DIRECT` straight into the copy when the
//! bytes are not in the page cache, else through the page cache, whose pages it lets go
//! once the copy (and the file's hash) no longer needs them.

use std::fs::File;
use std::io;

use parking_lot::Mutex;

use crate::guarded_map::GuardedMap;

/// Reads a sealed file into a fill's memory: with `O_DIRECT` straight into the mapping
/// when the bytes are not in the page cache (no second set of fresh pages for the
/// sealed file's cache, and no copy), else through the page cache.
pub(super) struct SealedReader {
    pub(super) file: File,
    pub(super) direct: Option<File>,
    /// The file mapped, so a chunk whose bytes are in the page cache is decoded from there
    /// without a copy into a buffer first; `None` where it cannot be (then by `read`).
    map: Option<GuardedMap>,
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
        let file = File::open(&again)?;
        let map = GuardedMap::new(&file, file.metadata()?.len());
        Ok(SealedReader {
            file,
            direct,
            map,
            kept: Mutex::new(Vec::new()),
        })
    }

    /// What `decode` makes of the sealed bytes of `[off, off + out.len())` read where the page
    /// cache holds them (a mapping), written into `out`; `None` where the mapping cannot say
    /// (none, a page not in the cache, or a page of it failed: a file cut short or a disk
    /// error), and `out` is to be made again from a read.
    pub(super) fn decode_mapped<E>(
        &self,
        off: u64,
        out: &mut [u8],
        decode: impl FnOnce(&[u8], &mut [u8]) -> Result<(), E>,
    ) -> Option<Result<(), E>> {
        let len = out.len();
        // A page not in the cache would be read from the disk a page at a time, on a core
        // that decodes.
        if !crate::source::local::all_cached(&self.file, off, len as u64) {
            return None;
        }
        self.map
            .as_ref()?
            .read(off, len, |sealed| decode(sealed, out))
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    /// A chunk decoded where the page cache holds it reads the file's bytes through the
    /// mapping; a file cut short under a read faults there, and from then on every range is
    /// left to `read`, which tells the truth (a short file).
    #[test]
    fn decodes_from_the_mapping_until_the_file_is_cut_short_under_it() {
        let mut f = tempfile::NamedTempFile::new().unwrap();
        let bytes: Vec<u8> = (0..256u32 << 10).map(|i| (i % 251) as u8).collect();
        f.write_all(&bytes).unwrap();
        let reader = SealedReader::new(f.as_file()).unwrap();
        let copy = |sealed: &[u8], out: &mut [u8]| -> Result<(), ()> {
            out.copy_from_slice(sealed);
            Ok(())
        };
        let mut out = vec![0u8; 128 << 10];
        assert_eq!(reader.decode_mapped(4096, &mut out, copy), Some(Ok(())));
        assert!(out[..] == bytes[4096..4096 + (128 << 10)]);
        // Cut short while a decode reads the mapping: the pages past the cut fault.
        let cut_and_copy = |sealed: &[u8], out: &mut [u8]| -> Result<(), ()> {
            f.as_file().set_len(64 << 10).unwrap();
            out.copy_from_slice(sealed);
            Ok(())
        };
        assert_eq!(reader.decode_mapped(0, &mut out, cut_and_copy), None);
        // Refused from then on, before the cut too.
        assert_eq!(reader.decode_mapped(0, &mut out[..4096], copy), None);
        let mut buf = vec![0u8; 64 << 10];
        assert!(
            reader.read(128 << 10, &mut buf).is_err(),
            "read past the cut"
        );
        assert!(reader.read(0, &mut buf).is_ok(), "read before the cut");
    }
}
