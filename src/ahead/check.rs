//! Check ahead: the files under a manifest hashed right after mounting.

use std::collections::HashSet;
use std::sync::Arc;

use parking_lot::Mutex;

use crate::background::run_in_background;
use crate::view::{Ino, View};

use super::fetch::{FetchPlan, ShardWalk};
use super::spawn;
use super::store::{Hashed, Storing, HASH_STEP};

/// The largest file check ahead may be hashing for an open of a shard to wait for it to
/// end, rather than hash that shard itself.
const WAIT_BEHIND_MAX: u64 = 64 << 20;

/// Check ahead: the files under a manifest hashed right after mounting, one at a time on a
/// thread of its own in the background (`SCHED_IDLE`): first the files other than shards
/// (small, and what engines open first: config, tokenizer, index), then each shard in the
/// order engines load them ([`super::order`]), each followed at once by its fetch ahead
/// ([`FetchAhead`](super::FetchAhead)), so the first shard is decoded into the kernel while
/// the next is hashed; a remote shard is stored from the bytes its hash reads, downloaded
/// once.
/// Through FUSE an open of such a file waits for its verdict: hashed ahead, it finds the
/// verdict in, or its hash under way and urged to the normal policy (a hash one waits for
/// must not run only on idle cycles). A local file's sealed bytes are then in the page
/// cache for the reads that follow.
pub struct CheckAhead {
    state: Mutex<Checking>,
    /// Signalled when a shard is taken and when the thread ends.
    moved: parking_lot::Condvar,
}

#[derive(Default)]
struct Checking {
    /// The file being hashed ahead, its length, and whether an open urged its hash.
    current: Option<Ino>,
    current_len: u64,
    urged: bool,
    /// The check-ahead thread.
    tid: Option<libc::pid_t>,
    /// Files an open asked for before their hash ahead began: hashed by the open itself.
    opened: HashSet<Ino>,
    /// Remote shards check ahead is to hash and store from one download, not taken yet.
    coming: HashSet<Ino>,
    /// The one of them an open waits for: taken next, its hash urged.
    wanted: Option<Ino>,
    /// Whether a shard is in hand (an open of another one then hashes it itself, rather
    /// than wait for a whole shard).
    on_shard: bool,
    /// Shards taken whose digest check ahead feeds, or that it left: an open waiting for
    /// one goes on to its verdict.
    taken: HashSet<Ino>,
    /// The thread has ended.
    ended: bool,
}

/// Marks check ahead ended however its thread ends, so no open waits for it.
struct CheckEnded(Arc<CheckAhead>);

impl Drop for CheckEnded {
    fn drop(&mut self) {
        self.0.state.lock().ended = true;
        self.0.moved.notify_all();
    }
}

impl CheckAhead {
    fn new() -> CheckAhead {
        CheckAhead {
            state: Mutex::new(Checking::default()),
            moved: parking_lot::Condvar::new(),
        }
    }

