use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::*;
use crate::ahead::Ahead;
use crate::fill::{Fill, Priority};
use crate::memfs::MemoryFile;
use crate::view::{Content, Ino, View};

/// The mode another user gets, from a child that became nobody: its exit code says
/// what `choose` answered (0: FUSE and why, 1: passthrough, 2: refused, 3: wrong why).
fn choose_as_nobody(requested: Requested) -> i32 {
    // SAFETY: the child only drops privileges, calls `choose` and exits.
    unsafe {
        match libc::fork() {
            0 => {
                let code = if libc::setgid(65534) != 0 || libc::setuid(65534) != 0 {
                    9
                } else {
                    match ServeMode::choose(requested, 1 << 20) {
                        Ok(m) => match m.describe() {
                            ("fuse", Some(why)) if why.contains("need root") => 0,
                            ("fuse", _) => 3,
                            _ => 1,
                        },
                        Err(e) if e.to_string().contains("need root") => 2,
                        Err(_) => 3,
                    }
                };
                libc::_exit(code)
            }
            pid => {
                let mut status = 0;
                libc::waitpid(pid, &mut status, 0);
                libc::WEXITSTATUS(status)
            }
        }
    }
}

#[test]
fn other_users_fall_back_to_fuse_or_are_refused() {
    if !rustix::process::geteuid().is_root() {
        eprintln!("skipped: needs root to become another user");
        return;
    }
    assert_eq!(choose_as_nobody(Requested::Auto), 0);
    assert_eq!(choose_as_nobody(Requested::Passthrough), 2);
}

#[test]
fn fuse_mode_needs_no_memory() {
    let m = ServeMode::choose(Requested::Fuse, 1 << 20).unwrap();
    assert!(m.passthrough().is_none() && m.memory().is_none());
    assert_eq!(m.describe(), ("fuse", Some("--mode fuse".to_string())));
}

/// A sealed sample's view, passthrough on (root only), with `Opens` over a fake kernel.
#[cfg(feature = "seal")]
fn sample_opens() -> Option<(tempfile::TempDir, Arc<View>, Opens<std::fs::File>)> {
    use crate::key::ModelKey;
    use crate::testseal;
    let mode = match ServeMode::choose(Requested::Auto, 64 << 20) {
        Ok(m) if m.passthrough().is_some() => m,
        _ => {
            eprintln!("skipped: passthrough needs root and a private tmpfs");
            return None;
        }
    };
    let tmp = tempfile::tempdir().unwrap();
    let (plain, sealed) = (tmp.path().join("plain"), tmp.path().join("sealed"));
    let key = ModelKey::new([7; 32]);
    testseal::write_sample_model(&plain, 16, 1).unwrap();
    let lock = Some(crate::lock::Version::V2);
    testseal::seal_dir(&plain, &sealed, &key, lock, [3; 16]).unwrap();
    let view = crate::sealed::open(&sealed, &key, &"test", &Default::default()).unwrap();
    let view = Arc::new(view);
    let copies = Copies {
        open_wait: Duration::from_secs(30),
        decode_ahead: false,
        ..Copies::default()
    };
    let opens = Opens::new(view.clone(), Arc::new(mode), copies);
    Some((tmp, view, opens))
}

#[cfg(feature = "seal")]
fn a_shard(view: &View) -> (String, Ino) {
    view.file_paths()
        .into_iter()
        .find(|(_, ino)| matches!(view.node(*ino).unwrap().content, Content::Shard { .. }))
        .expect("a locked shard")
}

/// The kernel's backing call, faked: the "handle" is a second descriptor of the file.
fn dup(f: &std::fs::File) -> std::io::Result<std::fs::File> {
    f.try_clone()
}

