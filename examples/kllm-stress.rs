//! Load on a mounted view, checked against the plain checkpoint it was sealed from
//! (scripts/stress drives it):
//!
//!   kllm-stress load    PLAIN MNT --pid PID --seconds S [--readers 8] [--rss-limit-mb N] [--passthrough]
//!   kllm-stress sigterm PLAIN MNT --pid PID [--passthrough]
//!
//! `load`: `--readers` threads read random ranges of random files of the mount (mostly the
//! largest locked shard; O_DIRECT, so the daemon serves every read, now and then through the
//! page cache), reopening a file now and then, and one thread reads a read-only mmap of that
//! shard at random windows, dropping its pages now and then and mapping it afresh. Every byte
//! is compared with the plain file: a shard's data region byte for byte, its header as JSON
//! without `kllm.lock`, any other file byte for byte (the files that differ by design,
//! config.json and the secret files, are compared as JSON / skipped). The daemon's own
//! memory (`RssAnon + RssFile`) is sampled every 100 ms; the decoded copies it maps
//! (`RssShmem`, passthrough mode) are reported beside it. Exits 1 on any error, wrong byte or
//! own memory above the limit.
//!
//! `sigterm`: eight threads read from open descriptors; SIGTERM goes to the daemon while
//! they do. No reader may hang or see a wrong byte, the daemon must exit, and nothing may
//! stay mounted; every reader must get an error, except under `--passthrough`, where a
//! descriptor the kernel serves from its backing file may go on reading the right bytes
//! after the daemon is gone. Exits 1 otherwise.
//!
//! `--passthrough`: the mount may serve files by FUSE passthrough, where `O_DIRECT` follows
//! the backing file system's rules (ext4: 4 KiB-aligned offsets, lengths and buffers; the
//! plain file's rules too), so `O_DIRECT` reads are aligned. Through FUSE they need not be.

use std::collections::BTreeMap;
use std::fs::{self, File};
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use serde_json::Value;

use kllm_mount::testkit::{
    alive, drop_page_cache, is_mounted, kill, open_direct, pread, pread_direct_aligned, rss,
    SplitMix,
};

/// `pread` through an `O_DIRECT` descriptor: 4 KiB-aligned where the mount may serve by
/// passthrough.
fn pread_direct(f: &File, off: u64, len: usize, passthrough: bool) -> io::Result<Vec<u8>> {
    if passthrough {
        pread_direct_aligned(f, off, len)
    } else {
        pread(f, off, len)
    }
}

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
    passthrough: bool,
}

impl Load {
    fn running(&self) -> bool {
        !self.stop.load(Ordering::Relaxed)
    }
}

