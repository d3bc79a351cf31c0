//! The open handles of every inode and the I/O mode the kernel holds it in, and the decoded
//! copies of files with none open (kept for a grace period, or decoded ahead). Generic over
//! the kernel's backing handle, so it runs without a kernel in tests.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex, MutexGuard};

use crate::ahead::Ahead;
use crate::fill::Fill;
use crate::memfs::MemoryFile;
use crate::view::Ino;

/// How one open is served.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OpenMode {
    Passthrough,
    Fuse,
}

/// A new backing for an inode: the kernel's handle, and the decoded memory behind it (none
/// for a file backed by itself).
pub struct Backing<B> {
    pub id: Arc<B>,
    pub memory: Option<Arc<MemoryFile>>,
}

/// Another open's share of the same backing (`B`, the kernel's handle, is not copied).
impl<B> Clone for Backing<B> {
    fn clone(&self) -> Self {
        Backing {
            id: self.id.clone(),
            memory: self.memory.clone(),
        }
    }
}

/// What an open got. A FUSE open of a file with a decoded copy (filling or complete) reads
/// from it.
pub enum Opened<B> {
    Passthrough { fh: u64, id: Arc<B> },
    Fuse { fh: u64, fill: Option<Arc<Fill>> },
}

impl<B> Opened<B> {
    pub fn fh(&self) -> u64 {
        match self {
            Opened::Passthrough { fh, .. } | Opened::Fuse { fh, .. } => *fh,
        }
    }
}

/// How an open of a file that is served from a decoded copy goes.
#[derive(Debug, Clone)]
pub struct OpenPolicy {
    /// How long an open waits for a copy still filling before it is served through FUSE
    /// from the part already decoded.
    pub wait: Duration,
    /// The most a copy may have left to decode for an open to wait for it.
    pub near: u64,
    /// How long an open waits for a copy more than half decoded (see
    /// [`OpenTable::open_copy`]), and the most it waits for one that has been filling a
    /// while.
    pub past_half: Duration,
    /// How far into a long wait the copy's pace is first judged, at least (and at least a
    /// quarter of the wait): a copy that cannot end within the wait at its pace in it is
    /// not waited for further ([`Fill::wait_complete_on_pace`]).
    pub probe: Duration,
}

impl OpenPolicy {
    /// How long an open may wait for a copy still filling that has been filling for
    /// `filling_for`: as long again, up to `past_half`. None for a copy too new to judge
    /// its pace (a fresh mount's first byte).
    fn catch_up(&self, filling_for: Duration) -> Option<Duration> {
        (filling_for >= 2 * self.probe).then(|| filling_for.min(self.past_half))
    }
}

pub(super) struct InodeOpens<B> {
    passthrough: u32,
    fuse: u32,
    backing: Option<Backing<B>>,
    /// The file's decoded copy, filling or complete. It outlives the last close by the
    /// table's grace period, so the next open of a normal load finds it.
    pub(super) fill: Option<Arc<Fill>>,
    /// When the last handle closed; `None` while open or never opened.
    idle_since: Option<Instant>,
    /// Decoded ahead and not opened yet: its place in the decode-ahead order.
    ahead: Option<usize>,
    /// Opened at least once: decoding ahead is for files not read yet.
    opened: bool,
}

impl<B> InodeOpens<B> {
    fn is_open(&self) -> bool {
        self.passthrough + self.fuse > 0
    }
}

/// An inode's handles, and a signal for opens waiting for its FUSE handles to close.
pub(super) struct InodeSlot<B> {
    pub(super) state: Mutex<InodeOpens<B>>,
    released: Condvar,
}

pub(super) type Inode<B> = Arc<InodeSlot<B>>;

/// How long an open that waited for a file's verdict then waits for a copy already decoded
/// whole to be sealed and handed out (a check of the verdict, a `fchmod` and a reopen:
/// milliseconds, more on a loaded machine). A bound, not a pace.
const SEAL_WAIT: Duration = Duration::from_secs(5);

/// How long an open of a file whose copy is complete waits for the inode's FUSE handles to
/// go: the kernel sends RELEASE after `close` returns, so a reopen right after a close
/// would otherwise find the inode still open through the page cache.
const RELEASE_WAIT: Duration = Duration::from_millis(20);

