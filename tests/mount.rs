//! The binary mounted for real through the kernel: every good vector read back in several
//! ways and at several cache sizes, read-only semantics, refusals, key sources, the daemon's
//! lifecycle and signals, and corruption turning into EIO.
//!
//! Needs /dev/fuse and fusermount3 (the tests run as root). Mount points live in temporary
//! directories; a guard unmounts and removes them even when a test panics.

mod common;

use std::collections::BTreeSet;
use std::ffi::{OsStr, OsString};
use std::fs::{self, File, OpenOptions};
use std::io::{self, Read};
use std::os::unix::fs::{FileExt, MetadataExt, PermissionsExt};
use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use common::*;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use serde_json::Value;

const EROFS: i32 = libc::EROFS;
const EIO: i32 = libc::EIO;

// ---------------------------------------------------------------------------------------
// Mounting a case
// ---------------------------------------------------------------------------------------

fn mount_case(case: &Case, extra: &[&str]) -> Mnt {
    let m = Mnt::new();
    let (mut args, env) = case.key_setup();
    args.extend(extra.iter().map(OsString::from));
    m.mount_with(&case.sealed(), &args, |c| {
        c.envs(env);
    });
    m
}

/// A refusal: exit 1, exactly one stderr line `kllm-mount: ...`, nothing mounted, no daemon.
fn assert_refused(m: &Mnt, out: &Output, what: &str) -> String {
    let err = stderr_of(out);
    assert!(
        !out.status.success(),
        "{what}: kllm-mount succeeded, must be refused"
    );
    assert_eq!(
        out.status.code(),
        Some(1),
        "{what}: exit status; stderr {err:?}"
    );
    assert!(
        err.starts_with("kllm-mount: "),
        "{what}: stderr does not start with \"kllm-mount: \": {err:?}"
    );
    assert!(
        err.ends_with('\n') && err.matches('\n').count() == 1,
        "{what}: stderr is not exactly one line: {err:?}"
    );
    assert!(
        !is_mounted(&m.mp),
        "{what}: refused but {} is mounted",
        m.mp.display()
    );
    std::thread::sleep(Duration::from_millis(50));
    assert!(
        pids_with_arg(&m.mp).is_empty(),
        "{what}: refused but a kllm-mount process is still running"
    );
    err.trim_end().to_string()
}

// ---------------------------------------------------------------------------------------
// Reading
// ---------------------------------------------------------------------------------------

fn slice(want: &[u8], off: u64, len: usize) -> &[u8] {
    let lo = (off as usize).min(want.len());
    let hi = lo.saturating_add(len).min(want.len());
    &want[lo..hi]
}

/// Absolute offsets where a safetensors file changes meaning: the end of the header and
/// every tensor's start and end.
fn boundaries(bytes: &[u8]) -> Vec<u64> {
    if bytes.len() < 8 {
        return Vec::new();
    }
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap());
    let data_start = 8 + n;
    let header: Value = serde_json::from_slice(&bytes[8..data_start as usize]).unwrap();
    let mut out = BTreeSet::from([data_start]);
    for (name, t) in header.as_object().unwrap() {
        if name == "__metadata__" {
            continue;
        }
        for o in t["data_offsets"].as_array().unwrap() {
            out.insert(data_start + o.as_u64().unwrap());
        }
    }
    out.into_iter().collect()
}

/// One range to read from a file of `len` bytes: across one of `bounds` (tensor and
/// header/data boundaries), at the end, past the end, or anywhere, of any size.
fn one_range(rng: &mut StdRng, len: u64, bounds: &[u64]) -> (u64, usize) {
    match rng.gen_range(0..10) {
        0..=3 if !bounds.is_empty() => {
            let b = *bounds.choose(rng).unwrap();
            let d = rng.gen_range(1..=b.clamp(1, 64));
            (b.saturating_sub(d), d as usize + rng.gen_range(1..=300))
        }
        4 => {
            let back = rng.gen_range(0..=len.min(300));
            (len - back, rng.gen_range(1..=600))
        }
        5 => (len + rng.gen_range(0..100), rng.gen_range(1..100)),
        6 => (rng.gen_range(0..=len), rng.gen_range(1..=16)),
        7 => (rng.gen_range(0..=len), rng.gen_range(1..=70_000)),
        _ => (rng.gen_range(0..=len), rng.gen_range(1..=5000)),
    }
}

/// `n` ranges: the start, the whole file, the end, the header/data boundary, then random.
fn ranges(rng: &mut StdRng, len: u64, bounds: &[u64], n: usize) -> Vec<(u64, usize)> {
    let mut out = vec![(0, 1), (0, 8), (0, len as usize), (len, 10), (len - 1, 1)];
    if let Some(&data_start) = bounds.first() {
        out.push((data_start - 1, 2));
        out.push((0, data_start as usize + 1));
        out.push((data_start - 3, 4096));
    }
    while out.len() < n {
        out.push(one_range(rng, len, bounds));
    }
    out
}

struct Expected {
    rel: String,
    bytes: Vec<u8>,
    bounds: Vec<u64>,
}

fn expected_files(case: &Case) -> Vec<Expected> {
    tree(&case.view())
        .into_iter()
        .map(|(rel, path)| {
            let bytes = fs::read(path).unwrap();
            let bounds = if rel.ends_with(".safetensors") {
                boundaries(&bytes)
            } else {
                Vec::new()
            };
            Expected { rel, bytes, bounds }
        })
        .collect()
}

fn page_size() -> usize {
    // SAFETY: sysconf has no preconditions.
    unsafe { libc::sysconf(libc::_SC_PAGESIZE) as usize }
}

