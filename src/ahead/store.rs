//! The store thread of fetch ahead: the steps fetched ahead (or hashed by check ahead, in
//! their buffers) handed to it, decoded a piece at a time and stored in the kernel's page
//! cache of the mount (`FUSE_NOTIFY_STORE`), so the engine's reads find them there.

use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;

use crate::background::run_in_background;
use crate::view::{Ino, View};

use super::spawn;

/// Bytes decoded at once to store: small enough to decode on the store thread alone (a
/// larger read is spread over the decode pool, which does not run in the background), and
/// at least a readahead request (so it passes the block cache by).
const STORE_DECODE: usize = 128 << 10;
/// Bytes stored in the kernel at once.
const STORE_PIECE: usize = 1 << 20;
/// The most sealed bytes held in the daemon's memory (a remote source's parts) that were
/// handed to the store thread and not stored yet: the fetch waits beyond it.
const HANDED_HELD_MAX: u64 = 64 << 20;
/// Sealed bytes of a remote shard under a manifest read and hashed at once by check ahead,
/// then handed to the store thread in the same buffer (as `source::sha256` reads).
pub(super) const HASH_STEP: usize = 8 << 20;
/// Buffers of `HASH_STEP` in the handoff: one read and hashed while the other is unlocked
/// and stored.
const HASH_BUFFERS: usize = 2;
/// How often a check that waits for a free buffer looks whether an open now waits for it.
const BUFFER_POLL: Duration = Duration::from_millis(20);
/// The longest a hash an open waits for waits for a free buffer; then the step is hashed
/// only (a store thread that cannot go on must not hold a verdict back).
const URGED_BUFFER_WAIT: Duration = Duration::from_millis(250);

/// The kernel's page cache of the mount's files, which the FUSE adapter fills
/// (`FUSE_NOTIFY_STORE`): what fetch ahead decodes goes there.
pub trait PageCache: Send + Sync {
    /// Have the kernel know file `path` of the view (a lookup through the mount): it keeps
    /// pages only for files it knows.
    fn look_up(&self, path: &str) -> std::io::Result<()>;
    /// Put `bytes`, the view's bytes of file `ino` at `off`, into its page cache.
    fn store(&self, ino: Ino, off: u64, bytes: &[u8]) -> std::io::Result<()>;
    /// Drop every page of file `ino` from its page cache.
    fn invalidate(&self, ino: Ino) -> std::io::Result<()>;
}

/// Where fetch ahead's steps go.
pub(super) trait Steps {
    /// Whether they are stored in the kernel (opened shards are then skipped, not the end).
    fn stores(&self) -> bool;
    /// Bytes `[off, off + len)` of shard `ino` are in; `held`: in the daemon's memory.
    fn fetched(&mut self, ino: Ino, off: u64, len: u64, held: bool);
    /// Wait until every step handed on was stored; whether any was waiting.
    fn drain(&mut self) -> bool;
}

/// Fetch ahead's steps counted, and handed to the store thread when there is one.
pub(super) struct Storing {
    pub(super) stats: Arc<crate::metrics::Stats>,
    pub(super) handoff: Option<Arc<Handoff>>,
    /// The page cache the store thread stores into.
    pub(super) cache: Option<Arc<dyn PageCache>>,
}

impl Storing {
    pub(super) fn start(
        view: &Arc<View>,
        page_cache: Option<Arc<dyn PageCache>>,
        opened: impl Fn(Ino) -> bool + Send + 'static,
    ) -> Storing {
        let stats = view.stats().clone();
        let Some(cache) = page_cache else {
            return Storing {
                stats,
                handoff: None,
                cache: None,
            };
        };
        let handoff = Arc::new(Handoff::default());
        let (h, view, kept) = (handoff.clone(), view.clone(), cache.clone());
        let run = move || {
            // However this thread ends (a bug's panic included), the fetch thread must not
            // wait for it.
            let _ended = EndOnDrop(h.clone());
            // SAFETY: gettid has no preconditions.
            run_in_background(unsafe { libc::gettid() }, true);
            let Some(mut store) = StoreAhead::new(&view, cache) else {
                return;
            };
            while let Some(work) = h.next() {
                let went_on = match work {
                    Work::Fetched(ino, off, len) => {
                        let went_on = store.decode_and_store(ino, off, len, &opened);
                        h.stored();
                        went_on
                    }
                    Work::Hashed(mut hashed) => {
                        hashed.urged |= h.urged.load(std::sync::atomic::Ordering::Relaxed);
                        let went_on = store.unlock_and_store(&mut hashed);
                        h.give_back(hashed.buf);
                        went_on
                    }
                };
                if !went_on {
                    return;
                }
            }
        };
        let started = spawn(
            "kllm-store-ahead",
            run,
            "decode ahead through FUSE",
            "shards are decoded on their reads",
        );
        Storing {
            stats,
            handoff: started.then_some(handoff),
            cache: Some(kept),
        }
    }
}

