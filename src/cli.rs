//! The command line: check everything, build the view, then mount it in the foreground or
//! in a daemon that reports back only once the mount answers.

use std::io::{Read, Write};
use std::os::fd::{FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::Duration;

use clap::{CommandFactory, Parser};
use fuser::{Config, MountOption, SessionACL};

use crate::fuse::KllmFs;
use crate::kernel_mount::Unmounter;
use crate::key;
use crate::mounttab::{expand_options, Ours};
use crate::passthrough::{Requested, ServeMode};
use crate::sealed::{self, Options, Verify};
use crate::status::StatusServer;
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
    #[arg(required_unless_present = "status")]
    sealed: Option<PathBuf>,
    /// Where to show the unlocked view (an existing directory).
    #[arg(required_unless_present = "status")]
    mountpoint: Option<PathBuf>,
    /// Print one JSON object about the daemon serving MOUNTPOINT, and exit.
    #[arg(long, value_name = "MOUNTPOINT", conflicts_with_all = ["sealed", "mountpoint"])]
    pub status: Option<PathBuf>,
    /// With --status: the counters as Prometheus text instead.
    #[arg(long, requires = "status")]
    pub metrics: bool,
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
    /// How reads are served: `passthrough` decodes a locked shard whole into private
    /// memory on its first open, and the kernel then serves it without the daemon (root,
    /// Linux 6.9+); `fuse` serves every read through the daemon; `auto` picks passthrough
    /// where possible.
    #[arg(long, value_enum, default_value_t = Requested::Auto)]
    pub mode: Requested,
    /// Memory for decoded shards in passthrough mode (K/M/G suffixes); an open past it is
    /// served through FUSE. Default: half the machine's memory.
    #[arg(long, value_name = "SIZE", value_parser = parse_size)]
    pub passthrough_memory: Option<u64>,
    /// When files are checked against the manifest (kllm-manifest.json): `open` hashes each
    /// file before its first byte is served, `mount` hashes all before the mount answers.
    #[arg(long, value_enum, value_name = "WHEN", default_value_t = Verify::Open)]
    pub verify: Verify,
    /// Check against this manifest instead of <SEALED>/kllm-manifest.json.
    #[arg(long, value_name = "FILE")]
    pub manifest: Option<PathBuf>,
    /// Refuse to mount unless the manifest's SHA-256 is HEX (a value from a trusted source).
    #[arg(long, value_name = "HEX")]
    pub manifest_sha256: Option<String>,
    /// Append log lines to FILE (the daemon otherwise logs to syslog; -f logs to stderr).
    #[arg(long, value_name = "FILE")]
    pub log_file: Option<PathBuf>,
}

/// Parse `256M`, `1G`, `4096`, `64k` (binary units).
pub fn parse_size(text: &str) -> Result<u64, String> {
    let t = text.trim();
    let (num, mult) = match t.char_indices().last() {
        Some((i, c)) if c.is_ascii_alphabetic() => {
            let mult = match c.to_ascii_uppercase() {
                'K' => 1u64 << 10,
                'M' => 1 << 20,
                'G' => 1 << 30,
                'T' => 1 << 40,
                _ => {
                    return Err(format!(
                        "unknown size suffix in {text:?} (use K, M, G or T)"
                    ))
                }
            };
            (&t[..i], mult)
        }
        _ => (t, 1),
    };
    let n: u64 = num
        .trim()
        .parse()
        .map_err(|_| format!("{text:?} is not a size (e.g. 512M, 2G)"))?;
    n.checked_mul(mult)
        .ok_or_else(|| format!("{text:?} is too large"))
}

impl Args {
    /// The sealed directory (clap requires it unless --status is given).
    pub fn sealed(&self) -> &Path {
        self.sealed.as_deref().expect("SEALED is required")
    }

