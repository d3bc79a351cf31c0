use super::dispatch::FIRST_FETCHES;
use super::fetch::PREFETCH_WINDOW;
use super::input::disk_look;
use super::pools::WRITE_PIECE;
use super::sealed_reader::SealedReader;
use super::*;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

/// The "decoded" byte at `pos`.
fn byte(pos: u64) -> u8 {
    (pos % 251) as u8 ^ (pos >> 20) as u8
}

fn decode_ok(off: u64, buf: &mut [u8]) -> Result<(), ReadError> {
    for (i, b) in buf.iter_mut().enumerate() {
        *b = byte(off + i as u64);
    }
    Ok(())
}

/// A writable scratch file standing in for private memory, allocated as it fills.
fn scratch(len: u64) -> Target {
    Target {
        file: tempfile::tempfile().unwrap(),
        len,
        steps: Steps::same(1 << 20),
        seal: Box::new(crate::memfs::seal),
        reservation: None,
    }
}

/// A source whose chunks are made by `decode` alone (nothing to fetch).
fn with(
    decode: impl Fn(u64, &mut [u8]) -> Result<(), ReadError> + Send + Sync + 'static,
    check: Option<Arc<CheckFn>>,
    prefetch: Option<Box<PrefetchFn>>,
) -> Input {
    Input {
        check,
        prefetch,
        ..Input::made_by(decode)
    }
}

fn source(
    decode: impl Fn(u64, &mut [u8]) -> Result<(), ReadError> + Send + Sync + 'static,
) -> Input {
    with(decode, None, None)
}

fn start(len: u64, src: Input, p: Priority) -> Fill {
    Fill::start(scratch(len), src, p, "test".into()).unwrap()
}

/// Every byte of a completed copy.
fn copy_bytes(m: &MemoryFile) -> Vec<u8> {
    let mut all = vec![0u8; m.len() as usize];
    std::os::unix::fs::FileExt::read_exact_at(m.file(), &mut all, 0).unwrap();
    all
}

/// Poll `holds` until it is true, failing with `what` after `secs` seconds.
fn wait_until(secs: u64, what: &str, mut holds: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(secs);
    while !holds() {
        assert!(Instant::now() < deadline, "{what}: not within {secs} s");
        std::thread::sleep(Duration::from_millis(1));
    }
}

fn expect(off: u64, got: &[u8]) {
    for (i, &b) in got.iter().enumerate() {
        assert_eq!(b, byte(off + i as u64), "byte {}", off + i as u64);
    }
}

/// The kernel's counters of shmem folios made are machine-wide, and one of the tests
/// that read them checks that a fill made no 1 MiB folios: they take turns (no other
/// test of the library's makes 1 MiB folios).
static FOLIO_COUNTERS: parking_lot::Mutex<()> = parking_lot::Mutex::new(());

/// Decode ahead through a real view's local shard: `Input::in_page_cache` comes from
/// `cachestat` of the sealed file, so decode ahead takes 2 MiB folios while its bytes
/// are in the page cache and 1 MiB ones once they are not.
#[cfg(feature = "seal")]
#[test]
fn decode_ahead_of_a_local_shard_takes_2_mib_folios_only_while_it_is_cached() {
    use crate::memfs::{shmem_folios_made, Pages};
    use crate::testseal;
    let _turn = FOLIO_COUNTERS.lock();
    let tmp = tempfile::tempdir().unwrap();
    let (plain, sealed) = (tmp.path().join("plain"), tmp.path().join("sealed"));
    let key = crate::key::ModelKey::new([7; 32]);
    testseal::write_sample_model(&plain, 2048, 2).unwrap();
    let lock = Some(crate::lock::Version::V2);
    testseal::seal_dir(&plain, &sealed, &key, lock, [3; 16]).unwrap();
    let view = Arc::new(crate::sealed::open(&sealed, &key, &"test", &Default::default()).unwrap());
    let (path, ino) = view
        .file_paths()
        .into_iter()
        .max_by_key(|(_, ino)| view.node(*ino).unwrap().attr.size)
        .unwrap();
    let len = view.node(ino).unwrap().attr.size;
    assert!(len >= 4 * CHUNK, "{path}: {len} bytes");
    let Some(mem) = crate::memfs::tests::memory_fs(3 * len) else {
        return;
    };
    if mem.pages() != Pages::Folios || shmem_folios_made(2 << 20).is_none() {
        eprintln!("skipped: this kernel makes no tmpfs folios of each size");
        return;
    }
    let made = |size| shmem_folios_made(size).expect("the counter read a moment ago");
    let want = view.read(ino, 0, len as usize).unwrap();
    let decode_ahead = || {
        let reservation = mem.reserve(len).expect("room for the copy");
        let f = Fill::of_view(&view, ino, &mem, reservation, Priority::Ahead).unwrap();
        f.wait_done();
        let got = copy_bytes(&f.complete().expect("the fill completes"));
        assert!(
            got[..] == want[..],
            "{path}: the copy differs from the view"
        );
    };
    let sealed_file = File::open(sealed.join(&path)).unwrap();
    let _ = std::io::Read::read_to_end(&mut &sealed_file, &mut Vec::new()).unwrap();
    let huge = made(2 << 20);
    decode_ahead();
    let huge_after = made(2 << 20);
    assert!(
        huge_after >= huge + (len - AWAITED_START) / (2 << 20),
        "cached: {huge} -> {huge_after}"
    );
    sealed_file.sync_all().unwrap();
    crate::testkit::drop_page_cache(&sealed_file);
    let large = made(1 << 20);
    decode_ahead();
    let large_after = made(1 << 20);
    assert!(
        large_after >= large + len / (1 << 20),
        "from the disk: {large} -> {large_after}"
    );
}