impl Steps for Storing {
    fn stores(&self) -> bool {
        self.handoff.as_ref().is_some_and(|h| !h.ended())
    }

    fn fetched(&mut self, ino: Ino, off: u64, len: u64, held: bool) {
        crate::metrics::Stats::add(&self.stats.bytes_fetched_ahead, len);
        if let Some(h) = &self.handoff {
            h.hand(ino, off, len, held);
        }
    }

    fn drain(&mut self) -> bool {
        self.handoff.as_ref().is_some_and(|h| h.drain())
    }
}

impl Drop for Storing {
    fn drop(&mut self) {
        if let Some(h) = &self.handoff {
            h.close();
        }
    }
}

/// Ends the handoff when the store thread ends.
struct EndOnDrop(Arc<Handoff>);

impl Drop for EndOnDrop {
    fn drop(&mut self) {
        self.0.end();
    }
}

/// The steps fetched and not stored yet, from the fetch thread to the store thread.
#[derive(Default)]
pub(super) struct Handoff {
    state: Mutex<Handed>,
    changed: parking_lot::Condvar,
    /// An open waits for the verdict of the shard check ahead hands over now.
    urged: std::sync::atomic::AtomicBool,
}

#[derive(Default)]
struct Handed {
    /// Each step: bytes `[off, off + len)` of shard `ino`, and whether they are held in the
    /// daemon's memory. The front one stays until stored.
    steps: std::collections::VecDeque<(Ino, u64, u64, bool)>,
    /// Sealed bytes check ahead read and hashed, to unlock and store.
    hashed: std::collections::VecDeque<Hashed>,
    /// Buffers for `hashed` not in use, and how many are (taken, handed or being stored).
    free: Vec<crate::secmem::SecureBuf>,
    out: usize,
    /// No more steps will come.
    closed: bool,
    /// The store thread is gone (the kernel refused a store).
    ended: bool,
}

/// Bytes `[off, off + len)` of shard `ino`, sealed, in `buf` (locked memory: the store
/// thread unlocks them in place).
pub(super) struct Hashed {
    pub(super) ino: Ino,
    pub(super) off: u64,
    pub(super) len: usize,
    pub(super) buf: crate::secmem::SecureBuf,
    /// An open waits for the file's verdict: unlocked and stored at the normal policy, so
    /// the reads that follow find the pages (in the background they would mostly not).
    pub(super) urged: bool,
}

/// What the store thread takes next.
enum Work {
    /// Bytes `[off, off + len)` of shard `ino` fetched ahead: decoded from the source.
    Fetched(Ino, u64, u64),
    /// Sealed bytes read by check ahead.
    Hashed(Hashed),
}

impl Handed {
    /// Bytes handed on, not stored yet, and held in memory.
    fn held(&self) -> u64 {
        self.steps.iter().filter(|s| s.3).map(|s| s.2).sum()
    }
}

impl Handoff {
    /// Queue a step; a step held in memory first waits while [`HANDED_HELD_MAX`] held bytes
    /// are not stored.
    fn hand(&self, ino: Ino, off: u64, len: u64, held: bool) {
        let mut s = self.state.lock();
        while held && s.held() >= HANDED_HELD_MAX && !s.ended {
            self.changed.wait(&mut s);
        }
        if s.ended {
            return;
        }
        s.steps.push_back((ino, off, len, held));
        self.changed.notify_all();
    }

    /// The next work to store, once there is some; `None` once closed and empty.
    fn next(&self) -> Option<Work> {
        let mut s = self.state.lock();
        loop {
            if let Some(hashed) = s.hashed.pop_front() {
                return Some(Work::Hashed(hashed));
            }
            if let Some(&(ino, off, len, _)) = s.steps.front() {
                return Some(Work::Fetched(ino, off, len));
            }
            if s.closed {
                return None;
            }
            self.changed.wait(&mut s);
        }
    }

