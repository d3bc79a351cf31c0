//! Fetch ahead: through FUSE, the shards' sealed bytes brought in right after mounting and
//! decoded into the kernel's page cache (the walk over the shards here, the decode and the
//! store in `store`).

use std::collections::HashSet;
use std::sync::Arc;

use parking_lot::Mutex;

use crate::background::run_in_background;
use crate::source::Object;
use crate::view::{Ino, View};

use super::spawn;
use super::store::{PageCache, Steps, Storing};

/// Fetch ahead: where shards are served through FUSE, their sealed bytes are what an open
/// would wait for (under a manifest, once hashed). Right after mounting (under a manifest,
/// each shard right after its check), on a thread in the background (`SCHED_IDLE`), the
/// shards are brought in from their starts in the order engines read them, one after
/// another, until a quarter of the memory limit is in or the source takes on no more. A
/// remote source keeps them as parts read ahead, within half of `--source-memory`, until
/// read; a local one reads them into the page cache a piece at a time on a quiet disk, as
/// decode ahead does. Steps of one part, then two, then four, so a reader that opens at
/// once finds the first part come in alone, as fast as it can.
///
/// Given the kernel's page cache of the mount ([`PageCache`]), each step is then decoded
/// and stored there on a second background thread, beside the next step's fetch (and the
/// next shard's hash), so the engine's reads find the view's pages in the kernel and reach
/// the daemon no more: through FUSE, the decode ahead of passthrough mode. A shard opened
/// is then left to its reads, and fetch ahead goes on with the next: an engine reads one
/// shard while the next is decoded. Where nothing is stored, the first open of a shard ends
/// fetch ahead: the parts it would keep are the memory a reader's window fills.
pub struct FetchAhead {
    /// The shards opened so far.
    opened: Mutex<HashSet<Ino>>,
}

/// The widest step of fetch ahead, in bytes asked for at once (each step waits for its
/// parts: four 8 MiB parts at once keep loopback and a LAN busy).
const FETCH_STEP_MAX: u64 = 32 << 20;
/// Its first step: one default part.
const FETCH_STEP_FIRST: u64 = 8 << 20;

impl FetchAhead {
    pub fn new() -> Arc<FetchAhead> {
        Arc::new(FetchAhead {
            opened: Mutex::new(HashSet::new()),
        })
    }

    /// Start fetching ahead `shards` ([`super::order`]) on a thread of its own; whether it started
    /// (not if there is no shard).
    pub fn start(self: &Arc<Self>, view: Arc<View>, shards: Vec<Ino>, plan: FetchPlan) -> bool {
        if shards.is_empty() {
            return false;
        }
        let run = move || {
            let mut walk = plan.walk(&view);
            for ino in shards {
                if !walk.shard(&view, ino) {
                    break;
                }
            }
        };
        let fetched_on_read = "shards are fetched on their first read";
        spawn("kllm-fetch-ahead", run, "fetch ahead", fetched_on_read)
    }

    /// Shard `ino` was opened: its reads fetch (and decode) it from now on.
    pub fn opened(&self, ino: Ino) {
        self.opened.lock().insert(ino);
    }

    pub(super) fn is_opened(&self, ino: Ino) -> bool {
        self.opened.lock().contains(&ino)
    }

    fn any_opened(&self) -> bool {
        !self.opened.lock().is_empty()
    }
}

/// What fetch ahead is to do: where its bytes go and how many it may bring in.
pub struct FetchPlan {
    pub ahead: Arc<FetchAhead>,
    /// The most bytes brought in, all shards together.
    pub bound: u64,
    /// The kernel's page cache of the mount, if steps are decoded into it.
    pub page_cache: Option<Arc<dyn PageCache>>,
}

impl FetchPlan {
    /// Begin the walk over the shards on the calling thread, which goes to the background;
    /// the store thread, if any, starts here.
    pub(super) fn walk(self, view: &Arc<View>) -> ShardWalk<Storing> {
        // Nobody waits for it: the engine's own start keeps the CPU.
        // SAFETY: gettid has no preconditions.
        run_in_background(unsafe { libc::gettid() }, true);
        let ahead = self.ahead.clone();
        let sink = Storing::start(view, self.page_cache, move |ino| ahead.is_opened(ino));
        ShardWalk::new(self.ahead, self.bound, sink)
    }
}