/// A fill someone waits for takes 512 KiB folios, decode ahead 1 MiB ones (2 MiB over sealed
/// bytes in the page cache, past the file's start) (`Steps`): read off the kernel's counters
/// of shmem folios made.
#[test]
fn a_waited_for_fill_takes_512_kib_folios_decode_ahead_1_mib_and_2_mib_over_cached_bytes() {
    use crate::memfs::{shmem_folios_made, Pages};
    let _turn = FOLIO_COUNTERS.lock();
    let len = 8 * CHUNK;
    // Room for all three files: a fill's threads may still hold its file for a moment
    // after it completes (nothing here takes a budget reservation to wait on).
    let Some(mem) = crate::memfs::tests::memory_fs(3 * len) else {
        return;
    };
    if mem.pages() != Pages::Folios {
        eprintln!("skipped: this kernel makes no tmpfs folios below 2 MiB");
        return;
    }
    let fill_at = |p: Priority, cached: bool| {
        let target = Target {
            file: mem.create().unwrap(),
            len,
            steps: Steps::of(mem.pages()),
            seal: Box::new(crate::memfs::seal),
            reservation: None,
        };
        let src = Input {
            in_page_cache: Some(Box::new(move |_, _| cached)),
            ..source(decode_ok)
        };
        let f = Fill::start(target, src, p, "test".into()).unwrap();
        // At its own priority: `wait_complete` would raise it.
        f.wait_done();
        expect(0, &copy_bytes(&f.complete().expect("the fill completes")));
    };
    let sizes = [512 << 10, 1 << 20, 2 << 20];
    if sizes.iter().any(|&s| shmem_folios_made(s).is_none()) {
        eprintln!("skipped: no shmem folio counters");
        return;
    }
    let made = |size| shmem_folios_made(size).expect("the counter read a moment ago");
    let (medium, large) = (made(512 << 10), made(1 << 20));
    fill_at(Priority::Demand, true);
    let (medium_after, large_after) = (made(512 << 10), made(1 << 20));
    assert!(
        medium_after >= medium + len / (512 << 10),
        "waited for: {medium} -> {medium_after}"
    );
    assert!(
        large_after < large + len / (1 << 20),
        "waited for: {large} -> {large_after}"
    );
    fill_at(Priority::Ahead, false);
    let large_ahead = made(1 << 20);
    assert!(
        large_ahead >= large_after + len / (1 << 20),
        "ahead from the disk: {large_after} -> {large_ahead}"
    );
    let (large, huge) = (made(1 << 20), made(2 << 20));
    fill_at(Priority::Ahead, true);
    let (huge_after, large_after) = (made(2 << 20), made(1 << 20));
    assert!(
        huge_after >= huge + (len - AWAITED_START) / (2 << 20),
        "ahead, cached: {huge} -> {huge_after}"
    );
    assert!(
        large_after >= large + AWAITED_START / (1 << 20),
        "ahead, cached, the start: {large} -> {large_after}"
    );
}

#[test]
fn reads_during_and_after_the_fill_are_exact() {
    let len = 5 * CHUNK + 12345;
    let f = start(len, source(decode_ok), Priority::Demand);
    // Ranges across chunk edges, at the end, past the end.
    for &(off, n) in &[
        (0u64, 4096usize),
        (CHUNK - 10, 20),
        (3 * CHUNK + 7, 2 * CHUNK as usize),
        (len - 100, 4096),
    ] {
        let mut out = vec![0u8; n];
        let got = f.read(off, &mut out).unwrap();
        assert_eq!(got as u64, (n as u64).min(len - off));
        expect(off, &out[..got]);
    }
    let m = f.wait_complete(Duration::from_secs(30)).expect("complete");
    assert_eq!(m.len(), len);
    let mut back = vec![0u8; 1 << 20];
    use std::os::unix::fs::FileExt;
    m.file().read_exact_at(&mut back, 2 * CHUNK + 5).unwrap();
    expect(2 * CHUNK + 5, &back);
    assert_eq!(f.read(len, &mut back).unwrap(), 0);
}

#[test]
fn a_reader_moves_the_decoder_to_its_chunk() {
    // The decoder is slow; a read of the last chunk must not wait for all the others.
    let order = Arc::new(Mutex::new(Vec::new()));
    let o = order.clone();
    let slow = move |off: u64, buf: &mut [u8]| {
        o.lock().push(off / CHUNK);
        std::thread::sleep(Duration::from_millis(30));
        decode_ok(off, buf)
    };
    let f = start(40 * CHUNK, source(slow), Priority::Demand);
    let mut out = vec![0u8; 4096];
    let t = Instant::now();
    f.read(39 * CHUNK, &mut out).unwrap();
    expect(39 * CHUNK, &out);
    assert!(
        t.elapsed() < Duration::from_millis(600),
        "{:?}",
        t.elapsed()
    );
    let seen = order.lock().clone();
    assert!(seen.len() < 10 && seen.contains(&39), "{seen:?}");
    drop(f);
}

/// CPU time of the calling thread.
fn thread_cpu() -> Duration {
    let mut t = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `t` is a valid timespec for the call to fill.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut t) };
    Duration::new(t.tv_sec as u64, t.tv_nsec as u32)
}

#[test]
fn readers_waiting_for_a_chunk_sleep() {
    // Eight readers (tensor-parallel ranks) wait 400 ms for the first chunk. Waiting
    // must cost them nothing: before the fix each waiter woke the others in turn, and
    // together they spun on both cores for as long as the chunk took.
    let slow = move |off: u64, buf: &mut [u8]| {
        std::thread::sleep(Duration::from_millis(400));
        decode_ok(off, buf)
    };
    let f = Arc::new(start(2 * CHUNK, source(slow), Priority::Demand));
    let readers: Vec<_> = (0..8)
        .map(|k| {
            let f = f.clone();
            std::thread::spawn(move || {
                let cpu = thread_cpu();
                let mut out = vec![0u8; 4096];
                f.read(k * 4096, &mut out).unwrap();
                expect(k * 4096, &out);
                thread_cpu() - cpu
            })
        })
        .collect();
    let spent: Vec<Duration> = readers.into_iter().map(|r| r.join().unwrap()).collect();
    let total: Duration = spent.iter().sum();
    assert!(total < Duration::from_millis(100), "{spent:?}");
}

#[test]
fn a_failed_chunk_fails_only_the_reads_that_touch_the_bad_bytes() {
    // One bad byte in chunk 2: its chunk fails, reads elsewhere in it still succeed.
    let bad = 2 * CHUNK + 1000;
    let decode = move |off: u64, buf: &mut [u8]| {
        if (off..off + buf.len() as u64).contains(&bad) {
            return Err(ReadError::Corrupt {
                tensor: "t".into(),
                unit: bad,
            });
        }
        decode_ok(off, buf)
    };
    let f = start(4 * CHUNK, source(decode), Priority::Demand);
    let mut out = vec![0u8; 4096];
    let err = f.read(bad - 10, &mut out).unwrap_err();
    assert!(matches!(err, ReadError::Corrupt { .. }), "{err}");
    f.read(2 * CHUNK + 8192, &mut out).unwrap();
    expect(2 * CHUNK + 8192, &out);
    f.read(3 * CHUNK, &mut out).unwrap();
    expect(3 * CHUNK, &out);
    assert!(f.wait_complete(Duration::from_secs(30)).is_none());
    assert_eq!(f.progress(), Progress::Broken);
}

