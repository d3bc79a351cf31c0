//! Private memory for decoded shards: a tmpfs of the daemon's own, made with the new mount
//! API and never attached to a path, so no mount table and no other process can name it.
//!
//! Its options carry the guarantees: `noswap` keeps decoded bytes off swap (Linux 6.4+), and
//! `size=` makes the kernel enforce the memory budget. Files are made with `O_TMPFILE`, so
//! they never have a name, and live until the last descriptor and the last mapping of them
//! are gone.
//!
//! The page size is chosen per mount ([`Pages`]): folios where the kernel gives a tmpfs
//! mounted `huge=within_size` folios as large as each allocation (Linux 6.14+), else 2 MiB
//! pages (`huge=always`). Both serve reads about as fast as the page cache of a plain file,
//! where 4 KiB pages take three times the CPU. A copy someone waits for comes in 512 KiB
//! folios: below the 2 MiB blocks that a VM's guest reports free to its host (free page
//! reporting), which the host takes back and which then cost 2-3 s per GiB to touch again,
//! and large enough to fill and read back faster than smaller ones; 1 MiB ones run short of
//! free blocks of their size when a loader also allocates as it reads (docs/PERFORMANCE-LOG.md,
//! "Fresh memory on this VM", "Page size of the decoded copy"). Decode ahead, which no one
//! waits for yet, takes 1 MiB folios, leaving the smaller blocks to the processes that wait,
//! and 2 MiB ones where its sealed bytes are in the page cache: made of the reported blocks,
//! it leaves the memory the host still backs to what the engine allocates after its load.

use std::fs::File;
use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;

use parking_lot::Mutex;

use rustix::fs::{FallocateFlags, Mode, OFlags};
use rustix::mount::{FsMountFlags, FsOpenFlags, MountAttrFlags};

/// The page size of decoded files.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pages {
    /// 2 MiB pages: `huge=always`, memory allocated in any steps.
    Huge,
    /// Folios as large as each allocation (`huge=within_size`): 512 KiB, or 1 or 2 MiB for
    /// decode ahead; memory allocated in file order.
    Folios,
}

impl Pages {
    /// The allocation step of a copy someone waits for: 512 KiB folios, whose free blocks (too
    /// small for a VM's guest to report to its host) last through a load (see the module's
    /// docs).
    pub fn step(self) -> u64 {
        match self {
            Pages::Huge => 2 << 20,
            Pages::Folios => 512 << 10,
        }
    }

    /// The allocation step of decode ahead of bytes from the disk: 1 MiB folios, which
    /// leave the smaller free blocks, memory the host still backs, to the processes that
    /// wait meanwhile.
    pub fn ahead_step(self) -> u64 {
        match self {
            Pages::Huge => 2 << 20,
            Pages::Folios => 1 << 20,
        }
    }

    /// The allocation step for decode ahead of sealed bytes in the page cache: 2 MiB folios,
    /// made of the free blocks the guest reports to its host. The copy replaces the sealed
    /// page cache, which goes back as blocks of 2 MiB and more; in smaller folios it would
    /// also take the smaller blocks, the memory the host still backs, from what an engine
    /// allocates after its load (a CPU engine's KV cache). Copying cached bytes is quick,
    /// which leaves the fill time for the dearer memory; bytes read from the disk do not
    /// (a cold start would wait for the slower fill), nor do a file's first two chunks,
    /// which an open that comes with the mount waits for (`fill::AWAITED_START`).
    pub fn ahead_cached_step(self) -> u64 {
        2 << 20
    }

    fn huge_option(self) -> &'static str {
        match self {
            Pages::Huge => "always",
            Pages::Folios => "within_size",
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Pages::Huge => "2 MiB",
            Pages::Folios => "512 KiB, 1 MiB and 2 MiB",
        }
    }
}

/// A detached tmpfs instance.
pub struct MemoryFs {
    root: OwnedFd,
    budget: u64,
    pages: Pages,
    /// Bytes promised to files still filling or alive (see [`Reservation`]).
    reserved: Arc<Mutex<u64>>,
}

/// A claim on the budget for one file, held for as long as the daemon holds the file: a
/// fill allocates its memory chunk by chunk, and two fills must not both count on the
/// same free bytes.
pub struct Reservation {
    len: u64,
    reserved: Arc<Mutex<u64>>,
}

impl Drop for Reservation {
    fn drop(&mut self) {
        let mut r = self.reserved.lock();
        *r = r.saturating_sub(self.len);
    }
}

impl MemoryFs {
    /// A tmpfs of at most `budget` bytes, with folios sized by each allocation where the
    /// kernel makes them.
    /// Needs CAP_SYS_ADMIN; fails on kernels without the new mount API or without
    /// `noswap`, since decoded bytes must never reach swap.
    pub fn new(budget: u64) -> io::Result<MemoryFs> {
        let folios = MemoryFs::with_pages(budget, Pages::Folios)?;
        if folios.makes_folios() {
            return Ok(folios);
        }
        MemoryFs::with_pages(budget, Pages::Huge)
    }