#[cfg(feature = "seal")]
#[test]
fn a_locked_shard_is_backed_by_its_whole_decoded_copy() {
    use std::io::Read;
    let Some((_tmp, view, opens)) = sample_opens() else {
        return;
    };
    let (path, ino) = a_shard(&view);
    let node = view.node(ino).unwrap();
    let Ok(Opened::Passthrough { fh, id }) = opens.open(ino, node, dup) else {
        panic!("{path}: not opened in passthrough mode");
    };
    let mut backed = Vec::new();
    (&*id).read_to_end(&mut backed).unwrap();
    let want = view.read(ino, 0, node.attr.size as usize).unwrap();
    assert!(
        backed[..] == want[..],
        "{path}: backing differs from the view"
    );
    assert!(opens.release(fh).is_some());
}

#[cfg(feature = "seal")]
#[test]
fn a_kernel_refusing_backing_files_turns_passthrough_off() {
    let Some((_tmp, view, opens)) = sample_opens() else {
        return;
    };
    let (_, ino) = a_shard(&view);
    let node = view.node(ino).unwrap();
    let refuse = |_: &std::fs::File| Err(std::io::Error::from_raw_os_error(libc::EPERM));
    assert!(matches!(
        opens.open(ino, node, refuse),
        Ok(Opened::Fuse { .. })
    ));
    let (mode, why) = opens.mode().describe();
    assert_eq!(mode, "fuse");
    assert!(why.unwrap().contains("refuses backing files"));
    // Later opens go through FUSE without asking the kernel.
    let never = |_: &std::fs::File| -> std::io::Result<std::fs::File> {
        panic!("a backing file was asked for with passthrough off")
    };
    assert!(matches!(
        opens.open(ino, node, never),
        Ok(Opened::Fuse { .. })
    ));
}

