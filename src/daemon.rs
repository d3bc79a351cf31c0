//! The daemon: mount, report readiness, serve until unmounted or signalled, unmount
//! cleanly; in the background, a forked child that reports back through a pipe. It takes
//! its [`Settings`] from the command line (src/cli.rs) and returns its errors there.

use std::io::{Read, Write};
use std::os::fd::{FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use fuser::{Config, MountOption, SessionACL};

use crate::budget::{self, Budgets};
use crate::fuse::KllmFs;
use crate::kernel_mount::Unmounter;
use crate::limits::Limits;
use crate::passthrough::Reclaim;
use crate::passthrough::{Copies, ServeMode};
use crate::pressure::{Guard, Watcher, Watermarks};
use crate::status::StatusServer;
use crate::view::View;
use crate::{Error, Result};

/// What the daemon needs to mount and serve, built by the command line (src/cli.rs).
#[derive(Debug, Clone)]
pub struct Settings {
    /// The sealed directory: the mount's source in the mount table, and in `--status`.
    pub source: PathBuf,
    pub mountpoint: PathBuf,
    /// FUSE options, comma-separated, as `-o` gives them.
    pub fuse_options: Vec<String>,
    /// Threads serving kernel requests.
    pub threads: usize,
    /// The kernel's readahead window for the mount, in bytes; 0 keeps the kernel's.
    pub readahead: u64,
    /// The memory budgets (src/budget.rs).
    pub budgets: Budgets,
    /// The limits they were decided from, watched while serving (src/pressure.rs).
    pub limits: Limits,
    /// How decoded copies are made and kept in passthrough mode.
    pub copies: Copies,
}

/// What a mount serves: the view, and the mode it is served in.
pub struct Served {
    pub view: View,
    pub mode: ServeMode,
}

/// FUSE mount configuration from the command line; the mount is always read-only.
pub fn fuse_config(sealed: &Path, options: &[String], threads: usize) -> Result<Config> {
    let mut cfg = Config::default();
    // ops: `fuse.kllm-mount` in /proc/mounts, with the resolved sealed path as its source.
    let source = std::fs::canonicalize(sealed).unwrap_or_else(|_| sealed.to_path_buf());
    let mut opts = vec![
        MountOption::FSName(source.to_string_lossy().into_owned()),
        MountOption::Subtype(crate::mounttab::SUBTYPE.into()),
        MountOption::RO,
        MountOption::NoDev,
        MountOption::NoSuid,
        MountOption::DefaultPermissions,
    ];
    for opt in options
        .iter()
        .flat_map(|o| o.split(','))
        .map(str::trim)
        .filter(|o| !o.is_empty())
    {
        match opt {
            "allow_other" => cfg.acl = SessionACL::All,
            "allow_root" => cfg.acl = SessionACL::RootAndOwner,
            "ro" | "default_permissions" | "nodev" | "nosuid" => {}
            "rw" => return Err(Error::new("-o rw: the view is read-only")),
            "auto_unmount" => opts.push(MountOption::AutoUnmount),
            "exec" => opts.push(MountOption::Exec),
            "noexec" => opts.push(MountOption::NoExec),
            "atime" => opts.push(MountOption::Atime),
            "noatime" => opts.push(MountOption::NoAtime),
            o if o.starts_with("fsname=") => opts[0] = MountOption::FSName(o[7..].into()),
            o if o.starts_with("subtype=") => opts[1] = MountOption::Subtype(o[8..].into()),
            o => opts.push(MountOption::CUSTOM(o.into())),
        }
    }
    cfg.mount_options = opts;
    cfg.n_threads = Some(threads.max(1));
    cfg.clone_fd = true;
    Ok(cfg)
}

enum Event {
    Signal(i32),
    Ended(std::io::Result<()>),
}

/// Mount and serve until unmounted or signalled. `ready` is called once the mount answers,
/// or with the error that stopped it.
pub fn serve(settings: &Settings, served: Served, ready: impl FnOnce(Result<()>)) -> Result<()> {
    let (tx, rx) = mpsc::channel();
    let view = Arc::new(served.view);
    let mode = Arc::new(served.mode);
    let guard = Arc::new(memory_guard(settings));
    let session = start_session(settings, view.clone(), mode.clone(), guard.clone(), tx);
    let (mut unmounter, reclaim) = match session {
        Ok(u) => u,
        Err(e) => {
            ready(Err(e.clone()));
            return Err(e);
        }
    };
    // The handshake is done; a stat through the kernel proves the mount answers.
    if let Err(e) = std::fs::metadata(&settings.mountpoint) {
        let err = Error::at(
            &settings.mountpoint,
            format!("mounted but does not answer ({e})"),
        );
        let _ = unmounter.unmount();
        ready(Err(err.clone()));
        return Err(err);
    }
    raise_readahead(&settings.mountpoint, settings.readahead);
    let _watcher = Watcher::start(
        guard.clone(),
        crate::pressure::POLL,
        Box::new(move |bytes| reclaim.give_back(bytes)),
    );
    let _status = start_status(settings, view, mode, guard);
    ready(Ok(()));
    log::info!(
        "mounted {} at {}",
        settings.source.display(),
        settings.mountpoint.display()
    );
    wait_for_end(&settings.mountpoint, &rx, unmounter)
}

/// Catch signals, mount, and run the session and the signal watcher on threads of their
/// own that report to `events`.
fn start_session(
    settings: &Settings,
    view: Arc<View>,
    mode: Arc<ServeMode>,
    guard: Arc<Guard>,
    events: mpsc::Sender<Event>,
) -> Result<(Unmounter, Reclaim)> {
    // Signals are caught before mounting, so none can end the process with the mount left.
    let mut signals =
        signal_hook::iterator::Signals::new([libc::SIGTERM, libc::SIGINT, libc::SIGHUP])
            .map_err(|e| Error::new(format!("cannot handle signals ({e})")))?;
    let cfg = fuse_config(&settings.source, &settings.fuse_options, settings.threads)?;
    // rayon's global pool decodes large reads; unnamed, its threads would carry the name of
    // the FUSE thread that first decoded (`fuser-1` in `top -H` and `perf`). Already built
    // (a mount-time use came first), it keeps that name.
    let _ = rayon::ThreadPoolBuilder::new()
        .thread_name(|i| format!("kllm-decode-{i}"))
        .build_global();
    // Looked up before mounting: afterwards the path's last step is the mount itself.
    let mountpoint =
        std::fs::canonicalize(&settings.mountpoint).unwrap_or_else(|_| settings.mountpoint.clone());
    let fs = KllmFs::new(view, mode, settings.copies.clone(), guard)
        .mounted_at(mountpoint)
        .on_destroy(Box::new(|| {
            log::info!("session ended; exiting");
            std::process::exit(0)
        }));
    let reclaim = fs.reclaim();
    let notifier = fs.notifier_slot();
    // As root mount(2) as `fuse.kllm-mount` with the sealed path as source, else through
    // fusermount3 (src/kernel_mount.rs).
    let (session, unmounter) =
        crate::kernel_mount::mount(fs, &settings.mountpoint, &cfg).map_err(|e| {
            let hint = if e.kind() == std::io::ErrorKind::NotFound {
                " (is fuse3 installed? fusermount3 was not found)"
            } else {
                ""
            };
            Error::at(&settings.mountpoint, format!("cannot mount ({e}){hint}"))
        })?;
    if let Some(slot) = notifier {
        let _ = slot.set(session.notifier());
    }
    let ended = events.clone();
    spawn("kllm-session", move || {
        let _ = ended.send(Event::Ended(session.run()));
    })?;
    spawn("kllm-signals", move || {
        if let Some(sig) = signals.forever().next() {
            let _ = events.send(Event::Signal(sig));
        }
    })?;
    Ok((unmounter, reclaim))
}

/// The memory limit and its watermarks: past the high one, memory is given back; the
/// low one leaves the daemon its working memory, or a sixteenth of the limit if more.
fn memory_guard(settings: &Settings) -> Guard {
    let limit = settings.budgets.limit.bytes;
    let reserve = budget::headroom(settings.threads).max(limit / 16);
    Guard::new(
        settings.limits.clone(),
        Watermarks::for_limit(limit, reserve),
    )
}

/// The status socket (`kllm-mount --status`), its gauges read at each request. A mount
/// without one still serves: the socket is for watching, not for reading the model.
fn start_status(
    settings: &Settings,
    view: Arc<View>,
    mode: Arc<ServeMode>,
    guard: Arc<Guard>,
) -> Option<StatusServer> {
    let budgets = settings.budgets.clone();
    let copies = settings.copies.clone();
    let stats = view.stats().clone();
    let (now, _) = mode.describe();
    let extra = move || {
        let stats = view.stats();
        stats.cache_bytes.store(
            view.cache().held_bytes(),
            std::sync::atomic::Ordering::Relaxed,
        );
        let backing = mode.memory().and_then(|m| m.used().ok()).unwrap_or(0);
        stats
            .backing_bytes
            .store(backing, std::sync::atomic::Ordering::Relaxed);
        let (name, why) = mode.describe();
        serde_json::json!({
            "mode": name,
            "mode_reason": why,
            "cache_capacity": view.cache().capacity_bytes(),
            "backing_budget": mode.memory().map(|m| m.budget()),
            "keep_decoded_s": copies.grace.as_secs_f64(),
            "decode_ahead": copies.decode_ahead,
            "memory": memory_status(&budgets, &guard),
        })
    };
    match StatusServer::start(&settings.mountpoint, &settings.source, now, stats, extra) {
        Ok(s) => Some(s),
        Err(e) => {
            log::warn!("no status socket: {e}");
            None
        }
    }
}

/// `--status`'s `memory`: the limit, where it comes from, the budgets decided from it,
/// and what the pressure watcher saw (docs/STATUS.md).
fn memory_status(budgets: &Budgets, guard: &Guard) -> serde_json::Value {
    use std::sync::atomic::Ordering::Relaxed;
    let limits = guard.limits();
    let stats = guard.stats();
    serde_json::json!({
        "limit": budgets.limit.bytes,
        "limit_source": budgets.limit.source.kind(),
        "limit_from": budgets.limit.source.to_string(),
        "machine": limits.machine,
        "cgroup": limits.cgroup_limit.as_ref().map(|l| l.bytes),
        "rlimit_as": limits.rlimits.address_space,
        "rlimit_data": limits.rlimits.data,
        "passthrough_budget": budgets.passthrough_memory,
        "cache_budget": budgets.block_cache,
        "reserved": budgets.reserved,
        "in_use": guard.usage(),
        "give_back_above": guard.marks().high,
        "pressure_episodes": stats.episodes.load(Relaxed),
        "given_back": stats.given_back.load(Relaxed),
    })
}

fn spawn(name: &str, f: impl FnOnce() + Send + 'static) -> Result<()> {
    std::thread::Builder::new()
        .name(name.into())
        .spawn(f)
        .map(drop)
        .map_err(|e| Error::new(format!("cannot start the {name} thread ({e})")))
}

/// Serve until the session ends (unmounted from outside) or a signal asks to unmount.
fn wait_for_end(
    mountpoint: &Path,
    events: &mpsc::Receiver<Event>,
    mut unmounter: Unmounter,
) -> Result<()> {
    match events.recv() {
        Ok(Event::Signal(sig)) => {
            log::info!("signal {sig}: unmounting {}", mountpoint.display());
            if let Err(e) = unmounter.unmount() {
                // Busy (files open): detach lazily; the exit below then ends the connection.
                log::info!(
                    "unmount of {} failed ({e}); detaching it",
                    mountpoint.display()
                );
                if let Err(e) = detach(mountpoint) {
                    log::error!("cannot unmount {}: {e}", mountpoint.display());
                }
            }
            // Open files keep a lazily detached mount alive; the process exit that follows
            // closes the connection, and their reads then fail instead of hanging.
            let _ = events.recv_timeout(Duration::from_secs(2));
            Ok(())
        }
        Ok(Event::Ended(Ok(()))) | Err(_) => {
            log::info!("{} was unmounted", mountpoint.display());
            Ok(())
        }
        Ok(Event::Ended(Err(e))) => Err(Error::new(format!("the FUSE session failed: {e}"))),
    }
}

/// The kernel offers a FUSE mount 128 KiB of readahead, and no more can be asked for at
/// INIT; its backing device's `read_ahead_kb` can be raised afterwards (root only). Larger
/// windows mean more requests in flight, decoded side by side, and fewer round trips.
fn raise_readahead(mountpoint: &Path, bytes: u64) {
    use std::os::unix::fs::MetadataExt;
    if bytes == 0 {
        return;
    }
    let Ok(meta) = std::fs::metadata(mountpoint) else {
        return;
    };
    let dev = meta.dev();
    let (major, minor) = (libc::major(dev), libc::minor(dev));
    let knob = format!("/sys/class/bdi/{major}:{minor}/read_ahead_kb");
    let kb = bytes.div_ceil(1024);
    match std::fs::write(&knob, kb.to_string()) {
        Ok(()) => log::debug!("{knob} set to {kb}"),
        Err(e) => log::debug!("cannot raise {knob} ({e}); reads stay at the kernel's window"),
    }
}

/// Lazy unmount: `umount2(MNT_DETACH)` as root, else `fusermount3 -u -z`.
fn detach(mountpoint: &Path) -> std::io::Result<()> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(mountpoint.as_os_str().as_bytes())?;
    // SAFETY: a NUL-terminated path and a valid flag.
    if unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) } == 0 {
        return Ok(());
    }
    let status = std::process::Command::new("fusermount3")
        .arg("-u")
        .arg("-z")
        .arg(mountpoint)
        .status()?;
    if status.success() {
        Ok(())
    } else {
        Err(std::io::Error::other(format!(
            "fusermount3 -u -z exited with {status}"
        )))
    }
}