/// While the file's hash runs on its own thread beside the unlock, a fill someone waits for
/// unlocks with one thread fewer than the decode's pool (at least one), leaving the hash a
/// core. A digest the dispatcher feeds hands each hashed chunk to the decode's pool, as a
/// fill without a hash does. Every unlock runs at the process's own priority: one at a
/// lower one would lose its core to any busy process beside the daemon.
#[test]
fn a_waited_for_fill_leaves_the_hash_a_core() {
    let all = rayon::current_num_threads();
    let own_nice = nice_now();
    for case in ["hashed beside", "fed", "none"] {
        let release = Gate::new();
        let r = release.clone();
        let hash_beside = move || {
            r.wait();
            Ok(())
        };
        let threads = Arc::new(Mutex::new(Vec::new()));
        let t = threads.clone();
        let unlock = move |off: u64, buf: &mut [u8]| {
            t.lock().push((rayon::current_num_threads(), nice_now()));
            decode_ok(off, buf)
        };
        let len = 4 * CHUNK;
        let src = match case {
            "hashed beside" => with(unlock, Some(Arc::new(hash_beside)), None),
            "fed" => fed_digest_source(unlock, len, 2).0,
            _ => with(unlock, None, None),
        };
        let f = start(len, src, Priority::Demand);
        wait_until(30, "chunks unlocked", || threads.lock().len() >= 4);
        let fewer = all.saturating_sub(1).max(1);
        let want = match case {
            "hashed beside" => vec![(fewer, own_nice); 4],
            _ => vec![(all, own_nice); 4],
        };
        assert_eq!(*threads.lock(), want, "{case}");
        release.open();
        assert!(f.wait_complete(Duration::from_secs(30)).is_some(), "{case}");
    }
}

/// A source whose chunks `unlock` makes, `fetch_ahead` fetched at once, with a digest the
/// fill feeds; its check waits for that digest to be fed whole. The feed, to watch.
fn fed_digest_source(
    unlock: impl Fn(u64, &mut [u8]) -> Result<(), ReadError> + Send + Sync + 'static,
    len: u64,
    fetch_ahead: usize,
) -> (Input, Arc<crate::digest::DigestFeed>) {
    let (feed, feeder) = crate::digest::DigestFeed::start(len);
    let fed = feed.clone();
    let check = move || {
        fed.wait().expect("fed whole");
        Ok(())
    };
    let mut src = with(unlock, Some(Arc::new(check)), None);
    src.fetch_ahead = fetch_ahead;
    src.digest = Some(feeder);
    (src, feed)
}

/// A gate that holds whoever waits at it until it is opened, once and for all (the fill's
/// tests and the open table's).
#[derive(Clone)]
pub(crate) struct Gate(Arc<(Mutex<bool>, Condvar)>);

impl Gate {
    pub(crate) fn new() -> Gate {
        Gate(Arc::new((Mutex::new(false), Condvar::new())))
    }

    pub(crate) fn wait(&self) {
        let (open, opened) = &*self.0;
        let mut open = open.lock();
        while !*open {
            opened.wait(&mut open);
        }
    }

    /// Whether the gate opened within `limit`.
    pub(crate) fn wait_at_most(&self, limit: Duration) -> bool {
        let deadline = Instant::now() + limit;
        let (open, opened) = &*self.0;
        let mut open = open.lock();
        while !*open {
            if opened.wait_until(&mut open, deadline).timed_out() {
                return *open;
            }
        }
        true
    }

    pub(crate) fn open(&self) {
        *self.0 .0.lock() = true;
        self.0 .1.notify_all();
    }
}

/// The nice value of the calling thread.
fn nice_now() -> i32 {
    // SAFETY: getpriority of this thread alone (PRIO_PROCESS with a thread id).
    unsafe { libc::getpriority(libc::PRIO_PROCESS, libc::gettid() as libc::id_t) }
}

/// A fed digest does not wait for the unlocks: with the first chunk's unlock held, the
/// dispatcher goes on hashing the chunks after it (their unlocks pass it), where hashing
/// each next chunk beside the unlock before held the hash one chunk ahead of it.
#[test]
fn the_hash_runs_ahead_of_a_lagging_unlock() {
    let release = Gate::new();
    let r = release.clone();
    let unlock = move |off: u64, buf: &mut [u8]| {
        if off == 0 {
            r.wait();
        }
        decode_ok(off, buf)
    };
    let len = 6 * CHUNK;
    let (src, feed) = fed_digest_source(unlock, len, 4);
    let f = start(len, src, Priority::Demand);
    wait_until(30, "the hash two chunks past the held unlock", || {
        feed.fed() >= 3 * CHUNK
    });
    release.open();
    assert!(f.wait_complete(Duration::from_secs(30)).is_some());
    assert_eq!(feed.fed(), len);
}

/// An open waits for the verdict: a hash thread that ends by a panic still ends the
/// wait.
#[test]
fn a_hash_that_panics_still_ends_the_wait_for_the_verdict() {
    let check = || -> Result<(), ReadError> { panic!("a bug in the hash") };
    let f = start(
        2 * CHUNK,
        with(decode_ok, Some(Arc::new(check)), None),
        Priority::Demand,
    );
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        f.wait_verdict();
        let _ = tx.send(f.awaits_verdict());
    });
    let awaits = rx
        .recv_timeout(Duration::from_secs(30))
        .expect("still waiting for a hash that ended");
    assert!(!awaits);
}

#[test]
fn nothing_is_served_before_a_good_verdict() {
    let checked = Arc::new(AtomicBool::new(false));
    let c = checked.clone();
    let check = move || {
        std::thread::sleep(Duration::from_millis(100));
        c.store(true, Ordering::SeqCst);
        Ok(())
    };
    let src = with(decode_ok, Some(Arc::new(check)), None);
    let f = start(2 * CHUNK, src, Priority::Demand);
    let mut out = vec![0u8; 16];
    // The check runs once on its thread; a reader's call here stands in for the
    // view's verdict, which waits for that one hash.
    f.read(0, &mut out).unwrap();
    assert!(f.wait_complete(Duration::from_secs(30)).is_some());
    assert!(checked.load(Ordering::SeqCst));

    let altered = || Err(ReadError::Unverified("altered".into()));
    let bad = with(decode_ok, Some(Arc::new(altered)), None);
    let f = start(2 * CHUNK, bad, Priority::Demand);
    assert!(matches!(f.read(0, &mut out), Err(ReadError::Unverified(_))));
    assert!(f.wait_complete(Duration::from_secs(30)).is_none());
    assert_eq!(f.progress(), Progress::Broken);
}

