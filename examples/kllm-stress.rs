//! Load on a mounted view, checked against the plain checkpoint it was sealed from
//! (scripts/stress drives it):
//!
//!   kllm-stress load    PLAIN MNT --pid PID --seconds S [--readers 8] [--rss-limit-mb N]
//!   kllm-stress sigterm PLAIN MNT --pid PID
//!
//! `load`: `--readers` threads read random ranges of random files of the mount (mostly the
//! largest locked shard; O_DIRECT, so the daemon serves every read, now and then through the
//! page cache) and one thread reads a read-only mmap of that shard at random windows,
//! dropping its pages now and then. Every byte is compared with the plain file: a shard's
//! data region byte for byte, its header as JSON without `kllm.lock`, any other file byte
//! for byte (the files that differ by design, config.json and the secret files, are
//! compared as JSON / skipped). The daemon's RSS is sampled every 100 ms. Exits 1 on any
//! error, wrong byte or RSS above the limit.
//!
//! `sigterm`: eight threads read from open descriptors; SIGTERM goes to the daemon while
//! they do. Every reader must get an error (none may hang or see a wrong byte), the daemon
//! must exit, and nothing may stay mounted. Exits 1 otherwise.

use std::collections::BTreeMap;
use std::fs::{self, File};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use serde_json::Value;

use kllm_mount::testkit::{
    alive, drop_page_cache, is_mounted, kill, open_direct, pread, rss_kib, SplitMix,
};

fn die(msg: &str) -> ! {
    eprintln!("kllm-stress: {msg}");
    std::process::exit(2)
}

/// What one file of the view must hold.
struct Expect {
    rel: String,
    len: u64,
    kind: Kind,
}

enum Kind {
    /// Byte for byte the plain file (read through a descriptor, never all in memory).
    Same(File),
    /// A shard: the view's header (checked once, then kept) and the plain data region.
    Shard {
        view_header: Vec<u8>,
        plain: File,
        plain_data_start: u64,
    },
}

impl Expect {
    /// The expected bytes `[off, off+len)` (cut at the end).
    fn bytes(&self, off: u64, len: usize) -> Vec<u8> {
        let end = (off + len as u64).min(self.len);
        if off >= end {
            return Vec::new();
        }
        let mut out = vec![0u8; (end - off) as usize];
        match &self.kind {
            Kind::Same(f) => f.read_exact_at(&mut out, off).expect("read plain"),
            Kind::Shard {
                view_header,
                plain,
                plain_data_start,
            } => {
                let ds = view_header.len() as u64;
                let mut pos = off;
                if pos < ds {
                    let upto = end.min(ds);
                    out[..(upto - off) as usize]
                        .copy_from_slice(&view_header[off as usize..upto as usize]);
                    pos = upto;
                }
                if pos < end {
                    plain
                        .read_exact_at(
                            &mut out[(pos - off) as usize..],
                            pos - ds + plain_data_start,
                        )
                        .expect("read plain");
                }
            }
        }
        out
    }
}

fn data_start(head: &[u8]) -> u64 {
    8 + u64::from_le_bytes(head[..8].try_into().unwrap())
}

