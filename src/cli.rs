//! The command line: check everything, build the view, then mount it in the foreground or
//! in a daemon that reports back only once the mount answers.

use std::io::{Read, Write};
use std::os::fd::{FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::Duration;

use clap::Parser;
use fuser::{Config, MountOption, SessionACL};

use crate::cache::parse_size;
use crate::fuse::KllmFs;
use crate::key;
use crate::sealed::{self, Options, Seal};
use crate::view::View;
use crate::{Error, Result};

#[derive(Parser, Debug)]
#[command(
    name = "kllm-mount",
    version,
    about = "Mount a kLLM-sealed checkpoint read-only, decoded in memory, as a plain Hugging Face checkpoint"
)]
pub struct Args {
    /// The sealed model directory.
    pub sealed: PathBuf,
    /// Where to show the unlocked view (an existing directory).
    pub mountpoint: PathBuf,
    /// kLLM key file (open or passphrase). Default: $KLLM_MODEL_KEY (64 hex digits), then
    /// <SEALED>/kllm.key, then ~/.kllm/keys/default.key.
    #[arg(long, value_name = "FILE")]
    pub key: Option<PathBuf>,
    /// Stay in the foreground (containers, systemd).
    #[arg(short = 'f', long)]
    pub foreground: bool,
    /// Budget of the decoded-data cache (K/M/G suffixes; 0 disables it).
    #[arg(long, value_name = "SIZE", default_value = "256M", value_parser = parse_size)]
    pub cache_size: u64,
    /// FUSE options, comma-separated (e.g. allow_other; never on by default).
    #[arg(short = 'o', value_name = "OPTIONS")]
    pub options: Vec<String>,
    /// The kernel's readahead window for the mount (K/M/G suffixes). Sequential readers
    /// then keep several requests in flight, decoded in parallel. Applied only as root;
    /// 0 keeps the kernel's 128 KiB.
    #[arg(long, value_name = "SIZE", default_value = "4M", value_parser = parse_size)]
    pub readahead: u64,
    /// Threads serving kernel requests.
    #[arg(long, value_name = "N", default_value_t = default_threads())]
    pub threads: usize,
    /// Append log lines to FILE (the daemon otherwise logs to syslog; -f logs to stderr).
    #[arg(long, value_name = "FILE")]
    pub log_file: Option<PathBuf>,
}