/// Everything test 1 asks of one mounted good vector.
/// How `O_DIRECT` reads reach the file: exact ranges at the daemon (FUSE), or the
/// backing file's aligned direct I/O (passthrough, where some files may be).
#[derive(Clone, Copy, PartialEq)]
enum Direct {
    Exact,
    Aligned,
}

impl Direct {
    fn of(extra: &[&str]) -> Direct {
        if extra.windows(2).any(|w| w == ["--mode", "fuse"]) {
            Direct::Exact
        } else {
            Direct::Aligned
        }
    }

    fn pread(self, f: &File, off: u64, len: usize) -> io::Result<Vec<u8>> {
        match self {
            Direct::Exact => pread(f, off, len),
            Direct::Aligned => pread_direct_aligned(f, off, len),
        }
    }
}

fn check_mounted_case(case: &Case, m: &Mnt, label: &str, seed: u64, direct_io: Direct) {
    let files = expected_files(case);
    let ctx = |rel: &str| format!("{label} {}/{rel}", case.name);

    // The file list.
    let got: Vec<String> = tree(&m.mp).into_keys().collect();
    let want: Vec<String> = files.iter().map(|f| f.rel.clone()).collect();
    assert_eq!(got, want, "{label} {}: file list", case.name);

    // 8 threads at once, random ranges of all files, cold kernel cache, half of them
    // O_DIRECT so every read reaches the daemon.
    std::thread::scope(|s| {
        for t in 0..8u64 {
            let files = &files;
            let ctx = &ctx;
            s.spawn(move || {
                let mut rng = StdRng::seed_from_u64(seed ^ ((t + 1) * 0x9E37_79B9));
                let handles: Vec<File> = files
                    .iter()
                    .map(|f| {
                        let p = m.path(&f.rel);
                        if t % 2 == 0 {
                            open_direct(&p)
                        } else {
                            File::open(&p).unwrap()
                        }
                    })
                    .collect();
                for _ in 0..120 {
                    let i = rng.gen_range(0..files.len());
                    let f = &files[i];
                    let (off, len) = one_range(&mut rng, f.bytes.len() as u64, &f.bounds);
                    let read = if t % 2 == 0 {
                        direct_io.pread(&handles[i], off, len)
                    } else {
                        pread(&handles[i], off, len)
                    };
                    let got = read.unwrap_or_else(|e| {
                        panic!("{} [{off}, +{len}) thread {t}: {e}", ctx(&f.rel))
                    });
                    assert!(
                        got == slice(&f.bytes, off, len),
                        "{} [{off}, +{len}) thread {t}: wrong bytes",
                        ctx(&f.rel)
                    );
                }
            });
        }
    });

    let mut rng = StdRng::seed_from_u64(seed);
    let ps = page_size();
    for f in &files {
        let p = m.path(&f.rel);

        // mmap: pages touched in random order from a cold cache, then the whole map.
        if f.rel.ends_with(".safetensors") {
            let file = File::open(&p).unwrap();
            drop_page_cache(&file);
            // SAFETY: the view is read-only and immutable while mounted.
            let map = unsafe { memmap2::Mmap::map(&file) }
                .unwrap_or_else(|e| panic!("{}: mmap: {e}", ctx(&f.rel)));
            assert_eq!(map.len(), f.bytes.len(), "{}: mmap length", ctx(&f.rel));
            let mut pages: Vec<usize> = (0..f.bytes.len().div_ceil(ps)).collect();
            pages.shuffle(&mut rng);
            for pg in pages {
                let lo = pg * ps;
                let hi = (lo + ps).min(f.bytes.len());
                assert!(
                    map[lo..hi] == f.bytes[lo..hi],
                    "{}: mmap page {pg} differs",
                    ctx(&f.rel)
                );
            }
            assert_same_file(&ctx(&f.rel), &map, &f.bytes);
            assert!(
                map[..] == f.bytes[..],
                "{}: mmap not byte-exact",
                ctx(&f.rel)
            );
        }

        // ~200 preads: O_DIRECT (exact ranges at the daemon) and through the page cache.
        let direct = open_direct(&p);
        let cached = File::open(&p).unwrap();
        drop_page_cache(&cached);
        for (i, (off, len)) in ranges(&mut rng, f.bytes.len() as u64, &f.bounds, 200)
            .into_iter()
            .enumerate()
        {
            let (fd, how) = if i % 2 == 0 {
                (&direct, "O_DIRECT")
            } else {
                (&cached, "cached")
            };
            let read = if i % 2 == 0 {
                direct_io.pread(fd, off, len)
            } else {
                pread(fd, off, len)
            };
            let got =
                read.unwrap_or_else(|e| panic!("{} {how} pread [{off}, +{len}): {e}", ctx(&f.rel)));
            let want = slice(&f.bytes, off, len);
            if got != want {
                let at = got.iter().zip(want).position(|(a, b)| a != b);
                panic!(
                    "{} {how} pread [{off}, +{len}): {} bytes, want {}; first difference at {:?}",
                    ctx(&f.rel),
                    got.len(),
                    want.len(),
                    at.map(|a| off + a as u64)
                );
            }
        }

        // The whole file.
        drop_page_cache(&cached);
        let got = fs::read(&p).unwrap_or_else(|e| panic!("{}: read: {e}", ctx(&f.rel)));
        assert_same_file(&ctx(&f.rel), &got, &f.bytes);
        assert!(got == f.bytes, "{}: not byte-exact", ctx(&f.rel));
    }
}

fn every_good_vector(extra: &[&str], label: &str, seed: u64) {
    let t0 = Instant::now();
    for case in cases().iter().filter(|c| c.ok()) {
        let m = mount_case(case, extra);
        check_mounted_case(case, &m, label, seed, Direct::of(extra));
    }
    eprintln!("{label}: all good vectors in {:?}", t0.elapsed());
}

// ---------------------------------------------------------------------------------------
// 1. Every good vector through the kernel
// ---------------------------------------------------------------------------------------