/// Fetch ahead's walk over the shards, one after another: the ramp of its steps and the
/// bytes brought in so far carry from one shard to the next.
pub(super) struct ShardWalk<S> {
    ahead: Arc<FetchAhead>,
    /// The most bytes brought in, all shards together.
    pub(super) bound: u64,
    step: u64,
    /// The bytes brought in so far.
    pub(super) total: u64,
    pub(super) steps: S,
}

impl<S: Steps> ShardWalk<S> {
    fn new(ahead: Arc<FetchAhead>, bound: u64, steps: S) -> ShardWalk<S> {
        ShardWalk {
            ahead,
            bound,
            step: FETCH_STEP_FIRST,
            total: 0,
            steps,
        }
    }

    /// Fetch shard `ino` ahead; whether to go on with the next.
    pub(super) fn shard(&mut self, view: &View, ino: Ino) -> bool {
        match view.sealed_object(ino) {
            Ok(Some(object)) => {
                log::debug!("fetch ahead: {} begins", view.path_of(ino));
                self.object(ino, &**object)
            }
            _ => true,
        }
    }

    /// Fetch `object`, shard `ino`, from its start in growing steps, until the bound is
    /// reached, the source takes on less than asked (its memory for reading ahead is full,
    /// even once the steps handed on were stored), or the shard is opened (where steps
    /// are stored; any shard, where not); whether to go on with the next.
    fn object(&mut self, ino: Ino, object: &dyn Object) -> bool {
        let held = object.holds_fetched_ahead();
        let mut off = 0;
        while off < object.len() {
            if self.total >= self.bound {
                return false;
            }
            if self.steps.stores() {
                if self.ahead.is_opened(ino) {
                    return true;
                }
            } else if self.ahead.any_opened() {
                return false;
            }
            let want = self
                .step
                .min(object.len() - off)
                .min(self.bound - self.total);
            let mut had = object.fetch_ahead(off, want);
            if had < want && self.steps.drain() {
                had += object.fetch_ahead(off + had, want - had);
            }
            self.total += had;
            if had > 0 {
                self.steps.fetched(ino, off, had, held);
            }
            if had < want {
                log::debug!("fetch ahead: {} bytes of sealed shards in", self.total);
                return false;
            }
            off += want;
            self.step = (2 * self.step).min(FETCH_STEP_MAX);
        }
        true
    }
}

