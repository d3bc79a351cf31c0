//! A fault-injecting HTTP proxy on 127.0.0.1, in front of a test server: each request from
//! the client is sent upstream on a fresh connection, and the answer is passed back, or
//! spoilt as a rule says (an error status, a reset, a stall, a body cut short). Rules match
//! the request line and fire a number of times; everything not matched passes unchanged.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

#[derive(Debug, Clone)]
pub enum Fault {
    /// Answer with this status and no body, without asking upstream.
    Status(u16),
    /// Close the connection without answering.
    Reset,
    /// Answer nothing for this long, then close.
    Stall(Duration),
    /// Send the head (with the full Content-Length) and this many body bytes, then close.
    Truncate(usize),
    /// Answer `302 Found` with `Location:` this base URL, the request's path and this
    /// query, as a model hub sends a file's resolve URL to its CDN (signed).
    Redirect(String, String),
}

#[derive(Debug, Clone)]
pub struct Rule {
    /// A request whose request line (`GET /bucket/key HTTP/1.1`) contains this...
    pub matches: String,
    /// ...and, when set, carries a Range header.
    pub ranged_only: bool,
    pub fault: Fault,
    /// How many more times it fires (`usize::MAX`: always).
    pub times: usize,
}

impl Rule {
    pub fn new(matches: &str, fault: Fault, times: usize) -> Rule {
        Rule {
            matches: matches.to_string(),
            ranged_only: false,
            fault,
            times,
        }
    }

    pub fn ranged(mut self) -> Rule {
        self.ranged_only = true;
        self
    }
}

struct Shared {
    upstream: SocketAddr,
    rules: Mutex<Vec<Rule>>,
    requests: AtomicUsize,
    fired: AtomicUsize,
    stop: AtomicBool,
}

pub struct FaultProxy {
    pub addr: SocketAddr,
    shared: Arc<Shared>,
}

impl FaultProxy {
    pub fn start(upstream: SocketAddr) -> FaultProxy {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let shared = Arc::new(Shared {
            upstream,
            rules: Mutex::new(Vec::new()),
            requests: AtomicUsize::new(0),
            fired: AtomicUsize::new(0),
            stop: AtomicBool::new(false),
        });
        let s = shared.clone();
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                if s.stop.load(Ordering::Relaxed) {
                    break;
                }
                let Ok(conn) = conn else { continue };
                let s = s.clone();
                std::thread::spawn(move || serve(&s, conn));
            }
        });
        FaultProxy { addr, shared }
    }

    pub fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn add(&self, rule: Rule) {
        self.shared.rules.lock().unwrap().push(rule);
    }

    pub fn clear(&self) {
        self.shared.rules.lock().unwrap().clear();
    }

    /// Requests seen, and faults fired, so far.
    pub fn requests(&self) -> usize {
        self.shared.requests.load(Ordering::Relaxed)
    }

    pub fn fired(&self) -> usize {
        self.shared.fired.load(Ordering::Relaxed)
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Relaxed);
        // Wake the accept loop so it sees the flag.
        let _ = TcpStream::connect(self.addr);
    }
}

/// The head of an HTTP message (up to the blank line), and its Content-Length.
fn read_head(r: &mut impl BufRead) -> Option<(Vec<String>, usize)> {
    let mut lines = Vec::new();
    loop {
        let mut line = String::new();
        if r.read_line(&mut line).ok()? == 0 {
            return None;
        }
        let line = line.trim_end_matches(['\r', '\n']).to_string();
        if line.is_empty() {
            break;
        }
        lines.push(line);
    }
    let len = lines
        .iter()
        .find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.eq_ignore_ascii_case("content-length")
                .then(|| v.trim().parse().ok())
                .flatten()
        })
        .unwrap_or(0);
    Some((lines, len))
}

