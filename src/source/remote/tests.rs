use std::ops::Range;

use super::get::KEEP_BUFFERS;
use super::*;
use object_store::memory::InMemory;
use object_store::ObjectStoreExt;

fn settings(part: u64) -> RemoteSettings {
    RemoteSettings {
        tuning: Tuning {
            part_size: part,
            in_flight: 4,
            memory: 8 * part,
            max_window: 4,
            timeout: Duration::from_secs(5),
        },
        ..Default::default()
    }
}

/// A source over `mem`.
fn remote_over(mem: &Arc<InMemory>, settings: &RemoteSettings) -> Arc<Remote> {
    let store = mem.clone();
    let connect: Connect = Box::new(move || Ok(store.clone() as Arc<dyn ObjectStore>));
    Remote::new(connect, "mem://".into(), settings).unwrap()
}

/// Another version of `obj` in `mem`, `bytes` long.
fn replace(remote: &Remote, mem: &Arc<InMemory>, bytes: Vec<u8>) {
    remote
        .call("replace", |_| {
            let mem = mem.clone();
            async move { mem.put(&StorePath::from("obj"), bytes.into()).await }
        })
        .unwrap()
        .unwrap();
}

/// A source over an in-memory store holding `bytes` at `obj`, and that object.
fn one_object(bytes: &[u8], part: u64) -> (Arc<InMemory>, Arc<Remote>, RemoteObject) {
    let mem = Arc::new(InMemory::new());
    let remote = remote_over(&mem, &settings(part));
    let path = StorePath::from("obj");
    let meta = remote
        .call("put", |s| {
            let bytes = bytes.to_vec();
            async move {
                s.put(&path, bytes.into()).await?;
                s.head(&path).await
            }
        })
        .unwrap()
        .unwrap();
    let obj = remote.object(meta, "mem://obj".into());
    (mem, remote, obj)
}

/// A source over `mem` with a node cache in `dir`, counting into `stats`, and its
/// object as [`one_object`] put it.
fn cached_object(
    mem: &Arc<InMemory>,
    dir: &Path,
    stats: &Arc<Stats>,
) -> (Arc<Remote>, RemoteObject) {
    let s = RemoteSettings {
        cache_dir: Some(dir.into()),
        cache_dir_size: 1 << 20,
        stats: stats.clone(),
        ..settings(1000)
    };
    let remote = remote_over(mem, &s);
    let meta = remote
        .call(
            "head",
            |s| async move { s.head(&StorePath::from("obj")).await },
        )
        .unwrap()
        .unwrap();
    let obj = remote.object(meta, "mem://obj".into());
    (remote, obj)
}

/// The runtime's threads serve in the foreground even when a thread in the background
/// (decode or check ahead, the first to read after the daemon's fork) makes them.
#[test]
fn the_runtime_runs_in_the_foreground_whoever_starts_it() {
    use crate::background::{place_of, run_in_background, Background};
    let made_by = std::thread::spawn(move || {
        // SAFETY: gettid has no preconditions.
        let me = unsafe { libc::gettid() };
        run_in_background(me, true);
        let remote = remote_over(&Arc::new(InMemory::new()), &settings(1000));
        let live = remote.live().unwrap();
        let served = live.runtime.block_on(async {
            // SAFETY: gettid has no preconditions.
            let worker = tokio::spawn(async { place_of(unsafe { libc::gettid() }) });
            worker.await.unwrap()
        });
        (place_of(me), served)
    });
    let (maker, served) = made_by.join().unwrap();
    assert_ne!(
        maker,
        (libc::SCHED_OTHER, 0),
        "the maker runs in the background"
    );
    // Without leave to come back from nice 19 (`Background::Nice`) no thread can.
    if Background::chosen() == Background::Idle {
        assert_eq!(
            served,
            (libc::SCHED_OTHER, 0),
            "a GET's thread: (policy, nice)"
        );
    }
}