#[test]
fn good_vectors_default_mode() {
    every_good_vector(&[], "default mode", 1);
}

#[test]
fn good_vectors_fuse_cache_64k() {
    every_good_vector(
        &["--mode", "fuse", "--cache-size", "64K"],
        "--mode fuse --cache-size 64K",
        2,
    );
}

#[test]
fn good_vectors_fuse_cache_0() {
    every_good_vector(
        &["--mode", "fuse", "--cache-size", "0"],
        "--mode fuse --cache-size 0",
        3,
    );
}

#[test]
fn good_vectors_forced_passthrough() {
    every_good_vector(&["--mode", "passthrough"], "--mode passthrough", 4);
}

#[test]
fn good_vectors_forced_fuse() {
    every_good_vector(&["--mode", "fuse"], "--mode fuse", 5);
}

#[test]
fn good_vectors_passthrough_over_budget() {
    // Every shard larger than the budget falls back to FUSE while the small ones stay in
    // passthrough: both kinds of open side by side, on the same mount.
    every_good_vector(
        &[
            "--mode",
            "passthrough",
            "--passthrough-memory",
            "64K",
            "--cache-size",
            "0",
        ],
        "--passthrough-memory 64K",
        6,
    );
}

/// The mount's readahead window in KiB, from its backing device's sysfs knob.
fn read_ahead_kb(m: &Mnt) -> u64 {
    use std::os::unix::fs::MetadataExt;
    let dev = fs::metadata(&m.mp).unwrap().dev();
    let knob = format!(
        "/sys/class/bdi/{}:{}/read_ahead_kb",
        libc::major(dev),
        libc::minor(dev)
    );
    fs::read_to_string(&knob)
        .unwrap_or_else(|e| panic!("{knob}: {e}"))
        .trim()
        .parse()
        .unwrap()
}

#[test]
fn readahead_window_is_set_as_asked() {
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("skipped: only root may set a mount's readahead");
        return;
    }
    let case = cases().into_iter().find(|c| c.ok()).unwrap();
    // The window matters to reads through the daemon.
    let m = mount_case(&case, &["--mode", "fuse"]);
    assert_eq!(read_ahead_kb(&m), 4096, "default --readahead 4M");
    drop(m);
    let m = mount_case(&case, &["--mode", "fuse", "--readahead", "2M"]);
    assert_eq!(read_ahead_kb(&m), 2048);
    drop(m);
    let m = mount_case(&case, &["--mode", "fuse", "--readahead", "0"]);
    assert!(
        read_ahead_kb(&m) < 2048,
        "--readahead 0 keeps the kernel's window"
    );
    check_mounted_case(&case, &m, "--readahead 0", 4, Direct::Exact);
}

// ---------------------------------------------------------------------------------------
// 2. Read-only
// ---------------------------------------------------------------------------------------

fn libc_result(r: libc::c_int) -> io::Result<libc::c_int> {
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r)
    }
}

#[test]
fn the_view_is_read_only() {
    for name in ["llm_v2", "pipe_h3"] {
        let c = case(name);
        let m = mount_case(&c, &[]);
        let files: Vec<String> = tree(&c.view()).into_keys().collect();
        let mut targets = vec![
            files.iter().find(|f| f.ends_with(".safetensors")).unwrap(),
            files
                .iter()
                .find(|f| *f == "tokenizer.json" || f.ends_with("/tokenizer.json"))
                .unwrap(),
            files.iter().find(|f| f.ends_with("config.json")).unwrap(),
        ];
        targets.dedup();
        for rel in targets {
            let p = m.path(rel);
            let what = |op: &str| format!("{name}/{rel}: {op}");
            let mut before = Vec::new();
            File::open(&p).unwrap().read_to_end(&mut before).unwrap();
            for (op, opts) in [
                ("open O_WRONLY", OpenOptions::new().write(true).clone()),
                (
                    "open O_RDWR",
                    OpenOptions::new().read(true).write(true).clone(),
                ),
                ("open O_APPEND", OpenOptions::new().append(true).clone()),
                (
                    "open O_WRONLY|O_TRUNC",
                    OpenOptions::new().write(true).truncate(true).clone(),
                ),
            ] {
                assert_eq!(errno_of(opts.open(&p), &what(op)), EROFS, "{}", what(op));
            }
            assert_eq!(
                errno_of(fs::remove_file(&p), &what("unlink")),
                EROFS,
                "{}",
                what("unlink")
            );
            assert_eq!(
                errno_of(
                    fs::set_permissions(&p, fs::Permissions::from_mode(0o666)),
                    &what("chmod")
                ),
                EROFS,
                "{}",
                what("chmod")
            );
            let cp = cpath(&p);
            // SAFETY (these three): path-based syscalls on a valid C string that outlives them.
            let r = unsafe { libc::truncate(cp.as_ptr(), 0) };
            assert_eq!(errno_of(libc_result(r), &what("truncate")), EROFS);
            let r = unsafe { libc::chown(cp.as_ptr(), 1, 1) };
            assert_eq!(errno_of(libc_result(r), &what("chown")), EROFS);
            let r = unsafe {
                libc::setxattr(
                    cp.as_ptr(),
                    c"user.test".as_ptr(),
                    b"x".as_ptr().cast(),
                    1,
                    0,
                )
            };
            assert_eq!(errno_of(libc_result(r), &what("setxattr")), EROFS);
            assert_eq!(
                errno_of(fs::rename(&p, m.path("renamed")), &what("rename")),
                EROFS
            );
            assert_eq!(
                errno_of(fs::hard_link(&p, m.path("linked")), &what("link")),
                EROFS
            );
            // Nothing changed.
            assert!(
                fs::read(&p).unwrap() == before,
                "{}",
                what("contents changed")
            );
        }
        for (op, r) in [
            ("create", File::create(m.path("new.bin")).map(|_| ())),
            (
                "create_new",
                OpenOptions::new()
                    .write(true)
                    .create_new(true)
                    .open(m.path("new2.bin"))
                    .map(|_| ()),
            ),
            ("mkdir", fs::create_dir(m.path("newdir"))),
            (
                "symlink",
                std::os::unix::fs::symlink("config.json", m.path("lnk")),
            ),
            (
                "chmod root",
                fs::set_permissions(&m.mp, fs::Permissions::from_mode(0o777)),
            ),
        ] {
            assert_eq!(errno_of(r, &format!("{name}: {op}")), EROFS, "{name}: {op}");
        }
        if let Some(dir) = fs::read_dir(&m.mp)
            .unwrap()
            .flatten()
            .find(|e| e.file_type().unwrap().is_dir())
        {
            assert_eq!(
                errno_of(fs::remove_dir_all(dir.path()), &format!("{name}: rmdir")),
                EROFS
            );
            assert_eq!(
                errno_of(
                    File::create(dir.path().join("x")).map(|_| ()),
                    &format!("{name}: create in a subdirectory")
                ),
                EROFS
            );
        }
        assert!(
            !m.path("trusted.kllm").exists(),
            "{name}: trusted.kllm visible"
        );
        assert_eq!(
            fs::metadata(m.path("trusted.kllm")).unwrap_err().kind(),
            io::ErrorKind::NotFound
        );
        // Still the view, untouched.
        assert_eq!(tree(&m.mp).into_keys().collect::<Vec<_>>(), files);
    }
}

