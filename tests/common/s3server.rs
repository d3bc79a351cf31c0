//! A real S3 server on 127.0.0.1 for the tests: `moto_server` (PyPI `moto[server]`), started
//! on a free port and ended on drop, and a small HTTP client to make buckets and put objects
//! (moto takes unsigned requests).
//!
//! Where it is found: `KLLM_MOTO_SERVER` (the program), else
//! `${KLLM_S3_VENV:-/var/tmp/kllm-s3/venv}/bin/moto_server` (what `.ci/run` installs), else
//! `moto_server` on `PATH`. Without it a test skips with a message, except under CI
//! (`CI=true`), where it fails.

use std::collections::VecDeque;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStderr, Command, Stdio};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

/// The credentials the tests give kllm-mount (moto accepts any).
pub const ACCESS_KEY: &str = "AKIAKLLMTESTEXAMPLE1";
pub const SECRET_KEY: &str = "kllmTestSecret/ThisMustNeverBeLogged0123";

fn moto_program() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("KLLM_MOTO_SERVER").filter(|p| !p.is_empty()) {
        return Some(PathBuf::from(p));
    }
    let venv = std::env::var_os("KLLM_S3_VENV")
        .filter(|p| !p.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/var/tmp/kllm-s3/venv"));
    let in_venv = venv.join("bin/moto_server");
    if in_venv.is_file() {
        return Some(in_venv);
    }
    std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|d| d.join("moto_server"))
            .find(|p| p.is_file())
    })
}

/// A port on 127.0.0.1 where nothing listens, held for as long as this lives: bound without
/// `SO_REUSEADDR` and never listening, so a connection to it is refused and no server can
/// take it meanwhile (a port bound and let go could be taken by another test's server).
pub struct ClosedPort {
    _socket: std::os::fd::OwnedFd,
    pub port: u16,
}

impl ClosedPort {
    pub fn new() -> ClosedPort {
        use std::os::fd::FromRawFd;
        // SAFETY: plain socket calls on a descriptor this function owns; the address
        // structures are zeroed and sized for AF_INET.
        unsafe {
            let fd = libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0);
            assert!(fd >= 0, "socket: {}", std::io::Error::last_os_error());
            let socket = std::os::fd::OwnedFd::from_raw_fd(fd);
            let mut addr: libc::sockaddr_in = std::mem::zeroed();
            addr.sin_family = libc::AF_INET as libc::sa_family_t;
            addr.sin_addr.s_addr = u32::from(std::net::Ipv4Addr::LOCALHOST).to_be();
            let len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
            let bound = libc::bind(fd, (&raw const addr).cast(), len);
            assert!(bound == 0, "bind: {}", std::io::Error::last_os_error());
            let mut got: libc::sockaddr_in = std::mem::zeroed();
            let mut got_len = len;
            let named = libc::getsockname(fd, (&raw mut got).cast(), &mut got_len);
            assert!(
                named == 0,
                "getsockname: {}",
                std::io::Error::last_os_error()
            );
            ClosedPort {
                _socket: socket,
                port: u16::from_be(got.sin_port),
            }
        }
    }
}

pub struct S3Server {
    child: Child,
    pub addr: SocketAddr,
    /// moto's last lines on stderr, shown if it ends before the test lets it go.
    said: Arc<Mutex<VecDeque<String>>>,
}