#[test]
fn prefetch_runs_ahead_of_the_decoder() {
    let asked = Arc::new(AtomicUsize::new(0));
    let a = asked.clone();
    let asked_for = move |_off, len: u64| {
        a.fetch_add(len as usize, Ordering::SeqCst);
    };
    let src = with(decode_ok, None, Some(Box::new(asked_for)));
    let len = 20 * CHUNK;
    let f = start(len, src, Priority::Ahead);
    assert!(f.wait_complete(Duration::from_secs(60)).is_some());
    assert!(asked.load(Ordering::SeqCst) as u64 >= PREFETCH_WINDOW.min(len));
}

/// Work started ahead runs in the background (SCHED_IDLE where this process may leave
/// it again, else nice 19), its pool threads too; urged, the fill's threads move to the
/// foreground.
#[test]
fn ahead_work_runs_in_the_background_until_urged() {
    use crate::background::{background_place, place_of, Background};
    let background = background_place();
    let foreground = (libc::SCHED_OTHER, 0);
    // Root (CI) may leave SCHED_IDLE.
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } == 0 {
        assert_eq!(Background::chosen(), Background::Idle);
    }
    let policies = |f: &Fill| -> Vec<(i32, i32)> {
        let tids = f.inner.state.lock().tids.clone();
        tids.into_iter().map(place_of).collect()
    };
    let slow = |off: u64, buf: &mut [u8]| {
        std::thread::sleep(Duration::from_millis(20));
        decode_ok(off, buf)
    };
    let f = start(100 * CHUNK, source(slow), Priority::Ahead);
    std::thread::sleep(Duration::from_millis(50));
    let before = policies(&f);
    assert!(!before.is_empty(), "no thread works for the fill");
    assert!(before.iter().all(|&p| p == background), "ahead: {before:?}");
    let pool = ahead_pool().expect("the decode-ahead pool");
    // SAFETY: gettid has no preconditions.
    let in_pool = pool.install(|| place_of(unsafe { libc::gettid() }));
    assert_eq!(in_pool, background);
    f.urge();
    if Background::chosen() == Background::Idle {
        let after = policies(&f);
        assert!(after.iter().all(|&p| p == foreground), "urged: {after:?}");
    }
}

#[test]
fn dropping_the_fill_stops_it() {
    let calls = Arc::new(AtomicUsize::new(0));
    let c = calls.clone();
    let slow = move |off: u64, buf: &mut [u8]| {
        c.fetch_add(1, Ordering::SeqCst);
        std::thread::sleep(Duration::from_millis(20));
        decode_ok(off, buf)
    };
    let f = start(100 * CHUNK, source(slow), Priority::Ahead);
    // A fill ahead runs on idle cycles, so on a busy machine its first decode may come
    // late: wait for it, then for the count to settle, rather than for set times.
    wait_until(20, "the fill's first decode", || {
        calls.load(Ordering::SeqCst) > 0
    });
    drop(f);
    let until = Instant::now() + Duration::from_secs(20);
    let mut n = calls.load(Ordering::SeqCst);
    let mut still_since = Instant::now();
    while still_since.elapsed() < Duration::from_millis(300) && Instant::now() < until {
        std::thread::sleep(Duration::from_millis(10));
        let now = calls.load(Ordering::SeqCst);
        if now != n {
            n = now;
            still_since = Instant::now();
        }
    }
    // Undropped, the fill decodes all 100 chunks, one every 20 ms, without a pause.
    assert!(n < 100, "still decoding after the drop: {n} chunks");
}

/// The "sealed" bytes of `[off, off + buf.len())`: what `xor_sealed`'s unlock turns into
/// view bytes.
fn seal_into(off: u64, buf: &mut [u8]) {
    for (i, b) in buf.iter_mut().enumerate() {
        *b = byte(off + i as u64) ^ 0x5a;
    }
}

/// A source that fetches with `fetch` and unlocks what [`seal_into`] wrote, one fetch
/// at a time, on no shared disk.
fn xor_sealed(fetch: impl Fn(u64, &mut [u8]) -> io::Result<()> + Send + Sync + 'static) -> Input {
    Input {
        fetch: Box::new(fetch),
        unlock: Box::new(|_, buf: &mut [u8]| {
            buf.iter_mut().for_each(|b| *b ^= 0x5a);
            Ok(())
        }),
        ..Input::made_by(decode_ok)
    }
}

/// A source whose fetch writes the "sealed" bytes (after a pause) and whose unlock
/// turns them into view bytes: a chunk unlocked before its fetch, or fetched twice over
/// an unlocked chunk, reads wrong. Counts the fetches, and the most at once. The fetch
/// of chunk `failing` fails.
fn sealed_source(
    fetch_ahead: usize,
    failing: Option<u64>,
) -> (Input, Arc<AtomicUsize>, Arc<AtomicUsize>) {
    let (fetches, most) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let (f2, m2) = (fetches.clone(), most.clone());
    let running = Arc::new(AtomicUsize::new(0));
    let fetch = move |off, buf: &mut [u8]| {
        f2.fetch_add(1, Ordering::SeqCst);
        let now = running.fetch_add(1, Ordering::SeqCst) + 1;
        m2.fetch_max(now, Ordering::SeqCst);
        std::thread::sleep(Duration::from_millis(5));
        seal_into(off, buf);
        running.fetch_sub(1, Ordering::SeqCst);
        match failing {
            Some(c) if off / CHUNK == c => Err(io::Error::other("no such part")),
            _ => Ok(()),
        }
    };
    let src = Input {
        // With one fetch at a time, the chunk after the next is faulted in beside it.
        fetch_ahead,
        ..xor_sealed(fetch)
    };
    (src, fetches, most)
}

/// A source whose fetches record their lengths, each taking `pause`, on a disk that
/// `look` answers for.
fn recording_source(
    look: impl Fn(u64, u64) -> DiskLook + Send + Sync + 'static,
    pause: Duration,
) -> (Input, Arc<Mutex<Vec<usize>>>) {
    let lens = Arc::new(Mutex::new(Vec::new()));
    let l2 = lens.clone();
    let fetch = move |off, buf: &mut [u8]| {
        l2.lock().push(buf.len());
        std::thread::sleep(pause);
        seal_into(off, buf);
        Ok(())
    };
    let src = Input {
        disk_shared: Some(Box::new(look)),
        ..xor_sealed(fetch)
    };
    (src, lens)
}