#[test]
fn hidden_files_and_modes_kept() {
    let c = case("llm_v2");
    let m = Mnt::new();
    let sealed = m.scratch().join("sealed");
    copy_tree(&c.sealed(), &sealed);
    fs::copy(c.dir.join("kllm.key"), sealed.join("kllm.key")).unwrap();
    // Modes of every kind, on verbatim files and locked shards alike.
    let modes = [
        ("README.md", 0o600),
        ("merges.txt", 0o640),
        ("generation_config.json", 0o755),
        ("model-00001-of-00005.safetensors", 0o400),
        ("model-00002-of-00005.safetensors", 0o664),
        ("tokenizer_config.json", 0o444),
    ];
    for (rel, mode) in modes {
        fs::set_permissions(sealed.join(rel), fs::Permissions::from_mode(mode)).unwrap();
    }
    fs::set_permissions(&sealed, fs::Permissions::from_mode(0o750)).unwrap();
    m.mount_with(
        &sealed,
        &[OsStr::new("--key"), c.dir.join("kllm.key").as_os_str()],
        |_| {},
    );

    let names: BTreeSet<String> = fs::read_dir(&m.mp)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    for hidden in ["trusted.kllm", "kllm.key"] {
        assert!(!names.contains(hidden), "{hidden} listed: {names:?}");
        assert_eq!(
            fs::metadata(m.path(hidden)).unwrap_err().kind(),
            io::ErrorKind::NotFound,
            "{hidden} reachable by name"
        );
        assert!(File::open(m.path(hidden)).is_err(), "{hidden} opens");
    }
    assert_eq!(
        tree(&m.mp).into_keys().collect::<Vec<_>>(),
        tree(&c.view()).into_keys().collect::<Vec<_>>()
    );

    // Every file of the sealed directory that the view shows keeps its mode (and owner);
    // the size too, except the metadata file that loses its lock flag.
    for (rel, path) in tree(&sealed) {
        if rel == "trusted.kllm" || rel == "kllm.key" {
            continue;
        }
        let s = fs::metadata(&path).unwrap();
        let v = fs::metadata(m.path(&rel)).unwrap();
        assert_eq!(
            v.mode() & 0o7777,
            s.mode() & 0o7777,
            "{rel}: mode {:o} in the view, {:o} sealed",
            v.mode() & 0o7777,
            s.mode() & 0o7777
        );
        assert!(v.is_file(), "{rel}: not a regular file in the view");
        assert_eq!((v.uid(), v.gid()), (s.uid(), s.gid()), "{rel}: owner");
        if rel != "config.json" {
            assert_eq!(v.len(), s.len(), "{rel}: size");
        }
    }
    for (rel, mode) in modes {
        assert_eq!(
            fs::metadata(m.path(rel)).unwrap().mode() & 0o7777,
            mode,
            "{rel}"
        );
    }
    let root = fs::metadata(&m.mp).unwrap();
    assert!(root.is_dir());
    assert_eq!(root.mode() & 0o7777, 0o750, "mount root mode");
    // Files of the view are read as the view says, with those modes.
    for (rel, path) in tree(&c.view()) {
        assert!(
            fs::read(m.path(&rel)).unwrap() == fs::read(path).unwrap(),
            "{rel}: not the view"
        );
    }
}

#[test]
fn pipeline_directories_keep_their_modes() {
    for name in ["pipe_h3", "pipe_zimage_client"] {
        let c = case(name);
        let m = mount_case(&c, &[]);
        fn walk(sealed: &Path, mounted: &Path, rel: &str) {
            for e in fs::read_dir(sealed.join(rel)).unwrap().flatten() {
                let r = if rel.is_empty() {
                    e.file_name().to_string_lossy().into_owned()
                } else {
                    format!("{rel}/{}", e.file_name().to_string_lossy())
                };
                if r == "trusted.kllm" {
                    continue;
                }
                let s = e.metadata().unwrap();
                let v = fs::metadata(mounted.join(&r)).unwrap_or_else(|err| panic!("{r}: {err}"));
                assert_eq!(s.is_dir(), v.is_dir(), "{r}: kind");
                assert_eq!(v.mode() & 0o7777, s.mode() & 0o7777, "{r}: mode");
                if s.is_dir() {
                    walk(sealed, mounted, &r);
                }
            }
        }
        walk(&c.sealed(), &m.mp, "");
    }
}

