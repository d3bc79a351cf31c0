//! Private memory for decoded shards: a tmpfs of the daemon's own, made with the new mount
//! API and never attached to a path, so no mount table and no other process can name it.
//!
//! Its options carry the guarantees: `noswap` keeps decoded bytes off swap (Linux 6.4+),
//! `huge=always` backs files with 2 MiB pages (the kernel then serves reads and page faults
//! at page-cache speed; 4 KiB pages cost a third of that), and `size=` makes the kernel
//! enforce the memory budget. Files are made with `O_TMPFILE`, so they never have a name,
//! and live until the last descriptor and the last mapping of them are gone.

use std::fs::File;
use std::io;
use std::os::fd::{AsFd, OwnedFd};

use rustix::fs::{FallocateFlags, Mode, OFlags};
use rustix::mount::{FsMountFlags, FsOpenFlags, MountAttrFlags};

/// A detached tmpfs instance.
pub struct MemoryFs {
    root: OwnedFd,
    budget: u64,
}

impl MemoryFs {
    /// A tmpfs of at most `budget` bytes. Needs CAP_SYS_ADMIN; fails on kernels without
    /// the new mount API or without `noswap`, since decoded bytes must never reach swap.
    pub fn new(budget: u64) -> io::Result<MemoryFs> {
        use rustix::mount::{fsconfig_create, fsconfig_set_flag, fsconfig_set_string, fsmount};
        let fs = rustix::mount::fsopen("tmpfs", FsOpenFlags::FSOPEN_CLOEXEC)?;
        let set = |key: &str, value: &str| {
            fsconfig_set_string(&fs, key, value)
                .map_err(|e| io::Error::new(e.kind(), format!("tmpfs option {key}={value}: {e}")))
        };
        // The kernel rounds the size up to whole pages.
        set("size", &budget.max(1).to_string())?;
        set("huge", "always")?;
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
        Ok(MemoryFs { root, budget })
    }

    pub fn budget(&self) -> u64 {
        self.budget
    }

    /// Bytes of the budget in use (files and mappings still alive, this daemon's or not).
    pub fn used(&self) -> io::Result<u64> {
        let st = rustix::fs::fstatvfs(&self.root)?;
        Ok((st.f_blocks - st.f_bfree) * st.f_frsize)
    }

    /// A nameless file of `len` bytes with its memory allocated: the kernel refuses here,
    /// not at a later page fault, when the budget cannot hold it.
    pub fn allocate(&self, len: u64) -> io::Result<File> {
        let fd = rustix::fs::openat(
            &self.root,
            ".",
            OFlags::TMPFILE | OFlags::RDWR | OFlags::CLOEXEC,
            Mode::from_raw_mode(0o600),
        )?;
        if len > 0 {
            rustix::fs::fallocate(&fd, FallocateFlags::empty(), 0, len)?;
        }
        Ok(File::from(fd))
    }

    /// Fill a new file of `len` bytes through a writable mapping, then hand back a
    /// read-only descriptor of it: the writable one is closed, and the file's mode no
    /// longer lets anyone open it for writing.
    pub fn fill<E: From<io::Error>>(
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
mod tests {
    use super::*;
    use std::os::unix::fs::FileExt;

    /// Needs CAP_SYS_ADMIN, as the daemon does; other users get `None` and the test says so.
    fn memory_fs(budget: u64) -> Option<MemoryFs> {
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
        // A child another test forks holds copies of every descriptor until it exits.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while mem.used().unwrap() != 0 {
            assert!(
                std::time::Instant::now() < deadline,
                "memory not freed on the last close"
            );
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
        assert_eq!(mem.used().unwrap(), 0);
    }
}