/// The files of the view that can be checked against `plain`, the largest shard first.
fn expectations(plain: &Path, mnt: &Path) -> Vec<Expect> {
    let mut out = Vec::new();
    let mut stack = vec![PathBuf::new()];
    while let Some(rel_dir) = stack.pop() {
        for e in fs::read_dir(plain.join(&rel_dir)).unwrap().flatten() {
            let rel = rel_dir.join(e.file_name());
            if e.file_type().unwrap().is_dir() {
                stack.push(rel);
                continue;
            }
            let name = rel.to_string_lossy().into_owned();
            // Rewritten by the seal or kept in trusted.kllm; tests/ check them.
            if name == "config.json"
                || name.ends_with("tokenizer.json")
                || name.ends_with("vocab.json")
            {
                continue;
            }
            let pf = File::open(plain.join(&rel)).unwrap();
            let len = pf.metadata().unwrap().len();
            let kind = if name.ends_with(".safetensors") {
                let mut head = [0u8; 8];
                pf.read_exact_at(&mut head, 0).unwrap();
                let pds = data_start(&head);
                let mf =
                    File::open(mnt.join(&rel)).unwrap_or_else(|e| die(&format!("{name}: {e}")));
                let mut vhead = [0u8; 8];
                mf.read_exact_at(&mut vhead, 0).unwrap();
                let vds = data_start(&vhead);
                let mut view_header = vec![0u8; vds as usize];
                mf.read_exact_at(&mut view_header, 0).unwrap();
                let mut ph = vec![0u8; pds as usize];
                pf.read_exact_at(&mut ph, 0).unwrap();
                let v: Value =
                    serde_json::from_slice(&view_header[8..]).expect("view header is JSON");
                let p: Value = serde_json::from_slice(&ph[8..]).expect("plain header is JSON");
                let strip = |mut v: Value| {
                    if let Some(m) = v.get_mut("__metadata__").and_then(Value::as_object_mut) {
                        m.remove("kllm.lock");
                        m.remove("format");
                    }
                    v
                };
                if strip(v) != strip(p) {
                    die(&format!(
                        "{name}: the view's header is not the plain header"
                    ));
                }
                let vlen = mf.metadata().unwrap().len();
                if vlen - vds != len - pds {
                    die(&format!("{name}: data region sizes differ"));
                }
                Expect {
                    rel: name,
                    len: vlen,
                    kind: Kind::Shard {
                        view_header,
                        plain: pf,
                        plain_data_start: pds,
                    },
                }
            } else {
                Expect {
                    rel: name,
                    len,
                    kind: Kind::Same(pf),
                }
            };
            out.push(kind);
        }
    }
    out.sort_by_key(|e| std::cmp::Reverse(e.len));
    if out.is_empty() {
        die("nothing to read");
    }
    out
}

#[derive(Default)]
struct Stats {
    reads: AtomicU64,
    bytes: AtomicU64,
    errors: AtomicU64,
    wrong: AtomicU64,
}

fn report_bad(stats: &Stats, what: String, wrong: bool) {
    let n = if wrong {
        stats.wrong.fetch_add(1, Ordering::Relaxed)
    } else {
        stats.errors.fetch_add(1, Ordering::Relaxed)
    };
    if n < 20 {
        eprintln!("kllm-stress: {what}");
    }
}

/// The first differing offset, for messages.
fn first_diff(a: &[u8], b: &[u8]) -> usize {
    a.iter()
        .zip(b)
        .position(|(x, y)| x != y)
        .unwrap_or(a.len().min(b.len()))
}

/// What the readers of `load` share.
struct Load {
    files: Vec<Expect>,
    stats: Stats,
    stop: AtomicBool,
}

impl Load {
    fn running(&self) -> bool {
        !self.stop.load(Ordering::Relaxed)
    }
}

/// Reader `t`: random ranges of random files by `pread` (nine in ten on the largest shard),
/// through O_DIRECT or, one read in eight, the page cache, each compared with the plain file.
fn pread_reader(load: &Load, mnt: &Path, t: usize) {
    let files = &load.files;
    let mut rng = SplitMix(0x5eed ^ (t as u64) << 32 ^ std::process::id() as u64);
    let direct: Vec<File> = files
        .iter()
        .map(|f| open_direct(&mnt.join(&f.rel)))
        .collect();
    let cached: Vec<File> = files
        .iter()
        .map(|f| File::open(mnt.join(&f.rel)).unwrap())
        .collect();
    while load.running() {
        let i = if rng.below(10) < 9 {
            0
        } else {
            rng.below(files.len() as u64) as usize
        };
        let f = &files[i];
        let off = rng.below(f.len + 1);
        let len = rng.size(4 << 20) as usize;
        let via_cache = rng.below(8) == 0;
        let h = if via_cache { &cached[i] } else { &direct[i] };
        if via_cache && rng.below(4) == 0 {
            drop_page_cache(h);
        }
        match pread(h, off, len) {
            Ok(got) => {
                let want = f.bytes(off, len);
                if got != want {
                    report_bad(
                        &load.stats,
                        format!(
                            "WRONG BYTES: {} [{off}, +{len}) {} first at +{} (got {} bytes, want {})",
                            f.rel,
                            if via_cache { "cached" } else { "direct" },
                            first_diff(&got, &want),
                            got.len(),
                            want.len()
                        ),
                        true,
                    );
                }
                load.stats
                    .bytes
                    .fetch_add(got.len() as u64, Ordering::Relaxed);
            }
            Err(e) => report_bad(
                &load.stats,
                format!("ERROR: {} [{off}, +{len}): {e}", f.rel),
                false,
            ),
        }
        load.stats.reads.fetch_add(1, Ordering::Relaxed);
    }
}