    pub fn with_pages(budget: u64, pages: Pages) -> io::Result<MemoryFs> {
        use rustix::mount::{fsconfig_create, fsconfig_set_flag, fsconfig_set_string, fsmount};
        let fs = rustix::mount::fsopen("tmpfs", FsOpenFlags::FSOPEN_CLOEXEC)?;
        let set = |key: &str, value: &str| {
            fsconfig_set_string(&fs, key, value)
                .map_err(|e| io::Error::new(e.kind(), format!("tmpfs option {key}={value}: {e}")))
        };
        // The kernel rounds the size up to whole pages.
        set("size", &budget.max(1).to_string())?;
        set("huge", pages.huge_option())?;
        set("mode", "0700")?;
        fsconfig_set_flag(&fs, "noswap")
            .map_err(|e| io::Error::new(e.kind(), format!("tmpfs option noswap: {e}")))?;
        fsconfig_create(&fs)?;
        let root = fsmount(
            &fs,
            FsMountFlags::FSMOUNT_CLOEXEC,
            MountAttrFlags::MOUNT_ATTR_NOEXEC
                | MountAttrFlags::MOUNT_ATTR_NOSUID
                | MountAttrFlags::MOUNT_ATTR_NODEV,
        )?;
        Ok(MemoryFs {
            root,
            budget,
            pages,
            reserved: Arc::new(Mutex::new(0)),
        })
    }

    /// Whether allocating in steps of this tmpfs's folio size makes folios of that size:
    /// the kernel's counter of such shmem folios moves (Linux 6.14+ for tmpfs; older
    /// kernels make 4 KiB pages).
    fn makes_folios(&self) -> bool {
        let step = self.pages.step();
        let probe = || -> Option<bool> {
            let before = shmem_folios_made(step)?;
            let f = self.create().ok()?;
            for i in 0..4 {
                rustix::fs::fallocate(&f, FallocateFlags::empty(), i * step, step).ok()?;
            }
            Some(shmem_folios_made(step)? >= before + 4)
        };
        probe().unwrap_or(false)
    }

    pub fn budget(&self) -> u64 {
        self.budget
    }

    pub fn pages(&self) -> Pages {
        self.pages
    }

    /// Claim `len` bytes of the budget, or `None` when the budget cannot hold them now
    /// (counting both what files hold and what fills have been promised).
    pub fn reserve(&self, len: u64) -> Option<Reservation> {
        let mut r = self.reserved.lock();
        let used = self.used().unwrap_or(0);
        if (*r).max(used).saturating_add(len) > self.budget {
            return None;
        }
        *r += len;
        Some(Reservation {
            len,
            reserved: self.reserved.clone(),
        })
    }

    /// A new nameless, empty file, writable by the daemon alone; its memory is allocated
    /// as it fills ([`allocate_range`]).
    pub fn create(&self) -> io::Result<File> {
        let fd = rustix::fs::openat(
            &self.root,
            ".",
            OFlags::TMPFILE | OFlags::RDWR | OFlags::CLOEXEC,
            Mode::from_raw_mode(0o600),
        )?;
        Ok(File::from(fd))
    }

    /// Bytes of the budget in use (files and mappings still alive, this daemon's or not).
    pub fn used(&self) -> io::Result<u64> {
        let st = rustix::fs::fstatvfs(&self.root)?;
        Ok((st.f_blocks - st.f_bfree) * st.f_frsize)
    }

    /// A nameless file of `len` bytes with its memory allocated: the kernel refuses here,
    /// not at a later page fault, when the budget cannot hold it. (The daemon fills files
    /// chunk by chunk, `crate::fill`; this and `MemoryFs::fill` test the tmpfs's
    /// guarantees on whole files.)
    #[cfg(test)]
    fn allocate(&self, len: u64) -> io::Result<File> {
        let file = self.create()?;
        allocate_range(&file, 0, len, self.pages.step())?;
        Ok(file)
    }

    /// Fill a new file of `len` bytes through a writable mapping, then hand back a
    /// read-only descriptor of it: the writable one is closed, and the file's mode no
    /// longer lets anyone open it for writing.
    #[cfg(test)]
    fn fill<E: From<io::Error>>(
        &self,
        len: u64,
        fill: impl FnOnce(&mut [u8]) -> Result<(), E>,
    ) -> Result<MemoryFile, E> {
        let file = self.allocate(len)?;
        if len > 0 {
            // SAFETY: the file is ours alone (nameless, just made) and holds `len` bytes; the
            // mapping is dropped before any other descriptor of it exists.
            let mut map = unsafe { memmap2::MmapOptions::new().len(len as usize).map_mut(&file) }?;
            let _ = map.advise(memmap2::Advice::DontDump);
            fill(&mut map)?;
        }
        seal(file).map_err(E::from)
    }
}