fn default_threads() -> usize {
    std::thread::available_parallelism()
        .map_or(4, |n| n.get())
        .clamp(4, 16)
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

/// Everything that can fail before mounting: arguments, the seal, the key, the view.
pub fn prepare(args: &Args) -> Result<View> {
    let mp = &args.mountpoint;
    // ops: refuse to stack a second view on one mount point (src/mounttab.rs).
    crate::mounttab::check_not_mounted(mp)?;
    match std::fs::metadata(mp) {
        Ok(m) if m.is_dir() => {}
        Ok(_) => return Err(Error::at(mp, "mount point is not a directory")),
        Err(e) => return Err(Error::at(mp, format!("mount point is not usable ({e})"))),
    }
    let seal = Seal::read(&args.sealed)?;
    let (model_key, source) = key::resolve(
        args.key.as_deref(),
        &args.sealed,
        &key::passphrase_from_env_or_prompt,
    )?;
    seal.check_key(&model_key, &source)?;
    scrub_env(&[key::KEY_ENV, key::PASSPHRASE_ENV]);
    let opts = Options::with_cache(args.cache_size);
    let view = sealed::build(&seal, &model_key, &opts)?;
    log::info!(
        "{}: {} nodes, lock {}, cache {} bytes",
        args.sealed.display(),
        view.len(),
        seal.lock.map_or("none", |v| v.label()),
        view.cache().capacity_bytes()
    );
    Ok(view)
}

enum Event {
    Signal(i32),
    Ended(std::io::Result<()>),
}

/// Mount and serve until unmounted or signalled. `ready` is called once the mount answers.
pub fn serve(args: &Args, view: View, ready: impl FnOnce(Result<()>)) -> Result<()> {
    let (tx, rx) = mpsc::channel();
    // Signals are caught before mounting, so none can end the process with the mount left.
    let mut signals =
        signal_hook::iterator::Signals::new([libc::SIGTERM, libc::SIGINT, libc::SIGHUP])
            .map_err(|e| Error::new(format!("cannot handle signals ({e})")))?;
    let cfg = match fuse_config(&args.sealed, &args.options, args.threads) {
        Ok(c) => c,
        Err(e) => {
            ready(Err(e.clone()));
            return Err(e);
        }
    };
    // ops: mount(2) as `fuse.kllm-mount` as root, else fusermount3 (src/kernel_mount.rs).
    let (session, mut unmounter) = match crate::kernel_mount::mount(
        KllmFs::new(Arc::new(view)).on_destroy(Box::new(|| {
            log::info!("session ended; exiting");
            std::process::exit(0)
        })),
        &args.mountpoint,
        &cfg,
    ) {
        Ok(s) => s,
        Err(e) => {
            let hint = if e.kind() == std::io::ErrorKind::NotFound {
                " (is fuse3 installed? fusermount3 was not found)"
            } else {
                ""
            };
            let e = Error::at(&args.mountpoint, format!("cannot mount ({e}){hint}"));
            ready(Err(e.clone()));
            return Err(e);
        }
    };
    let ended = tx.clone();
    std::thread::Builder::new()
        .name("kllm-session".into())
        .spawn(move || {
            let _ = ended.send(Event::Ended(session.run()));
        })
        .map_err(|e| Error::new(format!("cannot start the session thread ({e})")))?;
    std::thread::Builder::new()
        .name("kllm-signals".into())
        .spawn(move || {
            if let Some(sig) = signals.forever().next() {
                let _ = tx.send(Event::Signal(sig));
            }
        })
        .map_err(|e| Error::new(format!("cannot start the signal thread ({e})")))?;
    // The handshake is done; a stat through the kernel proves the mount answers.
    match std::fs::metadata(&args.mountpoint) {
        Ok(_) => {
            raise_readahead(&args.mountpoint, args.readahead);
            ready(Ok(()))
        }
        Err(e) => {
            let err = Error::at(
                &args.mountpoint,
                format!("mounted but does not answer ({e})"),
            );
            let _ = unmounter.unmount();
            ready(Err(err.clone()));
            return Err(err);
        }
    }
    log::info!(
        "mounted {} at {}",
        args.sealed.display(),
        args.mountpoint.display()
    );
    match rx.recv() {
        Ok(Event::Signal(sig)) => {
            log::info!("signal {sig}: unmounting {}", args.mountpoint.display());
            if let Err(e) = unmounter.unmount() {
                // Busy (files open): detach lazily; the exit below then ends the connection.
                log::info!(
                    "unmount of {} failed ({e}); detaching it",
                    args.mountpoint.display()
                );
                if let Err(e) = detach(&args.mountpoint) {
                    log::error!("cannot unmount {}: {e}", args.mountpoint.display());
                }
            }
            // Open files keep a lazily detached mount alive; the process exit that follows
            // closes the connection, and their reads then fail instead of hanging.
            let _ = rx.recv_timeout(Duration::from_secs(2));
            Ok(())
        }
        Ok(Event::Ended(Ok(()))) | Err(_) => {
            log::info!("{} was unmounted", args.mountpoint.display());
            Ok(())
        }
        Ok(Event::Ended(Err(e))) => Err(Error::new(format!("the FUSE session failed: {e}"))),
    }
}

/// Remove secrets from the environment: from what children (fusermount3) inherit, and
/// from the process's initial environment block, which /proc/PID/environ shows.
fn scrub_env(names: &[&str]) {
    for name in names {
        let Ok(c) = std::ffi::CString::new(*name) else {
            continue;
        };
        // SAFETY: single-threaded (no thread is started before the view is built). getenv
        // points into the environment's `NAME=value` bytes; after the entry is removed from
        // the environment those bytes are no longer referenced and are overwritten.
        unsafe {
            let value = libc::getenv(c.as_ptr());
            std::env::remove_var(name);
            if !value.is_null() {
                let start = value.sub(name.len() + 1);
                let len = name.len() + 1 + libc::strlen(value);
                std::ptr::write_bytes(start, 0, len);
            }
        }
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

/// A `Write` that sends each line to syslog, for the daemon without a log file.
struct Syslog(Vec<u8>);

impl Write for Syslog {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.extend_from_slice(buf);
        while let Some(i) = self.0.iter().position(|&b| b == b'\n') {
            let line: Vec<u8> = self
                .0
                .drain(..=i)
                .filter(|&b| b != b'\n' && b != 0)
                .collect();
            if let Ok(c) = std::ffi::CString::new(line) {
                // SAFETY: a constant format string and a NUL-terminated argument.
                unsafe { libc::syslog(libc::LOG_NOTICE, c"%s".as_ptr(), c.as_ptr()) };
            }
        }
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fn init_logging(args: &Args, daemon: bool) -> Result<()> {
    let mut b = env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("warn"));
    if let Some(path) = &args.log_file {
        let f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .map_err(|e| Error::at(path, format!("cannot open log file ({e})")))?;
        b.target(env_logger::Target::Pipe(Box::new(f)));
    } else if daemon {
        // SAFETY: a static identifier string; openlog keeps the pointer.
        unsafe { libc::openlog(c"kllm-mount".as_ptr(), libc::LOG_PID, libc::LOG_DAEMON) };
        b.target(env_logger::Target::Pipe(Box::new(Syslog(Vec::new()))));
    }
    let _ = b.try_init();
    Ok(())
}

fn fail(e: &Error) -> ! {
    eprintln!("kllm-mount: {e}");
    std::process::exit(1);
}

pub fn main() {
    crate::secmem::harden_process();
    let mut args = Args::parse();
    // ops: mount(8), fstab and mount.fuse3 pass our settings as -o key=FILE,... too.
    match crate::mounttab::split_options(&args.options) {
        Ok(o) => {
            args.key = o.key.or(args.key.take());
            args.cache_size = o.cache_size.unwrap_or(args.cache_size);
            args.readahead = o.readahead.unwrap_or(args.readahead);
            args.threads = o.threads.unwrap_or(args.threads);
            args.log_file = o.log_file.or(args.log_file.take());
            args.foreground |= o.foreground;
            args.options = o.fuse;
        }
        Err(e) => fail(&e),
    }
    // The daemon logs elsewhere; checks before it starts log to stderr.
    if let Err(e) = init_logging(&args, !args.foreground) {
        fail(&e);
    }
    let view = prepare(&args).unwrap_or_else(|e| fail(&e));
    if args.foreground {
        // ops: systemd Type=notify readiness (src/notify.rs).
        let ready = |r: Result<()>| {
            if r.is_ok() {
                crate::notify::ready(&args.mountpoint)
            }
        };
        if let Err(e) = serve(&args, view, ready) {
            fail(&e);
        }
        return;
    }
    daemonize(&args, view);
}

/// Fork a daemon that mounts; the parent exits 0 once the mount answers, or 1 with the
/// daemon's error line. No thread exists yet, so forking is safe.
fn daemonize(args: &Args, view: View) -> ! {
    let mut fds = [0i32; 2];
    // SAFETY: pipe2 fills two descriptors we then own.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        fail(&Error::new(format!(
            "cannot create a pipe ({})",
            std::io::Error::last_os_error()
        )));
    }
    // SAFETY: both descriptors were just created and are owned here alone.
    let (rd, wr) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    // SAFETY: single-threaded here (no thread was started yet).
    match unsafe { libc::fork() } {
        -1 => fail(&Error::new(format!(
            "cannot fork ({})",
            std::io::Error::last_os_error()
        ))),
        0 => {
            drop(rd);
            // SAFETY: detaching from the terminal and pointing stdio at /dev/null, in the child.
            unsafe {
                libc::setsid();
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
            let result = serve(args, view, |status| {
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
            drop(view);
            let mut status = String::new();
            let _ = std::fs::File::from(rd).read_to_string(&mut status);
            match status.strip_prefix("ERR ") {
                _ if status.starts_with("OK") => std::process::exit(0),
                Some(msg) => fail(&Error::new(msg.trim_end())),
                None => fail(&Error::new(
                    "the mount daemon exited before the mount was ready",
                )),
            }
        }
    }
}
