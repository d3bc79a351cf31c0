//! Whether other processes are reading the disk a sealed file is on, so that decode ahead,
//! which nobody waits for, can keep out of their way (`fill::BACKGROUND_PIECE`).
//!
//! The disk's own count of bytes read (`/sys/dev/block/MAJ:MIN/stat`) less what this process
//! had read from storage in the same time (`read_bytes` of `/proc/self/io`, which counts
//! `O_DIRECT` reads and the page cache's readahead of every thread): what is left, others
//! read. (A child's reads count as its parent's once it is waited for; the daemon starts no
//! child that reads.)

use parking_lot::Mutex;
use std::fs::File;
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// Before each piece, a reader nobody waits for waits while others keep reading the disk,
/// looking again after each pause: an engine importing pages its libraries in by bursts of
/// reads between stretches of work, and a piece read in those stretches delays none of them
/// (docs/PERFORMANCE-LOG.md, "Changed: decode ahead waits for a quiet disk").
pub const YIELD_PAUSE: Duration = Duration::from_millis(10);
/// The longest wait before a piece: a disk that others never leave still gives the reader a
/// piece this often, and two daemons reading ahead on one disk do not stop each other.
pub const MAX_YIELD: Duration = Duration::from_millis(100);

/// Wait while others read the disk: `busy` is the look already taken, `others_read` looks
/// again after each [`YIELD_PAUSE`]; at most [`MAX_YIELD`], and only while `still()` (a
/// reader someone now waits for stops yielding).
pub fn yield_to_others(
    mut busy: bool,
    mut others_read: impl FnMut() -> bool,
    still: impl Fn() -> bool,
) {
    let since = Instant::now();
    while busy && since.elapsed() < MAX_YIELD && still() {
        std::thread::sleep(YIELD_PAUSE);
        busy = others_read();
    }
}

/// The statistics of the block device that holds one file.
pub struct DiskShare {
    device_stat: PathBuf,
    /// The disk's and this process's bytes read at the last look.
    last: Mutex<Option<(u64, u64)>>,
}

impl DiskShare {
    /// The disk `file` is on, or `None` where its device keeps no block statistics (a
    /// network or btrfs file system, an overlay over several: device numbers that name no
    /// block device).
    pub fn of(file: &File) -> Option<DiskShare> {
        use std::os::unix::fs::MetadataExt;
        let dev = file.metadata().ok()?.dev();
        let (major, minor) = (libc::major(dev), libc::minor(dev));
        let device_stat = PathBuf::from(format!("/sys/dev/block/{major}:{minor}/stat"));
        let mut share = DiskShare {
            device_stat,
            last: Mutex::new(None),
        };
        *share.last.get_mut() = Some(share.read_counts()?);
        Some(share)
    }

    /// Bytes other processes read from the disk since the last call (the first: since
    /// [`DiskShare::of`]); `None` when either count could not be read.
    pub fn others_read(&self) -> Option<u64> {
        let now = self.read_counts();
        let mut last = self.last.lock();
        let before = std::mem::replace(&mut *last, now);
        let ((disk0, own0), (disk1, own1)) = (before?, now?);
        Some(
            disk1
                .saturating_sub(disk0)
                .saturating_sub(own1.saturating_sub(own0)),
        )
    }

    /// Wait while other processes read the disk ([`yield_to_others`]).
    pub fn wait_quiet(&self) {
        let others = || self.others_read().is_some_and(|n| n > 0);
        yield_to_others(others(), others, || true);
    }

    fn read_counts(&self) -> Option<(u64, u64)> {
        let stat = std::fs::read_to_string(&self.device_stat).ok()?;
        let io = std::fs::read_to_string("/proc/self/io").ok()?;
        Some((disk_bytes_read(&stat)?, own_bytes_read(&io)?))
    }
}

/// Bytes read by a block device, from its `stat` file: the third field counts 512-byte
/// sectors whatever the device's block size (Documentation/block/stat.rst).
fn disk_bytes_read(stat: &str) -> Option<u64> {
    let sectors: u64 = stat.split_whitespace().nth(2)?.parse().ok()?;
    Some(sectors * 512)
}