/// Decode ahead reads a disk that others read in pieces of `BACKGROUND_PIECE`, and
/// whole chunks when it has the disk to itself or someone waits for the fill (from the
/// piece after an open urges it); the bytes are exact either way.
#[test]
fn decode_ahead_reads_a_shared_disk_in_pieces() {
    let n = 4;
    let piece = BACKGROUND_PIECE;
    let whole = CHUNK as usize;
    for (look, priority, want) in [
        (DiskLook::Unknown, Priority::Ahead, piece),
        (DiskLook::Alone, Priority::Ahead, whole),
        (DiskLook::Unknown, Priority::Demand, whole),
    ] {
        let (src, lens) = recording_source(move |_, _| look, Duration::ZERO);
        let f = start(n * CHUNK, src, priority);
        // Waiting for the fill would urge it: wait for its fetches first.
        wait_until(60, "every fetch", || {
            lens.lock().iter().sum::<usize>() >= (n * CHUNK) as usize
        });
        let all = copy_bytes(&f.wait_complete(Duration::from_secs(60)).expect("complete"));
        expect(0, &all);
        let lens = lens.lock();
        assert!(
            lens.iter().all(|&l| l == want),
            "{look:?}, {priority:?}: fetches of {lens:?}"
        );
        assert_eq!(lens.iter().sum::<usize>(), all.len());
    }
    // Others never leave the disk: each piece still comes, and an urge ends the wait.
    let (src, lens) = recording_source(|_, _| DiskLook::OthersRead, Duration::from_millis(5));
    let f = start(n * CHUNK, src, Priority::Ahead);
    wait_until(60, "pieces while others read", || lens.lock().len() >= 3);
    f.urge();
    f.wait_complete(Duration::from_secs(60)).expect("complete");
    let lens = lens.lock();
    assert_eq!(lens[0], piece, "{lens:?}");
    assert_eq!(*lens.last().unwrap(), whole, "urged: {lens:?}");
    assert_eq!(lens.iter().sum::<usize>(), (n * CHUNK) as usize);
}

/// Decode ahead on a disk that others read waits, before each piece, for a look that
/// finds the disk quiet: here the first looks see others reading, then none do, then
/// others again before the third piece.
#[test]
fn decode_ahead_waits_for_a_quiet_disk_before_each_piece() {
    let events = Arc::new(Mutex::new(Vec::<&str>::new()));
    let (e1, e2) = (events.clone(), events.clone());
    let looks = AtomicUsize::new(0);
    let look = move |_, _| {
        e1.lock().push("look");
        match looks.fetch_add(1, Ordering::SeqCst) {
            0..=3 | 6 => DiskLook::OthersRead,
            _ => DiskLook::Alone,
        }
    };
    let fetch = move |off, buf: &mut [u8]| {
        e2.lock().push("fetch");
        seal_into(off, buf);
        Ok(())
    };
    let src = Input {
        disk_shared: Some(Box::new(look)),
        ..xor_sealed(fetch)
    };
    let f = start(CHUNK, src, Priority::Ahead);
    wait_until(60, "every piece", || {
        events.lock().iter().filter(|&&e| e == "fetch").count() >= 8
    });
    let m = f.wait_complete(Duration::from_secs(60)).expect("complete");
    expect(0, &copy_bytes(&m));
    // The chunk's look, three waits, the quiet look, a piece; a quiet look, a piece;
    // others, a wait, a quiet look, a piece; then one quiet look per piece.
    let mut want = vec!["look"; 5];
    want.extend(["fetch", "look", "fetch", "look", "look", "fetch"]);
    for _ in 0..5 {
        want.extend(["look", "fetch"]);
    }
    assert_eq!(*events.lock(), want);
}

/// Decode ahead's fetchers take turns on a local disk, a chunk's reads at a time, as one
/// fetcher would (an engine's reads then wait behind no more of them); a fill someone
/// waits for reads chunks at once.
#[test]
fn decode_ahead_fetchers_take_turns_on_the_disk() {
    for (priority, turns) in [(Priority::Ahead, true), (Priority::Demand, false)] {
        let (running, most) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
        let (r2, m2) = (running.clone(), most.clone());
        let fetch = move |off, buf: &mut [u8]| {
            m2.fetch_max(r2.fetch_add(1, Ordering::SeqCst) + 1, Ordering::SeqCst);
            std::thread::sleep(Duration::from_millis(5));
            seal_into(off, buf);
            r2.fetch_sub(1, Ordering::SeqCst);
            Ok(())
        };
        let src = Input {
            disk_shared: Some(Box::new(|_, _| DiskLook::Alone)),
            fetch_ahead: 4,
            ..xor_sealed(fetch)
        };
        let f = start(12 * CHUNK, src, priority);
        // Waiting for the copy would urge the fill: wait for its end instead.
        wait_until(60, "the fill's end", || f.progress() != Progress::Filling);
        expect(0, &copy_bytes(&f.complete().expect("complete")));
        let most = most.load(Ordering::SeqCst);
        if turns {
            assert_eq!(most, 1, "decode ahead: {most} fetches at once");
        } else {
            assert!(most > 1, "urged: one fetch at a time");
        }
    }
}

/// A look answers for the time since the one before. A chunk whose first look finds
/// that others read waits before its first piece, instead of looking again at once
/// (a look at no time at all, which always finds the disk quiet).
#[test]
fn a_chunk_whose_first_look_finds_others_reading_waits_before_its_first_piece() {
    let looked = Arc::new(Mutex::new(Vec::<Instant>::new()));
    let l = looked.clone();
    let look = move |_, _| {
        let mut at = l.lock();
        at.push(Instant::now());
        if at.len() == 1 {
            DiskLook::OthersRead
        } else {
            DiskLook::Alone
        }
    };
    let (src, lens) = recording_source(look, Duration::ZERO);
    // Not urged: a wait for the whole copy would raise the fill above decode ahead.
    let _f = start(CHUNK, src, Priority::Ahead);
    let pieces = (CHUNK / BACKGROUND_PIECE as u64) as usize;
    wait_until(60, "every piece", || lens.lock().len() >= pieces);
    let at = looked.lock();
    assert!(at.len() >= 2, "{} looks", at.len());
    assert!(
        at[1] - at[0] >= crate::disk_share::YIELD_PAUSE,
        "looked again after {:?}",
        at[1] - at[0]
    );
}

/// Sealed bytes in the page cache read no disk: their fetch never waits for others,
/// whatever they read (and the disk's counts are not even asked for).
#[test]
fn a_cached_fetch_does_not_look_at_the_disk() {
    let asked = AtomicUsize::new(0);
    let count = |n| {
        asked.fetch_add(1, Ordering::SeqCst);
        n
    };
    assert_eq!(disk_look(true, || count(Some(5))), DiskLook::Alone);
    assert_eq!(asked.load(Ordering::SeqCst), 0);
    assert_eq!(disk_look(false, || count(Some(0))), DiskLook::Alone);
    assert_eq!(disk_look(false, || count(Some(5))), DiskLook::OthersRead);
    assert_eq!(disk_look(false, || count(None)), DiskLook::Unknown);
    assert_eq!(asked.load(Ordering::SeqCst), 3);
}