impl S3Server {
    /// Start moto, or `None` (after saying why) when it is not installed and this is not CI.
    pub fn start() -> Option<S3Server> {
        let Some(program) = moto_program() else {
            let why = "moto_server not found (pip install 'moto[server]', or set \
                       KLLM_MOTO_SERVER or KLLM_S3_VENV; .ci/run installs it)";
            if std::env::var("CI").is_ok_and(|v| v == "true") {
                panic!("{why}");
            }
            eprintln!("SKIPPED: {why}");
            return None;
        };
        // moto binds port 0 itself and says which port it got: a port picked here and let go
        // could be taken by another test's server first, whose answers would then pass for
        // this one's until that test ended.
        let mut child = Command::new(&program)
            .args(["-H", "127.0.0.1", "-p", "0"])
            .env("MOTO_ALLOW_NONEXISTENT_REGION", "true")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("start {}: {e}", program.display()));
        let said = Arc::new(Mutex::new(VecDeque::new()));
        let port = announced_port(child.stderr.take().unwrap(), said.clone());
        let mut server = S3Server {
            child,
            addr: SocketAddr::from(([127, 0, 0, 1], 0)),
            said,
        };
        let Ok(port) = port.recv_timeout(Duration::from_secs(30)) else {
            let st = server.child.try_wait().unwrap();
            panic!(
                "{} did not say its port in 30 s (exit: {st:?})",
                program.display()
            );
        };
        server.addr.set_port(port);
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if request(server.addr, "GET", "/", &[], &[]).is_ok() {
                return Some(server);
            }
            if let Some(st) = server.child.try_wait().unwrap() {
                panic!("{} exited ({st}) before answering", program.display());
            }
            assert!(
                Instant::now() < deadline,
                "moto_server did not answer in 30 s"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    pub fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn make_bucket(&self, bucket: &str) {
        let (status, body) = request(self.addr, "PUT", &format!("/{bucket}"), &[], &[]).unwrap();
        assert!(
            status == 200,
            "create bucket {bucket}: {status} {}",
            String::from_utf8_lossy(&body)
        );
    }

    /// Put an object, readable without credentials too (the HTTP source reads object URLs).
    pub fn put(&self, bucket: &str, key: &str, body: &[u8]) {
        let (status, resp) = request(
            self.addr,
            "PUT",
            &format!("/{bucket}/{key}"),
            &[("x-amz-acl", "public-read")],
            body,
        )
        .unwrap();
        assert!(
            status == 200,
            "put {bucket}/{key}: {status} {}",
            String::from_utf8_lossy(&resp)
        );
    }

    /// Every regular file under `dir` as `PREFIX/<relative path>`; `skip` names left out.
    pub fn put_tree(&self, bucket: &str, prefix: &str, dir: &Path, skip: &[&str]) {
        for (rel, path) in super::vectors::tree(dir) {
            if skip.contains(&rel.as_str()) {
                continue;
            }
            self.put(
                bucket,
                &format!("{prefix}/{rel}"),
                &std::fs::read(path).unwrap(),
            );
        }
    }

    /// The plain HTTP URL of an object folder: moto serves object URLs path-style.
    pub fn object_url(&self, bucket: &str, prefix: &str) -> String {
        format!("http://{}/{bucket}/{prefix}", self.addr)
    }
}

/// The port from moto's " * Running on http://127.0.0.1:PORT" line. All of its stderr (a line
/// per request) is read, so that moto never blocks on a full pipe, and the last lines kept.
fn announced_port(stderr: ChildStderr, said: Arc<Mutex<VecDeque<String>>>) -> mpsc::Receiver<u16> {
    const KEPT: usize = 20;
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines() {
            let Ok(line) = line else { break };
            if let Some((_, rest)) = line.split_once("Running on http://127.0.0.1:") {
                let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
                if let Ok(port) = digits.parse() {
                    let _ = tx.send(port);
                }
            }
            let mut said = said.lock().unwrap();
            if said.len() == KEPT {
                said.pop_front();
            }
            said.push_back(line);
        }
    });
    rx
}

impl Drop for S3Server {
    fn drop(&mut self) {
        if let Ok(Some(st)) = self.child.try_wait() {
            let said = self.said.lock().map(|s| s.clone()).unwrap_or_default();
            eprintln!(
                "moto_server on {} had ended ({st}) before the test let it go; its last lines:",
                self.addr
            );
            for line in said {
                eprintln!("  {line}");
            }
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One HTTP/1.1 request on a fresh connection; the status and the body.
pub fn request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> std::io::Result<(u16, Vec<u8>)> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(5))?;
    s.set_read_timeout(Some(Duration::from_secs(60)))?;
    // moto checks no signature, but answers 403 to a request without one.
    let mut head = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Length: {}\r\nConnection: close\r\n\
         Content-Type: application/octet-stream\r\nAuthorization: AWS4-HMAC-SHA256 \
         Credential={ACCESS_KEY}/20260101/us-east-1/s3/aws4_request, SignedHeaders=host, \
         Signature=0\r\n",
        body.len()
    );
    for (k, v) in headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    head.push_str("\r\n");
    s.write_all(head.as_bytes())?;
    s.write_all(body)?;
    let mut resp = Vec::new();
    s.read_to_end(&mut resp)?;
    let split = resp
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .ok_or_else(|| std::io::Error::other("no HTTP head in the answer"))?;
    let status_line = String::from_utf8_lossy(&resp[..split]).into_owned();
    let status: u16 = status_line
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| std::io::Error::other(format!("bad status line {status_line:?}")))?;
    Ok((status, resp[split + 4..].to_vec()))
}

/// A kLLM catalog manifest (`kllm-manifest.json`) listing every file under `dir` but the
/// names in `skip`, as an HTTP source needs.
pub fn manifest_of(dir: &Path, skip: &[&str]) -> Vec<u8> {
    use sha2::{Digest, Sha256};
    let mut files = serde_json::Map::new();
    for (rel, path) in super::vectors::tree(dir) {
        if skip.contains(&rel.as_str()) {
            continue;
        }
        let digest = Sha256::digest(std::fs::read(path).unwrap());
        files.insert(rel, serde_json::Value::String(hex::encode(digest)));
    }
    serde_json::to_vec_pretty(&serde_json::json!({
        "format": "kllm-catalog",
        "version": 1,
        "files": files,
    }))
    .unwrap()
}