// ---------------------------------------------------------------------------------------
// 3. Refused vectors
// ---------------------------------------------------------------------------------------

#[test]
fn refused_vectors_exit_with_one_line_naming_the_problem() {
    let bad: Vec<Case> = cases().into_iter().filter(|c| !c.ok()).collect();
    assert!(bad.len() >= 4, "expected the four refused vectors");
    for case in &bad {
        let m = Mnt::new();
        let (args, env) = case.key_setup();
        let mut c = m.cmd(&case.sealed());
        c.args(&args);
        for (k, v) in &env {
            c.env(k, v);
        }
        let out = run(c);
        let err = assert_refused(&m, &out, &case.name);
        // Paths aside: the vector's own directory and the mount point do not count.
        let bare = err
            .replace(&*case.dir.to_string_lossy(), "")
            .replace(&*m.mp.to_string_lossy(), "");
        case.assert_error_names(&bare, &err);
        // The same in the foreground.
        let mut c = m.cmd(&case.sealed());
        c.arg("-f").args(&args);
        for (k, v) in &env {
            c.env(k, v);
        }
        let out = run(c);
        let err_f = assert_refused(&m, &out, &format!("{} -f", case.name));
        assert_eq!(err_f, err, "{}: -f says something else", case.name);
    }
}

// ---------------------------------------------------------------------------------------
// 4. Keys
// ---------------------------------------------------------------------------------------

/// All files of the view, compared whole.
fn assert_whole_view(case: &Case, m: &Mnt, label: &str) {
    let want = tree(&case.view());
    assert_eq!(
        tree(&m.mp).into_keys().collect::<Vec<_>>(),
        want.keys().cloned().collect::<Vec<_>>(),
        "{label}: file list"
    );
    for (rel, path) in want {
        let got = fs::read(m.path(&rel)).unwrap_or_else(|e| panic!("{label} {rel}: {e}"));
        let exp = fs::read(path).unwrap();
        assert_same_file(&format!("{label} {rel}"), &got, &exp);
        assert!(got == exp, "{label} {rel}: not byte-exact");
    }
}

#[test]
fn passphrase_key_file() {
    let c = case("llm_passphrase");
    let (key, pass) = c.key_file();
    let pass = pass.expect("llm_passphrase has passphrase.txt");
    let m = Mnt::new();
    m.mount_with(
        &c.sealed(),
        &[OsStr::new("--key"), key.as_os_str()],
        |cmd| {
            cmd.env("KLLM_PASSPHRASE", &pass);
        },
    );
    assert_whole_view(&c, &m, "KLLM_PASSPHRASE");
    drop(m);

    for wrong in [format!("{pass}x"), String::from("wrong"), String::new()] {
        let m = Mnt::new();
        let out = run({
            let mut cmd = m.cmd(&c.sealed());
            cmd.arg("--key").arg(&key).env("KLLM_PASSPHRASE", &wrong);
            cmd
        });
        let err = assert_refused(&m, &out, &format!("passphrase {wrong:?}"));
        assert!(
            err.contains("passphrase"),
            "{err:?} does not say passphrase"
        );
    }
}

#[test]
fn key_from_environment() {
    for c in cases().iter().filter(|c| c.ok()) {
        let m = Mnt::new();
        m.mount_with::<&str>(&c.sealed(), &[], |cmd| {
            cmd.env("KLLM_MODEL_KEY", c.key_hex());
        });
        assert_whole_view(c, &m, &format!("{} KLLM_MODEL_KEY", c.name));
    }
    // A malformed variable is refused by name.
    let c = case("llm_v2");
    let m = Mnt::new();
    let mut cmd = m.cmd(&c.sealed());
    cmd.env("KLLM_MODEL_KEY", "zz");
    let err = assert_refused(&m, &run(cmd), "KLLM_MODEL_KEY=zz");
    assert!(err.contains("KLLM_MODEL_KEY"), "{err:?}");
    // --key wins over the environment.
    let other = case("llm_v1");
    let m = Mnt::new();
    m.mount_with(
        &c.sealed(),
        &[OsStr::new("--key"), c.dir.join("kllm.key").as_os_str()],
        |cmd| {
            cmd.env("KLLM_MODEL_KEY", other.key_hex());
        },
    );
    assert_whole_view(&c, &m, "--key over KLLM_MODEL_KEY");
}

#[test]
fn key_shipped_inside_the_sealed_directory() {
    let c = case("llm_v2");
    let m = Mnt::new();
    let sealed = m.scratch().join("model");
    copy_tree(&c.sealed(), &sealed);
    fs::copy(c.dir.join("kllm.key"), sealed.join("kllm.key")).unwrap();
    m.mount_with::<&str>(&sealed, &[], |_| {});
    assert!(!m.path("kllm.key").exists(), "kllm.key visible in the view");
    assert!(!m.path("trusted.kllm").exists(), "trusted.kllm visible");
    assert_whole_view(&c, &m, "shipped kllm.key");
}

#[test]
fn default_key_in_home() {
    let c = case("llm_v1");
    assert!(!c.sealed().join("kllm.key").exists());
    let m = Mnt::new();
    // No key anywhere: refused, naming what to do.
    let err = assert_refused(&m, &run(m.cmd(&c.sealed())), "no key");
    assert!(err.contains("key"), "{err:?}");
    let keys = m.home.join(".kllm/keys");
    fs::create_dir_all(&keys).unwrap();
    fs::copy(c.dir.join("kllm.key"), keys.join("default.key")).unwrap();
    m.mount_with::<&str>(&c.sealed(), &[], |_| {});
    assert_whole_view(&c, &m, "HOME default.key");
}