#[test]
fn any_range_reads_exactly_across_parts() {
    let bytes: Vec<u8> = (0..10_000u32).map(|i| (i * 7 + i / 251) as u8).collect();
    let (_, _, obj) = one_object(&bytes, 1000);
    for (off, len) in [
        (0, 1),
        (0, 10_000),
        (999, 2),
        (1000, 1000),
        (4321, 3333),
        (9999, 1),
    ] {
        let mut buf = vec![0u8; len];
        obj.read_exact_at(&mut buf, off as u64).unwrap();
        assert_eq!(buf, bytes[off..off + len], "{off}+{len}");
    }
    // Sequential reads grow a window and still read exactly.
    let mut out = Vec::new();
    for off in (0..10_000).step_by(700) {
        let len = 700.min(10_000 - off);
        let mut buf = vec![0u8; len];
        obj.read_exact_at(&mut buf, off as u64).unwrap();
        out.extend_from_slice(&buf);
    }
    assert_eq!(out, bytes);
    let mut past = vec![0u8; 2];
    assert!(obj.read_exact_at(&mut past, 9_999).is_err());
}

#[test]
fn small_reads_fetch_only_their_bytes_and_use_parts_held() {
    let bytes: Vec<u8> = (0..10_000u32).map(|i| (i * 13 + i / 97) as u8).collect();
    let (_, remote, obj) = one_object(&bytes, 1000);
    let fetched = || remote.stats.remote_bytes_fetched.load(Ordering::Relaxed);
    let kept = || remote.parts.lock().lru.len();
    let mut buf = vec![0u8; 1500];
    obj.read_small_at(&mut buf, 300).unwrap();
    assert_eq!(buf, bytes[300..1800]);
    assert_eq!(
        fetched(),
        1500,
        "just the bytes asked for, not parts 0 and 1"
    );
    assert_eq!(kept(), 0, "nothing kept");
    // Part 2 held: a small read across parts 1-3 takes part 2's bytes from it and fetches
    // the runs on either side.
    let mut part2 = vec![0u8; 10];
    obj.read_exact_at(&mut part2, 2000).unwrap();
    let before = fetched();
    let mut buf = vec![0u8; 2200];
    obj.read_small_at(&mut buf, 1400).unwrap();
    assert_eq!(buf, bytes[1400..3600]);
    assert_eq!(fetched() - before, 600 + 600, "parts 1 and 3's bytes only");
    let mut past = vec![0u8; 2];
    assert!(obj.read_small_at(&mut past, 9_999).is_err());
}

#[test]
fn parts_read_through_are_let_go() {
    let bytes: Vec<u8> = (0..10_000u32).map(|i| (i % 253) as u8).collect();
    let (_, remote, obj) = one_object(&bytes, 1000);
    let kept = || remote.parts.lock().lru.len();
    let mut head = vec![0u8; 10];
    obj.read_exact_at(&mut head, 0).unwrap();
    assert_eq!(kept(), 1, "a part read in part stays for the rest of it");
    let mut out = Vec::new();
    for off in (0..10_000).step_by(700) {
        let mut buf = vec![0u8; 700.min(10_000 - off)];
        obj.read_exact_at(&mut buf, off as u64).unwrap();
        out.extend_from_slice(&buf);
    }
    assert_eq!(out, bytes);
    assert_eq!(kept(), 0, "every part was read through");
}

#[test]
fn part_buffers_are_given_back_and_reused() {
    let bytes: Vec<u8> = (0..10_000u32).map(|i| (i % 241) as u8).collect();
    let (_, remote, obj) = one_object(&bytes, 1000);
    let kept = || remote.buffers.free.lock().len();
    for round in 0..2 {
        let mut out = vec![0u8; 10_000];
        obj.read_exact_at(&mut out, 0).unwrap();
        assert_eq!(out, bytes, "round {round}");
        // Every part was read through and let go: its buffer is back for the next GET.
        assert!(
            kept() > 0 && kept() <= KEEP_BUFFERS,
            "round {round}: {}",
            kept()
        );
    }
}

