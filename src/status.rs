//! What a running mount is doing: counters the daemon bumps on its hot paths, and a Unix
//! socket that answers each connection with one JSON line (`kllm-mount --status MOUNTPOINT`)
//! or with the same counters in Prometheus' text format. docs/STATUS.md describes every
//! field.
//!
//! The socket lives in `$XDG_RUNTIME_DIR/kllm-mount/` (else `/run/kllm-mount/`), a 0700
//! folder, as a 0600 file named after the canonical mount point; the server also checks
//! the peer's uid (`SO_PEERCRED`) and answers only its own user and root.

use std::io::{self, Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{DirBuilderExt, FileTypeExt, MetadataExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};
use serde_json::Value;
use sha2::{Digest, Sha256};

use crate::{Error, Result};

/// Folder of the sockets under `$XDG_RUNTIME_DIR` or `/run`.
pub const DIR_NAME: &str = "kllm-mount";
/// How long a client may take to send its request, and to take the answer.
const CLIENT_TIMEOUT: Duration = Duration::from_millis(500);
/// The longest answer `query` accepts.
const MAX_ANSWER: u64 = 1 << 20;

/// Counters of a mount. Each is a relaxed atomic: bumping one costs one uncontended
/// `lock xadd`, and a snapshot may be a few requests out of step between counters.
#[derive(Debug, Default)]
pub struct Stats {
    /// Gauge: files the kernel holds open now.
    pub files_open: AtomicU64,
    /// Opens since the mount, all files.
    pub opens: AtomicU64,
    /// Opens answered with kernel passthrough (the kernel reads the backing file itself).
    pub passthrough_opens: AtomicU64,
    /// Bytes returned to read requests.
    pub bytes_served: AtomicU64,
    /// Bytes of locked tensor data decoded.
    pub bytes_decoded: AtomicU64,
    pub cache_hits: AtomicU64,
    pub cache_misses: AtomicU64,
    /// Gauge: bytes held by the decoded-data cache.
    pub cache_bytes: AtomicU64,
    /// Gauge: bytes of the sealed files the mount serves from.
    pub backing_bytes: AtomicU64,
    /// Read requests answered with an error.
    pub read_errors: AtomicU64,
    /// Files whose SHA-256 matched the manifest.
    pub verified_files: AtomicU64,
    /// Files whose SHA-256 did not match, or that could not be read for checking.
    pub failed_files: AtomicU64,
    /// Bytes hashed to check files against the manifest.
    pub verified_bytes: AtomicU64,
}

/// A copy of [`Stats`] at one moment, under the same names.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Counters {
    pub files_open: u64,
    pub opens: u64,
    pub passthrough_opens: u64,
    pub bytes_served: u64,
    pub bytes_decoded: u64,
    pub cache_hits: u64,
    pub cache_misses: u64,
    pub cache_bytes: u64,
    pub backing_bytes: u64,
    pub read_errors: u64,
    pub verified_files: u64,
    pub failed_files: u64,
    pub verified_bytes: u64,
}

/// Prometheus name suffix, type and help of each counter, in [`Counters`] order.
const METRICS: [(&str, &str, &str); 13] = [
    ("files_open", "gauge", "Files the kernel holds open now."),
    ("opens_total", "counter", "Opens since the mount."),
    (
        "passthrough_opens_total",
        "counter",
        "Opens served by kernel passthrough.",
    ),
    (
        "served_bytes_total",
        "counter",
        "Bytes returned to read requests.",
    ),
    (
        "decoded_bytes_total",
        "counter",
        "Bytes of locked tensor data decoded.",
    ),
    ("cache_hits_total", "counter", "Decoded-data cache hits."),
    (
        "cache_misses_total",
        "counter",
        "Decoded-data cache misses.",
    ),
    (
        "cache_bytes",
        "gauge",
        "Bytes held by the decoded-data cache.",
    ),
    (
        "backing_bytes",
        "gauge",
        "Bytes of the sealed files served from.",
    ),
    (
        "read_errors_total",
        "counter",
        "Read requests answered with an error.",
    ),
    (
        "verified_files_total",
        "counter",
        "Files that matched the manifest.",
    ),
    (
        "failed_files_total",
        "counter",
        "Files that failed the manifest check.",
    ),
    (
        "verified_bytes_total",
        "counter",
        "Bytes hashed for the manifest check.",
    ),
];

impl Stats {
    pub fn new() -> Arc<Stats> {
        Arc::new(Stats::default())
    }

