//! The command line: arguments (also from `-o` as mount(8) passes them), `--status`, and
//! every check that can fail before mounting, in the order a user needs them answered;
//! then it builds the daemon's settings and the daemon (src/daemon.rs) mounts.

use std::io::Write;
use std::path::{Path, PathBuf};

use clap::{CommandFactory, Parser};

use crate::budget::{self, Budgets};
use crate::daemon::{self, Served, Settings};
use crate::key;
use crate::limits::Limits;
use crate::mounttab::{expand_options, Ours};
use crate::passthrough::{Copies, Requested, ServeMode};
use crate::sealed::{self, Options, Verify};
use crate::source::Location;
use crate::{Error, Result};

#[derive(Parser, Debug)]
#[command(
    name = "kllm-mount",
    version,
    about = "Mount a kLLM-sealed checkpoint read-only, decoded in memory, as a plain Hugging Face checkpoint"
)]
pub struct Args {
    /// The sealed model: a directory, `s3://BUCKET/PREFIX` (any S3-compatible service), or
    /// `https://HOST/PATH/` (`http://` too; the files are those its kllm-manifest.json lists).
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
    /// SEALED/kllm.key, then ~/.kllm/keys/default.key.
    #[arg(long, value_name = "FILE")]
    pub key: Option<PathBuf>,
    /// Stay in the foreground (containers, systemd).
    #[arg(short = 'f', long)]
    pub foreground: bool,
    /// Budget of the block cache of FUSE-mode reads (K/M/G suffixes; 0 disables it).
    /// Default: 256M, or a quarter of what a memory limit leaves (src/budget.rs).
    #[arg(long, value_name = "SIZE", value_parser = parse_size)]
    pub cache_size: Option<u64>,
    /// In passthrough mode, how long a shard's decoded copy outlives its last close, so
    /// the next open of a load (a rank starting later, a second pass) finds it (e.g. 60s,
    /// 5m, 0). Copies are let go sooner when an open or memory pressure needs their memory.
    #[arg(long, value_name = "DURATION", default_value = "60s", value_parser = parse_duration)]
    pub keep_decoded: std::time::Duration,
    /// Do not work ahead of the first opens: by default, right after mounting and at low
    /// priority, the daemon decodes the shards in the order engines load them (passthrough
    /// mode, within --passthrough-memory), or through FUSE hashes the files under a
    /// manifest in that order, so their opens need not wait for the hash, or else fetches
    /// the shards in that order (a remote source's within half of --source-memory, a local
    /// one's into the page cache).
    #[arg(long)]
    pub no_decode_ahead: bool,
    /// FUSE options, comma-separated (e.g. allow_other; never on by default). Every long option
    /// is also taken here as name=value (key=FILE, cache_size=1G, foreground, ...), as
    /// mount(8) and fstab pass them.
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
    /// How reads are served: `passthrough` decodes each locked shard into private memory
    /// (ahead of its first open by default), and once a copy is complete the kernel serves
    /// it without the daemon (root, Linux 6.9+); `fuse` serves every read through the
    /// daemon; `auto` picks passthrough where possible.
    #[arg(long, value_enum, default_value_t = Requested::Auto)]
    pub mode: Requested,
    /// Memory for decoded shards in passthrough mode (K/M/G suffixes); an open past it is
    /// served through FUSE. Default: what the memory limit (cgroup, rlimit) leaves after the
    /// cache and the daemon's own; half the machine's memory without one (src/budget.rs).
    #[arg(long, value_name = "SIZE", value_parser = parse_size)]
    pub passthrough_memory: Option<u64>,
    /// When files are checked against the manifest (kllm-manifest.json): `open` hashes each
    /// file before its first byte is served, `mount` hashes all before the mount answers.
    #[arg(long, value_enum, value_name = "WHEN", default_value_t = Verify::Open)]
    pub verify: Verify,
    /// Check against this manifest instead of SEALED/kllm-manifest.json.
    #[arg(long, value_name = "FILE")]
    pub manifest: Option<PathBuf>,
    /// Refuse to mount unless the manifest's SHA-256 is HEX (a value from a trusted source).
    #[arg(long, value_name = "HEX")]
    pub manifest_sha256: Option<String>,
    /// Append log lines to FILE (the daemon otherwise logs to syslog; -f logs to stderr).
    #[arg(long, value_name = "FILE")]
    pub log_file: Option<PathBuf>,
    /// s3:// sources: the S3 endpoint (MinIO, Ceph RGW, R2, ...; http:// allowed). Default:
    /// $AWS_ENDPOINT_URL, else AWS.
    #[arg(long, value_name = "URL")]
    pub endpoint_url: Option<String>,
    /// Remote sources: keep the fetched sealed bytes (still locked) in DIR, so a restart or
    /// a second mount on this node does not download them again.
    #[arg(long, value_name = "DIR")]
    pub cache_dir: Option<PathBuf>,
    /// The bound of --cache-dir (K/M/G/T suffixes); least recently used parts go first.
    #[arg(long, value_name = "SIZE", default_value = "16G", value_parser = parse_size)]
    pub cache_dir_size: u64,
    /// Remote sources: a read not served within SECS seconds (retries included) fails with
    /// EIO; mount-time requests are bounded the same way.
    #[arg(long, value_name = "SECS", default_value_t = 60,
          value_parser = clap::value_parser!(u64).range(1..=3600))]
    pub source_timeout: u64,
    /// Remote sources: bytes per ranged GET (K/M/G suffixes).
    #[arg(long, value_name = "SIZE", default_value = "8M", value_parser = parse_part_size)]
    pub part_size: u64,
    /// Remote sources: memory for fetched parts, in flight and read ahead (K/M/G suffixes).
    #[arg(long, value_name = "SIZE", default_value = "512M", value_parser = parse_size)]
    pub source_memory: u64,
}