#[test]
fn reads_once_go_straight_into_the_callers_memory_and_keep_nothing() {
    let bytes: Vec<u8> = (0..10_000u32).map(|i| (i * 13 + i / 97) as u8).collect();
    let (_, remote, obj) = one_object(&bytes, 1000);
    let kept = || remote.parts.lock().lru.len();
    // Whole parts, one or many: none kept, none read ahead.
    for (off, len) in [(0, 1000), (1000, 3000), (9000, 1000), (0, 10_000)] {
        let mut buf = vec![0u8; len];
        obj.read_once_at(&mut buf, off as u64).unwrap();
        assert!(buf == bytes[off..off + len], "bytes {off}..+{len}");
        assert_eq!(kept(), 0, "after bytes {off}..+{len}");
    }
    // Parts cut by the range's ends come through the kept parts, with nothing read
    // ahead: the two cut parts of 500..2500 at most are kept. The bytes are exact.
    for (off, len) in [(500, 2000), (9999, 1), (1, 9998)] {
        let mut buf = vec![0u8; len];
        obj.read_once_at(&mut buf, off as u64).unwrap();
        assert!(buf == bytes[off..off + len], "bytes {off}..+{len}");
        if off == 500 {
            assert!(kept() <= 2, "{} parts kept", kept());
        }
    }
    let mut buf = vec![0u8; 2];
    assert!(obj.read_once_at(&mut buf, 9999).is_err());
}

#[test]
fn a_read_once_of_a_replaced_object_fails() {
    let bytes = vec![1u8; 4000];
    let (mem, remote, obj) = one_object(&bytes, 1000);
    replace(&remote, &mem, vec![2u8; 4000]);
    let mut buf = vec![0u8; 1000];
    assert!(matches!(
        obj.read_once_at(&mut buf, 1000),
        Err(ReadError::Changed)
    ));
    assert!(matches!(
        obj.read_exact_at(&mut buf, 0),
        Err(ReadError::Changed)
    ));
}

#[test]
fn a_replaced_object_is_never_served() {
    let bytes = vec![1u8; 4000];
    let (mem, remote, obj) = one_object(&bytes, 1000);
    let mut buf = vec![0u8; 10];
    obj.read_exact_at(&mut buf, 0).unwrap();
    replace(&remote, &mem, vec![2u8; 4000]);
    assert!(matches!(
        obj.read_exact_at(&mut buf, 3000),
        Err(ReadError::Changed)
    ));
    // Sticky: parts had before fail too.
    assert!(matches!(
        obj.read_exact_at(&mut buf, 0),
        Err(ReadError::Changed)
    ));
    assert!(matches!(obj.check_unchanged(), Err(ReadError::Changed)));
}

#[test]
fn a_fork_quiesce_keeps_parts_and_restarts_the_runtime() {
    let bytes: Vec<u8> = (0..3000u32).map(|i| i as u8).collect();
    let (_, remote, obj) = one_object(&bytes, 1000);
    let mut buf = vec![0u8; 3000];
    obj.read_exact_at(&mut buf, 0).unwrap();
    quiesce_for_fork();
    assert!(remote.live.lock().is_none());
    obj.read_exact_at(&mut buf, 0).unwrap();
    assert_eq!(buf, bytes);
}