    /// Start checking ahead on a thread of its own, `shards` in that order ([`super::order`]), each
    /// fetched ahead right after its verdict when `fetch` is given; `None` if there is
    /// nothing to check or the thread could not start.
    pub fn start(
        view: Arc<View>,
        shards: Vec<Ino>,
        fetch: Option<FetchPlan>,
    ) -> Option<Arc<CheckAhead>> {
        if !awaits_any_verdict(&view) {
            return None;
        }
        let others = others_to_check(&view, &shards);
        let check = Arc::new(CheckAhead::new());
        if fetch.as_ref().is_some_and(|f| f.page_cache.is_some()) {
            check.state.lock().coming = (shards.iter().copied())
                .filter(|&ino| view.awaits_verdict(ino) && is_remote(&view, ino))
                .collect();
        }
        let c = check.clone();
        let run = move || {
            let _ended = CheckEnded(c.clone());
            // SAFETY: gettid has no preconditions.
            c.state.lock().tid = Some(unsafe { libc::gettid() });
            log::debug!(
                "check ahead: {} files, then {} shards",
                others.len(),
                shards.len()
            );
            let check = |ino: Ino| {
                let len = view.node(ino).map_or(0, |n| n.attr.size);
                if view.awaits_verdict(ino) && c.claim(ino, len) {
                    // A mismatch is logged by the verdict itself; its opens fail.
                    let _ = view.verify(ino);
                    c.done();
                    log::debug!("check ahead: {} checked", view.path_of(ino));
                }
            };
            others.into_iter().for_each(check);
            let mut walk = fetch.map(|plan| plan.walk(&view));
            let mut todo: std::collections::VecDeque<Ino> = shards.into();
            while let Some(ino) = c.next_shard(&mut todo) {
                // A remote shard read once for both its hash and its store; any other
                // hashed, then fetched ahead (not if it failed: its reads fail).
                let stored = (walk.as_mut()).is_some_and(|w| w.check_and_store(&view, &c, ino));
                c.taken(ino);
                if !stored {
                    check(ino);
                    if let Some(w) = walk.as_mut().filter(|_| !view.failed_check(ino)) {
                        if !w.shard(&view, ino) {
                            walk = None;
                        }
                    }
                }
                c.shard_done();
            }
            log::debug!("check ahead: done");
        };
        let hashed_on_open = "files are hashed on their first open";
        spawn("kllm-check", run, "check ahead", hashed_on_open).then_some(check)
    }

    /// Whether the check-ahead thread hashes file `ino` now (in the background, or urged
    /// if an open waits for it), or leaves it to the open that asked for it first.
    pub(super) fn claim(&self, ino: Ino, len: u64) -> bool {
        let mut s = self.state.lock();
        if s.opened.contains(&ino) {
            return false;
        }
        let urged = s.wanted == Some(ino);
        if let Some(tid) = s.tid {
            run_in_background(tid, !urged);
        }
        s.current = Some(ino);
        s.current_len = len;
        s.urged = urged;
        true
    }

    /// The shard to check next: the one an open waits for, else the next in order.
    fn next_shard(&self, todo: &mut std::collections::VecDeque<Ino>) -> Option<Ino> {
        let mut s = self.state.lock();
        let ino = match s.wanted.and_then(|w| todo.iter().position(|&i| i == w)) {
            Some(at) => todo.remove(at),
            None => todo.pop_front(),
        }?;
        s.coming.remove(&ino);
        s.on_shard = true;
        Some(ino)
    }

    /// Shard `ino` is fed by check ahead now, or was left: an open waiting for it goes on.
    pub(super) fn taken(&self, ino: Ino) {
        let mut s = self.state.lock();
        if s.taken.insert(ino) {
            self.moved.notify_all();
        }
        if s.wanted == Some(ino) {
            s.wanted = None;
        }
    }

    /// The shard in hand is checked (and fetched ahead).
    fn shard_done(&self) {
        self.state.lock().on_shard = false;
    }

    pub(super) fn done(&self) {
        let mut s = self.state.lock();
        s.current = None;
        s.urged = false;
        // The fetch that follows runs in the background whatever urged the hash.
        if let Some(tid) = s.tid {
            run_in_background(tid, true);
        }
    }

    /// Whether an open waits for the verdict of the file hashed now.
    pub(super) fn urged(&self) -> bool {
        self.state.lock().urged
    }