    pub fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Relaxed);
    }

    /// An open: `files_open` and `opens` up, `passthrough_opens` too when it applies.
    pub fn opened(&self, passthrough: bool) {
        self.files_open.fetch_add(1, Relaxed);
        self.opens.fetch_add(1, Relaxed);
        if passthrough {
            self.passthrough_opens.fetch_add(1, Relaxed);
        }
    }

    /// A release; never below zero, whatever the kernel sends.
    pub fn released(&self) {
        let _ = self
            .files_open
            .fetch_update(Relaxed, Relaxed, |n| Some(n.saturating_sub(1)));
    }

    pub fn snapshot(&self) -> Counters {
        Counters {
            files_open: self.files_open.load(Relaxed),
            opens: self.opens.load(Relaxed),
            passthrough_opens: self.passthrough_opens.load(Relaxed),
            bytes_served: self.bytes_served.load(Relaxed),
            bytes_decoded: self.bytes_decoded.load(Relaxed),
            cache_hits: self.cache_hits.load(Relaxed),
            cache_misses: self.cache_misses.load(Relaxed),
            cache_bytes: self.cache_bytes.load(Relaxed),
            backing_bytes: self.backing_bytes.load(Relaxed),
            read_errors: self.read_errors.load(Relaxed),
            verified_files: self.verified_files.load(Relaxed),
            failed_files: self.failed_files.load(Relaxed),
            verified_bytes: self.verified_bytes.load(Relaxed),
        }
    }
}

impl Counters {
    fn values(&self) -> [u64; 13] {
        [
            self.files_open,
            self.opens,
            self.passthrough_opens,
            self.bytes_served,
            self.bytes_decoded,
            self.cache_hits,
            self.cache_misses,
            self.cache_bytes,
            self.backing_bytes,
            self.read_errors,
            self.verified_files,
            self.failed_files,
            self.verified_bytes,
        ]
    }
}

/// The socket folders, in the order `query` looks: `$XDG_RUNTIME_DIR/kllm-mount` when the
/// variable is set (and absolute), then `/run/kllm-mount`.
pub fn runtime_dirs() -> Vec<PathBuf> {
    let mut dirs = Vec::new();
    if let Some(xdg) = std::env::var_os("XDG_RUNTIME_DIR") {
        let xdg = PathBuf::from(xdg);
        if xdg.is_absolute() {
            dirs.push(xdg.join(DIR_NAME));
        }
    }
    dirs.push(Path::new("/run").join(DIR_NAME));
    dirs
}

/// The folder a daemon puts its socket in: the first of [`runtime_dirs`].
pub fn runtime_dir() -> PathBuf {
    runtime_dirs().remove(0)
}

/// The mount point as the kernel names it, without asking the mount itself (a hung daemon
/// must not hang `--status`): the parent is canonicalized and the last part, when a
/// symbolic link, followed by hand.
pub fn canonical_mount_point(mountpoint: &Path) -> Result<PathBuf> {
    let mut path = std::path::absolute(mountpoint).map_err(|e| Error::at(mountpoint, e))?;
    for _ in 0..40 {
        let (Some(parent), Some(name)) = (path.parent(), path.file_name()) else {
            // `/`, or a path ending in `..`: nothing to keep the mount out of.
            return std::fs::canonicalize(&path).map_err(|e| Error::at(mountpoint, e));
        };
        let parent = std::fs::canonicalize(parent).map_err(|e| Error::at(mountpoint, e))?;
        let joined = parent.join(name);
        match std::fs::read_link(&joined) {
            Ok(target) => path = parent.join(target),
            Err(_) => return Ok(joined),
        }
    }
    Err(Error::at(mountpoint, "too many levels of symbolic links"))
}

/// The socket's file name for a mount point: 16 bytes of the SHA-256 of the canonical
/// path's bytes, in hex, then `.sock` (fixed length, whatever the path).
pub fn socket_name(mountpoint: &Path) -> Result<String> {
    use std::os::unix::ffi::OsStrExt;
    let canonical = canonical_mount_point(mountpoint)?;
    let digest = Sha256::digest(canonical.as_os_str().as_bytes());
    Ok(format!("{}.sock", hex::encode(&digest[..16])))
}