/// The mmap reader: random windows of a private read-only mapping of the largest (locked)
/// shard, its pages dropped every 16 reads so they are fetched from the daemon again.
fn mmap_reader(load: &Load, mnt: &Path) {
    let big = &load.files[0];
    let f = File::open(mnt.join(&big.rel)).unwrap();
    let len = big.len as usize;
    // SAFETY: a private read-only mapping of a file we hold open; unmapped below. The mount
    // is not torn down during the load, so no SIGBUS.
    let base = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ,
            libc::MAP_PRIVATE,
            f.as_raw_fd(),
            0,
        )
    };
    assert_ne!(base, libc::MAP_FAILED, "mmap");
    // SAFETY: the mapping just made, `len` bytes, alive until the munmap below.
    let map = unsafe { std::slice::from_raw_parts(base as *const u8, len) };
    let mut rng = SplitMix(0x3a3a);
    let mut n = 0u64;
    while load.running() {
        let off = rng.below(len as u64) as usize;
        let l = (rng.size(8 << 20) as usize).min(len - off);
        let want = big.bytes(off as u64, l);
        if map[off..off + l] != want[..] {
            report_bad(
                &load.stats,
                format!(
                    "WRONG BYTES: mmap {} [{off}, +{l}) first at +{}",
                    big.rel,
                    first_diff(&map[off..off + l], &want)
                ),
                true,
            );
        }
        load.stats.bytes.fetch_add(l as u64, Ordering::Relaxed);
        load.stats.reads.fetch_add(1, Ordering::Relaxed);
        n += 1;
        if n.is_multiple_of(16) {
            // SAFETY: on our own mapping.
            unsafe { libc::madvise(base, len, libc::MADV_DONTNEED) };
            drop_page_cache(&f);
        }
    }
    // SAFETY: the mapping made above.
    unsafe { libc::munmap(base, len) };
}

/// The daemon's memory as sampled while the load ran.
#[derive(Default)]
struct DaemonWatch {
    max_rss_kib: u64,
    samples: u64,
    /// It was gone before the end.
    died: bool,
}

/// Sample the daemon's RSS every 100 ms until `deadline` (or until it is gone), with a
/// progress line every 30 s.
fn watch_daemon(load: &Load, pid: i32, deadline: Instant) -> DaemonWatch {
    let start = Instant::now();
    let mut w = DaemonWatch::default();
    let mut last_report = Instant::now();
    while Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(100));
        match rss_kib(pid) {
            Some(kb) => {
                w.max_rss_kib = w.max_rss_kib.max(kb);
                w.samples += 1;
            }
            None => {
                eprintln!("kllm-stress: the daemon (pid {pid}) is gone");
                w.died = true;
                break;
            }
        }
        if last_report.elapsed() >= Duration::from_secs(30) {
            last_report = Instant::now();
            let stats = &load.stats;
            eprintln!(
                "kllm-stress: {:>5.0} s: {} reads, {} MiB, {} errors, {} wrong, daemon RSS {} MiB (max {} MiB)",
                start.elapsed().as_secs_f64(),
                stats.reads.load(Ordering::Relaxed),
                stats.bytes.load(Ordering::Relaxed) >> 20,
                stats.errors.load(Ordering::Relaxed),
                stats.wrong.load(Ordering::Relaxed),
                rss_kib(pid).unwrap_or(0) >> 10,
                w.max_rss_kib >> 10
            );
        }
    }
    w
}