    /// The shard whose hash set the urge (only `take_buffer` sets it) is over: the store
    /// thread runs in the background again; its pieces still queued keep their own urge.
    pub(super) fn end_urge(&self) {
        self.urged
            .store(false, std::sync::atomic::Ordering::Relaxed);
    }

    /// A buffer for check ahead to read a step into, once one is free (none once the store
    /// thread is gone). While `urged()` says an open waits for the verdict, the store thread
    /// runs urged too: the hash waits for it, and the reads that follow find the pages.
    pub(super) fn take_buffer(&self, urged: impl Fn() -> bool) -> Option<crate::secmem::SecureBuf> {
        let mut s = self.state.lock();
        let mut waited_urged = Duration::ZERO;
        loop {
            if urged() {
                self.urged.store(true, std::sync::atomic::Ordering::Relaxed);
                if waited_urged >= URGED_BUFFER_WAIT {
                    return None;
                }
            }
            if s.ended {
                return None;
            }
            if let Some(b) = s.free.pop() {
                s.out += 1;
                return Some(b);
            }
            if s.out < HASH_BUFFERS {
                // Made outside the lock: the store thread must not wait for an mmap.
                drop(s);
                let made = crate::secmem::SecureBuf::new(HASH_STEP);
                s = self.state.lock();
                match made {
                    Ok(b) => s.free.push(b),
                    Err(e) => {
                        log::debug!("check ahead stores nothing (no memory: {e})");
                        return None;
                    }
                }
                continue;
            }
            let since = std::time::Instant::now();
            self.changed.wait_for(&mut s, BUFFER_POLL);
            if urged() {
                waited_urged += since.elapsed();
            }
        }
    }

    /// Hand sealed bytes read and hashed to the store thread (dropped if it is gone).
    pub(super) fn hand_hashed(&self, hashed: Hashed) {
        let mut s = self.state.lock();
        if s.ended {
            s.out = s.out.saturating_sub(1);
            return;
        }
        s.hashed.push_back(hashed);
        self.changed.notify_all();
    }

    /// A buffer from [`Handoff::take_buffer`] is free again.
    pub(super) fn give_back(&self, buf: crate::secmem::SecureBuf) {
        let mut s = self.state.lock();
        s.out = s.out.saturating_sub(1);
        if !s.ended {
            s.free.push(buf);
        }
        self.changed.notify_all();
    }

    /// The step [`Handoff::next`] gave was stored (or left).
    fn stored(&self) {
        self.state.lock().steps.pop_front();
        self.changed.notify_all();
    }

    /// Wait until nothing handed on is left to store; whether anything was.
    pub(super) fn drain(&self) -> bool {
        let mut s = self.state.lock();
        let busy = |s: &Handed| !s.steps.is_empty() || !s.hashed.is_empty() || s.out > 0;
        let waited = busy(&s);
        while busy(&s) && !s.ended {
            self.changed.wait(&mut s);
        }
        waited
    }

    fn close(&self) {
        self.state.lock().closed = true;
        self.changed.notify_all();
    }

    fn end(&self) {
        let mut s = self.state.lock();
        s.ended = true;
        s.steps.clear();
        s.hashed.clear();
        s.free.clear();
        // Buffers still taken are dropped by the check that took them.
        s.out = 0;
        self.changed.notify_all();
    }

    pub(super) fn ended(&self) -> bool {
        self.state.lock().ended
    }
}

/// Decodes what fetch ahead brought in and stores it in the kernel's page cache.
struct StoreAhead<'a> {
    view: &'a View,
    cache: Arc<dyn PageCache>,
    /// The file the kernel was last asked to look up.
    known: Option<Ino>,
    /// A file whose bytes could not be had (its reads fail the same way): left to them.
    failed: Option<Ino>,
    /// The decoded bytes, in locked memory like every other decoded byte of the daemon's.
    buf: crate::secmem::SecureBuf,
    /// Whether this thread runs at the normal policy now (for an open that waits).
    urged: bool,
}