/// `read_bytes` of `/proc/<pid>/io`: bytes the process caused to be read from storage.
fn own_bytes_read(io: &str) -> Option<u64> {
    io.lines()
        .find_map(|l| l.strip_prefix("read_bytes:"))?
        .trim()
        .parse()
        .ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_are_parsed_from_the_kernels_formats() {
        let stat = "   12345        0  2000000   5000    10    0    80    3    0  4000  5003 \
                    0 0 0 0 0 0\n";
        assert_eq!(disk_bytes_read(stat), Some(2_000_000 * 512));
        let io = "rchar: 100\nwchar: 0\nsyscr: 3\nsyscw: 0\nread_bytes: 8192\n\
                  write_bytes: 0\ncancelled_write_bytes: 0\n";
        assert_eq!(own_bytes_read(io), Some(8192));
        assert_eq!(disk_bytes_read(""), None);
        assert_eq!(own_bytes_read("rchar: 1\n"), None);
    }

    /// How many looks a yield takes: none on a quiet disk or for a reader someone waits
    /// for, until the disk is quiet, and no more than the longest wait allows.
    #[test]
    fn a_yield_looks_until_the_disk_is_quiet_or_the_wait_is_up() {
        let looks = |busy: bool, quiet_after: usize, still: bool| {
            let mut n = 0;
            yield_to_others(
                busy,
                || {
                    n += 1;
                    n < quiet_after
                },
                || still,
            );
            n
        };
        assert_eq!(looks(false, usize::MAX, true), 0, "quiet");
        assert_eq!(looks(true, usize::MAX, false), 0, "someone waits");
        assert_eq!(looks(true, 3, true), 3, "quiet at the third look");
        let most = (MAX_YIELD.as_millis() / YIELD_PAUSE.as_millis()) as usize;
        let n = looks(true, usize::MAX, true);
        assert!((1..=most).contains(&n), "{n} looks of at most {most}");
    }

    /// A read of this process's own from the disk is not counted as another's; a read by
    /// another process is. Needs a file on a block device whose cache can be dropped.
    #[test]
    fn reads_by_others_are_told_from_our_own() {
        use std::io::Write;
        use std::os::unix::fs::FileExt;
        let dir = tempfile::tempdir_in("/var/tmp").unwrap();
        let path = dir.path().join("f");
        let mut f = File::create(&path).unwrap();
        f.write_all(&vec![7u8; 4 << 20]).unwrap();
        f.sync_all().unwrap();
        let Some(share) = DiskShare::of(&f) else {
            eprintln!("skipped: /var/tmp is on no block device with statistics");
            return;
        };
        let evict = |f: &File| {
            use std::os::fd::AsRawFd;
            // SAFETY: advice on an open descriptor.
            unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
        };
        evict(&f);
        let mut buf = vec![0u8; 4 << 20];
        File::open(&path)
            .unwrap()
            .read_exact_at(&mut buf, 0)
            .unwrap();
        let ours = share.others_read().unwrap();
        evict(&f);
        // Read by a process that is not our child: a child's reads count as ours once it is
        // waited for.
        let done = dir.path().join("done");
        let script = format!(
            "(dd if={} of=/dev/null bs=1M 2>/dev/null; touch {}) &",
            path.display(),
            done.display()
        );
        let status = std::process::Command::new("sh")
            .args(["-c", &script])
            .status()
            .unwrap();
        assert!(status.success());
        let t0 = std::time::Instant::now();
        while !done.exists() {
            assert!(t0.elapsed().as_secs() < 30, "dd did not finish");
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        let theirs = share.others_read().unwrap();
        // Other processes on the machine may read meanwhile; the 4 MiB are what we check.
        assert!(theirs >= 4 << 20, "dd's read not seen: {theirs} bytes");
        assert!(
            ours < 4 << 20,
            "our own read counted as another's: {ours} bytes"
        );
    }
}