    pub fn mountpoint(&self) -> &Path {
        self.mountpoint.as_deref().expect("MOUNTPOINT is required")
    }
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

/// Half of the machine's memory.
fn default_passthrough_memory() -> u64 {
    // SAFETY: sysconf with valid names.
    let (pages, page) = unsafe {
        (
            libc::sysconf(libc::_SC_PHYS_PAGES),
            libc::sysconf(libc::_SC_PAGESIZE),
        )
    };
    (pages.max(0) as u64 * page.max(0) as u64) / 2
}

/// What a mount serves: the view, and the mode it is served in.
pub struct Prepared {
    pub view: View,
    pub mode: ServeMode,
}

/// Everything that can fail before mounting: arguments, the seal, the key, the view, the
/// serving mode.
pub fn prepare(args: &Args) -> Result<Prepared> {
    let mp = args.mountpoint();
    // A second view stacked on one mount point would hide the first.
    crate::mounttab::check_not_mounted(mp)?;
    match std::fs::metadata(mp) {
        Ok(m) if m.is_dir() => {}
        Ok(_) => return Err(Error::at(mp, "mount point is not a directory")),
        Err(e) => return Err(Error::at(mp, format!("mount point is not usable ({e})"))),
    }
    let (model_key, source) = key::resolve(
        args.key.as_deref(),
        args.sealed(),
        &key::passphrase_from_env_or_prompt,
    )?;
    scrub_env(&[key::KEY_ENV, key::PASSPHRASE_ENV]);
    let opts = Options {
        verify: args.verify,
        manifest: args.manifest.clone(),
        manifest_sha256: args.manifest_sha256.clone(),
        ..Options::with_cache(args.cache_size)
    };
    let view = sealed::open(args.sealed(), &model_key, &source, &opts)?;
    let memory = args
        .passthrough_memory
        .unwrap_or_else(default_passthrough_memory);
    let mode = ServeMode::choose(args.mode, memory)?;
    Ok(Prepared { view, mode })
}

enum Event {
    Signal(i32),
    Ended(std::io::Result<()>),
}

/// Mount and serve until unmounted or signalled. `ready` is called once the mount answers,
/// or with the error that stopped it.
pub fn serve(args: &Args, prepared: Prepared, ready: impl FnOnce(Result<()>)) -> Result<()> {
    let (tx, rx) = mpsc::channel();
    let view = Arc::new(prepared.view);
    let mode = Arc::new(prepared.mode);
    let mut unmounter = match start_session(args, view.clone(), mode.clone(), tx) {
        Ok(u) => u,
        Err(e) => {
            ready(Err(e.clone()));
            return Err(e);
        }
    };
    // The handshake is done; a stat through the kernel proves the mount answers.
    if let Err(e) = std::fs::metadata(args.mountpoint()) {
        let err = Error::at(
            args.mountpoint(),
            format!("mounted but does not answer ({e})"),
        );
        let _ = unmounter.unmount();
        ready(Err(err.clone()));
        return Err(err);
    }
    raise_readahead(args.mountpoint(), args.readahead);
    let _status = start_status(args, view, mode);
    ready(Ok(()));
    log::info!(
        "mounted {} at {}",
        args.sealed().display(),
        args.mountpoint().display()
    );
    wait_for_end(args.mountpoint(), &rx, unmounter)
}

/// Catch signals, mount, and run the session and the signal watcher on threads of their
/// own that report to `events`.
fn start_session(
    args: &Args,
    view: Arc<View>,
    mode: Arc<ServeMode>,
    events: mpsc::Sender<Event>,
) -> Result<Unmounter> {
    // Signals are caught before mounting, so none can end the process with the mount left.
    let mut signals =
        signal_hook::iterator::Signals::new([libc::SIGTERM, libc::SIGINT, libc::SIGHUP])
            .map_err(|e| Error::new(format!("cannot handle signals ({e})")))?;
    let cfg = fuse_config(args.sealed(), &args.options, args.threads)?;
    let fs = KllmFs::new(view, mode, args.cache_size).on_destroy(Box::new(|| {
        log::info!("session ended; exiting");
        std::process::exit(0)
    }));
    // As root mount(2) as `fuse.kllm-mount` with the sealed path as source, else through
    // fusermount3 (src/kernel_mount.rs).
    let (session, unmounter) =
        crate::kernel_mount::mount(fs, args.mountpoint(), &cfg).map_err(|e| {
            let hint = if e.kind() == std::io::ErrorKind::NotFound {
                " (is fuse3 installed? fusermount3 was not found)"
            } else {
                ""
            };
            Error::at(args.mountpoint(), format!("cannot mount ({e}){hint}"))
        })?;
    let ended = events.clone();
    spawn("kllm-session", move || {
        let _ = ended.send(Event::Ended(session.run()));
    })?;
    spawn("kllm-signals", move || {
        if let Some(sig) = signals.forever().next() {
            let _ = events.send(Event::Signal(sig));
        }
    })?;
    Ok(unmounter)
}

/// The status socket (`kllm-mount --status`), its gauges read at each request. A mount
/// without one still serves: the socket is for watching, not for reading the model.
fn start_status(args: &Args, view: Arc<View>, mode: Arc<ServeMode>) -> Option<StatusServer> {
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
        })
    };
    match StatusServer::start(args.mountpoint(), args.sealed(), now, stats, extra) {
        Ok(s) => Some(s),
        Err(e) => {
            log::warn!("no status socket: {e}");
            None
        }
    }
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