#[test]
fn fetched_bytes_node_cache_lookups_and_failures_are_counted() {
    let bytes: Vec<u8> = (0..4500u32).map(|i| (i % 253) as u8).collect();
    let (mem, _, _) = one_object(&bytes, 1000);
    let cache = tempfile::tempdir().unwrap();
    let with_cache = |stats: &Arc<Stats>| cached_object(&mem, cache.path(), stats);
    let count = |s: &Stats| {
        let c = s.snapshot();
        (
            c.remote_bytes_fetched,
            c.node_cache_hits,
            c.node_cache_misses,
            c.remote_get_failures,
        )
    };
    let mut buf = vec![0u8; bytes.len()];

    // Reads once into an empty cache keep what they fetch there.
    {
        let once = Stats::new();
        let (_remote, obj) = with_cache(&once);
        obj.read_once_at(&mut buf, 0).unwrap();
        assert_eq!(buf, bytes);
        assert_eq!(count(&once), (4500, 0, 5, 0));
        obj.read_exact_at(&mut buf, 0).unwrap();
        assert_eq!(count(&once), (4500, 5, 5, 0));
        std::fs::remove_dir_all(cache.path().join("kllm-parts-v1")).unwrap();
    }

    // An empty cache: five parts looked for, fetched (4500 bytes), kept.
    let first = Stats::new();
    let (_remote, obj) = with_cache(&first);
    obj.read_exact_at(&mut buf, 0).unwrap();
    assert_eq!(buf, bytes);
    assert_eq!(count(&first), (4500, 0, 5, 0));
    // Read again: the parts read through were let go, and the cache gives them back;
    // nothing fetched.
    obj.read_exact_at(&mut buf, 0).unwrap();
    assert_eq!(buf, bytes);
    assert_eq!(count(&first), (4500, 5, 5, 0));

    // Another source on the node: every part from the cache.
    let second = Stats::new();
    let (remote, obj) = with_cache(&second);
    obj.read_exact_at(&mut buf, 0).unwrap();
    assert_eq!(buf, bytes);
    assert_eq!(count(&second), (0, 5, 0, 0));
    // Reads once (a fill's) find the parts there too.
    obj.read_once_at(&mut buf, 0).unwrap();
    assert_eq!(buf, bytes);
    assert_eq!(count(&second), (0, 10, 0, 0));

    // The object replaced in the store: a part not in memory or in the cache is asked
    // for, the store says the object changed, and that part is a failure (nothing fetched).
    let third = Stats::new();
    let (_remote3, obj) = with_cache(&third);
    replace(&remote, &mem, vec![9u8; 4600]);
    // The cache still holds the mounted version's parts, and would serve them: empty it.
    std::fs::remove_dir_all(cache.path().join("kllm-parts-v1")).unwrap();
    assert!(matches!(
        obj.read_exact_at(&mut buf[..10], 0),
        Err(ReadError::Changed)
    ));
    assert_eq!(count(&third), (0, 0, 1, 1));
}

#[test]
fn a_fetch_whose_cache_lookup_never_runs_fails_without_a_miss_or_a_get() {
    let bytes: Vec<u8> = (0..2000u32).map(|i| (i % 251) as u8).collect();
    let (mem, _, _) = one_object(&bytes, 1000);
    let cache = tempfile::tempdir().unwrap();
    let stats = Stats::new();
    let (remote, obj) = cached_object(&mem, cache.path(), &stats);
    let job = remote.job(&remote.live().unwrap(), &obj, 0);
    // As before the fork: the runtime is shutting down when the fetch asks for its
    // lookup, which tokio then cancels instead of running.
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let handle = runtime.handle().clone();
    runtime.shutdown_background();
    let _in_it = handle.enter();
    let got = futures::executor::block_on(job.run());
    assert!(got.is_err(), "a part not looked for is not had");
    let c = stats.snapshot();
    assert_eq!(
        (c.node_cache_misses, c.remote_gets, c.remote_bytes_fetched),
        (0, 0, 0),
        "no miss counted, no GET begun"
    );
}