fn each_chunk_fetched_once_and_unlocked_after_its_fetch(fetch_ahead: usize) -> usize {
    let (src, fetches, most) = sealed_source(fetch_ahead, None);
    let n = 12;
    let f = start(n * CHUNK, src, Priority::Demand);
    // Readers move the decoder around: the last chunk, the middle, then the rest.
    for &c in &[n - 1, n / 2, 0] {
        let mut out = vec![0u8; 8192];
        f.read(c * CHUNK + 100, &mut out).unwrap();
        expect(c * CHUNK + 100, &out);
    }
    let m = f.wait_complete(Duration::from_secs(60)).expect("complete");
    expect(0, &copy_bytes(&m));
    assert_eq!(fetches.load(Ordering::SeqCst), n as usize);
    most.load(Ordering::SeqCst)
}

#[test]
fn each_chunk_is_fetched_once_and_unlocked_after_its_fetch() {
    assert_eq!(each_chunk_fetched_once_and_unlocked_after_its_fetch(1), 1);
}

#[test]
fn many_fetches_at_once_each_chunk_once_and_unlocked_after_it() {
    let most = each_chunk_fetched_once_and_unlocked_after_its_fetch(4);
    assert!((2..=4).contains(&most), "{most} fetches at once, 4 allowed");
}

#[test]
fn fetches_start_few_and_grow_as_chunks_decode() {
    let n = 24;
    let started = Arc::new(AtomicUsize::new(0));
    let started_by_first = Arc::new(AtomicUsize::new(0));
    let most = Arc::new(AtomicUsize::new(0));
    let (s2, b2, m2) = (started.clone(), started_by_first.clone(), most.clone());
    let running = AtomicUsize::new(0);
    // The fetch brings view bytes; the unlock leaves them.
    let mut src = with(|_, _| Ok(()), None, None);
    src.decode = Box::new(decode_ok);
    src.fetch = Box::new(move |off, buf: &mut [u8]| {
        s2.fetch_add(1, Ordering::SeqCst);
        m2.fetch_max(running.fetch_add(1, Ordering::SeqCst) + 1, Ordering::SeqCst);
        // The first chunk comes in last of those asked for with it, as it does when many
        // GETs share a link.
        std::thread::sleep(Duration::from_millis(if off == 0 { 60 } else { 10 }));
        if off == 0 {
            b2.store(s2.load(Ordering::SeqCst), Ordering::SeqCst);
        }
        running.fetch_sub(1, Ordering::SeqCst);
        decode_ok(off, buf).map_err(io::Error::from)
    });
    src.fetch_ahead = 16;
    let f = start(n * CHUNK, src, Priority::Demand);
    let m = f.wait_complete(Duration::from_secs(60)).expect("complete");
    expect(0, &copy_bytes(&m));
    assert_eq!(started.load(Ordering::SeqCst), n as usize);
    let first = started_by_first.load(Ordering::SeqCst);
    assert_eq!(
        first, FIRST_FETCHES,
        "fetches started before the first chunk came in"
    );
    let most = most.load(Ordering::SeqCst);
    assert!(
        most > FIRST_FETCHES,
        "at most {most} fetches at once: the ramp did not grow"
    );
}

#[test]
fn many_fetches_at_once_feed_the_sealed_bytes_digest_in_order() {
    use sha2::Digest;
    let n = 7;
    let len = n * CHUNK - 1000;
    let (mut src, _, most) = sealed_source(4, None);
    let (feed, feeder) = crate::digest::DigestFeed::start(len);
    src.digest = Some(feeder);
    let f = start(len, src, Priority::Demand);
    let m = f.wait_complete(Duration::from_secs(60)).expect("complete");
    // The fetched bytes, before their unlock.
    let mut sealed = vec![0u8; len as usize];
    seal_into(0, &mut sealed);
    let want: [u8; 32] = sha2::Sha256::digest(&sealed).into();
    assert_eq!(feed.wait(), Some(want));
    assert!(most.load(Ordering::SeqCst) >= 2);
    let mut back = vec![0u8; 4096];
    use std::os::unix::fs::FileExt;
    m.file().read_exact_at(&mut back, len - 4096).unwrap();
    expect(len - 4096, &back);
}

/// A fill's digest takes each next chunk's sealed bytes while the chunk before is
/// unlocked, not between the unlocks, whether its chunks are fetched one after another
/// (a local file) or many at once (a remote one): every unlock but the last sees the
/// next chunk hashed before it ends.
#[test]
fn the_digest_takes_the_next_chunk_beside_each_unlock() {
    use sha2::Digest;
    let n = 6;
    let len = n * CHUNK;
    let mut sealed = vec![0u8; len as usize];
    seal_into(0, &mut sealed);
    let want: [u8; 32] = sha2::Sha256::digest(&sealed).into();
    for fetch_ahead in [1, 8] {
        let (mut src, _, _) = sealed_source(fetch_ahead, None);
        let (feed, feeder) = crate::digest::DigestFeed::start(len);
        src.digest = Some(feeder);
        let (fed, seen) = (feed.clone(), Arc::new(Mutex::new(Vec::new())));
        let saw = seen.clone();
        let unlock = std::mem::replace(&mut src.unlock, Box::new(|_, _| Ok(())));
        src.unlock = Box::new(move |off, buf: &mut [u8]| {
            let i = off / CHUNK;
            if i + 1 < n {
                let next_in = (i + 2) * CHUNK;
                let deadline = Instant::now() + Duration::from_secs(5);
                while fed.fed() < next_in && Instant::now() < deadline {
                    std::thread::sleep(Duration::from_millis(1));
                }
                saw.lock().push((i, fed.fed() >= next_in));
            }
            unlock(off, buf)
        });
        let f = start(len, src, Priority::Demand);
        let m = f.wait_complete(Duration::from_secs(60)).expect("complete");
        expect(0, &copy_bytes(&m));
        let beside: Vec<(u64, bool)> = (0..n - 1).map(|i| (i, true)).collect();
        // Unlocks behind the hash run as tasks at once, so they may end out of order.
        seen.lock().sort();
        assert_eq!(
            *seen.lock(),
            beside,
            "fetch_ahead {fetch_ahead}: (chunk, the next one hashed during its unlock)"
        );
        assert_eq!(feed.wait(), Some(want), "fetch_ahead {fetch_ahead}");
    }
}

#[test]
fn a_failed_fetch_gives_up_the_digest() {
    let (mut src, _, _) = sealed_source(4, Some(2));
    let (feed, feeder) = crate::digest::DigestFeed::start(5 * CHUNK);
    src.digest = Some(feeder);
    let f = start(5 * CHUNK, src, Priority::Demand);
    f.wait_done();
    assert_eq!(feed.wait(), None);
}