fn serve(s: &Shared, client: TcpStream) {
    let _ = client.set_read_timeout(Some(Duration::from_secs(120)));
    let mut reader = BufReader::new(client.try_clone().unwrap());
    let mut client = client;
    while let Some((head, len)) = read_head(&mut reader) {
        let mut body = vec![0u8; len];
        if reader.read_exact(&mut body).is_err() {
            return;
        }
        s.requests.fetch_add(1, Ordering::Relaxed);
        let ranged = head
            .iter()
            .any(|l| l.to_ascii_lowercase().starts_with("range:"));
        let fault = {
            let mut rules = s.rules.lock().unwrap();
            rules
                .iter_mut()
                .find(|r| r.times > 0 && head[0].contains(&r.matches) && (ranged || !r.ranged_only))
                .map(|r| {
                    r.times = r.times.saturating_sub(1);
                    r.fault.clone()
                })
        };
        if fault.is_some() {
            s.fired.fetch_add(1, Ordering::Relaxed);
        }
        match fault {
            Some(Fault::Status(code)) => {
                let msg = format!(
                    "HTTP/1.1 {code} Injected\r\nContent-Length: 0\r\nConnection: keep-alive\r\n\r\n"
                );
                if client.write_all(msg.as_bytes()).is_err() {
                    return;
                }
                continue;
            }
            Some(Fault::Redirect(base, query)) => {
                let path = head[0].split(' ').nth(1).unwrap_or("/");
                let msg = format!(
                    "HTTP/1.1 302 Found\r\nLocation: {base}{path}{query}\r\nContent-Length: 0\r\n\
                     Connection: keep-alive\r\n\r\n"
                );
                if client.write_all(msg.as_bytes()).is_err() {
                    return;
                }
                continue;
            }
            Some(Fault::Reset) => {
                let _ = client.shutdown(Shutdown::Both);
                return;
            }
            Some(Fault::Stall(d)) => {
                let until = Instant::now() + d;
                while Instant::now() < until && !s.stop.load(Ordering::Relaxed) {
                    std::thread::sleep(Duration::from_millis(50));
                }
                let _ = client.shutdown(Shutdown::Both);
                return;
            }
            _ => {}
        }
        let Some((resp_head, resp_body)) = forward(s.upstream, &head, &body) else {
            let _ = client.shutdown(Shutdown::Both);
            return;
        };
        let mut out = resp_head.join("\r\n").into_bytes();
        out.extend_from_slice(b"\r\n\r\n");
        if let Some(Fault::Truncate(n)) = fault {
            out.extend_from_slice(&resp_body[..n.min(resp_body.len())]);
            let _ = client.write_all(&out);
            let _ = client.shutdown(Shutdown::Both);
            return;
        }
        out.extend_from_slice(&resp_body);
        if client.write_all(&out).is_err() {
            return;
        }
    }
}

/// Send one request upstream on its own connection; the answer's head (with a
/// Content-Length and keep-alive) and body.
fn forward(upstream: SocketAddr, head: &[String], body: &[u8]) -> Option<(Vec<String>, Vec<u8>)> {
    let mut up = TcpStream::connect_timeout(&upstream, Duration::from_secs(5)).ok()?;
    up.set_read_timeout(Some(Duration::from_secs(60))).ok()?;
    let mut req = String::new();
    for l in head {
        if l.to_ascii_lowercase().starts_with("connection:") {
            continue;
        }
        req.push_str(l);
        req.push_str("\r\n");
    }
    req.push_str("Connection: close\r\n\r\n");
    up.write_all(req.as_bytes()).ok()?;
    up.write_all(body).ok()?;
    let mut r = BufReader::new(up);
    let (resp_head, _) = read_head(&mut r)?;
    let mut resp_body = Vec::new();
    r.read_to_end(&mut resp_body).ok()?;
    let is_head = head[0].starts_with("HEAD ");
    let mut out: Vec<String> = resp_head
        .into_iter()
        .filter(|l| {
            let l = l.to_ascii_lowercase();
            !l.starts_with("connection:")
                && !l.starts_with("transfer-encoding:")
                && (is_head || !l.starts_with("content-length:"))
        })
        .collect();
    if !is_head {
        out.push(format!("Content-Length: {}", resp_body.len()));
    }
    out.push("Connection: keep-alive".to_string());
    Some((out, resp_body))
}