impl<'a> StoreAhead<'a> {
    fn new(view: &'a View, cache: Arc<dyn PageCache>) -> Option<StoreAhead<'a>> {
        match crate::secmem::SecureBuf::new(STORE_PIECE) {
            Ok(buf) => Some(StoreAhead {
                view,
                cache,
                known: None,
                failed: None,
                buf,
                urged: false,
            }),
            Err(e) => {
                log::warn!("fetch ahead decodes nothing ahead (no memory: {e})");
                None
            }
        }
    }

    /// Decode bytes `[off, off + len)` of file `ino` and store them, until the file is
    /// opened; whether to go on (false once the kernel failed, logged). A file that fails
    /// to decode (a bad value, a failed check) is skipped.
    fn decode_and_store(
        &mut self,
        ino: Ino,
        off: u64,
        len: u64,
        opened: &dyn Fn(Ino) -> bool,
    ) -> bool {
        if self.urged {
            // Fetched ahead, nobody waits for it.
            self.urged = false;
            // SAFETY: gettid has no preconditions.
            run_in_background(unsafe { libc::gettid() }, true);
        }
        let path = || self.view.path_of(ino);
        if self.failed == Some(ino) {
            return true;
        }
        if !self.know(ino) {
            return false;
        }
        let end = off + len;
        let mut at = off;
        while at < end && !opened(ino) {
            let n = (end - at).min(STORE_PIECE as u64) as usize;
            let piece = &mut self.buf[..n];
            for (i, part) in piece.chunks_mut(STORE_DECODE).enumerate() {
                if let Err(e) = self
                    .view
                    .read_into(ino, at + (i * STORE_DECODE) as u64, part)
                {
                    log::debug!("fetch ahead: {} not decoded at {at}: {e}", path());
                    self.failed = Some(ino);
                    return true;
                }
            }
            if !store_piece(&*self.cache, self.view, ino, at, piece) {
                return false;
            }
            at += n as u64;
        }
        if at >= end {
            log::debug!("store ahead: {} stored to {end}", path());
        }
        true
    }

    /// Have the kernel know file `ino` before its pages are stored; false (logged) if it
    /// cannot.
    fn know(&mut self, ino: Ino) -> bool {
        if self.known != Some(ino) {
            if let Err(e) = self.cache.look_up(&self.view.path_of(ino)) {
                log::debug!(
                    "fetch ahead: {} not looked up ({e}); nothing decoded ahead",
                    self.view.path_of(ino)
                );
                return false;
            }
            self.known = Some(ino);
        }
        true
    }

    /// Unlock the sealed bytes check ahead read and hashed, in place, on the background
    /// pool (every core, taking only the cycles no one else wants), and store them; whether
    /// to go on (false once the kernel failed, logged). Stored whatever the verdict will be:
    /// no open of the file is answered before it, and a failed one drops them.
    fn unlock_and_store(&mut self, hashed: &mut Hashed) -> bool {
        let Hashed { ino, off, len, .. } = *hashed;
        if self.failed == Some(ino) {
            return true;
        }
        if !self.know(ino) {
            return false;
        }
        if hashed.urged != self.urged {
            self.urged = hashed.urged;
            // SAFETY: gettid has no preconditions.
            run_in_background(unsafe { libc::gettid() }, !self.urged);
        }
        let bytes = &mut hashed.buf[..len];
        let mut unlock = || self.view.unlock_in_place(ino, off, bytes);
        let unlocked = match crate::fill::ahead_pool().filter(|_| !hashed.urged) {
            Some(pool) => pool.install(unlock),
            None => unlock(),
        };
        if let Err(e) = unlocked {
            log::debug!(
                "check ahead: {} not decoded at {off}: {e}",
                self.view.path_of(ino)
            );
            self.failed = Some(ino);
            return true;
        }
        for (i, piece) in hashed.buf[..len].chunks(STORE_PIECE).enumerate() {
            if !store_piece(
                &*self.cache,
                self.view,
                ino,
                off + (i * STORE_PIECE) as u64,
                piece,
            ) {
                return false;
            }
        }
        true
    }
}

/// Store `piece`, the view's bytes of file `ino` at `at`, in the kernel's page cache and
/// count it; false (logged) if the kernel refused it.
fn store_piece(cache: &dyn PageCache, view: &View, ino: Ino, at: u64, piece: &[u8]) -> bool {
    if let Err(e) = cache.store(ino, at, piece) {
        log::debug!("store ahead: {} not stored at {at}: {e}", view.path_of(ino));
        return false;
    }
    crate::metrics::Stats::add(&view.stats().bytes_stored_ahead, piece.len() as u64);
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Steps held in memory wait while 64 MiB handed over are not stored (page-cache steps
    /// do not); once the store thread is gone, however it ended, nothing waits for it.
    #[test]
    fn the_handoff_bounds_held_bytes_and_frees_the_fetch_when_the_store_ends() {
        const M: u64 = 1 << 20;
        let pause = || std::thread::sleep(Duration::from_millis(50));
        let h = Arc::new(Handoff::default());
        h.hand(1, 0, 64 * M, true);
        h.hand(2, 0, 100 * M, false);
        let h2 = h.clone();
        let waiter = std::thread::spawn(move || h2.hand(1, 64 * M, 8 * M, true));
        pause();
        assert!(!waiter.is_finished(), "64 MiB held and not stored: waits");
        assert_eq!(fetched(h.next()), Some((1, 0, 64 * M)));
        h.stored();
        waiter.join().unwrap();
        assert_eq!(
            fetched(h.next()),
            Some((2, 0, 100 * M)),
            "in the order handed"
        );

        let h3 = h.clone();
        let drainer = std::thread::spawn(move || h3.drain());
        pause();
        assert!(!drainer.is_finished(), "a drain waits for the store");
        drop(EndOnDrop(h.clone()));
        assert!(drainer.join().unwrap(), "steps were waiting");
        assert!(h.ended());
        h.hand(3, 0, 200 * M, true);
        assert!(!h.drain(), "nothing is handed to a store that is gone");
    }

    /// The step a store thread was given, if fetched ahead.
    fn fetched(work: Option<Work>) -> Option<(Ino, u64, u64)> {
        match work? {
            Work::Fetched(ino, off, len) => Some((ino, off, len)),
            Work::Hashed(h) => panic!("hashed bytes of {} at {}", h.ino, h.off),
        }
    }

    /// Check ahead reads a checked shard into at most two buffers: a third waits for one
    /// to come back from the store thread (urged, if an open waits for the verdict);
    /// hashed bytes go to the store thread before steps fetched ahead, a drain waits for
    /// them, and once the store thread is gone nothing is taken or kept.
    #[test]
    fn check_ahead_hands_hashed_bytes_in_two_buffers() {
        use std::sync::atomic::Ordering::Relaxed;
        let pause = || std::thread::sleep(Duration::from_millis(100));
        let h = Arc::new(Handoff::default());
        let one = h.take_buffer(|| false).expect("a first buffer");
        let two = h.take_buffer(|| false).expect("a second buffer");
        assert!(!h.urged.load(Relaxed));
        assert!(
            h.take_buffer(|| true).is_none(),
            "an open waits: none comes back in time, the step goes without"
        );
        assert!(
            h.urged.load(Relaxed),
            "an open waits: the store thread is urged"
        );
        let h2 = h.clone();
        let waiter = std::thread::spawn(move || h2.take_buffer(|| false).is_some());
        pause();
        assert!(!waiter.is_finished(), "waits for a buffer");
        h.hand(7, 0, 8, false);
        h.hand_hashed(Hashed {
            ino: 3,
            off: 0,
            len: 5,
            buf: one,
            urged: false,
        });
        let Some(Work::Hashed(first)) = h.next() else {
            panic!("hashed bytes first");
        };
        assert_eq!((first.ino, first.off, first.len), (3, 0, 5));
        let h3 = h.clone();
        let drainer = std::thread::spawn(move || h3.drain());
        h.give_back(first.buf);
        assert!(waiter.join().unwrap(), "the buffer given back is taken");
        pause();
        assert!(
            !drainer.is_finished(),
            "buffers out and a step: the drain waits"
        );
        assert_eq!(fetched(h.next()), Some((7, 0, 8)));
        h.stored();
        h.give_back(two);
        pause();
        assert!(!drainer.is_finished(), "one buffer still out");
        drop(EndOnDrop(h.clone()));
        assert!(drainer.join().unwrap());
        assert!(
            h.take_buffer(|| false).is_none(),
            "the store thread is gone"
        );
        assert!(!h.drain());
    }
}