/// A wrong sealed path is answered as such, before any key is looked for (none is given
/// here, so a key error would mean the path was not checked first).
#[test]
fn a_wrong_source_is_named_before_the_key_is_looked_for() {
    let m = Mnt::new();
    let missing = m.scratch().join("no-such-model");
    let empty = m.scratch().join("empty");
    fs::create_dir(&empty).unwrap();
    let cases = [
        (&missing, "does not exist"),
        (&empty, "is not a sealed kLLM directory"),
    ];
    for (dir, problem) in cases {
        for fg in [false, true] {
            let mut cmd = m.cmd(dir);
            if fg {
                cmd.arg("-f");
            }
            let label = format!("{} (-f: {fg})", dir.display());
            let err = assert_refused(&m, &run(cmd), &label);
            assert!(
                err.contains(&*dir.to_string_lossy()),
                "{label}: {err:?} does not name the path"
            );
            assert!(err.contains(problem), "{label}: {err:?} lacks {problem:?}");
            assert!(!err.contains("no key"), "{label}: {err:?} asks for a key");
        }
    }
}

#[test]
fn key_of_another_model_is_refused_with_both_fingerprints() {
    let fp_of = |c: &Case| -> String {
        let doc: Value =
            serde_json::from_str(&fs::read_to_string(c.dir.join("kllm.key")).unwrap()).unwrap();
        doc["fingerprint"].as_str().unwrap().to_string()
    };
    let target = case("llm_v2");
    let other = case("llm_v1");
    let (fa, fb) = (fp_of(&target), fp_of(&other));
    assert_ne!(fa, fb);
    let m = Mnt::new();
    let mut cmd = m.cmd(&target.sealed());
    cmd.arg("--key").arg(other.dir.join("kllm.key"));
    let err = assert_refused(&m, &run(cmd), "key of llm_v1 on llm_v2");
    assert!(
        err.contains(&fa),
        "{err:?} lacks the sealed fingerprint {fa}"
    );
    assert!(
        err.contains(&fb),
        "{err:?} lacks the key's fingerprint {fb}"
    );
    // The same key through the environment.
    let mut cmd = m.cmd(&target.sealed());
    cmd.env("KLLM_MODEL_KEY", other.key_hex());
    let err = assert_refused(&m, &run(cmd), "KLLM_MODEL_KEY of llm_v1 on llm_v2");
    assert!(err.contains(&fa) && err.contains(&fb), "{err:?}");
}

// ---------------------------------------------------------------------------------------
// 5. Lifecycle
// ---------------------------------------------------------------------------------------

#[test]
fn background_mode_returns_only_once_mounted() {
    for name in ["llm_v2", "pipe_h3", "llm_edge_v2"] {
        let c = case(name);
        let m = Mnt::new();
        let parent_dev = fs::metadata(m.scratch()).unwrap().dev();
        let (args, env) = c.key_setup();
        let mut cmd = m.cmd(&c.sealed());
        cmd.args(&args);
        for (k, v) in &env {
            cmd.env(k, v);
        }
        let out = run(cmd);
        // Nothing in between: the very next look must find the mount, answering.
        let mounted = is_mounted(&m.mp);
        let st = fs::metadata(&m.mp);
        assert!(out.status.success(), "{name}: {}", stderr_of(&out));
        assert!(
            out.stderr.is_empty(),
            "{name}: stderr {:?}",
            stderr_of(&out)
        );
        assert!(mounted, "{name}: exit 0 before the mount is in mountinfo");
        let st = st.unwrap_or_else(|e| panic!("{name}: stat right after exit 0: {e}"));
        assert_ne!(
            st.dev(),
            parent_dev,
            "{name}: stat saw the bare mount point"
        );
        assert_eq!(
            st.ino(),
            1,
            "{name}: root of the mount is not FUSE's root inode"
        );
        assert!(m.path("config.json").exists() || m.path("kllm.json").exists());
        let pid = m.daemon();
        assert!(pid > 0);
        // Out of its starter's process group, in its session (and so its scheduling group).
        let fields = proc_stat_fields(pid).expect("the daemon's /proc/PID/stat");
        let (pgrp, session): (i32, i32) = (fields[2].parse().unwrap(), fields[3].parse().unwrap());
        assert_eq!(
            pgrp, pid,
            "{name}: the daemon leads a process group of its own"
        );
        // SAFETY: getsid(0) asks for this process's session.
        assert_eq!(
            session,
            unsafe { libc::getsid(0) },
            "{name}: the daemon left the session"
        );
        if let Ok(mine) = fs::read_to_string("/proc/self/autogroup") {
            let its = fs::read_to_string(format!("/proc/{pid}/autogroup")).unwrap();
            assert_eq!(its, mine, "{name}: the daemon's scheduling group");
        }
    }
}

#[test]
fn daemon_ends_when_unmounted_with_fusermount() {
    let c = case("llm_v2");
    let m = mount_case(&c, &[]);
    let pid = m.daemon();
    fs::read(m.path("model-00001-of-00005.safetensors")).unwrap();
    assert!(fusermount_u(&m.mp, false), "fusermount3 -u failed");
    assert!(!is_mounted(&m.mp));
    match wait_gone(pid, Duration::from_secs(5)) {
        None => panic!("daemon {pid} still running 5 s after fusermount3 -u"),
        Some(Gone::Exited(code)) => assert_eq!(code, Some(0), "daemon exit status"),
        Some(Gone::Vanished) => {}
    }
    // The mount point is the bare directory again.
    assert_eq!(fs::read_dir(&m.mp).unwrap().count(), 0);
}