/// How many shmem folios of `size` bytes the kernel has made since boot (machine-wide), where
/// it counts them (Linux 6.10+, multi-size THP).
pub fn shmem_folios_made(size: u64) -> Option<u64> {
    let stat = format!(
        "/sys/kernel/mm/transparent_hugepage/hugepages-{}kB/stats/shmem_alloc",
        size >> 10
    );
    std::fs::read_to_string(stat).ok()?.trim().parse().ok()
}

/// Allocate the memory of `[from, to)` of `file`, `step` bytes at a time, growing the file:
/// tmpfs sizes each folio by the allocation that makes it, so the step sets the page size.
/// The kernel refuses (ENOSPC) past the tmpfs's size.
pub fn allocate_range(file: &File, from: u64, to: u64, step: u64) -> io::Result<()> {
    let mut at = from;
    while at < to {
        let n = step.min(to - at);
        rustix::fs::fallocate(file, FallocateFlags::empty(), at, n)?;
        at += n;
    }
    Ok(())
}

/// Hand back a read-only descriptor of a filled file: the writable one is closed, and the
/// file's mode no longer lets anyone open it for writing.
pub fn seal(file: File) -> io::Result<MemoryFile> {
    let len = file.metadata()?.len();
    rustix::fs::fchmod(&file, Mode::from_raw_mode(0o400)).map_err(io::Error::from)?;
    let read_only = reopen_read_only(&file)?;
    drop(file);
    Ok(MemoryFile {
        file: read_only,
        len,
    })
}

/// Open the same inode again, read-only, through the process's descriptor link (the file
/// has no name to open it by).
fn reopen_read_only(file: &File) -> io::Result<File> {
    use std::os::fd::AsRawFd;
    File::open(format!("/proc/self/fd/{}", file.as_fd().as_raw_fd()))
}

/// A decoded file in private memory, read-only. Dropping it closes the daemon's descriptor;
/// the kernel frees the memory once no open file and no mapping of it remains.
pub struct MemoryFile {
    file: File,
    len: u64,
}

impl MemoryFile {
    pub fn file(&self) -> &File {
        &self.file
    }

    pub fn len(&self) -> u64 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use std::os::unix::fs::FileExt;

    /// Needs CAP_SYS_ADMIN, as the daemon does; other users get `None` and the test says so.
    pub(crate) fn memory_fs(budget: u64) -> Option<MemoryFs> {
        match MemoryFs::new(budget) {
            Ok(m) => Some(m),
            Err(e) if !rustix::process::geteuid().is_root() => {
                eprintln!("skipped: a private tmpfs needs root ({e})");
                None
            }
            Err(e) => panic!("root cannot make a private tmpfs: {e}"),
        }
    }

    #[test]
    fn filled_files_read_back_and_are_read_only() {
        let Some(mem) = memory_fs(64 << 20) else {
            return;
        };
        let f = mem
            .fill::<io::Error>(5 << 20, |buf| {
                for (i, b) in buf.iter_mut().enumerate() {
                    *b = (i % 251) as u8;
                }
                Ok(())
            })
            .unwrap();
        let mut back = vec![0u8; 4096];
        f.file().read_exact_at(&mut back, 3 << 20).unwrap();
        assert!(back
            .iter()
            .enumerate()
            .all(|(i, &b)| b == (((3 << 20) + i) % 251) as u8));
        assert!(f.file().write_at(b"x", 0).is_err(), "writable descriptor");
        assert!(mem.used().unwrap() >= 5 << 20);
        drop(f);
        assert_freed(&mem, "memory not freed on the last close");
    }

    /// Every byte of `mem` freed, within a few seconds: a child another test forks holds
    /// copies of every descriptor until it execs or exits.
    fn assert_freed(mem: &MemoryFs, what: &str) {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while mem.used().unwrap() != 0 {
            assert!(std::time::Instant::now() < deadline, "{what}");
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    }

    #[test]
    fn the_budget_is_enforced_by_the_kernel() {
        let Some(mem) = memory_fs(8 << 20) else {
            return;
        };
        let _held = mem.fill::<io::Error>(6 << 20, |_| Ok(())).unwrap();
        let err = mem.fill::<io::Error>(4 << 20, |_| Ok(())).err().unwrap();
        assert_eq!(err.raw_os_error(), Some(libc::ENOSPC), "{err}");
    }

    #[test]
    fn a_failed_fill_frees_its_memory() {
        let Some(mem) = memory_fs(16 << 20) else {
            return;
        };
        let err = mem
            .fill(4 << 20, |_| Err(io::Error::other("decode failed")))
            .err()
            .unwrap();
        assert_eq!(err.to_string(), "decode failed");
        assert_freed(&mem, "a failed fill's memory not freed");
    }
}
