//! Mounting the binary for real and reading through the kernel: the harness of the
//! integration tests (through tests/common) and of examples/kllm-stress.rs. Only in builds
//! with the `seal` feature, beside the sealer.
//!
//! - the binary ([`kllm_mount_bin`]) and the mount guard [`Mnt`]: a temporary mount point
//!   that is unmounted, its daemons ended and removed on drop, even after a panic; it mounts
//!   in the background ([`Mnt::mount`], [`Mnt::mount_with`]; [`Mounted`] holds the guard and
//!   its daemon) or in the foreground ([`Mnt::start_foreground`]); [`run`] and [`stderr_of`]
//!   for commands whose refusal is the point;
//! - the mount table: [`mount_points`], [`is_mounted`], [`fusermount_u`];
//! - processes: [`become_subreaper`], [`proc_stat_fields`], [`proc_state`], [`alive`], [`pids_with_arg`],
//!   [`wait_gone`], [`kill`], [`rss_kib`];
//! - reading: [`pread`], [`read_direct`], [`open_direct`], [`drop_page_cache`], [`listing`],
//!   and for failures [`errno_of`], [`cpath`]; [`copy_tree`] for writable copies of sealed
//!   directories;
//! - [`SplitMix`], a small seeded generator.

use std::collections::BTreeSet;
use std::ffi::{CString, OsStr, OsString};
use std::fs::{self, File, OpenOptions};
use std::io::{self, Read};
use std::os::fd::AsRawFd;
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::os::unix::fs::{FileExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use tempfile::TempDir;

// ---------------------------------------------------------------------------------------
// Processes
// ---------------------------------------------------------------------------------------

/// The `kllm-mount` binary, which Cargo builds beside the directory of the running test or
/// example (`target/PROFILE/deps/..`, `target/PROFILE/examples/..`).
pub fn kllm_mount_bin() -> PathBuf {
    let exe = std::env::current_exe().expect("current_exe");
    let profile_dir = exe.parent().and_then(Path::parent).expect("target dir");
    profile_dir.join("kllm-mount")
}

/// Daemons that outlive the `kllm-mount` that forked them become our children, so their exit
/// status can be collected (and they never linger as zombies of some other init).
pub fn become_subreaper() {
    static ONCE: OnceLock<()> = OnceLock::new();
    ONCE.get_or_init(|| {
        // SAFETY: a plain prctl on this process.
        unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) };
    });
}

/// The fields of `/proc/PID/stat` after the command name (state, ppid, pgrp, session,
/// ...), `None` when the process is gone.
pub fn proc_stat_fields(pid: i32) -> Option<Vec<String>> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The name is in parentheses and may hold spaces and ')': the fields follow the last.
    let fields = stat.rsplit_once(')')?.1;
    Some(fields.split_whitespace().map(str::to_string).collect())
}

/// The process state letter of `pid`, `None` when it is gone.
pub fn proc_state(pid: i32) -> Option<char> {
    proc_stat_fields(pid)?.first()?.chars().next()
}

/// Running, not a zombie.
pub fn alive(pid: i32) -> bool {
    !matches!(proc_state(pid), None | Some('Z') | Some('X'))
}

/// Live processes (not zombies) with `arg` as one of their arguments; never this process.
pub fn pids_with_arg(arg: &Path) -> Vec<i32> {
    let me = std::process::id() as i32;
    fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter(|&pid| pid != me && alive(pid))
        .filter(|pid| {
            fs::read(format!("/proc/{pid}/cmdline")).is_ok_and(|c| {
                c.split(|&b| b == 0)
                    .any(|a| a == arg.as_os_str().as_bytes())
            })
        })
        .collect()
}

/// How a process we waited for ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Gone {
    /// Reaped by us: `Some(code)` for a normal exit, `None` when killed by a signal.
    Exited(Option<i32>),
    /// Not our child; it is gone or a zombie.
    Vanished,
}