    /// An open is about to wait for file `ino`'s verdict: a hash of it under way ahead is
    /// urged to the normal policy, and one not begun is left to the open. Whether it urged.
    pub fn before_verdict(&self, ino: Ino) -> bool {
        let mut s = self.state.lock();
        let busy = s.on_shard || (s.current.is_some() && s.current_len > WAIT_BEHIND_MAX);
        let free = s.wanted.is_none() || s.wanted == Some(ino);
        if s.coming.contains(&ino) && !busy && !s.ended && free {
            // A remote shard check ahead has not begun while it hashes no other shard:
            // taken next, from one download that also stores it, rather than hashed here
            // and downloaded again by the reads.
            s.wanted = Some(ino);
            if let Some(tid) = s.tid {
                run_in_background(tid, false);
            }
            log::debug!("check ahead: an open waits for a shard, taken next");
            while !s.taken.contains(&ino) && !s.ended {
                self.moved.wait(&mut s);
            }
            return true;
        }
        if s.current == Some(ino) {
            if !s.urged {
                s.urged = true;
                if let Some(tid) = s.tid {
                    run_in_background(tid, false);
                }
                log::debug!("check ahead urged by an open");
            }
            return true;
        }
        s.opened.insert(ino);
        false
    }
}

/// The files other than `shards` whose verdict is not in: check ahead hashes them first.
fn others_to_check(view: &View, shards: &[Ino]) -> Vec<Ino> {
    view.file_paths()
        .into_iter()
        .map(|(_, ino)| ino)
        .filter(|ino| !shards.contains(ino) && view.awaits_verdict(*ino))
        .collect()
}

/// Whether file `ino`'s sealed bytes come from a remote source (held in the daemon's
/// memory when fetched ahead).
fn is_remote(view: &View, ino: Ino) -> bool {
    matches!(view.sealed_object(ino), Ok(Some(o)) if o.holds_fetched_ahead())
}

/// Whether anything in the view awaits its verdict (a manifest lists it, unchecked yet).
pub fn awaits_any_verdict(view: &View) -> bool {
    view.file_paths()
        .iter()
        .any(|&(_, ino)| view.awaits_verdict(ino))
}