/// Creates `dir` as 0700, or checks an existing one: a real folder of this user, closed to
/// others (tightened when it is this user's).
fn prepare_dir(dir: &Path) -> Result<()> {
    match std::fs::DirBuilder::new().mode(0o700).create(dir) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
        Err(e) => {
            return Err(Error::at(
                dir,
                format!("cannot create the status folder: {e}"),
            ))
        }
    }
    let meta = std::fs::symlink_metadata(dir).map_err(|e| Error::at(dir, e))?;
    if !meta.is_dir() {
        return Err(Error::at(dir, "is not a folder (status sockets go there)"));
    }
    // SAFETY: geteuid cannot fail.
    let me = unsafe { libc::geteuid() };
    if meta.uid() != me {
        return Err(Error::at(
            dir,
            format!(
                "belongs to uid {}, not to this user ({me}): the status socket cannot go there",
                meta.uid()
            ),
        ));
    }
    // Umask may have loosened a fresh folder, or someone an old one.
    if meta.mode() & 0o7777 != 0o700 {
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))
            .map_err(|e| Error::at(dir, e))?;
    }
    Ok(())
}

/// The uid of the process at the other end of a Unix socket.
fn peer_uid(stream: &UnixStream) -> io::Result<u32> {
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: `cred` and `len` are valid for writing and sized for SO_PEERCRED.
    let rc = unsafe {
        libc::getsockopt(
            stream.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(cred.uid)
}

/// Who may read a mount's status: its own user and root.
pub fn peer_allowed(peer: u32, owner: u32) -> bool {
    peer == owner || peer == 0
}

/// What every answer carries besides the counters.
struct Identity {
    mode: String,
    sealed: PathBuf,
    mounted_at: PathBuf,
    started: SystemTime,
    owner: u32,
}

type Extra = Box<dyn Fn() -> Value + Send + 'static>;

/// The status socket of one mount; removed on drop.
pub struct StatusServer {
    socket: PathBuf,
    /// (dev, ino) of the socket bound, so drop removes only ours.
    inode: (u64, u64),
    wake: UnixStream,
    thread: Option<JoinHandle<()>>,
}

impl StatusServer {
    /// Serves the status of the mount at `mountpoint` from the folder of [`runtime_dir`].
    /// Call it in the process that serves the mount (after any fork). `extra()` is called
    /// per request; the members of the object it returns are added to the answer (the
    /// fixed fields and counters win over members of the same name).
    pub fn start(
        mountpoint: &Path,
        sealed: &Path,
        mode: &str,
        stats: Arc<Stats>,
        extra: impl Fn() -> Value + Send + 'static,
    ) -> Result<StatusServer> {
        Self::start_in(&runtime_dir(), mountpoint, sealed, mode, stats, extra)
    }

    /// [`StatusServer::start`] with the socket folder given.
    pub fn start_in(
        dir: &Path,
        mountpoint: &Path,
        sealed: &Path,
        mode: &str,
        stats: Arc<Stats>,
        extra: impl Fn() -> Value + Send + 'static,
    ) -> Result<StatusServer> {
        let mounted_at = canonical_mount_point(mountpoint)?;
        let sealed = std::fs::canonicalize(sealed).unwrap_or_else(|_| sealed.to_path_buf());
        prepare_dir(dir)?;
        let socket = dir.join(socket_name(&mounted_at)?);
        claim_socket_path(&socket, &mounted_at)?;
        let listener = UnixListener::bind(&socket)
            .and_then(|l| l.set_nonblocking(true).map(|()| l))
            .map_err(|e| Error::at(&socket, format!("cannot listen: {e}")))?;
        std::fs::set_permissions(&socket, std::fs::Permissions::from_mode(0o600))
            .map_err(|e| Error::at(&socket, e))?;
        let meta = std::fs::symlink_metadata(&socket).map_err(|e| Error::at(&socket, e))?;
        let (wake, wake_rx) = UnixStream::pair().map_err(|e| Error::at(&socket, e))?;
        let identity = Identity {
            mode: mode.to_owned(),
            sealed,
            mounted_at,
            started: SystemTime::now(),
            // SAFETY: geteuid cannot fail.
            owner: unsafe { libc::geteuid() },
        };
        let extra: Extra = Box::new(extra);
        let thread = std::thread::Builder::new()
            .name("kllm-status".into())
            .spawn(move || serve(listener, wake_rx, identity, stats, extra))
            .map_err(|e| Error::at(&socket, format!("cannot start the status thread: {e}")))?;
        Ok(StatusServer {
            socket,
            inode: (meta.dev(), meta.ino()),
            wake,
            thread: Some(thread),
        })
    }

    /// Where the socket is.
    pub fn socket_path(&self) -> &Path {
        &self.socket
    }
}

impl Drop for StatusServer {
    fn drop(&mut self) {
        let _ = self.wake.write_all(b"x");
        let _ = self.wake.shutdown(std::net::Shutdown::Both);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        if let Ok(meta) = std::fs::symlink_metadata(&self.socket) {
            if (meta.dev(), meta.ino()) == self.inode {
                let _ = std::fs::remove_file(&self.socket);
            }
        }
    }
}

/// Makes `socket` free to bind: refused while a daemon answers there, a stale socket file
/// (nobody listening) is removed.
fn claim_socket_path(socket: &Path, mounted_at: &Path) -> Result<()> {
    let meta = match std::fs::symlink_metadata(socket) {
        Ok(m) => m,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(Error::at(socket, e)),
    };
    if !meta.file_type().is_socket() {
        return Err(Error::at(socket, "exists and is not a socket; remove it"));
    }
    match UnixStream::connect(socket) {
        Ok(_) => Err(Error::at(
            mounted_at,
            format!(
                "another kllm-mount daemon answers for this mount point ({})",
                socket.display()
            ),
        )),
        Err(_) => std::fs::remove_file(socket).map_err(|e| Error::at(socket, e)),
    }
}

fn serve(listener: UnixListener, wake: UnixStream, id: Identity, stats: Arc<Stats>, extra: Extra) {
    let mut fds = [
        libc::pollfd {
            fd: listener.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        },
        libc::pollfd {
            fd: wake.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        },
    ];
    loop {
        // SAFETY: `fds` is a valid array of two pollfd for the call.
        let rc = unsafe { libc::poll(fds.as_mut_ptr(), 2, -1) };
        if rc < 0 {
            if io::Error::last_os_error().kind() == io::ErrorKind::Interrupted {
                continue;
            }
            log::warn!("status socket: poll: {}", io::Error::last_os_error());
            return;
        }
        if fds[1].revents != 0 {
            return;
        }
        if fds[0].revents == 0 {
            continue;
        }
        match listener.accept() {
            Ok((stream, _)) => {
                // The listener is non-blocking (a client gone between poll and accept must
                // not park the thread); the answer wants blocking I/O with timeouts.
                if let Err(e) = stream
                    .set_nonblocking(false)
                    .and_then(|()| answer(stream, &id, &stats, &extra))
                {
                    log::debug!("status socket: {e}");
                }
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            Err(e) => log::debug!("status socket: accept: {e}"),
        }
    }
}

/// One connection: check the peer, read the request (`status`, `metrics`, or nothing),
/// write one answer, close. Every step is bounded by a timeout.
fn answer(mut stream: UnixStream, id: &Identity, stats: &Stats, extra: &Extra) -> io::Result<()> {
    let peer = peer_uid(&stream)?;
    if !peer_allowed(peer, id.owner) {
        log::info!("status socket: refused uid {peer}");
        return Ok(());
    }
    stream.set_read_timeout(Some(CLIENT_TIMEOUT))?;
    stream.set_write_timeout(Some(CLIENT_TIMEOUT))?;
    let request = read_request(&mut stream);
    let body = match request.as_str() {
        "metrics" => {
            // Brings the gauges up to date.
            let _ = extra();
            metrics_text(id, &stats.snapshot())
        }
        "" | "status" => {
            let mut line = serde_json::to_string(&status_object(id, stats, extra))?;
            line.push('\n');
            line
        }
        other => format!(
            "{{\"error\":{}}}\n",
            Value::String(format!("unknown request {other:?}; send status or metrics"))
        ),
    };
    stream.write_all(body.as_bytes())
}

/// The first line the client sends, trimmed; empty at EOF or timeout without a newline.
fn read_request(stream: &mut UnixStream) -> String {
    let mut buf = [0u8; 64];
    let mut got = 0;
    while got < buf.len() {
        match stream.read(&mut buf[got..]) {
            Ok(0) => break,
            Ok(n) => {
                got += n;
                if buf[..got].contains(&b'\n') {
                    break;
                }
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(_) => break,
        }
    }
    let line = buf[..got].split(|&b| b == b'\n').next().unwrap_or_default();
    String::from_utf8_lossy(line).trim().to_owned()
}

fn unix_seconds(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

/// `YYYY-MM-DDTHH:MM:SSZ` for seconds since 1970 (UTC, proleptic Gregorian).
pub fn rfc3339(secs: u64) -> String {
    let days = (secs / 86_400) as i64;
    let rem = secs % 86_400;
    // Days to civil date (H. Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem / 60 % 60,
        rem % 60
    )
}

fn status_object(id: &Identity, stats: &Stats, extra: &Extra) -> Value {
    let started = unix_seconds(id.started);
    let uptime = SystemTime::now()
        .duration_since(id.started)
        .map_or(0, |d| d.as_secs());
    // First, so it can bring the gauges up to date before they are read.
    let more = extra();
    let mode = more
        .get("mode")
        .and_then(Value::as_str)
        .map_or_else(|| id.mode.clone(), str::to_string);
    let mut obj = serde_json::Map::new();
    for (k, v) in [
        ("version", Value::from(env!("CARGO_PKG_VERSION"))),
        ("pid", Value::from(std::process::id())),
        ("mode", Value::from(mode)),
        ("sealed", Value::from(id.sealed.to_string_lossy())),
        ("mounted_at", Value::from(id.mounted_at.to_string_lossy())),
        ("started", Value::from(rfc3339(started))),
        ("started_unix", Value::from(started)),
        ("uptime_s", Value::from(uptime)),
    ] {
        obj.insert(k.to_owned(), v);
    }
    if let Ok(Value::Object(counters)) = serde_json::to_value(stats.snapshot()) {
        obj.extend(counters);
    }
    match more {
        Value::Object(more) => {
            for (k, v) in more {
                obj.entry(k).or_insert(v);
            }
        }
        Value::Null => {}
        other => {
            obj.entry("extra").or_insert(other);
        }
    }
    Value::Object(obj)
}

/// Prometheus text exposition (format 0.0.4): every counter as `kllm_mount_<name>`,
/// labelled with the mount point, plus an info metric and the start time.
fn metrics_text(id: &Identity, counters: &Counters) -> String {
    use std::fmt::Write as _;
    let label = |s: &Path| {
        s.to_string_lossy()
            .replace('\\', "\\\\")
            .replace('"', "\\\"")
            .replace('\n', "\\n")
    };
    let mp = label(&id.mounted_at);
    let mut out = String::new();
    let _ = writeln!(
        out,
        "# HELP kllm_mount_info The mount, its sealed directory and mode."
    );
    let _ = writeln!(out, "# TYPE kllm_mount_info gauge");
    let _ = writeln!(
        out,
        "kllm_mount_info{{mountpoint=\"{mp}\",sealed=\"{}\",mode=\"{}\",version=\"{}\"}} 1",
        label(&id.sealed),
        label(Path::new(&id.mode)),
        env!("CARGO_PKG_VERSION")
    );
    let _ = writeln!(
        out,
        "# HELP kllm_mount_start_time_seconds When the mount started."
    );
    let _ = writeln!(out, "# TYPE kllm_mount_start_time_seconds gauge");
    let _ = writeln!(
        out,
        "kllm_mount_start_time_seconds{{mountpoint=\"{mp}\"}} {}",
        unix_seconds(id.started)
    );
    for ((name, kind, help), value) in METRICS.iter().zip(counters.values()) {
        let _ = writeln!(out, "# HELP kllm_mount_{name} {help}");
        let _ = writeln!(out, "# TYPE kllm_mount_{name} {kind}");
        let _ = writeln!(out, "kllm_mount_{name}{{mountpoint=\"{mp}\"}} {value}");
    }
    out
}

fn no_daemon(mountpoint: &Path) -> Error {
    Error::at(
        mountpoint,
        "no kllm-mount daemon answers for this mount point",
    )
}

/// Sends `request` to the mount's socket in `dirs` (the first that answers) and returns the
/// answer.
fn ask(dirs: &[PathBuf], mountpoint: &Path, request: &str) -> Result<String> {
    let name = socket_name(mountpoint).map_err(|_| no_daemon(mountpoint))?;
    for dir in dirs {
        let socket = dir.join(&name);
        let Ok(mut stream) = UnixStream::connect(&socket) else {
            continue;
        };
        let io = |e: io::Error| Error::at(&socket, format!("status socket: {e}"));
        stream
            .set_read_timeout(Some(Duration::from_secs(5)))
            .map_err(io)?;
        stream
            .set_write_timeout(Some(Duration::from_secs(5)))
            .map_err(io)?;
        stream
            .write_all(format!("{request}\n").as_bytes())
            .map_err(io)?;
        let _ = stream.shutdown(std::net::Shutdown::Write);
        let mut text = String::new();
        (&mut stream)
            .take(MAX_ANSWER + 1)
            .read_to_string(&mut text)
            .map_err(io)?;
        if text.len() as u64 > MAX_ANSWER {
            return Err(Error::at(
                &socket,
                "the daemon's answer is larger than 1 MiB",
            ));
        }
        if text.is_empty() {
            return Err(Error::at(
                &socket,
                "the daemon closed without answering (it answers only its own user and root)",
            ));
        }
        return Ok(text);
    }
    Err(no_daemon(mountpoint))
}

/// The status object of the daemon serving `mountpoint`, from either socket folder.
pub fn query(mountpoint: &Path) -> Result<Value> {
    query_in(&runtime_dirs(), mountpoint)
}

/// [`query`] in the folders given.
pub fn query_in(dirs: &[PathBuf], mountpoint: &Path) -> Result<Value> {
    let text = ask(dirs, mountpoint, "status")?;
    serde_json::from_str(text.trim_end())
        .map_err(|e| Error::at(mountpoint, format!("the daemon's status is not JSON ({e})")))
}

/// The daemon's counters in Prometheus' text format.
pub fn metrics(mountpoint: &Path) -> Result<String> {
    ask(&runtime_dirs(), mountpoint, "metrics")
}

/// [`metrics`] in the folders given.
pub fn metrics_in(dirs: &[PathBuf], mountpoint: &Path) -> Result<String> {
    ask(dirs, mountpoint, "metrics")
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Setup {
        tmp: tempfile::TempDir,
        dir: PathBuf,
        mnt: PathBuf,
        sealed: PathBuf,
    }

    fn setup() -> Setup {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("run/kllm-mount");
        std::fs::create_dir(tmp.path().join("run")).unwrap();
        let mnt = tmp.path().join("mnt");
        let sealed = tmp.path().join("sealed");
        std::fs::create_dir(&mnt).unwrap();
        std::fs::create_dir(&sealed).unwrap();
        Setup {
            tmp,
            dir,
            mnt,
            sealed,
        }
    }

    fn start(s: &Setup, stats: &Arc<Stats>) -> Result<StatusServer> {
        StatusServer::start_in(
            &s.dir,
            &s.mnt,
            &s.sealed,
            "decode",
            stats.clone(),
            || serde_json::json!({"cache_budget": 1024, "mode": "fuse", "pid": 1}),
        )
    }

    #[test]
    fn answers_one_json_line_with_every_counter_and_removes_the_socket() {
        let s = setup();
        let stats = Stats::new();
        let server = start(&s, &stats).unwrap();
        stats.opened(true);
        stats.opened(false);
        stats.released();
        Stats::add(&stats.bytes_served, 4096);
        Stats::add(&stats.bytes_decoded, 1000);
        stats.cache_bytes.store(77, Relaxed);
        stats.verified_files.fetch_add(3, Relaxed);

        let v = query_in(std::slice::from_ref(&s.dir), &s.mnt).unwrap();
        // The mode may change while serving: the live one wins; other fields are fixed.
        assert_eq!(v["mode"], "fuse");
        assert_eq!(v["pid"], std::process::id());
        assert_eq!(
            v["mounted_at"],
            s.mnt.canonicalize().unwrap().to_str().unwrap()
        );
        assert_eq!(
            v["sealed"],
            s.sealed.canonicalize().unwrap().to_str().unwrap()
        );
        assert_eq!(v["pid"], std::process::id());
        assert_eq!(v["version"], env!("CARGO_PKG_VERSION"));
        assert_eq!(v["cache_budget"], 1024);
        assert!(v["uptime_s"].as_u64().unwrap() < 60);
        let started = v["started_unix"].as_u64().unwrap();
        assert_eq!(v["started"], rfc3339(started));
        let counters: Counters = serde_json::from_value(v.clone()).unwrap();
        assert_eq!(counters, stats.snapshot());
        assert_eq!(
            (
                counters.files_open,
                counters.opens,
                counters.passthrough_opens
            ),
            (1, 2, 1)
        );
        assert_eq!((counters.bytes_served, counters.cache_bytes), (4096, 77));
        for field in [
            "files_open",
            "bytes_served",
            "bytes_decoded",
            "cache_hits",
            "cache_misses",
            "cache_bytes",
            "read_errors",
            "verified_files",
            "failed_files",
            "backing_bytes",
        ] {
            assert!(v[field].is_u64(), "{field} missing in {v}");
        }

        // Raw protocol: nothing sent, EOF: one line, then the server closes.
        let socket = server.socket_path().to_path_buf();
        let mut raw = UnixStream::connect(&socket).unwrap();
        raw.shutdown(std::net::Shutdown::Write).unwrap();
        let mut text = String::new();
        raw.read_to_string(&mut text).unwrap();
        assert_eq!(text.matches('\n').count(), 1);
        assert!(text.ends_with("}\n"));

        let m = metrics_in(std::slice::from_ref(&s.dir), &s.mnt).unwrap();
        assert!(
            m.contains("kllm_mount_served_bytes_total{mountpoint=\""),
            "{m}"
        );
        assert!(m.contains("\"} 4096\n"), "{m}");
        assert!(m.contains("# TYPE kllm_mount_cache_bytes gauge"), "{m}");

        drop(server);
        assert!(!socket.exists());
        let e = query_in(std::slice::from_ref(&s.dir), &s.mnt)
            .unwrap_err()
            .to_string();
        assert!(
            e.ends_with("no kllm-mount daemon answers for this mount point"),
            "{e}"
        );
        assert!(e.starts_with(&s.mnt.display().to_string()), "{e}");
    }

    #[test]
    fn folder_is_0700_socket_0600_and_named_after_the_canonical_mount_point() {
        let s = setup();
        let server = start(&s, &Stats::new()).unwrap();
        let dir_mode = std::fs::metadata(&s.dir).unwrap().mode() & 0o7777;
        let sock_mode = std::fs::symlink_metadata(server.socket_path())
            .unwrap()
            .mode()
            & 0o7777;
        assert_eq!((dir_mode, sock_mode), (0o700, 0o600));
        let name = server.socket_path().file_name().unwrap().to_str().unwrap();
        assert_eq!(name.len(), 32 + ".sock".len());
        // The same mount point through a symbolic link and a `..` finds the same socket.
        let link = s.tmp.path().join("link");
        std::os::unix::fs::symlink(&s.mnt, &link).unwrap();
        let dotted = s.sealed.join("../mnt");
        assert_eq!(socket_name(&link).unwrap(), name);
        assert_eq!(socket_name(&dotted).unwrap(), name);
        assert_ne!(socket_name(&s.sealed).unwrap(), name);
        query_in(&[s.tmp.path().join("elsewhere"), s.dir.clone()], &link).unwrap();
    }

    #[test]
    fn a_loose_folder_is_tightened_and_a_foreign_one_refused() {
        let s = setup();
        std::fs::DirBuilder::new()
            .mode(0o777)
            .create(&s.dir)
            .unwrap();
        std::fs::set_permissions(&s.dir, std::fs::Permissions::from_mode(0o777)).unwrap();
        let server = start(&s, &Stats::new()).unwrap();
        assert_eq!(std::fs::metadata(&s.dir).unwrap().mode() & 0o7777, 0o700);
        drop(server);
        std::os::unix::fs::chown(&s.dir, Some(65534), None).unwrap();
        let e = start(&s, &Stats::new()).err().unwrap().to_string();
        assert!(e.contains("belongs to uid 65534"), "{e}");
    }

    #[test]
    fn a_live_socket_is_refused_and_a_stale_one_replaced() {
        let s = setup();
        let first = start(&s, &Stats::new()).unwrap();
        let e = start(&s, &Stats::new()).err().unwrap().to_string();
        assert!(e.contains("another kllm-mount daemon answers"), "{e}");
        // The refused start must not have removed the live socket.
        query_in(std::slice::from_ref(&s.dir), &s.mnt).unwrap();
        let socket = first.socket_path().to_path_buf();
        drop(first);
        // A daemon killed without cleanup leaves a bound socket nobody listens on.
        drop(UnixListener::bind(&socket).unwrap());
        assert!(socket.exists());
        let e = query_in(std::slice::from_ref(&s.dir), &s.mnt)
            .unwrap_err()
            .to_string();
        assert!(e.contains("no kllm-mount daemon answers"), "{e}");
        let second = start(&s, &Stats::new()).unwrap();
        assert_eq!(second.socket_path(), socket);
        query_in(std::slice::from_ref(&s.dir), &s.mnt).unwrap();
        drop(second);
        // A regular file where the socket goes is not ours to delete.
        std::fs::write(&socket, b"").unwrap();
        let e = start(&s, &Stats::new()).err().unwrap().to_string();
        assert!(e.contains("not a socket"), "{e}");
    }

    #[test]
    fn a_client_that_never_reads_does_not_stall_the_server() {
        let s = setup();
        let stats = Stats::new();
        let _server = StatusServer::start_in(&s.dir, &s.mnt, &s.sealed, "decode", stats, || {
            // An answer far larger than the socket buffer, so the write must time out.
            serde_json::json!({"padding": "x".repeat(900 << 10)})
        })
        .unwrap();
        let socket = s.dir.join(socket_name(&s.mnt).unwrap());
        let idle = UnixStream::connect(&socket).unwrap();
        idle.shutdown(std::net::Shutdown::Write).unwrap();
        let t = std::time::Instant::now();
        let v = query_in(std::slice::from_ref(&s.dir), &s.mnt).unwrap();
        assert_eq!(v["padding"].as_str().unwrap().len(), 900 << 10);
        assert!(t.elapsed() < Duration::from_secs(4), "{:?}", t.elapsed());
        drop(idle);
    }

    #[test]
    fn peers_other_than_the_owner_and_root_get_nothing() {
        // SAFETY: geteuid cannot fail.
        if unsafe { libc::geteuid() } != 0 {
            // Only root can make a process of another uid; the rule itself is checked below.
            assert!(peer_allowed(1000, 1000) && !peer_allowed(1001, 1000));
            return;
        }
        assert!(peer_allowed(0, 1000) && peer_allowed(1000, 1000) && !peer_allowed(1001, 1000));
        let s = setup();
        let server = start(&s, &Stats::new()).unwrap();
        // Open the path so that only the uid check stands between uid 65534 and the answer.
        for p in [s.tmp.path(), &s.tmp.path().join("run"), &s.dir] {
            std::fs::set_permissions(p, std::fs::Permissions::from_mode(0o755)).unwrap();
        }
        std::fs::set_permissions(server.socket_path(), std::fs::Permissions::from_mode(0o666))
            .unwrap();
        let code = connect_as(65534, server.socket_path());
        assert_eq!(
            code, 0,
            "uid 65534 got an answer (code 1) or no connection (2)"
        );
        query_in(std::slice::from_ref(&s.dir), &s.mnt).unwrap();
    }

    /// Exit code of a child that drops to `uid`, connects and reads: 0 closed without a
    /// byte, 1 got bytes, 2 could not connect. Raw syscalls only between fork and exit.
    fn connect_as(uid: u32, socket: &Path) -> i32 {
        use std::os::unix::ffi::OsStrExt;
        // SAFETY: plain-data structure, zero is a valid value.
        let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
        addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
        let bytes = socket.as_os_str().as_bytes();
        assert!(bytes.len() < addr.sun_path.len());
        for (d, s) in addr.sun_path.iter_mut().zip(bytes) {
            *d = *s as libc::c_char;
        }
        // SAFETY: the child calls only async-signal-safe functions and exits with _exit.
        unsafe {
            let pid = libc::fork();
            assert!(pid >= 0);
            if pid == 0 {
                if libc::setgid(uid) != 0 || libc::setuid(uid) != 0 {
                    libc::_exit(3);
                }
                let fd = libc::socket(libc::AF_UNIX, libc::SOCK_STREAM, 0);
                let len = std::mem::size_of::<libc::sockaddr_un>() as libc::socklen_t;
                if fd < 0 || libc::connect(fd, (&addr as *const libc::sockaddr_un).cast(), len) != 0
                {
                    libc::_exit(2);
                }
                let req = b"status\n";
                libc::write(fd, req.as_ptr().cast(), req.len());
                let mut buf = [0u8; 16];
                let n = libc::read(fd, buf.as_mut_ptr().cast(), buf.len());
                libc::_exit(if n > 0 { 1 } else { 0 });
            }
            let mut status = 0;
            assert_eq!(libc::waitpid(pid, &mut status, 0), pid);
            assert!(libc::WIFEXITED(status));
            libc::WEXITSTATUS(status)
        }
    }

    #[test]
    fn rfc3339_dates() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00Z");
        assert_eq!(rfc3339(951_782_400), "2000-02-29T00:00:00Z");
        assert_eq!(rfc3339(1_796_083_199), "2026-11-30T23:59:59Z");
        assert_eq!(rfc3339(4_107_542_400), "2100-03-01T00:00:00Z");
    }

    #[test]
    fn released_never_goes_below_zero() {
        let stats = Stats::new();
        stats.released();
        assert_eq!(stats.snapshot().files_open, 0);
    }
}