/// Threads of this process, from `/proc/self/status` (`None` where it cannot be read).
fn threads_now() -> Option<usize> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("Threads:"))
        .and_then(|n| n.trim().parse().ok())
}

/// Wait up to `limit` for this process to be down to one thread; the count left when not.
/// Where the count cannot be read, go on.
fn wait_single_threaded(limit: Duration) -> std::result::Result<(), usize> {
    let deadline = Instant::now() + limit;
    loop {
        match threads_now() {
            None | Some(1) => return Ok(()),
            Some(n) if Instant::now() >= deadline => return Err(n),
            Some(_) => std::thread::sleep(Duration::from_millis(2)),
        }
    }
}

/// Fork a daemon that mounts and serves, then exits. The parent returns once the mount
/// answers, or with the daemon's error. No thread exists then (a remote source's I/O
/// threads are stopped first, and started again on their next use), so forking is safe.
pub fn daemonize(settings: &Settings, served: Served) -> Result<()> {
    #[cfg(feature = "remote")]
    crate::source::remote::quiesce_for_fork();
    // A thread alive at the fork is gone in the daemon, with whatever it held or was to do
    // (a rayon pool started before the fork left every decode handed to it waiting forever,
    // `--verify mount`'s hash once did): refuse to fork rather than start a daemon that
    // hangs. Threads of pools already dropped are let finish exiting first.
    wait_single_threaded(Duration::from_secs(5)).map_err(|n| {
        Error::new(format!(
            "cannot start the daemon: {n} threads still run before the fork (a bug); \
             -f serves in the foreground"
        ))
    })?;
    let mut fds = [0i32; 2];
    // SAFETY: pipe2 fills two descriptors we then own.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(Error::new(format!(
            "cannot create a pipe ({})",
            std::io::Error::last_os_error()
        )));
    }
    // SAFETY: both descriptors were just created and are owned here alone.
    let (rd, wr) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    // SAFETY: single-threaded here (no thread was started yet).
    match unsafe { libc::fork() } {
        -1 => Err(Error::new(format!(
            "cannot fork ({})",
            std::io::Error::last_os_error()
        ))),
        0 => {
            drop(rd);
            // SAFETY: leaving the caller's process group and pointing stdio at /dev/null, in
            // the child.
            unsafe {
                // A process group of its own, out of the terminal's foreground (no ^C, no
                // hangup), but the caller's session: a new session would be a scheduling
                // group of its own (autogroup), which gets an equal share of the CPU against
                // the engine started from the same shell however far in the background work
                // ahead runs (docs/DESIGN.md, "Decode ahead").
                libc::setpgid(0, 0);
                let null = libc::open(c"/dev/null".as_ptr(), libc::O_RDWR);
                if null >= 0 {
                    libc::dup2(null, 0);
                    libc::dup2(null, 1);
                    libc::dup2(null, 2);
                    if null > 2 {
                        libc::close(null);
                    }
                }
            }
            let mut wr = std::fs::File::from(wr);
            let result = serve(settings, served, |status| {
                let msg = match status {
                    Ok(()) => "OK\n".to_string(),
                    Err(e) => format!("ERR {e}\n"),
                };
                let _ = wr.write_all(msg.as_bytes());
                drop(wr);
            });
            std::process::exit(if result.is_ok() { 0 } else { 1 });
        }
        _child => {
            drop(wr);
            drop(served);
            let mut status = String::new();
            let _ = std::fs::File::from(rd).read_to_string(&mut status);
            match status.strip_prefix("ERR ") {
                _ if status.starts_with("OK") => Ok(()),
                Some(msg) => Err(Error::new(msg.trim_end())),
                None => Err(Error::new(
                    "the mount daemon exited before the mount was ready",
                )),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The count sees threads that run (the harness's main thread, this test's, and three
    /// more), and the wait for one thread gives up on them.
    #[test]
    fn running_threads_hold_the_fork_back() {
        let (stop, stopped) = mpsc::channel::<()>();
        let stopped = Arc::new(std::sync::Mutex::new(stopped));
        let threads: Vec<_> = (0..3)
            .map(|_| {
                let stopped = stopped.clone();
                std::thread::spawn(move || {
                    let _ = stopped.lock().map(|r| r.recv());
                })
            })
            .collect();
        let left = wait_single_threaded(Duration::from_millis(20)).unwrap_err();
        assert!(left >= 5, "{left} threads");
        drop(stop);
        threads.into_iter().for_each(|t| t.join().unwrap());
    }
}