/// A stand-in for the kernel's backing id that counts how many exist.
struct Id(Arc<AtomicUsize>);
impl Drop for Id {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

fn new_id(live: &Arc<AtomicUsize>) -> Backing<Id> {
    live.fetch_add(1, Ordering::SeqCst);
    Backing {
        id: Arc::new(Id(live.clone())),
        memory: None,
    }
}

fn make(live: &Arc<AtomicUsize>) -> impl FnOnce() -> Option<Backing<Id>> {
    let live = live.clone();
    move || Some(new_id(&live))
}

fn fh<B>(o: &Opened<B>) -> u64 {
    o.fh()
}

#[test]
fn opens_share_one_backing_until_the_last_release() {
    let t = OpenTable::new(Duration::ZERO);
    let live = Arc::new(AtomicUsize::new(0));
    let a = t.open_direct(7, make(&live));
    let b = t.open_direct(7, || panic!("a second backing was made"));
    let (Opened::Passthrough { id: ia, .. }, Opened::Passthrough { id: ib, .. }) = (&a, &b) else {
        panic!("not passthrough");
    };
    assert!(Arc::ptr_eq(ia, ib));
    let (fa, fb) = (fh(&a), fh(&b));
    drop((a, b));
    assert_eq!(t.open_handles(), (2, 0));
    t.release(fa);
    assert_eq!(
        live.load(Ordering::SeqCst),
        1,
        "closed while a handle is open"
    );
    t.release(fb);
    assert_eq!(
        live.load(Ordering::SeqCst),
        0,
        "backing kept after the last release"
    );
    assert_eq!(t.open_handles(), (0, 0));
    // A later open makes a new one.
    let c = t.open_direct(7, make(&live));
    assert!(matches!(c, Opened::Passthrough { .. }));
    assert_eq!(live.load(Ordering::SeqCst), 1);
}

#[test]
fn an_inode_open_through_the_page_cache_stays_there() {
    let t = OpenTable::new(Duration::ZERO);
    let live = Arc::new(AtomicUsize::new(0));
    // The first open falls back (no backing could be made).
    let a = t.open_direct(3, || None);
    assert!(matches!(a, Opened::Fuse { .. }));
    // While it is open, a passthrough open would be refused by the kernel.
    let b = t.open_direct(3, || panic!("passthrough asked for a cached inode"));
    assert!(matches!(b, Opened::Fuse { .. }));
    t.release(fh(&a));
    t.release(fh(&b));
    // Once all are closed, passthrough is possible again.
    assert!(matches!(
        t.open_direct(3, make(&live)),
        Opened::Passthrough { .. }
    ));
    // And while that is open, even a plain FUSE-only file keeps its own inode's mode.
    assert!(matches!(t.open_direct(4, || None), Opened::Fuse { .. }));
}

#[test]
fn handles_are_unique_and_released_once() {
    let t: OpenTable<Id> = OpenTable::new(Duration::ZERO);
    let fhs: Vec<u64> = (0..100).map(|i| t.open_fuse(i % 3)).collect();
    let mut sorted = fhs.clone();
    sorted.sort();
    sorted.dedup();
    assert_eq!(sorted.len(), 100);
    for f in &fhs {
        assert!(t.release(*f).is_some());
    }
    assert!(t.release(fhs[0]).is_none(), "released twice");
    assert_eq!(t.open_handles(), (0, 0));
}

use crate::fill::tests::Gate;
use crate::fill::{Input, Target, CHUNK};

/// A fill of `len` bytes into a scratch file, each chunk taking `per_chunk`.
fn fill(len: u64, per_chunk: Duration) -> Arc<Fill> {
    checked_fill(len, per_chunk, None, Arc::default())
}

/// The same, under an integrity check, counting the bytes made into `made`.
fn checked_fill(
    len: u64,
    per_chunk: Duration,
    check: Option<Arc<crate::fill::CheckFn>>,
    made: Arc<AtomicU64>,
) -> Arc<Fill> {
    paced_fill(len, move |_| std::thread::sleep(per_chunk), check, made)
}

/// A fill whose chunks wait for `pace(offset)` before they are made.
fn paced_fill(
    len: u64,
    pace: impl Fn(u64) + Send + Sync + Clone + 'static,
    check: Option<Arc<crate::fill::CheckFn>>,
    made: Arc<AtomicU64>,
) -> Arc<Fill> {
    let make = move |off, buf: &mut [u8]| {
        pace(off);
        for (i, b) in buf.iter_mut().enumerate() {
            *b = ((off + i as u64) % 253) as u8;
        }
        Ok(())
    };
    let made_here = make.clone();
    let unlock = move |off, buf: &mut [u8]| {
        made_here(off, buf)?;
        made.fetch_add(buf.len() as u64, Ordering::SeqCst);
        Ok(())
    };
    let source = Input {
        unlock: Box::new(unlock),
        check,
        ..Input::made_by(make)
    };
    let target = Target {
        file: tempfile::tempfile().unwrap(),
        len,
        steps: crate::fill::Steps::same(1 << 20),
        seal: Box::new(crate::memfs::seal),
        reservation: None,
    };
    Arc::new(Fill::start(target, source, Priority::Demand, "test".into()).unwrap())
}

const WAIT: OpenPolicy = OpenPolicy {
    wait: Duration::from_millis(20),
    near: u64::MAX,
    past_half: Duration::from_millis(20),
    probe: Duration::from_millis(20),
};

fn backed(live: &Arc<AtomicUsize>) -> impl FnOnce(&Arc<MemoryFile>) -> Option<Backing<Id>> {
    let live = live.clone();
    move |m| {
        let mut b = new_id(&live);
        b.memory = Some(m.clone());
        Some(b)
    }
}

#[test]
fn a_copy_done_in_time_is_handed_to_the_kernel() {
    let t = OpenTable::new(Duration::from_secs(60));
    let live = Arc::new(AtomicUsize::new(0));
    let o = t.open_copy(
        5,
        &WAIT,
        || Some(fill(1 << 20, Duration::ZERO)),
        backed(&live),
    );
    // A one-chunk fill finishes within the wait (or the open is served from it, on a
    // busy machine).
    if let Opened::Fuse { fill, .. } = &o {
        let fill = fill.as_ref().expect("a FUSE open without the copy");
        fill.wait_done();
    }
    t.release(o.fh());
    // Once complete, every open is passthrough.
    let f = t.open_copy(5, &WAIT, || panic!("decoded twice"), backed(&live));
    assert!(matches!(f, Opened::Passthrough { .. }));
}

#[test]
fn an_open_waits_only_for_a_copy_nearly_done() {
    let t = OpenTable::new(Duration::from_secs(60));
    let live = Arc::new(AtomicUsize::new(0));
    let policy = OpenPolicy {
        wait: Duration::from_secs(30),
        near: NEAR_DONE,
        past_half: Duration::from_secs(30),
        probe: Duration::from_millis(50),
    };
    // Far from done: served through FUSE at once, not after the wait.
    let started = Instant::now();
    let far = t.open_copy(
        3,
        &policy,
        || Some(fill(20 * CHUNK, Duration::from_millis(50))),
        backed(&live),
    );
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
    assert!(matches!(far, Opened::Fuse { fill: Some(_), .. }));
    // Nearly done: waited for, and handed to the kernel.
    let near = t.open_copy(
        4,
        &policy,
        || Some(fill(NEAR_DONE, Duration::from_millis(50))),
        backed(&live),
    );
    assert!(matches!(near, Opened::Passthrough { .. }));
}

/// A fill of 20 chunks whose first `through` take `early` each and whose rest wait until
/// the returned gate opens, then take `late` each, one at a time (whatever the cores):
/// still filling, that far, for as long as a test needs.
fn gated_fill(early: Duration, through: u64, late: Duration) -> (Arc<Fill>, Gate) {
    let gate = Gate::new();
    let shut = gate.clone();
    let one_at_a_time = Arc::new(parking_lot::Mutex::new(()));
    let pace = move |off| {
        if off < through * CHUNK {
            std::thread::sleep(early);
            return;
        }
        shut.wait();
        let _turn = one_at_a_time.lock();
        std::thread::sleep(late);
    };
    (paced_fill(20 * CHUNK, pace, None, Arc::default()), gate)
}

/// Past half (15 chunks of 20) and still filling until the gate opens.
fn held_fill(early: Duration) -> (Arc<Fill>, Gate) {
    gated_fill(early, 15, Duration::ZERO)
}

/// Open `gate` `after` from now, on a thread of its own: started just before an open, the
/// rest of a gated fill is let go once the open has begun to wait for it.
fn open_after(gate: &Gate, after: Duration) -> std::thread::JoinHandle<()> {
    let gate = gate.clone();
    std::thread::spawn(move || {
        std::thread::sleep(after);
        gate.open();
    })
}

/// A copy just begun is not waited for (a fresh mount's first byte), one past half is
/// (then handed to the kernel), one chunk from done too, and one past half that stalls
/// only up to `past_half`.
#[test]
fn an_open_waits_for_a_copy_past_half_not_one_just_begun() {
    let t = OpenTable::new(Duration::from_secs(60));
    let live = Arc::new(AtomicUsize::new(0));
    // The pace is judged only after the gate below has let the rest go.
    let policy = OpenPolicy {
        wait: Duration::from_millis(10),
        near: NEAR_DONE,
        past_half: Duration::from_secs(30),
        probe: Duration::from_secs(1),
    };
    let (copy, gate) = held_fill(Duration::from_millis(20));
    let started = Instant::now();
    let first = t.open_copy(3, &policy, || Some(copy), backed(&live));
    assert!(
        started.elapsed() < Duration::from_secs(1),
        "{:?}",
        started.elapsed()
    );
    let Opened::Fuse {
        fill: Some(copy), ..
    } = &first
    else {
        panic!("a copy just begun was waited for");
    };
    let copy = copy.clone();
    t.release(first.fh());
    while !copy.past_half() {
        std::thread::sleep(Duration::from_millis(2));
    }
    assert!(copy.complete().is_none());
    // The rest let go shortly after the open has begun waiting for it.
    let releaser = open_after(&gate, Duration::from_millis(100));
    let second = t.open_copy(3, &policy, || panic!("decoded twice"), backed(&live));
    assert!(matches!(second, Opened::Passthrough { .. }));
    releaser.join().unwrap();
    t.release(second.fh());

    // Past half and stalled: waited for `past_half`, then served through FUSE.
    let (copy, gate) = held_fill(Duration::ZERO);
    while !copy.past_half() {
        std::thread::sleep(Duration::from_millis(2));
    }
    let policy = OpenPolicy {
        past_half: Duration::from_millis(200),
        ..policy
    };
    let started = Instant::now();
    let third = t.open_copy(4, &policy, || Some(copy.clone()), backed(&live));
    let waited = started.elapsed();
    assert!(matches!(third, Opened::Fuse { fill: Some(_), .. }));
    assert!(
        waited >= Duration::from_millis(200) && waited < Duration::from_secs(5),
        "{waited:?}"
    );
    gate.open();
    copy.wait_done();
    assert!(copy.complete().is_some());
    t.release(third.fh());

    // One chunk left, held past `wait` (decode ahead's last chunk under the background
    // policy): waited for as past half, not served through FUSE after `wait`.
    let (copy, gate) = gated_fill(Duration::ZERO, 19, Duration::ZERO);
    while copy.left_bytes() > CHUNK {
        std::thread::sleep(Duration::from_millis(2));
    }
    let releaser = open_after(&gate, Duration::from_millis(100));
    let patient = OpenPolicy {
        past_half: Duration::from_secs(30),
        ..policy
    };
    let fourth = t.open_copy(5, &patient, || Some(copy.clone()), backed(&live));
    releaser.join().unwrap();
    assert!(matches!(fourth, Opened::Passthrough { .. }));
    t.release(fourth.fh());
}

/// Decode ahead's copy, filling a while and under half done when the open comes, is waited
/// for when it ends within as long again once urged, and given up once its pace shows it
/// cannot.
#[test]
fn an_open_waits_for_a_copy_filling_a_while_if_its_pace_ends_it_in_time() {
    let t = OpenTable::new(Duration::from_secs(60));
    let live = Arc::new(AtomicUsize::new(0));
    let policy = OpenPolicy {
        wait: Duration::from_millis(10),
        near: NEAR_DONE,
        past_half: Duration::from_secs(30),
        // Room for a few chunks of this unoptimized test decode to end before the pace
        // is judged.
        probe: Duration::from_millis(250),
    };
    let filling_a_while = |copy: &Arc<Fill>| {
        while copy.filling_for() < Duration::from_secs(3) {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert!(!copy.past_half() && copy.complete().is_none());
    };

    // Under half (9 chunks of 20 get past the gate), the rest let go as the open begins
    // to wait (the engine's work no longer ahead of the decode): waited for, and handed
    // to the kernel.
    let (copy, gate) = gated_fill(Duration::from_millis(1), 9, Duration::ZERO);
    let Ahead::Started(copy) = t.decode_ahead(3, 0, || Some(copy)) else {
        panic!("not decoded ahead");
    };
    filling_a_while(&copy);
    let releaser = open_after(&gate, Duration::from_millis(10));
    let started = Instant::now();
    let first = t.open_copy(3, &policy, || panic!("decoded twice"), backed(&live));
    releaser.join().unwrap();
    assert!(
        matches!(first, Opened::Passthrough { .. }),
        "through FUSE after {:?}, {} bytes left",
        started.elapsed(),
        copy.left_bytes()
    );
    t.release(first.fh());

    // Let go at a pace that cannot end it in as long again (11 chunks at 0.5 s each):
    // given up once the pace is known, not after as long again.
    let (copy, gate) = gated_fill(Duration::from_millis(1), 9, Duration::from_millis(500));
    let Ahead::Started(copy) = t.decode_ahead(4, 1, || Some(copy)) else {
        panic!("not decoded ahead");
    };
    filling_a_while(&copy);
    gate.open();
    let started = Instant::now();
    let second = t.open_copy(4, &policy, || panic!("decoded twice"), backed(&live));
    let waited = started.elapsed();
    assert!(matches!(second, Opened::Fuse { fill: Some(_), .. }));
    assert!(
        waited >= policy.probe && waited < Duration::from_millis(2700),
        "{waited:?}"
    );
    t.release(second.fh());
}

/// While the file's hash runs nothing of its copy is served, so an open waits for the
/// verdict, however far the copy is from done, and is then handed the copy (decoded
/// whole by the verdict here); a second open meanwhile waits as well and shares it.
#[test]
fn an_open_waits_for_the_verdict_and_gets_the_copy() {
    let t = OpenTable::new(Duration::from_secs(60));
    let live = Arc::new(AtomicUsize::new(0));
    let policy = OpenPolicy {
        wait: Duration::from_millis(10),
        near: NEAR_DONE,
        past_half: Duration::from_millis(10),
        probe: Duration::from_millis(10),
    };
    let len = 20 * CHUNK;
    let made = Arc::new(AtomicU64::new(0));
    // One hash, as the view's verdict (later callers wait for it, then return it),
    // which ends at least 300 ms in and after the whole copy is made.
    let hashed = Arc::new(Mutex::new(false));
    let m = made.clone();
    let started = Instant::now();
    let check = move || {
        let mut done = hashed.lock();
        while !*done {
            if m.load(Ordering::SeqCst) >= len && started.elapsed() >= Duration::from_millis(300) {
                *done = true;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        Ok(())
    };
    let check: Arc<crate::fill::CheckFn> = Arc::new(check);
    let (first, second) = std::thread::scope(|scope| {
        let second = scope.spawn(|| {
            std::thread::sleep(Duration::from_millis(50));
            t.open_copy(7, &policy, || panic!("decoded twice"), backed(&live))
        });
        let first = t.open_copy(
            7,
            &policy,
            || Some(checked_fill(len, Duration::ZERO, Some(check), made.clone())),
            backed(&live),
        );
        (first, second.join().unwrap())
    });
    assert!(started.elapsed() >= Duration::from_millis(300));
    assert!(matches!(first, Opened::Passthrough { .. }), "first open");
    assert!(matches!(second, Opened::Passthrough { .. }), "second open");
    assert_eq!(t.open_handles(), (2, 0));
}

#[test]
fn an_open_does_not_wait_for_a_whole_decode() {
    let t = OpenTable::new(Duration::from_secs(60));
    let live = Arc::new(AtomicUsize::new(0));
    // Chunks past the fourth wait for the open: an open that waited for the whole decode
    // would find the gate still shut after 30 s.
    let gate = Gate::new();
    let shut_too_long = Arc::new(AtomicBool::new(false));
    let (g, late) = (gate.clone(), shut_too_long.clone());
    let wait_for_open = move |off: u64| {
        if off >= 4 * CHUNK
            && !late.load(Ordering::SeqCst)
            && !g.wait_at_most(Duration::from_secs(30))
        {
            late.store(true, Ordering::SeqCst);
        }
    };
    let a = t.open_copy(
        9,
        &WAIT,
        || Some(paced_fill(20 * CHUNK, wait_for_open, None, Arc::default())),
        backed(&live),
    );
    gate.open();
    assert!(
        !shut_too_long.load(Ordering::SeqCst),
        "the open waited for the whole decode"
    );
    let Opened::Fuse { fill: Some(f), .. } = &a else {
        panic!("the first open of a filling copy is not served from it");
    };
    let mut buf = vec![0u8; 4096];
    f.read(3 * CHUNK, &mut buf).unwrap();
    assert_eq!(buf[0], ((3 * CHUNK) % 253) as u8);
    // A second open joins the first through FUSE and reads from the same copy.
    let b = t.open_copy(9, &WAIT, || panic!("decoded twice"), backed(&live));
    let Opened::Fuse { fill: Some(g), .. } = &b else {
        panic!("second open not served from the copy");
    };
    assert!(Arc::ptr_eq(f, g));
    assert!(f.wait_complete(Duration::from_secs(30)).is_some());
    t.release(a.fh());
    t.release(b.fh());
    // Complete and closed: the next open gets it by passthrough.
    let c = t.open_copy(9, &WAIT, || panic!("decoded twice"), backed(&live));
    assert!(matches!(c, Opened::Passthrough { .. }));
    assert_eq!(live.load(Ordering::SeqCst), 1);
}

#[test]
fn a_reopen_racing_the_release_of_the_last_fuse_handle_gets_passthrough() {
    let t = Arc::new(OpenTable::new(Duration::from_secs(60)));
    let live = Arc::new(AtomicUsize::new(0));
    let a = t.open_copy(
        11,
        &WAIT,
        || Some(fill(4 * CHUNK, Duration::from_millis(20))),
        backed(&live),
    );
    let Opened::Fuse { fill: Some(f), .. } = &a else {
        panic!("a slow copy was not served through FUSE");
    };
    assert!(f.wait_complete(Duration::from_secs(30)).is_some());
    // The kernel's RELEASE of the first handle arrives just after the next open.
    let (t2, fh) = (t.clone(), a.fh());
    let late = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(5));
        t2.release(fh);
    });
    let b = t.open_copy(11, &WAIT, || panic!("decoded twice"), backed(&live));
    late.join().unwrap();
    assert!(
        matches!(b, Opened::Passthrough { .. }),
        "the reopen stayed in FUSE"
    );
}

#[test]
fn copies_outlive_the_last_close_by_the_grace_period() {
    let t = OpenTable::new(Duration::from_secs(60));
    let live = Arc::new(AtomicUsize::new(0));
    let o = t.open_copy(
        2,
        &WAIT,
        || Some(fill(CHUNK, Duration::ZERO)),
        backed(&live),
    );
    assert_eq!(t.kept_bytes(), 0, "an open copy counted as kept");
    t.release(o.fh());
    assert_eq!(t.kept_bytes(), CHUNK);
    assert_eq!(t.expire(Instant::now()), 0, "let go before the grace ended");
    assert_eq!(t.expire(Instant::now() + Duration::from_secs(61)), CHUNK);
    assert_eq!(t.kept_bytes(), 0);
    // The next open decodes again.
    let started = Arc::new(AtomicBool::new(false));
    let s = started.clone();
    let o = t.open_copy(
        2,
        &WAIT,
        || {
            s.store(true, Ordering::SeqCst);
            Some(fill(CHUNK, Duration::ZERO))
        },
        backed(&live),
    );
    assert!(started.load(Ordering::SeqCst));
    t.release(o.fh());
}

#[test]
fn room_is_made_from_old_closed_copies_then_the_farthest_ahead() {
    let t: OpenTable<Id> = OpenTable::new(Duration::from_secs(60));
    let live = Arc::new(AtomicUsize::new(0));
    for (ino, rank) in [(20, 0), (21, 1), (22, 2)] {
        assert!(matches!(
            t.decode_ahead(ino, rank, || Some(fill(CHUNK, Duration::ZERO))),
            Ahead::Started(_)
        ));
    }
    // Decoding ahead never takes a file that has a copy.
    assert!(matches!(
        t.decode_ahead(20, 0, || panic!("twice")),
        Ahead::Skipped
    ));
    let a = t.open_copy(
        30,
        &WAIT,
        || Some(fill(CHUNK, Duration::ZERO)),
        backed(&live),
    );
    t.release(a.fh());
    // The closed copy goes first, then the farthest ahead (22).
    assert_eq!(t.make_room(1), CHUNK);
    let kept = |ino| t.inode(ino).state.lock().fill.is_some();
    assert!(!kept(30) && kept(20) && kept(21) && kept(22));
    assert_eq!(t.make_room(CHUNK + 1), 2 * CHUNK);
    assert!(kept(20) && !kept(21) && !kept(22));
    // The copy decoded ahead serves the first open of its file.
    let o = t.open_copy(20, &WAIT, || panic!("decoded again"), backed(&live));
    assert!(t.make_room(u64::MAX) == 0, "an open copy let go");
    t.release(o.fh());
}