/// Print the `load.*` lines scripts/stress reads; whether the load passed.
fn report_load(
    stats: &Stats,
    secs_run: f64,
    watch: &DaemonWatch,
    pid: i32,
    rss_limit_mb: Option<u64>,
) -> bool {
    let (reads, bytes) = (
        stats.reads.load(Ordering::Relaxed),
        stats.bytes.load(Ordering::Relaxed),
    );
    let (errors, wrong) = (
        stats.errors.load(Ordering::Relaxed),
        stats.wrong.load(Ordering::Relaxed),
    );
    let rss_ok = rss_limit_mb.is_none_or(|l| watch.max_rss_kib <= l << 10);
    println!("load.seconds={secs_run:.0}");
    println!("load.reads={reads}");
    println!("load.bytes_mib={}", bytes >> 20);
    println!("load.mib_per_s={:.0}", (bytes >> 20) as f64 / secs_run);
    println!("load.errors={errors}");
    println!("load.wrong_bytes={wrong}");
    println!(
        "load.daemon_max_rss_mib={:.1}",
        watch.max_rss_kib as f64 / 1024.0
    );
    println!("load.rss_samples={}", watch.samples);
    if let Some(l) = rss_limit_mb {
        println!("load.rss_limit_mib={l}");
    }
    println!("load.daemon_alive={}", !watch.died && alive(pid));
    errors == 0 && wrong == 0 && rss_ok && !watch.died
}

/// `readers` pread readers and one mmap reader for `secs` seconds while the daemon's RSS is
/// watched; whether every byte was right, no read failed and the daemon lived within its
/// limit.
fn load(
    plain: &Path,
    mnt: &Path,
    pid: i32,
    secs: u64,
    readers: usize,
    rss_limit_mb: Option<u64>,
) -> bool {
    let load = Arc::new(Load {
        files: expectations(plain, mnt),
        stats: Stats::default(),
        stop: AtomicBool::new(false),
    });
    let big = &load.files[0];
    eprintln!(
        "kllm-stress: {} files, largest {} ({} MiB); {readers} readers + 1 mmap reader for {secs} s",
        load.files.len(),
        big.rel,
        big.len >> 20
    );
    let deadline = Instant::now() + Duration::from_secs(secs);
    let mut handles = Vec::new();
    for t in 0..readers {
        let (load, mnt) = (load.clone(), mnt.to_path_buf());
        handles.push(std::thread::spawn(move || pread_reader(&load, &mnt, t)));
    }
    {
        let (load, mnt) = (load.clone(), mnt.to_path_buf());
        handles.push(std::thread::spawn(move || mmap_reader(&load, &mnt)));
    }
    let start = Instant::now();
    let watch = watch_daemon(&load, pid, deadline);
    load.stop.store(true, Ordering::Relaxed);
    for h in handles {
        let _ = h.join();
    }
    report_load(
        &load.stats,
        start.elapsed().as_secs_f64(),
        &watch,
        pid,
        rss_limit_mb,
    )
}