impl<S> Drop for ShardWalk<S> {
    fn drop(&mut self) {
        log::debug!("fetch ahead: done, {} bytes brought in", self.total);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An object that takes on what it is asked for while its budget lasts, noting each ask;
    /// after `opens_after` asks in all, shard `ino` is opened.
    struct Budgeted {
        ino: Ino,
        len: u64,
        budget: Arc<Mutex<u64>>,
        asked: Arc<Mutex<Vec<(u64, u64, u64)>>>,
        opens_after: Option<(usize, Arc<FetchAhead>)>,
    }

    impl Object for Budgeted {
        fn len(&self) -> u64 {
            self.len
        }
        fn read_exact_at(&self, _: &mut [u8], _: u64) -> Result<(), crate::ReadError> {
            unreachable!("fetch ahead reads nothing")
        }
        fn fetch_ahead(&self, off: u64, len: u64) -> u64 {
            let mut asked = self.asked.lock();
            asked.push((self.len, off, len));
            if let Some((n, ahead)) = &self.opens_after {
                if asked.len() == *n {
                    ahead.opened(self.ino);
                }
            }
            let mut budget = self.budget.lock();
            let had = len.min(*budget);
            *budget -= had;
            had
        }
        fn check_unchanged(&self) -> Result<(), crate::ReadError> {
            Ok(())
        }
        fn local_file(&self) -> Result<Option<&std::fs::File>, crate::ReadError> {
            Ok(None)
        }
        fn holds_fetched_ahead(&self) -> bool {
            true
        }
    }

    /// Steps taken as a store thread would: with `stores`, a drain gives the source's
    /// memory back (the store read the parts handed to it).
    struct Recorded {
        stores: bool,
        budget: Arc<Mutex<u64>>,
        pending: u64,
    }

    impl Steps for Recorded {
        fn stores(&self) -> bool {
            self.stores
        }
        fn fetched(&mut self, _: Ino, _: u64, len: u64, held: bool) {
            assert!(held, "a remote source's parts are held in memory");
            self.pending += len;
        }
        fn drain(&mut self) -> bool {
            if !self.stores || self.pending == 0 {
                return false;
            }
            let mut budget = self.budget.lock();
            *budget = budget.saturating_add(self.pending);
            self.pending = 0;
            true
        }
    }

    /// Steps of 8, 16, then 32 MiB from each object's start, one object after another, the
    /// ramp carried on; fetching ends at the bound, where the memory runs out (where steps
    /// are stored, only once what was handed on is stored and the step asked again), and at
    /// the first open of a shard where nothing is stored; where steps are stored, an opened
    /// shard is left and the next one fetched.
    #[test]
    fn fetch_ahead_ramps_up_in_order_and_stops_when_full_or_opened() {
        const M: u64 = 1 << 20;
        let run = |budget: u64, bound: u64, opens_after: Option<usize>, stores: bool| {
            let budget = Arc::new(Mutex::new(budget));
            let asked = Arc::new(Mutex::new(Vec::new()));
            let ahead = FetchAhead::new();
            let objects: Vec<Budgeted> = [100 * M, 20 * M]
                .into_iter()
                .enumerate()
                .map(|(i, len)| Budgeted {
                    ino: i as Ino,
                    len,
                    budget: budget.clone(),
                    asked: asked.clone(),
                    opens_after: opens_after.map(|n| (n, ahead.clone())),
                })
                .collect();
            let steps = Recorded {
                stores,
                budget: budget.clone(),
                pending: 0,
            };
            let mut walk = ShardWalk::new(ahead, bound, steps);
            for o in &objects {
                if !walk.object(o.ino, o) {
                    break;
                }
            }
            let asked = asked.lock().clone();
            (walk.total, asked)
        };
        for stores in [false, true] {
            let (total, asked) = run(u64::MAX, u64::MAX, None, stores);
            assert_eq!(total, 120 * M);
            assert_eq!(
                asked,
                [
                    (100 * M, 0, 8 * M),
                    (100 * M, 8 * M, 16 * M),
                    (100 * M, 24 * M, 32 * M),
                    (100 * M, 56 * M, 32 * M),
                    (100 * M, 88 * M, 12 * M),
                    (20 * M, 0, 20 * M),
                ]
            );
            let (total, asked) = run(u64::MAX, 30 * M, None, stores);
            assert_eq!(
                (total, asked.last().copied()),
                (30 * M, Some((100 * M, 24 * M, 6 * M))),
                "ends at the bound, the last step cut to it"
            );
        }
        let (total, asked) = run(30 * M, u64::MAX, None, false);
        assert_eq!(
            (total, asked.len()),
            (30 * M, 3),
            "nothing stored: ends at the first short step"
        );
        let (total, asked) = run(40 * M, u64::MAX, None, true);
        assert_eq!(total, 120 * M, "stored: room again once the store drained");
        assert!(
            asked.contains(&(100 * M, 40 * M, 16 * M)),
            "the short step asked again: {asked:?}"
        );
        let (total, asked) = run(u64::MAX, u64::MAX, Some(2), false);
        assert_eq!(
            (total, asked.len()),
            (24 * M, 2),
            "nothing stored: ends once a shard is opened"
        );
        let (total, asked) = run(u64::MAX, u64::MAX, Some(2), true);
        assert_eq!(
            (total, asked.last().copied()),
            (44 * M, Some((20 * M, 0, 20 * M))),
            "stored: the opened shard left, the next fetched with the ramp carried on"
        );
    }
}