/// What an open waits for with the inode let go: the file's verdict, or a copy that should
/// end within the time given.
enum LongWait {
    Verdict,
    Copy(Duration),
}

struct Handle {
    ino: Ino,
    mode: OpenMode,
    fill: Option<Arc<Fill>>,
}

/// The open handles of every inode, and the decoded copies of files with none.
pub struct OpenTable<B> {
    inodes: Mutex<HashMap<Ino, Inode<B>>>,
    handles: Mutex<HashMap<u64, Handle>>,
    next_fh: AtomicU64,
    /// How long a decoded copy is kept after its last close.
    grace: Duration,
}

impl<B> OpenTable<B> {
    /// `grace`: how long a decoded copy is kept after the last close of its file.
    pub fn new(grace: Duration) -> OpenTable<B> {
        OpenTable {
            inodes: Mutex::new(HashMap::new()),
            handles: Mutex::new(HashMap::new()),
            next_fh: AtomicU64::new(1),
            grace,
        }
    }

    pub(super) fn inode(&self, ino: Ino) -> Inode<B> {
        self.inodes
            .lock()
            .entry(ino)
            .or_insert_with(|| {
                Arc::new(InodeSlot {
                    released: Condvar::new(),
                    state: Mutex::new(InodeOpens {
                        passthrough: 0,
                        fuse: 0,
                        backing: None,
                        fill: None,
                        idle_since: None,
                        ahead: None,
                        opened: false,
                    }),
                })
            })
            .clone()
    }

    fn handle(&self, ino: Ino, mode: OpenMode, fill: Option<Arc<Fill>>) -> u64 {
        let fh = self.next_fh.fetch_add(1, Ordering::Relaxed);
        self.handles.lock().insert(fh, Handle { ino, mode, fill });
        fh
    }

    fn fuse(&self, ino: Ino, state: &mut InodeOpens<B>) -> Opened<B> {
        state.fuse += 1;
        state.opened = true;
        let fill = state.fill.clone();
        Opened::Fuse {
            fh: self.handle(ino, OpenMode::Fuse, fill.clone()),
            fill,
        }
    }

    fn passthrough(&self, ino: Ino, state: &mut InodeOpens<B>, backing: Backing<B>) -> Opened<B> {
        let id = backing.id.clone();
        state.backing = Some(backing);
        state.passthrough += 1;
        state.opened = true;
        Opened::Passthrough {
            fh: self.handle(ino, OpenMode::Passthrough, None),
            id,
        }
    }

    /// Open `ino` through the page cache (passthrough is off, or the file is not one the
    /// kernel can be handed).
    pub fn open_fuse(&self, ino: Ino) -> u64 {
        let inode = self.inode(ino);
        let mut state = inode.state.lock();
        state.idle_since = None;
        self.fuse(ino, &mut state).fh()
    }

    /// Open a file the kernel reads from itself (a verbatim file, backed by the sealed
    /// file): passthrough through the inode's backing or a new one from `make`, unless the
    /// inode is open through the page cache or `make` gives none.
    pub fn open_direct(&self, ino: Ino, make: impl FnOnce() -> Option<Backing<B>>) -> Opened<B> {
        let inode = self.inode(ino);
        let mut state = inode.state.lock();
        state.idle_since = None;
        if state.fuse == 0 {
            if let Some(backing) = state.backing.clone() {
                return self.passthrough(ino, &mut state, backing);
            }
            if let Some(backing) = make() {
                return self.passthrough(ino, &mut state, backing);
            }
        }
        self.fuse(ino, &mut state)
    }

