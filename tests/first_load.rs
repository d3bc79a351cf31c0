//! The first load in passthrough mode, through the kernel: opens served while the decoded
//! copy fills (pread, mmap, many threads, reopens), passthrough once it is complete, one
//! decode for tensor-parallel opens, a corrupt value met mid-fill (EIO for the reads that
//! touch it, right bytes elsewhere), and decode ahead after mounting.

mod common;

use std::fs::{self, File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use common::*;
use kllm_mount::lock::Version;

const KEY: [u8; 32] = [0x6b; 32];
const BIG: &str = "model-00002-of-00002.safetensors";
const SMALL: &str = "model-00001-of-00002.safetensors";

/// A sample whose big shard (about 200 MiB, 25 chunks of the fill), once evicted from the
/// page cache, takes long enough to decode that opens arrive while its copy fills.
fn sample() -> Sample {
    Sample::new(KEY, 2048, 8, Some(Version::V2), |_| {})
}

/// Drop a file's pages from the page cache, so its first reader waits for the disk.
fn evict(path: &Path) {
    use std::os::fd::AsRawFd;
    let f = File::open(path).unwrap();
    f.sync_all().unwrap();
    // SAFETY: advice on a descriptor we hold.
    unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
}

fn mount(s: &Sample, m: &Mnt, log: &Path, extra: &[&str]) -> i32 {
    let mut args = vec!["--mode", "passthrough"];
    args.extend(extra);
    mount_logged(s, m, log, &args)
}

fn read_all(f: &File, len: usize) -> Vec<u8> {
    let mut out = vec![0u8; len];
    f.read_exact_at(&mut out, 0).unwrap();
    out
}

#[test]
fn the_first_open_reads_while_the_copy_fills_and_later_opens_get_passthrough() {
    let s = sample();
    let want = Arc::new(s.view()[BIG].clone());
    evict(&s.sealed().join(BIG));
    let m = Mnt::new();
    let log = m.scratch().join("log");
    mount(&s, &m, &log, &["--no-decode-ahead"]);

    // The first 4 KiB come before the copy is complete: the open did not wait for it.
    let held = File::open(m.path(BIG)).unwrap();
    let mut head = vec![0u8; 4096];
    held.read_exact_at(&mut head, 0).unwrap();
    assert!(head[..] == want[..4096], "first 4 KiB differ");
    assert_eq!(
        decodes_of(&log, BIG),
        0,
        "the open waited for the whole decode"
    );
    assert_eq!(counter(&m, "passthrough_opens"), 0);

    // Many threads with their own descriptors, each a quarter in 1 MiB reads, a reopen,
    // and a mapping, all while the copy may still be filling.
    let len = want.len();
    let readers: Vec<_> = (0..4)
        .map(|q| {
            let (path, want) = (m.path(BIG), want.clone());
            std::thread::spawn(move || {
                let f = File::open(path).unwrap();
                let (a, b) = (len * q / 4, len * (q + 1) / 4);
                let mut off = a;
                while off < b {
                    let n = (1 << 20).min(b - off);
                    let mut buf = vec![0u8; n];
                    f.read_exact_at(&mut buf, off as u64).unwrap();
                    assert!(buf[..] == want[off..off + n], "thread {q}: bytes at {off}");
                    off += n;
                }
            })
        })
        .collect();
    // SAFETY: the view is read-only and immutable while mounted.
    let map = unsafe { memmap2::Mmap::map(&held) }.unwrap();
    assert!(map[..] == want[..], "mmap differs");
    for r in readers {
        r.join().unwrap();
    }
    drop(map);
    wait_for(60, "the copy completes", || decodes_of(&log, BIG) == 1);
    // Still open through FUSE: a reopen joins it there, reading the completed copy.
    let again = File::open(m.path(BIG)).unwrap();
    assert!(
        read_all(&again, len) == *want,
        "reopen during the FUSE phase"
    );
    assert_eq!(counter(&m, "passthrough_opens"), 0);
    drop((held, again));

    // All closed: the next open is handed the complete copy, with no second decode.
    wait_for(10, "a passthrough open after the last close", || {
        let f = File::open(m.path(BIG)).unwrap();
        let got = read_all(&f, len);
        assert!(got == *want, "passthrough bytes differ");
        counter(&m, "passthrough_opens") > 0
    });
    assert_eq!(decodes_of(&log, BIG), 1, "decoded twice");
}

#[test]
fn tensor_parallel_opens_during_the_fill_decode_once() {
    let s = sample();
    let m = Mnt::new();
    let log = m.scratch().join("log");
    mount(&s, &m, &log, &["--no-decode-ahead"]);
    let want = m.scratch().join("want");
    fs::write(&want, &s.view()[BIG]).unwrap();
    evict(&s.sealed().join(BIG));
    assert!(
        cmp_side_by_side(4, &m.path(BIG), &want),
        "a rank saw other bytes"
    );
    wait_for(60, "the copy completes", || decodes_of(&log, BIG) == 1);
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(decodes_of(&log, BIG), 1, "decoded more than once");
}

#[test]
fn a_corrupt_value_met_mid_fill_fails_only_the_reads_that_touch_it() {
    let s = sample();
    let want = s.view()[BIG].clone();
    // One BF16 code outside every locked domain, two thirds into the data.
    let path = s.sealed().join(BIG);
    let sealed = fs::read(&path).unwrap();
    let data_start = 8 + u64::from_le_bytes(sealed[..8].try_into().unwrap()) as usize;
    let bad = (data_start + (sealed.len() - data_start) * 2 / 3) & !1;
    let f = OpenOptions::new().write(true).open(&path).unwrap();
    f.write_all_at(&[0xff, 0xff], bad as u64).unwrap();
    f.sync_all().unwrap();
    drop(f);

    let m = Mnt::new();
    let log = m.scratch().join("log");
    mount(&s, &m, &log, &["--no-decode-ahead"]);
    for pass in ["while filling", "after the fill"] {
        let f = open_direct(&m.path(BIG));
        let mut failed = Vec::new();
        let step = 1usize << 20;
        for off in (0..want.len()).step_by(step) {
            let end = (off + step).min(want.len());
            match pread(&f, off as u64, end - off) {
                Ok(got) => assert!(got == want[off..end], "{pass}: wrong bytes at {off}"),
                Err(e) => {
                    assert_eq!(e.raw_os_error(), Some(libc::EIO), "{pass} at {off}: {e}");
                    failed.push(off);
                }
            }
        }
        assert_eq!(
            failed,
            [bad / step * step],
            "{pass}: EIO elsewhere than the bad value"
        );
        drop(f);
        wait_for(60, "the fill ends", || {
            !log_lines(&log, &format!("{BIG}: 1 chunks not decoded")).is_empty()
        });
    }
    assert_eq!(
        decodes_of(&log, BIG),
        0,
        "a copy with a bad chunk handed to the kernel"
    );
    assert_eq!(counter(&m, "passthrough_opens"), 0);
}

#[test]
fn shards_are_decoded_ahead_in_load_order_and_found_by_their_first_open() {
    let s = sample();
    let want = s.view();
    let m = Mnt::new();
    let log = m.scratch().join("log");
    mount(&s, &m, &log, &[]);
    // Nothing opened: both shards decoded, the first of the index first.
    wait_for(60, "decode ahead", || decodes_of(&log, BIG) == 1);
    let decoded = log_lines(&log, ": decoded ");
    let first = |rel: &str| decoded.iter().position(|l| l.contains(rel)).unwrap();
    assert!(first(SMALL) < first(BIG), "not in index order: {decoded:?}");
    assert_eq!(counter(&m, "opens"), 0);
    for rel in [SMALL, BIG] {
        let f = File::open(m.path(rel)).unwrap();
        assert!(read_all(&f, want[rel].len()) == want[rel], "{rel} differs");
    }
    assert_eq!(
        counter(&m, "passthrough_opens"),
        2,
        "not served from the copies"
    );
    assert_eq!(decodes_of(&log, BIG), 1);
}

#[test]
fn no_decode_ahead_leaves_shards_until_opened() {
    let s = Sample::new(KEY, 256, 2, Some(Version::V2), |_| {});
    let m = Mnt::new();
    let log = m.scratch().join("log");
    mount(&s, &m, &log, &["--no-decode-ahead"]);
    std::thread::sleep(Duration::from_millis(500));
    assert!(
        log_lines(&log, ": decoded ").is_empty(),
        "decoded before any open"
    );
    let f = File::open(m.path(BIG)).unwrap();
    assert!(read_all(&f, s.view()[BIG].len()) == s.view()[BIG]);
}

/// Bytes of `path` in the page cache (`mincore` over a mapping of it).
fn cached_bytes(path: &Path) -> u64 {
    let f = File::open(path).unwrap();
    let len = f.metadata().unwrap().len() as usize;
    // SAFETY: a read-only mapping of a file no one writes during the test.
    let map = unsafe { memmap2::Mmap::map(&f) }.unwrap();
    let mut resident = vec![0u8; len.div_ceil(4096)];
    // SAFETY: `resident` has one byte per page of the mapping.
    let r = unsafe { libc::mincore(map.as_ptr() as *mut _, len, resident.as_mut_ptr()) };
    assert_eq!(r, 0, "mincore: {}", std::io::Error::last_os_error());
    resident.iter().filter(|&&b| b & 1 == 1).count() as u64 * 4096
}

#[test]
fn a_sealed_shards_page_cache_goes_once_its_copy_holds_it() {
    let s = sample();
    let want = s.view()[BIG].clone();
    // On the disk the build is on: a tmpfs (where the system's temporary folder may be)
    // cannot let its pages go.
    let disk = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    for manifest in [false, true] {
        let sealed = disk.path().join(format!("sealed-{manifest}"));
        copy_tree(&s.sealed(), &sealed);
        if manifest {
            fs::write(
                sealed.join("kllm-manifest.json"),
                s3server::manifest_of(&sealed, &[]),
            )
            .unwrap();
        }
        let shard = sealed.join(BIG);
        let len = fs::metadata(&shard).unwrap().len();
        // Written back (a dirty page cannot go), and all of it in the page cache.
        File::open(&shard).unwrap().sync_all().unwrap();
        fs::read(&shard).unwrap();
        assert!(
            cached_bytes(&shard) >= len * 9 / 10,
            "the sealed shard is not in the page cache to begin with"
        );
        let m = Mnt::new();
        let log = m.scratch().join("log");
        let mut c = m.cmd(&sealed);
        c.arg("--key")
            .arg(s.key_file())
            .args(["--log-file".as_ref(), log.as_os_str()])
            .args(["--mode", "passthrough"])
            .env("RUST_LOG", "kllm_mount=debug");
        m.mount(c);
        let f = File::open(m.path(BIG)).unwrap();
        assert!(read_all(&f, want.len()) == want, "{BIG} differs");
        wait_for(60, "the decoded copy", || decodes_of(&log, BIG) == 1);
        if manifest {
            // The copy is complete only with a good verdict: the shard was hashed whole.
            assert!(counter(&m, "verified_bytes") >= len);
        }
        // Each chunk's pages go once fetched, but the first and last (the chunks beside may
        // read the values cut there), which go once the copy is complete.
        let left = cached_bytes(&shard);
        assert!(
            left == 0,
            "{left} of {len} bytes of the sealed shard still cached (manifest: {manifest})"
        );
    }
}

/// Through FUSE a shard opened at once is left to its reads, and fetch ahead goes on with
/// the next: an engine reads one shard from the daemon while the next is decoded into the
/// kernel's page cache, whose reads then reach the daemon no more.
#[test]
fn fuse_mode_fetches_the_next_shard_ahead_while_the_first_is_read() {
    let s = sample();
    let view = s.view();
    let shards = s.sealed_shards();
    assert_eq!(shards[0].0, SMALL, "the shard engines load first");
    for (rel, _) in &shards {
        evict(&s.sealed().join(rel));
    }
    let m = s.mount_fuse(&["--verify", "off"]);
    let held = File::open(m.path(SMALL)).unwrap();
    let next = view[BIG].len() as u64;
    wait_for(30, "the next shard decoded ahead", || {
        counter(&m, "bytes_stored_ahead") >= next
    });
    let served = counter(&m, "bytes_served");
    assert!(fs::read(m.path(BIG)).unwrap() == view[BIG], "{BIG} differs");
    // All of it from the kernel's page cache, but for pages proactive reclaim took.
    let from_daemon = counter(&m, "bytes_served") - served;
    assert!(
        from_daemon <= reclaim_allowance(next),
        "{BIG}: {from_daemon} of {next} bytes read from the daemon, not the kernel's page cache"
    );
    assert!(
        read_all(&held, view[SMALL].len()) == view[SMALL],
        "{SMALL} differs"
    );
}

/// How many of `path`'s pages are in the page cache.
fn pages_cached(path: &Path) -> usize {
    let f = File::open(path).unwrap();
    // SAFETY: a read-only mapping of a file we hold, looked at by mincore only.
    let map = unsafe { memmap2::Mmap::map(&f) }.unwrap();
    let mut vec = vec![0u8; map.len().div_ceil(4096)];
    // SAFETY: `vec` has a byte for each page of the mapping.
    let rc = unsafe {
        libc::mincore(
            map.as_ptr() as *mut libc::c_void,
            map.len(),
            vec.as_mut_ptr(),
        )
    };
    assert_eq!(rc, 0);
    vec.iter().filter(|&&b| b & 1 == 1).count()
}

/// Through FUSE with nothing to hash first, a local source's shards are read into the page
/// cache right after mounting (fetch ahead) and decoded into the kernel's page cache of the
/// mount, so an engine that opens them after its imports finds every page there: its reads
/// reach neither the disk nor the daemon. With --no-decode-ahead they are left to their
/// first reads. The bytes read are exact either way.
#[test]
fn fuse_mode_decodes_local_shards_into_the_kernels_page_cache_ahead_of_their_first_open() {
    let s = Sample::new(KEY, 256, 4, Some(Version::V2), |_| {});
    let view = s.view();
    let shards = s.sealed_shards();
    let sealed: u64 = shards.iter().map(|(_, len)| len).sum();
    let decoded: u64 = shards.iter().map(|(rel, _)| view[rel].len() as u64).sum();
    let pages: usize = shards
        .iter()
        .map(|(_, len)| (*len as usize).div_ceil(4096))
        .sum();
    let cached = || -> usize {
        shards
            .iter()
            .map(|(rel, _)| pages_cached(&s.sealed().join(rel)))
            .sum()
    };
    for ahead in [false, true] {
        for (rel, _) in &shards {
            evict(&s.sealed().join(rel));
        }
        let mut args = vec!["--verify", "off"];
        if !ahead {
            args.push("--no-decode-ahead");
        }
        let m = s.mount_fuse(&args);
        if ahead {
            wait_for(30, "every shard decoded ahead", || {
                counter(&m, "bytes_stored_ahead") == decoded
            });
            assert_eq!(counter(&m, "bytes_fetched_ahead"), sealed);
            assert_eq!(
                cached(),
                pages,
                "every page of the shards in the page cache"
            );
        } else {
            std::thread::sleep(Duration::from_millis(500));
            assert_eq!(counter(&m, "bytes_fetched_ahead"), 0, "--no-decode-ahead");
            assert_eq!(counter(&m, "bytes_stored_ahead"), 0, "--no-decode-ahead");
            assert!(
                cached() < pages / 2,
                "--no-decode-ahead: {} of {pages} pages cached before any open",
                cached()
            );
        }
        let served = counter(&m, "bytes_served");
        for (rel, _) in &shards {
            let got = fs::read(m.path(rel)).unwrap();
            assert!(got == view[rel], "{rel}: not byte-exact (ahead: {ahead})");
            // And through a mapping, from the same pages.
            let f = File::open(m.path(rel)).unwrap();
            // SAFETY: the view is read-only and immutable while mounted.
            let map = unsafe { memmap2::Mmap::map(&f) }.unwrap();
            assert!(map[..] == view[rel][..], "{rel}: mapping not byte-exact");
        }
        let served = counter(&m, "bytes_served") - served;
        if ahead {
            // Every byte from the kernel's page cache, but for pages proactive reclaim took.
            assert!(
                served <= reclaim_allowance(decoded),
                "{served} of {decoded} bytes served by the daemon, not the kernel's page cache"
            );
        } else {
            assert!(
                served >= decoded,
                "{served} of {decoded} bytes served by the daemon"
            );
        }
    }
}