#[test]
fn a_fetched_part_whose_cache_write_never_runs_is_not_had() {
    use futures::task::{waker, ArcWake};
    use std::future::Future;
    use std::task::Context;
    struct Woken(AtomicBool);
    impl ArcWake for Woken {
        fn wake_by_ref(w: &Arc<Self>) {
            w.0.store(true, Ordering::SeqCst);
        }
    }
    let bytes: Vec<u8> = (0..2000u32).map(|i| (i % 251) as u8).collect();
    let (mem, _, _) = one_object(&bytes, 1000);
    let cache = tempfile::tempdir().unwrap();
    let stats = Stats::new();
    let (remote, obj) = cached_object(&mem, cache.path(), &stats);
    let job = remote.job(&remote.live().unwrap(), &obj, 0);
    // The lookup runs; the runtime then shuts down (as before the fork), so tokio
    // cancels the write that follows the GET instead of running it. The one blocking
    // thread is held until the fetch has asked for its lookup, so that the lookup
    // cannot end before the first poll does (and the write run within that poll).
    let runtime = tokio::runtime::Builder::new_current_thread()
        .max_blocking_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let handle = runtime.handle().clone();
    let _in_it = handle.enter();
    let (unplug, plugged) = std::sync::mpsc::channel::<()>();
    let (started, plug_started) = std::sync::mpsc::channel::<()>();
    handle.spawn_blocking(move || {
        started.send(()).unwrap();
        plugged.recv()
    });
    plug_started.recv().unwrap();
    let woken = Arc::new(Woken(AtomicBool::new(false)));
    let waker = waker(woken.clone());
    let mut run = std::pin::pin!(job.run());
    let pending = run.as_mut().poll(&mut Context::from_waker(&waker));
    assert!(
        pending.is_pending(),
        "the lookup waits for the blocking thread"
    );
    unplug.send(()).unwrap();
    while !woken.0.load(Ordering::SeqCst) {
        std::thread::sleep(Duration::from_millis(1));
    }
    runtime.shutdown_background();
    let got = futures::executor::block_on(run);
    let c = stats.snapshot();
    assert_eq!(
        (c.node_cache_misses, c.remote_bytes_fetched),
        (1, 1000),
        "the lookup and the GET ran"
    );
    assert!(got.is_err(), "a part not kept is not had");
    let node_cache = remote.node_cache.as_ref().unwrap();
    let kept = node_cache.get(&obj.cache_key(&remote.name), 0, 1000);
    assert!(kept.is_none(), "nothing was written to the node cache");
}

#[test]
fn listing_is_depth_first_and_sorted_with_implied_folders() {
    let t = SystemTime::UNIX_EPOCH;
    let keys = ["b/x", "a.json", "b/c/y", "b0", "bad//key", "dir/", "./z"];
    let got: Vec<String> = listing(keys.iter().map(|k| (*k, 1, t)))
        .iter()
        .map(|e| {
            format!(
                "{}{}",
                e.path.display(),
                if e.attr.kind == Kind::Dir { "/" } else { "" }
            )
        })
        .collect();
    assert_eq!(got, ["/", "a.json", "b/", "b/c/", "b/c/y", "b/x", "b0"]);
}

#[test]
fn windows_grow_only_for_sequential_readers_that_wait() {
    let mut s = Streams::default();
    let p = 8;
    // A reader that waits for its parts at each read.
    let waiting = |s: &mut Streams, r: Range<u64>| {
        let w = s.note(r.clone(), p, 16);
        s.waited(r.end);
        w
    };
    assert_eq!(waiting(&mut s, 0..8), 0);
    assert_eq!(waiting(&mut s, 8..16), 2);
    assert_eq!(waiting(&mut s, 16..24), 4);
    // Another reader elsewhere starts its own stream.
    assert_eq!(waiting(&mut s, 1000..1008), 0);
    assert_eq!(waiting(&mut s, 24..32), 8);
    assert_eq!(waiting(&mut s, 32..40), 16);
    assert_eq!(waiting(&mut s, 40..48), 16);
    assert_eq!(waiting(&mut s, 1008..1016), 2);
    // Its parts there in time, a stream keeps its window.
    assert_eq!(s.note(48..56, p, 16), 16);
    assert_eq!(s.note(1016..1024, p, 16), 4);
    assert_eq!(s.note(1024..1032, p, 16), 4);
    assert_eq!(s.note(1032..1040, p, 16), 4);
    s.waited(1040);
    assert_eq!(s.note(1040..1048, p, 16), 8);
}