#[test]
fn a_failed_fetch_among_many_leaves_its_chunk_to_the_read_path() {
    let (src, _, _) = sealed_source(4, Some(3));
    let n = 6;
    let f = start(n * CHUNK, src, Priority::Demand);
    for c in 0..n {
        let mut out = vec![0u8; 4096];
        assert_eq!(f.read(c * CHUNK + 7, &mut out).unwrap(), 4096);
        expect(c * CHUNK + 7, &out);
    }
    assert!(f.wait_complete(Duration::from_secs(60)).is_none());
    assert_eq!(f.progress(), Progress::Broken);
}

/// A chunk whose fetch or unlock panics (a bug) fails alone, one fetch at a time or
/// many: its reads decode their own range, the other chunks come from the copy, and the
/// fill ends broken instead of leaving its readers waiting.
#[test]
fn a_chunk_whose_fetch_or_unlock_panics_fails_alone() {
    let bad = 3;
    for (fetch_ahead, step) in [(1, "unlock"), (4, "unlock"), (4, "fetch")] {
        let (mut src, _, _) = sealed_source(fetch_ahead, None);
        // The chunks the fill itself unlocked: all but the bad one, not only those
        // before it (as if its thread had died there).
        let unlocked = Arc::new(Mutex::new(std::collections::BTreeSet::new()));
        let (seen, unlock_panics) = (unlocked.clone(), step == "unlock");
        let unlock = std::mem::replace(&mut src.unlock, Box::new(|_, _| Ok(())));
        src.unlock = Box::new(move |off, buf: &mut [u8]| {
            assert!(
                !(unlock_panics && off / CHUNK == bad),
                "a bug in the unlock"
            );
            unlock(off, buf)?;
            seen.lock().insert(off / CHUNK);
            Ok(())
        });
        if step == "fetch" {
            let fetch = std::mem::replace(&mut src.fetch, Box::new(|_, _| Ok(())));
            src.fetch = Box::new(move |off, buf: &mut [u8]| {
                assert!(off / CHUNK != bad, "a bug in the fetch");
                fetch(off, buf)
            });
        }
        let n = 6;
        let f = start(n * CHUNK, src, Priority::Demand);
        wait_until(60, &format!("{fetch_ahead} {step}: the fill's end"), || {
            f.progress() != Progress::Filling
        });
        assert_eq!(f.progress(), Progress::Broken, "{fetch_ahead} {step}");
        let others: std::collections::BTreeSet<u64> = (0..n).filter(|&c| c != bad).collect();
        assert_eq!(*unlocked.lock(), others, "{fetch_ahead} {step}");
        for c in 0..n {
            let mut out = vec![0u8; 4096];
            assert_eq!(f.read(c * CHUNK + 11, &mut out).unwrap(), 4096);
            expect(c * CHUNK + 11, &out);
        }
    }
}

/// With fetches ahead, each chunk is unlocked as a task of its own, at most one running per
/// thread of the pool: a slow chunk does not hold the ones after it back (they finish first
/// and readers get them), and every byte comes out exact.
#[test]
fn chunks_unlock_as_tasks_of_their_own() {
    let width = rayon::current_num_threads();
    let (mut src, _, _) = sealed_source(4, None);
    let (running, most) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let ended = Arc::new(Mutex::new(Vec::new()));
    let (r2, m2, e2) = (running.clone(), most.clone(), ended.clone());
    let unlock = std::mem::replace(&mut src.unlock, Box::new(|_, _| Ok(())));
    src.unlock = Box::new(move |off, buf: &mut [u8]| {
        m2.fetch_max(r2.fetch_add(1, Ordering::SeqCst) + 1, Ordering::SeqCst);
        // The first chunk shares its core with other work and takes long.
        std::thread::sleep(Duration::from_millis(if off == 0 { 400 } else { 10 }));
        unlock(off, buf)?;
        e2.lock().push(off / CHUNK);
        r2.fetch_sub(1, Ordering::SeqCst);
        Ok(())
    });
    let n = 8;
    let f = start(n * CHUNK, src, Priority::Demand);
    let mut out = vec![0u8; 4096];
    f.read(CHUNK + 7, &mut out).unwrap();
    expect(CHUNK + 7, &out);
    let m = f.wait_complete(Duration::from_secs(60)).expect("complete");
    expect(0, &copy_bytes(&m));
    let most = most.load(Ordering::SeqCst);
    assert!(
        most <= width,
        "{most} chunks unlocking at once on {width} threads"
    );
    let ended = ended.lock().clone();
    assert_eq!(ended.len(), n as usize);
    if width > 1 {
        assert!(most > 1, "one chunk unlocking at a time on {width} threads");
        assert_ne!(
            ended[0], 0,
            "the chunks after the slow first one waited for it: {ended:?}"
        );
    }
}

/// A fill whose dispatcher dies outside a chunk (here in the seal's callback) ends
/// broken, its waiters released, its bytes still served.
#[test]
fn a_fill_whose_dispatcher_panics_ends_broken() {
    let mut src = source(decode_ok);
    src.completed = Some(Box::new(|| panic!("a bug after the seal")));
    let f = start(3 * CHUNK, src, Priority::Demand);
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let copy = f.wait_complete(Duration::from_secs(600));
        let mut out = vec![0u8; 4096];
        let read = f.read(2 * CHUNK + 5, &mut out).map(|_| out);
        let _ = tx.send((copy.is_none(), f.progress(), read));
    });
    let (no_copy, progress, read) = rx
        .recv_timeout(Duration::from_secs(30))
        .expect("still waiting for a fill whose dispatcher is gone");
    assert!(no_copy);
    assert_eq!(progress, Progress::Broken);
    expect(2 * CHUNK + 5, &read.unwrap());
}