    /// Open a file served from a decoded copy. While the inode is open through the page
    /// cache, the open joins it there; while it is open in passthrough, it shares the
    /// backing. Otherwise the copy (kept, decoded ahead, or a new one from `start`) is
    /// waited for: for its file's verdict; up to `policy.wait` when at most `policy.near`
    /// is left; up to `policy.past_half` when more than half of it is decoded, and up to
    /// as long as it has been filling (at most `policy.past_half`) otherwise, these two
    /// given up once the copy's pace in the wait cannot end it in time. Complete, it backs
    /// a passthrough open (`make`); still filling, the open is served through FUSE from
    /// the part already decoded, so no open waits for a decode just begun (the first byte
    /// of a fresh mount) or one too slow to end soon. Without a copy (no memory for one)
    /// the open is served through FUSE, decoded per read. `start` and `make` run under the
    /// inode's lock, so concurrent first opens share one decode.
    pub fn open_copy(
        &self,
        ino: Ino,
        policy: &OpenPolicy,
        start: impl FnOnce() -> Option<Arc<Fill>>,
        make: impl FnOnce(&Arc<MemoryFile>) -> Option<Backing<B>>,
    ) -> Opened<B> {
        let inode = self.inode(ino);
        let mut state = inode.state.lock();
        state.idle_since = None;
        state.ahead = None;
        let complete = state.fill.as_ref().is_some_and(|f| f.complete().is_some());
        if state.fuse > 0 && complete {
            let deadline = Instant::now() + RELEASE_WAIT;
            while state.fuse > 0 && !inode.released.wait_until(&mut state, deadline).timed_out() {}
        }
        if state.fuse > 0 {
            return self.fuse(ino, &mut state);
        }
        if let Some(backing) = state.backing.clone() {
            return self.passthrough(ino, &mut state, backing);
        }
        if state.fill.is_none() {
            state.fill = start();
        }
        let Some(fill) = state.fill.clone() else {
            return self.fuse(ino, &mut state);
        };
        let long_wait = if fill.complete().is_some() {
            None
        } else if fill.awaits_verdict() {
            // No byte of the copy is served before the file's verdict, so a handle opened
            // through FUSE now would wait for it as long, then read the whole file through
            // the daemon; waiting here gets the copy to the kernel instead.
            Some(LongWait::Verdict)
        } else if fill.past_half() {
            // At the pace so far the rest takes less than what is done took (less still
            // once the open urges it), and a reader of the whole file through FUSE would
            // wait for those chunks anyway, then read them at the daemon's pace rather than
            // memory's. So even with a chunk or two left (`policy.near`): the chunk in
            // flight may be one the background policy held back for longer than
            // `policy.wait`.
            Some(LongWait::Copy(policy.past_half))
        } else if fill.left_bytes() > policy.near {
            // Decode ahead's copy of a file an engine reaches while it is still under way
            // (behind the engine's own work, at the background policy): urged, the rest
            // may take less than it has taken so far, which is what the open may wait.
            // An open of a copy just begun (a fresh mount's first byte) does not wait.
            policy.catch_up(fill.filling_for()).map(LongWait::Copy)
        } else {
            None
        };
        if let Some(long_wait) = long_wait {
            // The inode is not held meanwhile: what other opens and closes did is asked
            // again after.
            MutexGuard::unlocked(&mut state, || match long_wait {
                LongWait::Verdict => {
                    fill.wait_verdict();
                    if fill.left_bytes() == 0 {
                        fill.wait_complete(SEAL_WAIT);
                    }
                }
                LongWait::Copy(timeout) => {
                    // A pace over a quarter of the wait, not its first chunks alone.
                    fill.wait_complete_on_pace(timeout, policy.probe.max(timeout / 4));
                }
            });
            if state.fuse > 0 || !state.fill.as_ref().is_some_and(|f| Arc::ptr_eq(f, &fill)) {
                return self.fuse(ino, &mut state);
            }
            if let Some(backing) = state.backing.clone() {
                return self.passthrough(ino, &mut state, backing);
            }
        }
        let complete = fill.complete().or_else(|| {
            (fill.left_bytes() <= policy.near).then(|| fill.wait_complete(policy.wait))?
        });
        match complete.and_then(|m| make(&m)) {
            Some(backing) => self.passthrough(ino, &mut state, backing),
            None => {
                fill.urge();
                self.fuse(ino, &mut state)
            }
        }
    }

    /// Start decoding `ino` ahead of any open with `start`, unless it was opened or has a
    /// copy already. `rank` is its place in the decode-ahead order.
    pub fn decode_ahead(
        &self,
        ino: Ino,
        rank: usize,
        start: impl FnOnce() -> Option<Arc<Fill>>,
    ) -> Ahead {
        let inode = self.inode(ino);
        let mut state = inode.state.lock();
        if state.opened || state.fill.is_some() {
            return Ahead::Skipped;
        }
        match start() {
            Some(fill) => {
                state.fill = Some(fill.clone());
                state.ahead = Some(rank);
                Ahead::Started(fill)
            }
            None => Ahead::NoRoom,
        }
    }