fn parse_part_size(text: &str) -> Result<u64, String> {
    let n = parse_size(text)?;
    if !(4096..=(256 << 20)).contains(&n) {
        return Err(format!("{text:?}: a part is 4K to 256M"));
    }
    Ok(n)
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

/// Parse `60s`, `5m`, `1h`, `500ms`, `30` (seconds).
pub fn parse_duration(text: &str) -> Result<std::time::Duration, String> {
    let t = text.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: u64 = num
        .parse()
        .map_err(|_| format!("{text:?} is not a duration (e.g. 60s, 5m)"))?;
    let ms = match unit.trim() {
        "ms" => 1,
        "" | "s" => 1000,
        "m" => 60_000,
        "h" => 3_600_000,
        _ => return Err(format!("unknown unit in {text:?} (use ms, s, m or h)")),
    };
    n.checked_mul(ms)
        .map(std::time::Duration::from_millis)
        .ok_or_else(|| format!("{text:?} is too long"))
}

impl Args {
    /// The sealed directory (clap requires it unless --status is given).
    pub fn sealed(&self) -> &Path {
        self.sealed.as_deref().expect("SEALED is required")
    }

    pub fn mountpoint(&self) -> &Path {
        self.mountpoint.as_deref().expect("MOUNTPOINT is required")
    }

    pub fn memory_flags(&self) -> budget::Flags {
        budget::Flags {
            cache_size: self.cache_size,
            passthrough_memory: self.passthrough_memory,
        }
    }

    /// The memory budgets these flags give under `limits`.
    pub fn budgets(&self, limits: &Limits) -> Budgets {
        let mut in_use = limits.usage().unwrap_or(0);
        // A remote source's fetched parts are working memory too.
        if self
            .sealed
            .as_deref()
            .and_then(|s| Location::parse(s).ok())
            .is_some_and(|l| l.is_remote())
        {
            in_use = in_use.saturating_add(self.source_memory);
        }
        Budgets::decide(
            self.memory_flags(),
            limits.effective(),
            in_use,
            self.threads,
        )
    }

    /// What the daemon needs from the command line.
    pub fn settings(&self, budgets: &Budgets, limits: Limits) -> Settings {
        Settings {
            source: self.sealed().to_path_buf(),
            mountpoint: self.mountpoint().to_path_buf(),
            fuse_options: self.options.clone(),
            threads: self.threads,
            readahead: self.readahead,
            budgets: budgets.clone(),
            limits,
            copies: Copies {
                grace: self.keep_decoded,
                decode_ahead: !self.no_decode_ahead,
                ..Copies::default()
            },
        }
    }

    /// How a remote source is reached and bounded; it counts into `stats`.
    #[cfg(feature = "remote")]
    pub fn remote_settings(
        &self,
        stats: std::sync::Arc<crate::metrics::Stats>,
    ) -> crate::source::remote::RemoteSettings {
        use crate::source::remote::{RemoteSettings, Tuning};
        RemoteSettings {
            endpoint_url: self.endpoint_url.clone(),
            cache_dir: self.cache_dir.clone(),
            cache_dir_size: self.cache_dir_size,
            manifest: self.manifest.clone(),
            tuning: Tuning {
                part_size: self.part_size,
                memory: self.source_memory.max(2 * self.part_size),
                timeout: std::time::Duration::from_secs(self.source_timeout),
                ..Tuning::default()
            },
            stats,
        }
    }
}

fn default_threads() -> usize {
    std::thread::available_parallelism()
        .map_or(4, |n| n.get())
        .clamp(4, 16)
}

/// Everything that can fail before mounting, in the order a user needs it answered: the
/// mount point, the sealed directory, the key, the view, the serving mode.
pub fn prepare(args: &Args, budgets: &Budgets) -> Result<Served> {
    let mp = args.mountpoint();
    // A second view stacked on one mount point would hide the first.
    crate::mounttab::check_not_mounted(mp)?;
    match std::fs::metadata(mp) {
        Ok(m) if m.is_dir() => {}
        Ok(_) => return Err(Error::at(mp, "mount point is not a directory")),
        Err(e) => return Err(Error::at(mp, format!("mount point is not usable ({e})"))),
    }
    let opts = Options {
        verify: args.verify,
        manifest: args.manifest.clone(),
        manifest_sha256: args.manifest_sha256.clone(),
        ..Options::with_cache(budgets.block_cache)
    };
    let location = Location::parse(args.sealed())?;
    let view = match &location {
        #[cfg(feature = "remote")]
        Location::S3(_) | Location::Http(_) => open_remote(args, &location, &opts)?,
        Location::Local(_) => {
            // A wrong path is answered as such, not as a missing key (one is looked for in it).
            check_source(args.sealed())?;
            let (model_key, key_source) = key::resolve(
                args.key.as_deref(),
                args.sealed(),
                &key::passphrase_from_env_or_prompt,
            )?;
            scrub_env(&[key::KEY_ENV, key::PASSPHRASE_ENV]);
            sealed::open(args.sealed(), &model_key, &key_source, &opts)?
        }
    };
    let mode =
        ServeMode::choose(args.mode, budgets.passthrough_memory)?.with_note(budgets.describe());
    Ok(Served { view, mode })
}

/// A warning said before the daemon starts: to the log, and to the command's terminal when
/// the daemon will log to syslog.
fn warn_at_mount(args: &Args, w: &str) {
    if !args.foreground && args.log_file.is_none() {
        eprintln!("kllm-mount: warning: {w}");
    }
    log::warn!("{w}");
}

/// Through FUSE without check ahead (`--no-decode-ahead`), a remote file under a manifest
/// is hashed before its first byte (the hash reads it whole) and then downloaded again by
/// its reads, unless a node cache keeps the first download: worth saying once at mount,
/// with what avoids it. Check ahead decodes each shard it hashes into the kernel's page
/// cache from the same download (`ShardWalk::check_and_store` in `ahead::check`).
fn downloaded_twice(args: &Args, served: &Served) -> Option<String> {
    let remote = !matches!(Location::parse(args.sealed()), Ok(Location::Local(_)));
    if !remote
        || served.mode.passthrough().is_some()
        || args.cache_dir.is_some()
        || !args.no_decode_ahead
    {
        return None;
    }
    let view = &served.view;
    let checked = (view.file_paths().iter())
        .filter(|(_, ino)| view.node(*ino).is_some_and(|n| n.integrity.is_some()))
        .count();
    (checked > 0).then(|| {
        format!(
            "served through FUSE with --no-decode-ahead, the {checked} files under the \
             manifest are each downloaded twice (hashed before their first byte, then read); \
             --cache-dir DIR keeps the first download (check ahead, on by default, and \
             passthrough mode, as root, download each shard once)"
        )
    })
}

/// The view of a remote source, its key resolved (one shipped beside the sealed files
/// included) and the credentials taken out of the environment.
#[cfg(feature = "remote")]
fn open_remote(args: &Args, location: &Location, opts: &Options) -> Result<crate::view::View> {
    // The source first: a key shipped beside the sealed files comes from it.
    let source = location.open(&args.remote_settings(opts.stats.clone()))?;
    let shipped = || shipped_key(&*source);
    let (model_key, key_source) = key::resolve_with_shipped(
        args.key.as_deref(),
        args.sealed(),
        &shipped,
        &key::passphrase_from_env_or_prompt,
    )?;
    // The client holds the credentials now; its threads stop while the environment is
    // rewritten, and start again on the next request.
    crate::source::remote::quiesce_for_fork();
    scrub_env(&[key::KEY_ENV, key::PASSPHRASE_ENV]);
    scrub_env(&crate::source::remote::SECRET_ENV);
    sealed::open_source(&*source, &model_key, &key_source, opts)
}

/// The sealed directory exists and is one this mount can serve.
fn check_source(sealed: &Path) -> Result<()> {
    match std::fs::metadata(sealed) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            Err(Error::at(sealed, "does not exist"))
        }
        Err(e) => Err(Error::at(sealed, format!("cannot be read ({e})"))),
        Ok(_) => sealed::Seal::read(sealed).map(drop),
    }
}

