//! The daemon's side: the socket, who may open it, and one answer per connection.

use std::io::{self, Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{DirBuilderExt, FileTypeExt, MetadataExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, SystemTime};

use serde_json::Value;

use super::report::{metrics_text, status_object, Extra, Identity};
use super::{canonical_mount_point, runtime_dir, socket_name};
use crate::metrics::Stats;
use crate::{Error, Result};

/// How long a client may take to send its request, and to take the answer.
const CLIENT_TIMEOUT: Duration = Duration::from_millis(500);

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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::{Counters, METRICS};
    use crate::status::{metrics_in, query_in, rfc3339};
    use std::sync::atomic::Ordering::Relaxed;

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
        for m in &METRICS {
            assert!(v[m.field].is_u64(), "{} missing in {v}", m.field);
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
}