/// Wait up to `timeout` for `pid` to end, reaping it when it is ours. `None` if it is still
/// running then.
pub fn wait_gone(pid: i32, timeout: Duration) -> Option<Gone> {
    let deadline = Instant::now() + timeout;
    loop {
        let mut status = 0;
        // SAFETY: waitpid on one pid with WNOHANG.
        let r = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
        if r == pid {
            return Some(Gone::Exited(
                libc::WIFEXITED(status).then(|| libc::WEXITSTATUS(status)),
            ));
        }
        if r < 0 && !alive(pid) {
            return Some(Gone::Vanished);
        }
        if Instant::now() >= deadline {
            return None;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

pub fn kill(pid: i32, sig: i32) {
    // SAFETY: a signal to one process the caller started or was told to test.
    unsafe { libc::kill(pid, sig) };
}

/// Resident memory of a process in KiB, from /proc/PID/status.
#[derive(Clone, Copy, Debug, Default)]
pub struct Rss {
    /// `RssAnon + RssFile`: the process's own memory.
    pub own_kib: u64,
    /// `RssShmem`: shared memory it maps (a daemon's decoded copies in passthrough mode).
    pub shmem_kib: u64,
}

/// The resident memory of `pid`; `None` once it is gone.
pub fn rss(pid: i32) -> Option<Rss> {
    let status = fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let field = |name: &str| -> Option<u64> {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
    };
    Some(Rss {
        own_kib: field("RssAnon")? + field("RssFile")?,
        shmem_kib: field("RssShmem")?,
    })
}

// ---------------------------------------------------------------------------------------
// The mount table
// ---------------------------------------------------------------------------------------

/// A mountinfo field with its octal escapes (`\040` for a space, ...) undone.
fn unescape_mountinfo(field: &str) -> PathBuf {
    let b = field.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\' && i + 3 < b.len() && b[i + 1..i + 4].iter().all(u8::is_ascii_digit) {
            out.push((b[i + 1] - b'0') * 64 + (b[i + 2] - b'0') * 8 + (b[i + 3] - b'0'));
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    PathBuf::from(OsString::from_vec(out))
}

/// `/proc/self/mountinfo`'s mount points, unescaped.
pub fn mount_points() -> Vec<PathBuf> {
    fs::read_to_string("/proc/self/mountinfo")
        .unwrap()
        .lines()
        .filter_map(|l| l.split(' ').nth(4))
        .map(unescape_mountinfo)
        .collect()
}

pub fn is_mounted(mp: &Path) -> bool {
    mount_points().iter().any(|p| p == mp)
}

pub fn fusermount_u(mp: &Path, lazy: bool) -> bool {
    let mut c = Command::new("fusermount3");
    c.args(["-u", "-q"]);
    if lazy {
        c.arg("-z");
    }
    c.arg(mp)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

// ---------------------------------------------------------------------------------------
// The mount guard
// ---------------------------------------------------------------------------------------

/// A temporary directory (mode 0755, so other users can reach a mount inside it) holding a
/// mount point (`mp`) and an empty `home` for `HOME`. Dropping it unmounts whatever is
/// mounted there, ends and reaps the processes serving it and removes it all, also when the
/// test panicked.
pub struct Mnt {
    dir: TempDir,
    pub mp: PathBuf,
    pub home: PathBuf,
    /// A `-f` process, when the test started one.
    pub child: Option<Child>,
    /// Background daemons that served this mount point: once gone they are zombies, which
    /// [`pids_with_arg`] no longer finds, so they are remembered to be reaped.
    daemons: Mutex<Vec<i32>>,
}

impl Default for Mnt {
    fn default() -> Self {
        Self::new()
    }
}

impl Mnt {
    pub fn new() -> Mnt {
        become_subreaper();
        let dir = tempfile::Builder::new()
            .prefix("kllm-mount-test.")
            .tempdir()
            .unwrap();
        fs::set_permissions(dir.path(), fs::Permissions::from_mode(0o755)).unwrap();
        let root = fs::canonicalize(dir.path()).unwrap();
        let mp = root.join("mnt");
        let home = root.join("home");
        fs::create_dir(&mp).unwrap();
        fs::create_dir(&home).unwrap();
        Mnt {
            dir,
            mp,
            home,
            child: None,
            daemons: Mutex::new(Vec::new()),
        }
    }

    /// The temporary directory, for files a test writes beside the mount point.
    pub fn scratch(&self) -> &Path {
        self.dir.path()
    }

    /// `kllm-mount SEALED MP`, with no key in the environment and an empty HOME.
    pub fn cmd(&self, sealed: &Path) -> Command {
        let mut c = Command::new(kllm_mount_bin());
        c.arg(sealed)
            .arg(&self.mp)
            .env_remove("KLLM_MODEL_KEY")
            .env_remove("KLLM_PASSPHRASE")
            .env_remove("RUST_LOG")
            .env("HOME", &self.home)
            .stdin(Stdio::null());
        c
    }

    pub fn path(&self, rel: &str) -> PathBuf {
        self.mp.join(rel)
    }

    /// The one background daemon serving this mount point.
    pub fn daemon(&self) -> i32 {
        let pids = pids_with_arg(&self.mp);
        assert_eq!(
            pids.len(),
            1,
            "daemons serving {}: {pids:?}",
            self.mp.display()
        );
        pids[0]
    }

    /// Run a background mount command (from [`Mnt::cmd`]): it must exit 0 with the mount in
    /// mountinfo the moment it returns and exactly one daemon serving it, whose pid this is.
    pub fn mount(&self, c: Command) -> i32 {
        self.mount_reporting(c).0
    }

    /// [`Mnt::mount`], and what the command wrote to stderr (warnings given at mount).
    pub fn mount_reporting(&self, c: Command) -> (i32, String) {
        let out = run(c);
        assert!(
            out.status.success(),
            "mount on {} failed ({}): {}",
            self.mp.display(),
            out.status,
            stderr_of(&out)
        );
        assert!(
            is_mounted(&self.mp),
            "kllm-mount returned 0 but {} is not in mountinfo",
            self.mp.display()
        );
        let pid = self.daemon();
        self.daemons.lock().unwrap().push(pid);
        (pid, stderr_of(&out))
    }

    /// [`Mnt::mount`] of `kllm-mount SEALED MP ARGS`, after `tweak` changed the command (the
    /// environment, limits, a wrapper); the daemon's pid.
    pub fn mount_with<A: AsRef<OsStr>>(
        &self,
        sealed: &Path,
        args: &[A],
        tweak: impl FnOnce(&mut Command),
    ) -> i32 {
        let mut c = self.cmd(sealed);
        c.args(args);
        tweak(&mut c);
        self.mount(c)
    }

    /// Start `kllm-mount SEALED MP -f ARGS` (as [`Mnt::cmd`], with `env` added) as
    /// [`Mnt::child`] and wait until the mount answers: mounted and its root lists a file.
    pub fn start_foreground(&mut self, sealed: &Path, args: &[OsString], env: &[(&str, String)]) {
        let mut cmd = self.cmd(sealed);
        cmd.arg("-f")
            .args(args)
            .envs(env.iter().map(|(k, v)| (*k, v)))
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        let child = self.child.insert(cmd.spawn().unwrap());
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let answers = || fs::read_dir(&self.mp).is_ok_and(|mut d| d.next().is_some());
            if is_mounted(&self.mp) && answers() {
                return;
            }
            if let Some(st) = child.try_wait().unwrap() {
                let mut err = String::new();
                let _ = child.stderr.take().unwrap().read_to_string(&mut err);
                panic!("kllm-mount -f exited ({st}) before mounting: {err}");
            }
            assert!(
                Instant::now() < deadline,
                "kllm-mount -f did not mount in 20 s"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Drop for Mnt {
    fn drop(&mut self) {
        if is_mounted(&self.mp) && !fusermount_u(&self.mp, false) {
            fusermount_u(&self.mp, true);
        }
        let mut ours = pids_with_arg(&self.mp);
        ours.extend(
            self.daemons
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .iter(),
        );
        if let Some(c) = &self.child {
            ours.push(c.id() as i32);
        }
        ours.sort_unstable();
        ours.dedup();
        for pid in ours {
            if wait_gone(pid, Duration::from_secs(5)).is_none() {
                kill(pid, libc::SIGKILL);
                wait_gone(pid, Duration::from_secs(5));
            }
        }
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        if is_mounted(&self.mp) {
            fusermount_u(&self.mp, true);
        }
    }
}

/// A background mount and the daemon serving it, in one guard: dropping it unmounts, ends
/// the daemon and removes the mount point.
pub struct Mounted {
    pub mnt: Mnt,
    pub pid: i32,
}

impl std::ops::Deref for Mounted {
    type Target = Mnt;
    fn deref(&self) -> &Mnt {
        &self.mnt
    }
}

impl Mounted {
    /// [`Mnt::mount_with`] on a new mount point through FUSE (`--mode fuse`), run in the
    /// mount's temporary directory (where a core file would land). For tests that hold the
    /// daemon's own read path to account: exact `O_DIRECT` ranges, files changed while
    /// mounted, its locked cache.
    pub fn fuse<A: AsRef<OsStr>>(
        sealed: &Path,
        args: &[A],
        tweak: impl FnOnce(&mut Command),
    ) -> Mounted {
        let mnt = Mnt::new();
        let dir = mnt.mp.parent().unwrap().to_path_buf();
        let pid = mnt.mount_with(sealed, &[OsStr::new("--mode"), OsStr::new("fuse")], |c| {
            c.args(args).current_dir(dir);
            tweak(c);
        });
        Mounted { mnt, pid }
    }

    /// The daemon still runs and the mount still answers.
    pub fn assert_alive(&self, what: &str) {
        assert!(alive(self.pid), "{what}: the daemon died");
        assert!(is_mounted(&self.mp), "{what}: no longer mounted");
        fs::metadata(&self.mp).unwrap_or_else(|e| panic!("{what}: the mount does not answer: {e}"));
    }
}

/// Run `c` to the end with its output captured.
pub fn run(mut c: Command) -> Output {
    c.stdout(Stdio::piped()).stderr(Stdio::piped());
    c.output().expect("run kllm-mount")
}

pub fn stderr_of(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

// ---------------------------------------------------------------------------------------
// Reading and failing
// ---------------------------------------------------------------------------------------

/// Open for reading with `O_DIRECT`, so every read goes to the daemon.
pub fn open_direct(path: &Path) -> File {
    OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(path)
        .unwrap_or_else(|e| panic!("open O_DIRECT {}: {e}", path.display()))
}

/// Drop the kernel's cached pages of a file so the next reads go to the daemon.
pub fn drop_page_cache(f: &File) {
    // SAFETY: advice on a descriptor we hold.
    unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
}

/// Fill `buf` from `off`, or up to the end of the file; how many bytes were read.
fn read_full_at(f: &File, buf: &mut [u8], off: u64) -> io::Result<usize> {
    let mut got = 0;
    while got < buf.len() {
        match f.read_at(&mut buf[got..], off + got as u64) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(got)
}

/// `pread` until `len` bytes or the end of the file.
pub fn pread(f: &File, off: u64, len: usize) -> io::Result<Vec<u8>> {
    let mut buf = vec![0u8; len];
    let got = read_full_at(f, &mut buf, off)?;
    buf.truncate(got);
    Ok(buf)
}

/// What a directory lists (names), through the kernel.
pub fn listing(dir: &Path) -> BTreeSet<String> {
    fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("list {}: {e}", dir.display()))
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect()
}

/// The whole file through the daemon (`O_DIRECT`: no page cache in between).
pub fn read_direct(path: &Path) -> io::Result<Vec<u8>> {
    let f = open_direct(path);
    let len = f.metadata()?.len() as usize;
    pread(&f, 0, len)
}

/// `pread` through an `O_DIRECT` descriptor of a file served by passthrough, which follows
/// its backing file system's rules: offset, length and buffer aligned to 4 KiB. Reads the
/// aligned span around `[off, off + len)` and returns that range of it.
pub fn pread_direct_aligned(f: &File, off: u64, len: usize) -> io::Result<Vec<u8>> {
    const ALIGN: u64 = 4096;
    let start = off / ALIGN * ALIGN;
    let end = (off + len as u64).div_ceil(ALIGN) * ALIGN;
    let span = (end - start).max(ALIGN) as usize;
    let mut buf = memmap2::MmapMut::map_anon(span)?;
    let got = read_full_at(f, &mut buf, start)?;
    let lo = ((off - start) as usize).min(got);
    let hi = (lo + len).min(got);
    Ok(buf[lo..hi].to_vec())
}

/// The errno of a call that must fail; panics if it succeeded or failed without one.
pub fn errno_of<T: std::fmt::Debug>(r: io::Result<T>, what: &str) -> i32 {
    match r {
        Ok(v) => {
            // Whole files may come back: show a prefix of what did.
            let mut shown = format!("{v:?}");
            if shown.len() > 200 {
                let cut = (0..=200)
                    .rev()
                    .find(|&i| shown.is_char_boundary(i))
                    .unwrap();
                shown.truncate(cut);
                shown.push_str("...");
            }
            panic!("{what}: succeeded ({shown}), must fail")
        }
        Err(e) => e
            .raw_os_error()
            .unwrap_or_else(|| panic!("{what}: {e} has no errno")),
    }
}

pub fn cpath(p: &Path) -> CString {
    CString::new(p.as_os_str().as_bytes()).unwrap()
}

/// A writable copy of a directory tree (files 0644).
pub fn copy_tree(from: &Path, to: &Path) {
    fs::create_dir_all(to).unwrap();
    for e in fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        let dst = to.join(e.file_name());
        if e.file_type().unwrap().is_dir() {
            copy_tree(&e.path(), &dst);
        } else {
            fs::copy(e.path(), &dst).unwrap();
            fs::set_permissions(&dst, fs::Permissions::from_mode(0o644)).unwrap();
        }
    }
}

// ---------------------------------------------------------------------------------------
// Seeded randomness
// ---------------------------------------------------------------------------------------

/// splitmix64: a seeded generator that needs no crate.
pub struct SplitMix(pub u64);

impl SplitMix {
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (0 when `n` is 0).
    pub fn below(&mut self, n: u64) -> u64 {
        if n == 0 {
            0
        } else {
            self.next_u64() % n
        }
    }

    /// 1..=max, log-uniform: as many 10-byte reads as 1-MiB ones.
    pub fn size(&mut self, max: u64) -> u64 {
        let bits = 64 - max.leading_zeros() as u64;
        let b = self.below(bits) + 1;
        (self.below(1 << b) + 1).min(max)
    }
}