/// `kllm.key` of a remote source, when it has one.
#[cfg(feature = "remote")]
fn shipped_key(source: &dyn crate::source::Source) -> Result<Option<zeroize::Zeroizing<String>>> {
    let rel = Path::new(key::SHIPPED_KEY);
    let Ok(object) = source.open(rel) else {
        return Ok(None);
    };
    let bytes = zeroize::Zeroizing::new(
        crate::source::read_all(&*object)
            .map_err(|e| Error::at(&source.at(rel), format!("cannot read key file ({e})")))?,
    );
    let text = std::str::from_utf8(&bytes)
        .map_err(|_| Error::at(&source.at(rel), "key file is not UTF-8 text"))?;
    Ok(Some(zeroize::Zeroizing::new(text.to_string())))
}

/// Remove secrets from the environment: from what children (fusermount3) inherit, and
/// from the process's initial environment block, which /proc/PID/environ shows.
fn scrub_env(names: &[&str]) {
    for name in names {
        let Ok(c) = std::ffi::CString::new(*name) else {
            continue;
        };
        // SAFETY: single-threaded (no thread is started before the view is built, and a
        // remote source's threads are stopped before this is called). getenv
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
    // Milliseconds: a shard's decode and an engine's open are often under a second apart.
    b.format_timestamp_millis();
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
    let limits = Limits::of_this_process();
    let budgets = args.budgets(&limits);
    if let Some(w) = budgets.warnings(args.memory_flags()) {
        warn_at_mount(&args, &w);
    }
    let served = prepare(&args, &budgets).unwrap_or_else(|e| fail(&e));
    if let Some(w) = downloaded_twice(&args, &served) {
        warn_at_mount(&args, &w);
    }
    let settings = args.settings(&budgets, limits);
    if args.foreground {
        // systemd Type=notify readiness (src/notify.rs).
        let ready = |r: Result<()>| {
            if r.is_ok() {
                crate::notify::ready(args.mountpoint())
            }
        };
        if let Err(e) = daemon::serve(&settings, served, ready) {
            fail(&e);
        }
        return;
    }
    if let Err(e) = daemon::daemonize(&settings, served) {
        fail(&e);
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

    #[test]
    fn durations() {
        use std::time::Duration;
        assert_eq!(parse_duration("60s").unwrap(), Duration::from_secs(60));
        assert_eq!(parse_duration("5m").unwrap(), Duration::from_secs(300));
        assert_eq!(parse_duration("250ms").unwrap(), Duration::from_millis(250));
        assert_eq!(parse_duration("0").unwrap(), Duration::ZERO);
        assert!(parse_duration("5d").is_err());
        assert!(parse_duration("s").is_err());
    }
}