    /// The decoded copy a FUSE handle reads from, if any.
    pub fn fill_of(&self, fh: u64) -> Option<Arc<Fill>> {
        self.handles.lock().get(&fh).and_then(|h| h.fill.clone())
    }

    /// The kernel released handle `fh`. After the last passthrough handle of an inode its
    /// backing is closed; after the last handle of any mode its decoded copy starts its
    /// grace period.
    pub fn release(&self, fh: u64) -> Option<(Ino, OpenMode)> {
        let Handle { ino, mode, .. } = self.handles.lock().remove(&fh)?;
        let inode = self.inode(ino);
        let mut state = inode.state.lock();
        match mode {
            OpenMode::Fuse => state.fuse = state.fuse.saturating_sub(1),
            OpenMode::Passthrough => {
                state.passthrough = state.passthrough.saturating_sub(1);
                if state.passthrough == 0 {
                    state.backing = None;
                }
            }
        }
        if !state.is_open() {
            state.idle_since = Some(Instant::now());
        }
        inode.released.notify_all();
        Some((ino, mode))
    }

    /// Let go of the decoded copies whose grace period ended by `now`; bytes let go.
    pub fn expire(&self, now: Instant) -> u64 {
        let ended = |s: &InodeOpens<B>| {
            s.idle_since
                .filter(|&t| now.saturating_duration_since(t) >= self.grace)
                .map(|_| (0, 0))
        };
        self.let_go(ended, u64::MAX)
    }

    /// Let go of copies no handle uses, until `need` bytes are let go: those closed
    /// longest ago first, then those decoded ahead and not opened yet, the last in the
    /// decode-ahead order first. Inodes busy in another open are skipped. Bytes let go.
    pub fn make_room(&self, need: u64) -> u64 {
        let order = |s: &InodeOpens<B>| match (s.idle_since, s.ahead) {
            (Some(t), _) => Some((0, u64::MAX - t.elapsed().as_millis() as u64)),
            (None, Some(rank)) => Some((1, u64::MAX - rank as u64)),
            (None, None) => None,
        };
        self.let_go(order, need)
    }

    /// Drop the copies of idle inodes that `pick` gives an order key, lowest key first,
    /// until `need` bytes are let go.
    fn let_go(&self, pick: impl Fn(&InodeOpens<B>) -> Option<(u8, u64)>, need: u64) -> u64 {
        let inodes: Vec<_> = self.inodes.lock().values().cloned().collect();
        let mut candidates: Vec<((u8, u64), Inode<B>)> = inodes
            .into_iter()
            .filter_map(|i| {
                let key = {
                    let s = i.state.try_lock()?;
                    if s.is_open() || s.fill.is_none() {
                        return None;
                    }
                    pick(&s)?
                };
                Some((key, i))
            })
            .collect();
        candidates.sort_by_key(|(k, _)| *k);
        let mut freed = 0;
        for (_, i) in candidates {
            if freed >= need {
                break;
            }
            let Some(mut s) = i.state.try_lock() else {
                continue;
            };
            if s.is_open() {
                continue;
            }
            if let Some(f) = s.fill.take() {
                freed += f.len();
                s.idle_since = None;
                s.ahead = None;
            }
        }
        freed
    }

    /// Handles open now, by mode.
    pub fn open_handles(&self) -> (u64, u64) {
        let handles = self.handles.lock();
        let pt = handles
            .values()
            .filter(|h| h.mode == OpenMode::Passthrough)
            .count() as u64;
        (pt, handles.len() as u64 - pt)
    }

    /// Bytes of decoded copies no handle uses (kept after a close, or decoded ahead).
    pub fn kept_bytes(&self) -> u64 {
        let inodes: Vec<_> = self.inodes.lock().values().cloned().collect();
        inodes
            .iter()
            .filter_map(|i| {
                let s = i.state.lock();
                (!s.is_open()).then(|| s.fill.as_ref().map_or(0, |f| f.len()))
            })
            .sum()
    }
}