#[test]
fn sealed_bytes_come_straight_from_disk_when_not_cached() {
    use std::io::Write;
    use std::os::unix::fs::FileExt;
    let len = (9 << 20) + 123;
    let data: Vec<u8> = (0..len).map(|i| byte(i as u64 * 7)).collect();
    let mut file = tempfile::tempfile_in("/var/tmp").unwrap();
    file.write_all(&data).unwrap();
    file.sync_all().unwrap();
    use std::os::fd::AsRawFd;
    // SAFETY: advice on our own descriptor.
    unsafe { libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    let r = SealedReader::new(&file).unwrap();
    if r.direct.is_none() {
        eprintln!("skipped: /var/tmp has no O_DIRECT");
        return;
    }
    let mut buf = memmap2::MmapMut::map_anon(len).unwrap();
    r.read(0, &mut buf[..8 << 20]).unwrap();
    r.read(8 << 20, &mut buf[8 << 20..]).unwrap();
    assert!(buf[..] == data[..]);
    assert!(
        !r.mostly_cached(0, 8 << 20),
        "the uncached part came through the page cache"
    );
    // Cached bytes come through the page cache, and are the same.
    let mut again = vec![0u8; 1 << 20];
    file.read_exact_at(&mut again, 0).unwrap();
    assert!(r.mostly_cached(0, 1 << 20));
    let mut out = memmap2::MmapMut::map_anon(1 << 20).unwrap();
    r.read(0, &mut out).unwrap();
    assert!(out[..] == data[..1 << 20]);
}

#[test]
fn an_empty_file_completes_at_once() {
    let f = start(0, source(decode_ok), Priority::Demand);
    assert!(f.wait_complete(Duration::from_secs(5)).is_some());
    assert_eq!(f.read(0, &mut [0u8; 8]).unwrap(), 0);
}

/// Chunks whose sealed bytes are in the page cache are decoded a piece at a time and
/// written into the file, not fetched into place, and their pages let go once in;
/// the other chunks are fetched and unlocked in place as before. Under a digest, which
/// reads the fetched bytes, every chunk is fetched.
#[test]
fn cached_chunks_are_decoded_and_written_not_fetched() {
    use sha2::Digest;
    let _turn = PIECE_BUFFERS_TURN.lock();
    let n = 6;
    let len = n * CHUNK - 1000;
    for priority in [Priority::Ahead, Priority::Demand] {
        let (mut src, fetches, _) = sealed_source(4, None);
        let let_go = Arc::new(Mutex::new(Vec::new()));
        let l2 = let_go.clone();
        src.in_page_cache = Some(Box::new(|off, _| (off / CHUNK).is_multiple_of(2)));
        src.decoded_from_cache = Some(Arc::new(move |off, len| l2.lock().push((off, len))));
        let f = start(len, src, priority);
        let all = copy_bytes(&f.wait_complete(Duration::from_secs(60)).expect("complete"));
        expect(0, &all);
        assert_eq!(
            fetches.load(Ordering::SeqCst),
            3,
            "{priority:?}: the odd chunks"
        );
        let mut let_go = let_go.lock().clone();
        let_go.sort();
        assert_eq!(
            let_go,
            [(0, CHUNK), (2 * CHUNK, CHUNK), (4 * CHUNK, CHUNK)],
            "{priority:?}"
        );
    }
    let (mut src, fetches, _) = sealed_source(4, None);
    src.in_page_cache = Some(Box::new(|_, _| true));
    let (feed, feeder) = crate::digest::DigestFeed::start(len);
    src.digest = Some(feeder);
    let f = start(len, src, Priority::Demand);
    expect(
        0,
        &copy_bytes(&f.wait_complete(Duration::from_secs(60)).expect("complete")),
    );
    assert_eq!(fetches.load(Ordering::SeqCst), n as usize);
    let mut sealed = vec![0u8; len as usize];
    seal_into(0, &mut sealed);
    assert_eq!(feed.wait(), Some(sha2::Sha256::digest(&sealed).into()));
}

/// The tests that count fetches of cached chunks take turns: the piece buffers are the
/// process's.
static PIECE_BUFFERS_TURN: Mutex<()> = Mutex::new(());

/// Every piece buffer, including those other tests' fills hold for a moment.
fn every_piece_buffer(what: &str) -> Vec<super::pools::PieceBuffer> {
    let mut held = Vec::new();
    wait_until(30, what, || {
        held.extend(std::iter::from_fn(super::pools::take_piece_buffer));
        held.len() == super::PIECE_BUFFERS
    });
    held
}

/// With every piece buffer in use, a cached chunk's pieces are fetched into place and
/// unlocked there, each on its own: the bytes are the same.
#[test]
fn cached_pieces_without_a_buffer_are_unlocked_in_place() {
    let _turn = PIECE_BUFFERS_TURN.lock();
    let held = every_piece_buffer("every piece buffer");
    let n = 3;
    let (mut src, fetches, _) = sealed_source(4, None);
    src.in_page_cache = Some(Box::new(|_, _| true));
    let f = start(n * CHUNK, src, Priority::Demand);
    let all = copy_bytes(&f.wait_complete(Duration::from_secs(60)).expect("complete"));
    drop(held);
    expect(0, &all);
    let pieces = (n * CHUNK / WRITE_PIECE) as usize;
    assert_eq!(fetches.load(Ordering::SeqCst), pieces, "a fetch per piece");
}

/// Under memory pressure the free piece buffers are let go; as many can be had again.
#[test]
fn free_piece_buffers_are_let_go_and_made_again() {
    let _turn = PIECE_BUFFERS_TURN.lock();
    drop(every_piece_buffer("every piece buffer"));
    // Another test's fill may take one back between the two lines, not all of them.
    assert!(super::drain_piece_buffers() >= WRITE_PIECE);
    every_piece_buffer("every piece buffer, made again");
}

/// A decode that panics (a bug) fails its chunk, and the piece buffer it held goes back
/// among the free ones: every buffer can still be had.
#[test]
fn a_panicking_decode_gives_its_piece_buffer_back() {
    let _turn = PIECE_BUFFERS_TURN.lock();
    let (mut src, _, _) = sealed_source(4, None);
    src.in_page_cache = Some(Box::new(|_, _| true));
    let decode = std::mem::replace(&mut src.decode, Box::new(|_, _| Ok(())));
    src.decode = Box::new(move |off, buf| {
        assert!(off != CHUNK, "a decode bug");
        decode(off, buf)
    });
    let f = start(3 * CHUNK, src, Priority::Demand);
    assert!(f.wait_complete(Duration::from_secs(60)).is_none());
    assert_eq!(f.progress(), Progress::Broken);
    every_piece_buffer("every piece buffer");
}

#[test]
fn a_pace_ends_a_fill_within_the_time_its_rate_needs() {
    let ms = Duration::from_millis;
    // 10 MB in 50 ms: 30 MB more takes 150 ms.
    let pace = Pace {
        done: 10_000_000,
        left: 30_000_000,
        waited: ms(50),
    };
    assert!(pace.ends_within(ms(150)));
    assert!(!pace.ends_within(ms(149)));
    // Nothing done yet: no pace to go by, however long is left.
    let stalled = Pace {
        done: 0,
        left: 1,
        waited: ms(50),
    };
    assert!(!stalled.ends_within(Duration::from_secs(3600)));
    // Nothing left: ended, however slow.
    let ended = Pace { left: 0, ..stalled };
    assert!(ended.ends_within(Duration::ZERO));
}