/// `--status`: the daemon's answer on stdout, exit 0; or one line why not, exit 1.
fn print_status(mountpoint: &Path, metrics: bool) -> ! {
    let answer = if metrics {
        crate::status::metrics(mountpoint)
    } else {
        crate::status::query(mountpoint).map(|v| format!("{v}\n"))
    };
    match answer {
        Ok(text) => {
            print!("{text}");
            std::process::exit(0)
        }
        Err(e) => fail(&e),
    }
}

fn fail(e: &Error) -> ! {
    eprintln!("kllm-mount: {e}");
    std::process::exit(1);
}

pub fn main() {
    crate::secmem::harden_process();
    // mount(8), fstab and mount.fuse3 pass our settings as -o key=FILE,... too.
    let argv = expand_options(std::env::args_os().collect(), |name| {
        let command = Args::command();
        let arg = command
            .get_arguments()
            .find(|a| a.get_long() == Some(name))?;
        Some(match arg.get_action().takes_values() {
            true => Ours::Value,
            false => Ours::Flag,
        })
    })
    .unwrap_or_else(|e| fail(&e));
    let args = Args::parse_from(argv);
    if let Some(mountpoint) = &args.status {
        print_status(mountpoint, args.metrics);
    }
    // The daemon logs elsewhere; checks before it starts log to stderr.
    if let Err(e) = init_logging(&args, !args.foreground) {
        fail(&e);
    }
    let prepared = prepare(&args).unwrap_or_else(|e| fail(&e));
    if args.foreground {
        // systemd Type=notify readiness (src/notify.rs).
        let ready = |r: Result<()>| {
            if r.is_ok() {
                crate::notify::ready(args.mountpoint())
            }
        };
        if let Err(e) = serve(&args, prepared, ready) {
            fail(&e);
        }
        return;
    }
    daemonize(&args, prepared);
}

/// Fork a daemon that mounts; the parent exits 0 once the mount answers, or 1 with the
/// daemon's error line. No thread exists yet, so forking is safe.
fn daemonize(args: &Args, prepared: Prepared) -> ! {
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
            let result = serve(args, prepared, |status| {
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
            drop(prepared);
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert_eq!(parse_size("64k").unwrap(), 64 << 10);
        assert_eq!(parse_size("512M").unwrap(), 512 << 20);
        assert_eq!(parse_size("2G").unwrap(), 2 << 30);
        assert!(parse_size("12Q").is_err());
        assert!(parse_size("M").is_err());
        assert!(parse_size("99999999999T").is_err());
    }
}