impl ShardWalk<Storing> {
    /// Check remote shard `ino` under a manifest by reading it once: its sealed bytes are
    /// hashed a step at a time for the verdict (the file's digest fed, as a passthrough fill
    /// feeds it), and each step within the bound is handed in its buffer to the store
    /// thread, which unlocks it in place and stores it in the kernel's page cache. Hashed,
    /// then fetched ahead, the shard was downloaded twice. The pages stored before the
    /// verdict are read by no one: every open of the file waits for the verdict, and a
    /// failed one refuses them all; they are dropped then. While an open waits, the store
    /// thread runs urged too (`Handoff::take_buffer`). Whether the shard was checked here
    /// (false: not a remote shard awaiting its verdict, no store thread, or an open hashes
    /// it).
    fn check_and_store(&mut self, view: &View, check: &CheckAhead, ino: Ino) -> bool {
        let (Some(handoff), Some(cache)) = (self.steps.handoff.clone(), self.steps.cache.clone())
        else {
            return false;
        };
        let Ok(Some(object)) = view.sealed_object(ino) else {
            return false;
        };
        if handoff.ended() || !object.holds_fetched_ahead() || !view.awaits_verdict(ino) {
            return false;
        }
        if !check.claim(ino, object.len()) {
            return false;
        }
        let Some(mut feeder) = view.digest_feeder(ino) else {
            check.done();
            return false;
        };
        // An open waiting for this shard now waits for the digest fed here.
        check.taken(ino);
        log::debug!(
            "check ahead: {} hashed and stored in one read",
            view.path_of(ino)
        );
        let mut plain: Vec<u8> = Vec::new();
        let mut off = 0;
        while off < object.len() {
            let n = (HASH_STEP as u64).min(object.len() - off) as usize;
            let mut buf = match self.total < self.bound {
                true => handoff.take_buffer(|| check.urged()),
                false => None,
            };
            let bytes = match buf.as_mut() {
                Some(b) => &mut b[..n],
                None => {
                    plain.resize(n, 0);
                    &mut plain[..n]
                }
            };
            if let Err(e) = crate::source::raw_read(&**object, off, bytes) {
                // The feeder given up: the verdict hashes the file itself, and meets the
                // failure there.
                log::debug!("check ahead: {} not read at {off}: {e}", view.path_of(ino));
                if let Some(b) = buf {
                    handoff.give_back(b);
                }
                break;
            }
            feeder.feed(off, bytes);
            if let Some(b) = buf {
                self.total += n as u64;
                crate::metrics::Stats::add(&self.steps.stats.bytes_fetched_ahead, n as u64);
                handoff.hand_hashed(Hashed {
                    ino,
                    off,
                    len: n,
                    buf: b,
                    urged: check.urged(),
                });
            }
            off += n as u64;
        }
        // Whole, the digest is in; else the verdict hashes the file itself.
        drop(feeder);
        handoff.end_urge();
        if view.verify(ino).is_err() {
            handoff.drain();
            if let Err(e) = cache.invalidate(ino) {
                log::warn!("{}: its pages not dropped ({e})", view.path_of(ino));
            }
        }
        check.done();
        log::debug!("check ahead: {} checked", view.path_of(ino));
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An open that comes first hashes the file itself (check ahead skips it); one that
    /// comes while the file is hashed ahead urges that hash once, and later files go back
    /// to the background.
    #[test]
    fn check_ahead_leaves_a_file_opened_first_and_urges_one_under_way() {
        let c = CheckAhead::new();
        assert!(!c.before_verdict(3), "nothing under way: the open hashes");
        assert!(
            !c.claim(3, 0),
            "a file an open asked for first is left to it"
        );
        assert!(c.claim(4, 0));
        assert!(
            c.before_verdict(4),
            "an open of the file under way urges it"
        );
        assert!(c.state.lock().urged);
        assert!(c.before_verdict(4), "a second open finds it urged");
        c.done();
        assert!(c.claim(5, 0));
        assert!(
            !c.state.lock().urged,
            "the next file starts in the background"
        );
        assert!(!c.before_verdict(4), "a file done: its verdict is in");
    }

    /// An open of a remote shard check ahead has not begun, while it hashes no other shard,
    /// waits for check ahead to take that shard next (its hash urged) rather than hash it
    /// itself; while another shard is in hand, or once check ahead has ended, it does not
    /// wait.
    #[test]
    fn an_open_of_a_coming_shard_waits_for_check_ahead_to_take_it_next() {
        let pause = || std::thread::sleep(std::time::Duration::from_millis(100));
        let c = Arc::new(CheckAhead::new());
        c.state.lock().coming = [5, 6, 7].into_iter().collect();
        assert!(c.claim(1, 0), "a small file in hand");
        let c2 = c.clone();
        let open = std::thread::spawn(move || c2.before_verdict(7));
        let c3 = c.clone();
        let rank = std::thread::spawn(move || c3.before_verdict(7));
        pause();
        assert!(!open.is_finished(), "the open waits for check ahead");
        assert!(
            !rank.is_finished(),
            "so does a second open of the same shard"
        );
        c.done();
        let mut todo: std::collections::VecDeque<Ino> = [5, 6, 7].into();
        assert_eq!(c.next_shard(&mut todo), Some(7), "the wanted shard first");
        assert!(c.claim(7, 0));
        assert!(c.urged(), "its hash urged");
        c.taken(7);
        assert!(open.join().unwrap());
        assert!(rank.join().unwrap());
        assert!(
            !c.state.lock().opened.contains(&7),
            "neither hashes it itself"
        );
        c.done();
        c.shard_done();
        assert_eq!(c.next_shard(&mut todo), Some(5));
        assert!(
            !c.before_verdict(6),
            "another shard in hand: the open hashes it"
        );
        assert!(!c.claim(6, 0), "and check ahead leaves it");
        c.taken(5);
        c.shard_done();
        c.state.lock().coming.insert(8);
        assert!(c.claim(2, WAIT_BEHIND_MAX + 1));
        assert!(
            !c.before_verdict(8),
            "a large file in hand: the open hashes it"
        );
        c.done();
        c.state.lock().coming.insert(9);
        drop(CheckEnded(c.clone()));
        assert!(!c.before_verdict(9), "check ahead ended: no wait");
    }
}