/// Reader `t`: random ranges of random files by `pread` (nine in ten on the largest shard),
/// through O_DIRECT or, one read in eight, the page cache, each compared with the plain file.
/// One read in 64 first opens its file afresh: a shard opened while its decoded copy fills
/// is served through FUSE, and once the copy is complete by passthrough.
fn pread_reader(load: &Load, mnt: &Path, t: usize) {
    let files = &load.files;
    let mut rng = SplitMix(0x5eed ^ (t as u64) << 32 ^ std::process::id() as u64);
    let mut direct: Vec<File> = files
        .iter()
        .map(|f| open_direct(&mnt.join(&f.rel)))
        .collect();
    let mut cached: Vec<File> = files
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
        if rng.below(64) == 0 {
            let path = mnt.join(&f.rel);
            if via_cache {
                cached[i] = File::open(&path).unwrap();
            } else {
                direct[i] = open_direct(&path);
            }
        }
        let h = if via_cache { &cached[i] } else { &direct[i] };
        if via_cache && rng.below(4) == 0 {
            drop_page_cache(h);
        }
        let got = if via_cache {
            pread(h, off, len)
        } else {
            pread_direct(h, off, len, load.passthrough)
        };
        match got {
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

/// The file at `path` opened, and a private read-only mapping of its first `len` bytes.
fn map_private(path: &Path, len: usize) -> (File, memmap2::Mmap) {
    let file = File::open(path).unwrap();
    // SAFETY: a private read-only mapping of a file held open beside it. The mount is not
    // torn down during the load, so no SIGBUS.
    let map = unsafe {
        memmap2::MmapOptions::new()
            .len(len)
            .map_copy_read_only(&file)
    }
    .unwrap_or_else(|e| panic!("mmap {}: {e}", path.display()));
    (file, map)
}

/// The mmap reader: random windows of a private read-only mapping of the largest (locked)
/// shard, its pages dropped every 16 reads so they are fetched from the daemon again, and
/// the file opened and mapped afresh every 64.
fn mmap_reader(load: &Load, mnt: &Path) {
    let big = &load.files[0];
    let path = mnt.join(&big.rel);
    let len = big.len as usize;
    let (mut file, mut map) = map_private(&path, len);
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
        if n.is_multiple_of(64) {
            (file, map) = map_private(&path, len);
        } else if n.is_multiple_of(16) {
            // SAFETY: a private read-only mapping: its pages are fetched again when next read.
            let _ = unsafe { map.unchecked_advise(memmap2::UncheckedAdvice::DontNeed) };
            drop_page_cache(&file);
        }
    }
}

/// The daemon's memory as sampled while the load ran.
#[derive(Default)]
struct DaemonWatch {
    /// `RssAnon + RssFile`.
    max_own_kib: u64,
    /// `RssShmem`: decoded copies it maps.
    max_shmem_kib: u64,
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
        match rss(pid) {
            Some(r) => {
                w.max_own_kib = w.max_own_kib.max(r.own_kib);
                w.max_shmem_kib = w.max_shmem_kib.max(r.shmem_kib);
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
                "kllm-stress: {:>5.0} s: {} reads, {} MiB, {} errors, {} wrong, daemon's own memory {} MiB (max {} MiB)",
                start.elapsed().as_secs_f64(),
                stats.reads.load(Ordering::Relaxed),
                stats.bytes.load(Ordering::Relaxed) >> 20,
                stats.errors.load(Ordering::Relaxed),
                stats.wrong.load(Ordering::Relaxed),
                rss(pid).unwrap_or_default().own_kib >> 10,
                w.max_own_kib >> 10
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
    let rss_ok = rss_limit_mb.is_none_or(|l| watch.max_own_kib <= l << 10);
    println!("load.seconds={secs_run:.0}");
    println!("load.reads={reads}");
    println!("load.bytes_mib={}", bytes >> 20);
    println!("load.mib_per_s={:.0}", (bytes >> 20) as f64 / secs_run);
    println!("load.errors={errors}");
    println!("load.wrong_bytes={wrong}");
    println!(
        "load.daemon_max_rss_mib={:.1}",
        watch.max_own_kib as f64 / 1024.0
    );
    println!(
        "load.daemon_max_shmem_mib={:.1}",
        watch.max_shmem_kib as f64 / 1024.0
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
    passthrough: bool,
) -> bool {
    let load = Arc::new(Load {
        files: expectations(plain, mnt),
        stats: Stats::default(),
        stop: AtomicBool::new(false),
        passthrough,
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

/// How a reader of `sigterm` ended.
enum Ending {
    /// A read failed, this long after the signal.
    Failed(io::Error, Duration),
    /// Still reading the right bytes when told to stop, after the daemon was gone.
    StillServed,
    Wrong(String),
}

fn sigterm(plain: &Path, mnt: &Path, pid: i32, passthrough: bool) -> bool {
    let files = Arc::new(expectations(plain, mnt));
    let stop = Arc::new(AtomicBool::new(false));
    let reads: Arc<Vec<AtomicU64>> = Arc::new((0..8).map(|_| AtomicU64::new(0)).collect());
    let signalled: Arc<std::sync::OnceLock<Instant>> = Arc::default();
    let (tx, rx) = mpsc::channel();
    for t in 0..8usize {
        let (files, stop, reads, signalled, tx) = (
            files.clone(),
            stop.clone(),
            reads.clone(),
            signalled.clone(),
            tx.clone(),
        );
        let direct = t % 2 == 0;
        let handles: Vec<File> = files
            .iter()
            .map(|f| {
                let p = mnt.join(&f.rel);
                if direct {
                    open_direct(&p)
                } else {
                    File::open(&p).unwrap()
                }
            })
            .collect();
        std::thread::spawn(move || {
            let mut rng = SplitMix(77 + t as u64);
            let ending = loop {
                if stop.load(Ordering::Relaxed) {
                    break Ending::StillServed;
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
                let got = if direct {
                    pread_direct(&handles[i], off, len, passthrough)
                } else {
                    pread(&handles[i], off, len)
                };
                match got {
                    Ok(got) if got == f.bytes(off, len) => {
                        reads[t].fetch_add(1, Ordering::Relaxed);
                    }
                    Ok(_) => break Ending::Wrong(format!("{} [{off}, +{len})", f.rel)),
                    Err(e) => {
                        let after = signalled.get().map_or(Duration::ZERO, Instant::elapsed);
                        break Ending::Failed(e, after);
                    }
                }
            };
            let _ = tx.send((t, ending));
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
    let _ = signalled.set(Instant::now());
    kill(pid, libc::SIGTERM);
    let exit_deadline = Instant::now() + Duration::from_secs(10);
    while alive(pid) && Instant::now() < exit_deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    let exited = !alive(pid);
    let exited_after = signalled.get().unwrap().elapsed();
    // Readers served through FUSE have failed by now; any still reading are served by the
    // kernel from a backing file.
    std::thread::sleep(Duration::from_millis(200));
    stop.store(true, Ordering::Relaxed);
    let mut ok = true;
    let mut errors = BTreeMap::new();
    let mut slowest = Duration::ZERO;
    let mut still_served = 0;
    let ended_by = Instant::now() + Duration::from_secs(20);
    for _ in 0..8 {
        match rx.recv_timeout(ended_by.saturating_duration_since(Instant::now())) {
            Ok((_, Ending::Failed(e, after))) => {
                slowest = slowest.max(after);
                *errors
                    .entry(e.raw_os_error().map_or(e.to_string(), |c| {
                        io::Error::from_raw_os_error(c).to_string()
                    }))
                    .or_insert(0) += 1;
            }
            Ok((t, Ending::StillServed)) => {
                still_served += 1;
                if !passthrough {
                    eprintln!("kllm-stress: reader {t} read on without an error");
                    ok = false;
                }
            }
            Ok((t, Ending::Wrong(what))) => {
                eprintln!("kllm-stress: reader {t}: WRONG BYTES at {what}");
                ok = false;
            }
            Err(_) => {
                eprintln!("kllm-stress: a reader hangs 20 s after SIGTERM");
                ok = false;
                break;
            }
        }
    }
    let still_mounted = is_mounted(mnt);
    println!("sigterm.reads_before_signal={in_flight}");
    println!(
        "sigterm.readers_errored_within_s={:.2}",
        slowest.as_secs_f64()
    );
    println!("sigterm.reader_errors={errors:?}");
    println!("sigterm.readers_served_after_exit={still_served}");
    println!("sigterm.daemon_exited={exited}");
    println!("sigterm.daemon_exit_s={:.2}", exited_after.as_secs_f64());
    println!("sigterm.still_mounted={still_mounted}");
    ok && exited && !still_mounted
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let usage = "usage: kllm-stress load|sigterm PLAIN MNT --pid PID [--seconds S] [--readers N] [--rss-limit-mb N] [--passthrough]";
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
    let passthrough = args.iter().any(|a| a == "--passthrough");
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
            passthrough,
        ),
        "sigterm" => sigterm(plain, mnt, pid, passthrough),
        _ => die(usage),
    };
    std::process::exit(if ok { 0 } else { 1 });
}