fn sigterm(plain: &Path, mnt: &Path, pid: i32) -> bool {
    let files = Arc::new(expectations(plain, mnt));
    let stop = Arc::new(AtomicBool::new(false));
    let reads: Arc<Vec<AtomicU64>> = Arc::new((0..8).map(|_| AtomicU64::new(0)).collect());
    let (tx, rx) = mpsc::channel();
    for t in 0..8usize {
        let (files, stop, reads, tx) = (files.clone(), stop.clone(), reads.clone(), tx.clone());
        let handles: Vec<File> = files
            .iter()
            .map(|f| {
                let p = mnt.join(&f.rel);
                if t % 2 == 0 {
                    open_direct(&p)
                } else {
                    File::open(&p).unwrap()
                }
            })
            .collect();
        std::thread::spawn(move || {
            let mut rng = SplitMix(77 + t as u64);
            let outcome = loop {
                if stop.load(Ordering::Relaxed) {
                    break Err("stopped without an error".to_string());
                }
                let i = if rng.below(4) == 0 {
                    rng.below(files.len() as u64) as usize
                } else {
                    0
                };
                let f = &files[i];
                let off = rng.below(f.len + 1);
                let len = rng.size(1 << 20) as usize;
                drop_page_cache(&handles[i]);
                match pread(&handles[i], off, len) {
                    Ok(got) if got == f.bytes(off, len) => {
                        reads[t].fetch_add(1, Ordering::Relaxed);
                    }
                    Ok(_) => break Err(format!("wrong bytes at {} [{off}, +{len})", f.rel)),
                    Err(e) => break Ok(e),
                }
            };
            let _ = tx.send((t, outcome));
        });
    }
    drop(tx);
    let ready = Instant::now() + Duration::from_secs(30);
    while reads.iter().any(|r| r.load(Ordering::Relaxed) < 20) {
        if Instant::now() > ready {
            eprintln!("kllm-stress: readers made no progress before the signal");
            stop.store(true, Ordering::Relaxed);
            return false;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    let in_flight: u64 = reads.iter().map(|r| r.load(Ordering::Relaxed)).sum();
    kill(pid, libc::SIGTERM);
    let signalled = Instant::now();
    let mut ok = true;
    let mut errors = BTreeMap::new();
    let mut slowest = Duration::ZERO;
    for _ in 0..8 {
        match rx.recv_timeout(Duration::from_secs(20)) {
            Ok((t, Ok(e))) => {
                slowest = signalled.elapsed();
                *errors
                    .entry(e.raw_os_error().map_or(e.to_string(), |c| {
                        io::Error::from_raw_os_error(c).to_string()
                    }))
                    .or_insert(0) += 1;
                let _ = t;
            }
            Ok((t, Err(why))) => {
                eprintln!("kllm-stress: reader {t}: {why}");
                ok = false;
            }
            Err(_) => {
                eprintln!("kllm-stress: a reader hangs 20 s after SIGTERM");
                ok = false;
                break;
            }
        }
    }
    stop.store(true, Ordering::Relaxed);
    let exit_deadline = Instant::now() + Duration::from_secs(10);
    while alive(pid) && Instant::now() < exit_deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    let exited = !alive(pid);
    let exited_after = signalled.elapsed();
    std::thread::sleep(Duration::from_millis(200));
    let still_mounted = is_mounted(mnt);
    println!("sigterm.reads_before_signal={in_flight}");
    println!(
        "sigterm.readers_errored_within_s={:.2}",
        slowest.as_secs_f64()
    );
    println!("sigterm.reader_errors={errors:?}");
    println!("sigterm.daemon_exited={exited}");
    println!("sigterm.daemon_exit_s={:.2}", exited_after.as_secs_f64());
    println!("sigterm.still_mounted={still_mounted}");
    ok && exited && !still_mounted
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let usage = "usage: kllm-stress load|sigterm PLAIN MNT --pid PID [--seconds S] [--readers N] [--rss-limit-mb N]";
    if args.len() < 3 {
        die(usage);
    }
    let opt = |name: &str| -> Option<u64> {
        args.iter().position(|a| a == name).map(|i| {
            args.get(i + 1)
                .and_then(|v| v.parse().ok())
                .unwrap_or_else(|| die(usage))
        })
    };
    let pid = opt("--pid").unwrap_or_else(|| die(usage)) as i32;
    let (plain, mnt) = (Path::new(&args[1]), Path::new(&args[2]));
    let ok = match args[0].as_str() {
        "load" => load(
            plain,
            mnt,
            pid,
            opt("--seconds").unwrap_or(600),
            opt("--readers").unwrap_or(8) as usize,
            opt("--rss-limit-mb"),
        ),
        "sigterm" => sigterm(plain, mnt, pid),
        _ => die(usage),
    };
    std::process::exit(if ok { 0 } else { 1 });
}