fn foreground_ends_on(sig: i32) {
    let c = case("llm_v2");
    let mut m = Mnt::new();
    let (args, env) = c.key_setup();
    m.start_foreground(&c.sealed(), &args, &env);
    assert_whole_view(&c, &m, "-f");
    let child = m.child.as_mut().unwrap();
    kill(child.id() as i32, sig);
    let deadline = Instant::now() + Duration::from_secs(5);
    let status = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break st;
        }
        assert!(
            Instant::now() < deadline,
            "kllm-mount -f still running 5 s after signal {sig}"
        );
        std::thread::sleep(Duration::from_millis(10));
    };
    let mut err = String::new();
    let _ = child.stderr.take().unwrap().read_to_string(&mut err);
    assert!(
        status.success(),
        "signal {sig}: exit {status}, stderr {err:?}"
    );
    assert!(!is_mounted(&m.mp), "signal {sig}: still mounted after exit");
    assert_eq!(fs::read_dir(&m.mp).unwrap().count(), 0);
}

#[test]
fn foreground_ends_cleanly_on_sigterm() {
    foreground_ends_on(libc::SIGTERM);
}

#[test]
fn foreground_ends_cleanly_on_sigint() {
    foreground_ends_on(libc::SIGINT);
}

/// SIGTERM to the daemon while 4 threads read through FUSE in a loop from files they hold
/// open: every reader gets an error within seconds (none hangs, none sees wrong bytes) and
/// the daemon exits 0. Returns the mount, for the caller to look at what is left.
fn sigterm_while_reading(c: &Case) -> Mnt {
    let m = mount_case(c, &["--mode", "fuse", "--cache-size", "0"]);
    let pid = m.daemon();
    let files = Arc::new(expected_files(c));
    let stop = Arc::new(AtomicBool::new(false));
    let reads: Arc<Vec<AtomicU64>> = Arc::new((0..4).map(|_| AtomicU64::new(0)).collect());
    let (tx, rx) = mpsc::channel();
    for t in 0..4usize {
        let (files, stop, reads, tx) = (files.clone(), stop.clone(), reads.clone(), tx.clone());
        let handles: Vec<File> = files
            .iter()
            .map(|f| {
                if t % 2 == 0 {
                    open_direct(&m.path(&f.rel))
                } else {
                    File::open(m.path(&f.rel)).unwrap()
                }
            })
            .collect();
        std::thread::spawn(move || {
            let mut rng = StdRng::seed_from_u64(40 + t as u64);
            let give_up = Instant::now() + Duration::from_secs(30);
            let outcome = loop {
                if stop.load(Ordering::Relaxed) || Instant::now() > give_up {
                    break Err("no error before the deadline".to_string());
                }
                let i = rng.gen_range(0..files.len());
                let f = &files[i];
                drop_page_cache(&handles[i]);
                let (off, len) = one_range(&mut rng, f.bytes.len() as u64, &f.bounds);
                match pread(&handles[i], off, len) {
                    Ok(got) if got == slice(&f.bytes, off, len) => {
                        reads[t].fetch_add(1, Ordering::Relaxed);
                    }
                    Ok(_) => break Err(format!("{} [{off}, +{len}): wrong bytes", f.rel)),
                    Err(e) => break Ok(e),
                }
            };
            let _ = tx.send((t, outcome));
        });
    }
    drop(tx);
    // Every reader is under way before the signal.
    let deadline = Instant::now() + Duration::from_secs(10);
    while reads.iter().any(|r| r.load(Ordering::Relaxed) < 20) {
        assert!(Instant::now() < deadline, "readers made no progress");
        if let Ok((t, outcome)) = rx.try_recv() {
            panic!("reader {t} stopped before the signal: {outcome:?}");
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    kill(pid, libc::SIGTERM);
    let signalled = Instant::now();
    let mut errors = Vec::new();
    for _ in 0..4 {
        match rx.recv_timeout(Duration::from_secs(15)) {
            Ok((t, Ok(e))) => errors.push((t, e)),
            Ok((t, Err(why))) => {
                stop.store(true, Ordering::Relaxed);
                panic!("reader {t}: {why}")
            }
            Err(_) => {
                stop.store(true, Ordering::Relaxed);
                panic!("a reader hangs 15 s after SIGTERM (got {errors:?})")
            }
        }
    }
    eprintln!(
        "readers stopped {:?} after SIGTERM with {errors:?}",
        signalled.elapsed()
    );
    match wait_gone(pid, Duration::from_secs(5)) {
        None => panic!("daemon still running 5 s after SIGTERM"),
        Some(Gone::Exited(code)) => assert_eq!(code, Some(0), "daemon exit status"),
        Some(Gone::Vanished) => {}
    }
    m
}

#[test]
fn sigterm_while_reading_ends_readers_and_daemon() {
    sigterm_while_reading(&case("llm_v2"));
}

#[test]
fn sigterm_while_reading_leaves_nothing_mounted() {
    let m = sigterm_while_reading(&case("llm_v2"));
    assert!(
        !is_mounted(&m.mp),
        "SIGTERM with open files left {} mounted (listing it: {:?})",
        m.mp.display(),
        fs::read_dir(&m.mp).map(|d| d.count())
    );
}

// ---------------------------------------------------------------------------------------
// 6. Bad mount points
// ---------------------------------------------------------------------------------------

#[test]
fn bad_mount_points_are_named() {
    let c = case("llm_v2");
    let m = Mnt::new();
    let file = m.scratch().join("a-file");
    fs::write(&file, b"x").unwrap();
    for mp in [m.scratch().join("does-not-exist"), file] {
        let mut cmd = Command::new(kllm_mount_bin());
        cmd.arg(c.sealed())
            .arg(&mp)
            .arg("--key")
            .arg(c.dir.join("kllm.key"))
            .env_remove("KLLM_MODEL_KEY")
            .stdin(Stdio::null());
        let out = run(cmd);
        let err = stderr_of(&out);
        assert_eq!(out.status.code(), Some(1), "{}: {err:?}", mp.display());
        assert!(
            err.starts_with("kllm-mount: ") && err.matches('\n').count() == 1,
            "{}: {err:?}",
            mp.display()
        );
        assert!(
            err.contains(&*mp.to_string_lossy()),
            "error {err:?} does not name {}",
            mp.display()
        );
        assert!(!is_mounted(&mp));
        assert!(pids_with_arg(&mp).is_empty());
    }
    assert_eq!(fs::read(m.scratch().join("a-file")).unwrap(), b"x");
}

// ---------------------------------------------------------------------------------------
// 7. Corruption gives EIO, never wrong bytes
// ---------------------------------------------------------------------------------------

struct Spot {
    shard: String,
    /// The altered value's absolute offset (2 bytes, BF16).
    at: u64,
    /// The altered tensor and another locked tensor of the same shard.
    tensor: (u64, u64),
    neighbour: (u64, u64),
}

/// Overwrite one BF16 value of a locked tensor whose domain is below 0x7F7F with 0x7F7F.
fn corrupt_one_value(sealed: &Path, key: &kllm_mount::key::ModelKey) -> Spot {
    let mut shards: Vec<String> = tree(sealed)
        .into_keys()
        .filter(|r| r.ends_with(".safetensors"))
        .collect();
    shards.sort();
    for rel in shards {
        let path = sealed.join(&rel);
        let file = File::open(&path).unwrap();
        let shard = kllm_mount::shard::Shard::open(&path, &file, "", key).unwrap();
        let Some(t) = shard.locked.iter().find(|t| {
            t.dtype == safetensors::Dtype::BF16 && t.lock.m < 0x7F7F && t.end - t.start >= 1024
        }) else {
            continue;
        };
        let Some(n) = shard.locked.iter().find(|o| o.start != t.start) else {
            continue;
        };
        let values = (t.end - t.start) / 2;
        let at = t.start + 2 * (values / 2 + 3);
        let f = OpenOptions::new().write(true).open(&path).unwrap();
        f.write_all_at(&[0x7F, 0x7F], at).unwrap();
        f.sync_all().unwrap();
        return Spot {
            shard: rel,
            at,
            tensor: (t.start, t.end),
            neighbour: (n.start, n.end),
        };
    }
    panic!("no locked BF16 tensor with a domain below 0x7F7F");
}

#[test]
fn corruption_gives_eio_never_wrong_bytes() {
    let c = case("llm_v2");
    let scratch = Mnt::new();
    let sealed = scratch.scratch().join("sealed");
    copy_tree(&c.sealed(), &sealed);
    let key_path = c.dir.join("kllm.key");
    let key =
        kllm_mount::key::parse_key_file(&key_path, &fs::read_to_string(&key_path).unwrap(), || {
            unreachable!("an open key file")
        })
        .unwrap();
    let spot = corrupt_one_value(&sealed, &key);
    let view = expected_files(&c);
    let want = &view.iter().find(|f| f.rel == spot.shard).unwrap().bytes;
    let key_args = ["--key".into(), key_path.clone().into_os_string()];

    for cache in ["256M", "0"] {
        let m = Mnt::new();
        let mut args = key_args.to_vec();
        args.extend(["--cache-size".into(), cache.into()]);
        m.mount_with(&sealed, &args, |_| {});
        let p = m.path(&spot.shard);
        let label = format!("--cache-size {cache}: {}", spot.shard);

        // Exact reads covering the altered value.
        let direct = open_direct(&p);
        for (off, len) in [
            (spot.at, 2),
            (spot.at + 1, 1),
            (spot.at - 100, 300),
            (spot.tensor.0, (spot.tensor.1 - spot.tensor.0) as usize),
            (0, want.len()),
        ] {
            let e = pread(&direct, off, len).map(|v| v.len());
            assert_eq!(
                errno_of(e, &format!("{label} [{off}, +{len})")),
                EIO,
                "{label} [{off}, +{len})"
            );
        }
        // Through the page cache and mmap too.
        let e = fs::read(&p).map(|v| v.len());
        assert_eq!(errno_of(e, &format!("{label}: read whole")), EIO);
        let buffered = File::open(&p).unwrap();
        let e = pread(&buffered, spot.at & !4095, 4096).map(|v| v.len());
        assert_eq!(errno_of(e, &format!("{label}: cached pread")), EIO);

        // Other shards are untouched and still read as the view.
        for f in view.iter().filter(|f| f.rel != spot.shard) {
            let got =
                fs::read(m.path(&f.rel)).unwrap_or_else(|e| panic!("{label}: {}: {e}", f.rel));
            assert!(got == f.bytes, "{label}: {} differs", f.rel);
        }

        if cache == "0" {
            // Without a cache block around it, the rest of the shard still reads: every 4 KiB
            // piece either fails with EIO (the one holding the value) or equals the view.
            let (a, b) = spot.neighbour;
            let got = pread(&direct, a, (b - a) as usize)
                .unwrap_or_else(|e| panic!("{label}: neighbour tensor [{a}, {b}): {e}"));
            assert!(
                got == want[a as usize..b as usize],
                "{label}: neighbour tensor"
            );
            let mut failed = Vec::new();
            for off in (0..want.len() as u64).step_by(4096) {
                match pread(&direct, off, 4096) {
                    Ok(got) => assert!(
                        got == slice(want, off, 4096),
                        "{label}: wrong bytes at [{off}, +4096)"
                    ),
                    Err(e) => {
                        assert_eq!(e.raw_os_error(), Some(EIO), "{label} at {off}: {e}");
                        failed.push(off);
                    }
                }
            }
            assert_eq!(failed, vec![spot.at & !4095], "{label}: pieces that fail");
        }
    }
}
