//! The dispatcher of a fill: the thread that takes the chunks in turn (those readers wait
//! for first), allocates their memory, has the fetchers bring their sealed bytes in, feeds
//! the file's digest, unlocks them on the cores (or decodes cached ones into place), and
//! at the end asks for the verdict and seals the file for passthrough.

use std::io;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use super::pools::{ahead_pool, beside_hash_pool, take_piece_buffer, WRITE_PIECE};
use super::{decode_panicked, Chunk, Fetch, Inner, Priority, Progress, AWAITED_START, CHUNK};
use crate::memfs::MemoryFile;
use crate::ReadError;

/// Chunk fetches a fill from a source of many parallel reads starts with, then doubled with
/// each chunk decoded up to the source's `parallel_reads`. Few enough that the first chunk
/// comes in soon over a link they share; each doubling costs one fetch's time where every
/// connection has a bandwidth of its own (S3), about two fetch times per fill.
pub(super) const FIRST_FETCHES: usize = 4;
/// Chunk fetches in flight while a local file decodes ahead: the chunk unlocked and the next
/// one, as a fill of one fetch at a time has them.
const LOCAL_FETCH_AHEAD_IN_BACKGROUND: usize = 2;
/// Hashed chunks whose unlock may wait for a thread while the hash goes on: no byte is
/// served before the verdict, so their order does not matter, and the hash need not stop
/// for an unlock that lags.
const UNLOCKS_BEHIND_HASH: usize = 2;
/// Unlock tasks in flight per thread of the pool, when no hash sets the pace. With one, a
/// core that ends its chunk waits for this thread to hand it the next (this thread shares the
/// cores with the unlocks, the FUSE replies and the reader, and allocates each chunk's memory
/// first): on two cores they idled 10-11% of a read at once of cached bytes. With two, 8-9%
/// and the read 1.02-1.05x as fast (docs/PERFORMANCE-LOG.md, "The runs of e410732, d819c76
/// and 0461e3e").
const UNLOCKS_PER_THREAD: usize = 2;

impl Inner {
    /// Decode every chunk, wanted ones first, else in order from the cursor. Each chunk is
    /// fetched (its sealed bytes brought into its place) and then unlocked in place; the
    /// next chunk is fetched on this thread while the cores unlock the current one, so the
    /// disk and the decode overlap, and the memory of the chunk after it is faulted in
    /// beside them when the disk writes it by DMA.
    pub(super) fn dispatch(self: &Arc<Self>) {
        let mut failures = 0usize;
        let finished = self.decode_chunks(&mut failures);
        {
            let mut s = self.state.lock();
            while s.unlocking > 0 {
                self.changed.wait(&mut s);
            }
            failures += s.failed_beside;
        }
        // The digest is given if every byte was fed (an empty file: none), else given up,
        // before the verdict is asked for.
        if let Some(mut feeder) = self.digest.lock().take() {
            feeder.finish_if_whole();
        }
        if finished {
            self.finish(failures);
        }
    }

    /// Every chunk, fetched by the fetcher threads up to `fetch_ahead` at once from the
    /// chunk decoded on (the chunk decoded first in the queue), each unlocked here once its
    /// fetch is in while the fetchers go on; false when the fill was cancelled.
    fn decode_chunks(self: &Arc<Self>, failures: &mut usize) -> bool {
        let mut allocated = 0;
        let n = self.len.div_ceil(CHUNK) as usize;
        // Fetches in flight start at a few and double with each chunk decoded: all of them
        // at once would share the link evenly, so the first chunk, which the decode and the
        // first reader wait for, would come in only with the last of them.
        let mut ramp = FIRST_FETCHES;
        // The chunk whose sealed bytes the digest took beside the unlock before.
        let mut hashed_ahead = None;
        loop {
            // A chunk whose sealed bytes the digest needs is fetched into place, where the
            // digest reads them.
            let feeds_digest = self.digest.lock().is_some();
            let (i, priority, jobs, written) = {
                let mut s = self.state.lock();
                if s.cancelled {
                    return false;
                }
                let Some(i) = s.take_next_chunk() else { break };
                self.changed.notify_all();
                let written = !feeds_digest && s.fetches[i] == Fetch::Idle && self.cached(i);
                let running = s
                    .fetches
                    .iter()
                    .filter(|f| matches!(f, Fetch::Queued | Fetch::Running))
                    .count();
                // Chunk `i` is fetched whatever runs already; the ones after it while
                // fewer than `fetch_ahead` fetches are under way.
                let mut jobs: Vec<usize> = (s.fetches[i] == Fetch::Idle && !written)
                    .then_some(i)
                    .into_iter()
                    .collect();
                // Decode ahead of a local file fetches only the next chunk beside each
                // unlock, as a fill of one fetch at a time would: an open that urges the
                // fill then finds one fetch, not several, beside the unlock it waits for
                // (which runs on the background pool to its end).
                let most = if s.priority == Priority::Ahead && self.source.disk_shared.is_some() {
                    LOCAL_FETCH_AHEAD_IN_BACKGROUND
                } else {
                    self.source.fetch_ahead
                };
                let room = most.min(ramp).saturating_sub(running + jobs.len());
                ramp = ramp.saturating_mul(2);
                let ahead: Vec<usize> = (i + 1..n)
                    .filter(|&j| s.chunks[j] == Chunk::Pending && s.fetches[j] == Fetch::Idle)
                    .take(room)
                    .collect();
                // Chunks in the page cache are made by `write_decoded`, without a fetch.
                jobs.extend(
                    ahead
                        .into_iter()
                        .filter(|&j| feeds_digest || !self.cached(j)),
                );
                for &j in &jobs {
                    s.fetches[j] = Fetch::Queued;
                }
                (i, s.priority, jobs, written)
            };
            let (a, b) = self.range(i);
            let top = jobs.iter().max().map_or(b, |&j| self.range(j).1.max(b));
            // Chunk `i`'s memory first and its fetch on its way, then the memory of the
            // chunks fetched after it: the wait for chunk `i` is not the allocation of
            // them all (32 MiB of fresh pages before a first byte).
            let mut result = self
                .allocate(&mut allocated, b, priority)
                .map_err(ReadError::Io);
            if result.is_ok() && jobs.contains(&i) {
                let mut s = self.state.lock();
                s.queued.push_front(i);
                self.fetch_moved.notify_all();
            }
            let rest = result.is_ok() && self.allocate(&mut allocated, top, priority).is_ok();
            {
                let mut s = self.state.lock();
                for &j in jobs.iter().filter(|&&j| j != i || result.is_err()) {
                    if rest {
                        s.queued.push_back(j);
                    } else {
                        s.fetches[j] = Fetch::Idle;
                    }
                }
                self.fetch_moved.notify_all();
                while result.is_ok()
                    && matches!(s.fetches[i], Fetch::Queued | Fetch::Running)
                    && !s.cancelled
                {
                    self.fetch_moved.wait(&mut s);
                }
                if s.cancelled {
                    return false;
                }
                if result.is_ok() && !written {
                    result = match std::mem::replace(&mut s.fetches[i], Fetch::Idle) {
                        Fetch::Fetched => Ok(()),
                        Fetch::Failed(why) => Err(ReadError::Io(io::Error::other(why))),
                        other => unreachable!("chunk {i} fetched as {other:?}"),
                    };
                }
            }
            if hashed_ahead != Some(i) && !written {
                // SAFETY: as below; read before the unlock turns the bytes into view bytes.
                self.feed_digest(result.is_ok(), a, unsafe { self.chunk_mut(i) });
            }
            hashed_ahead = None;
            if result.is_ok() && priority == Priority::Demand {
                // Chunk `i` is hashed (above, or beside the unlock before): its unlock is a
                // task of its own, so this thread goes on to hash the chunks after it. The
                // hash, one stream in file order, then runs without a pause on its own core
                // while the unlocks share the rest, where hashing the next chunk beside
                // each unlock held the two in step (docs/PERFORMANCE-LOG.md, "Checked loads").
                let most = if self.digest.lock().is_some() {
                    UNLOCKS_BEHIND_HASH
                } else {
                    0
                };
                self.unlock_beside(self.unlock_pool(priority), i, most, written);
                continue;
            }
            if result.is_ok() {
                // The next chunk in file order, once its fetch is in: its sealed bytes are
                // hashed on this thread while chunk `i` is unlocked, so the digest, one
                // stream on one core, runs beside the unlock instead of between unlocks.
                let next = (i + 1 < n && self.digest.lock().is_some())
                    .then(|| {
                        let s = self.state.lock();
                        let coming = matches!(
                            s.fetches[i + 1],
                            Fetch::Queued | Fetch::Running | Fetch::Fetched
                        );
                        (s.chunks[i + 1] == Chunk::Pending && coming).then_some(i + 1)
                    })
                    .flatten();
                // Decode ahead unlocks on this thread: chunks in flight on the background
                // pool when an open urges the fill would hold its first chunks behind them.
                let pool = self.unlock_pool(priority);
                // SAFETY: chunk `i` is Busy and its fetch is over: only this thread touches
                // its bytes until it is marked Done or Failed.
                let buf = unsafe { self.chunk_mut(i) };
                let unlocked = &AtomicBool::new(false);
                result = match next {
                    None if written => self.write_decoded(pool, a, b),
                    None => self.unlock(pool, a, buf),
                    Some(j) => std::thread::scope(|scope| {
                        let unlocking = scope.spawn(move || {
                            let r = self.unlock(pool, a, buf);
                            let _s = self.state.lock();
                            unlocked.store(true, Ordering::Relaxed);
                            self.fetch_moved.notify_all();
                            r
                        });
                        if self.fetched_before(j, unlocked) {
                            // SAFETY: chunk `j` is Pending with its fetch over: nothing
                            // writes its bytes until this thread takes it, and hashing only
                            // reads them.
                            let bytes = unsafe { self.chunk_mut(j) };
                            if self.feed_digest(true, self.range(j).0, bytes) {
                                hashed_ahead = Some(j);
                            }
                        }
                        unlocking.join().unwrap_or_else(|_| Err(decode_panicked()))
                    }),
                };
            }
            self.chunk_ended(i, result, failures);
        }
        true
    }

    /// Unlock fetched chunk `i` (or, `written`, make it by `write_decoded`) as a task of its
    /// own on `pool` (the global pool if none), up to `most` such tasks at once (0:
    /// [`UNLOCKS_PER_THREAD`] per thread of the pool). A chunk cut in halves across the
    /// cores waits for its slower half, which shares a core with the reader's FUSE replies
    /// and the fetches: the other core idles at that barrier, 15-20% of a read at once. As
    /// tasks a core that ends its chunk takes the next one, or a piece of one still running
    /// (docs/PERFORMANCE-LOG.md, "The decode on two cores").
    fn unlock_beside(
        self: &Arc<Self>,
        pool: Option<&'static rayon::ThreadPool>,
        i: usize,
        most: usize,
        written: bool,
    ) {
        let width = pool.map_or_else(rayon::current_num_threads, |p| p.current_num_threads());
        let most = if most == 0 {
            width * UNLOCKS_PER_THREAD
        } else {
            most
        };
        {
            let mut s = self.state.lock();
            while s.unlocking >= most.max(1) {
                self.changed.wait(&mut s);
            }
            s.unlocking += 1;
        }
        let inner = self.clone();
        let task = move || {
            let (a, b) = inner.range(i);
            let result = match written {
                true => inner.write_decoded(None, a, b),
                // SAFETY: chunk `i` is Busy and its fetch is over: only this task touches
                // its bytes until it is marked Done or Failed.
                false => inner.unlock(None, a, unsafe { inner.chunk_mut(i) }),
            };
            let mut failed = 0;
            inner.chunk_ended(i, result, &mut failed);
            let mut s = inner.state.lock();
            s.unlocking -= 1;
            s.failed_beside += failed;
            inner.changed.notify_all();
        };
        match pool {
            Some(pool) => pool.spawn(task),
            None => rayon::spawn(task),
        }
    }

    /// Wait until chunk `j`'s fetch is in (true), or it failed, the fill was cancelled or
    /// `unlocked` is set (false).
    fn fetched_before(&self, j: usize, unlocked: &AtomicBool) -> bool {
        let mut s = self.state.lock();
        loop {
            if s.chunks[j] != Chunk::Pending || s.cancelled {
                return false;
            }
            match s.fetches[j] {
                Fetch::Fetched => return true,
                Fetch::Queued | Fetch::Running if !unlocked.load(Ordering::Relaxed) => {
                    self.fetch_moved.wait(&mut s)
                }
                _ => return false,
            }
        }
    }

    /// Feed the sealed bytes at `off` to the file's digest, or give the digest up when they
    /// cannot be had (`ok` false) or come out of order; whether they were fed.
    fn feed_digest(&self, ok: bool, off: u64, bytes: &[u8]) -> bool {
        let mut digest = self.digest.lock();
        let Some(feeder) = digest.as_mut() else {
            return false;
        };
        let fed = ok && feeder.feed(off, bytes);
        if !fed {
            *digest = None;
        }
        fed
    }

    /// The pool that unlocks a chunk at the fill's priority: decode ahead's in the
    /// background; while the check hashes the file by its own reads, one core fewer: no byte
    /// is served before the verdict, and the hash is one stream on one thread, as much CPU
    /// per byte as the decode, so it is the longer of the two whenever it has to share its
    /// core. With a digest this dispatcher feeds, the decode's pool, at the process's own
    /// priority: the hash goes on while the unlocks, at most `UNLOCKS_BEHIND_HASH` behind
    /// it, take what is left of the cores. Run at a lower priority, as they were, they
    /// gained nothing on an idle machine and lost to any busy process beside
    /// (docs/PERFORMANCE-LOG.md, "Checked loads").
    fn unlock_pool(&self, priority: Priority) -> Option<&'static rayon::ThreadPool> {
        match priority {
            Priority::Ahead => ahead_pool(),
            Priority::Demand
                if self.hashing.load(Ordering::Relaxed) && self.digest.lock().is_none() =>
            {
                beside_hash_pool()
            }
            Priority::Demand => None,
        }
    }

    /// The fetched bytes at `a` turned into view bytes in place, on `pool` (this thread if
    /// none). An unlock that panics (a bug) fails its chunk alone.
    fn unlock(
        &self,
        pool: Option<&rayon::ThreadPool>,
        a: u64,
        buf: &mut [u8],
    ) -> Result<(), ReadError> {
        let mut unlock = || {
            std::panic::catch_unwind(AssertUnwindSafe(|| (self.source.unlock)(a, buf)))
                .unwrap_or_else(|_| Err(decode_panicked()))
        };
        match pool {
            Some(pool) => pool.install(unlock),
            None => unlock(),
        }
    }

    /// Whether chunk `i`'s sealed bytes are in the page cache.
    fn cached(&self, i: usize) -> bool {
        let (a, b) = self.range(i);
        let cached = self.source.in_page_cache.as_ref();
        cached.is_some_and(|c| c(a, b - a))
    }

    /// Make `[a, b)` from sealed bytes in the page cache, on `pool` (this thread if none): a
    /// piece at a time decoded into a buffer that stays in the core's cache, then written
    /// into the file. Brought into place and unlocked there instead, the copy's fresh pages
    /// are cleared by the kernel as they are first touched, then written with the sealed
    /// bytes, then read and written again by the unlock; a write fills them once
    /// (docs/PERFORMANCE-LOG.md, "Files in the page cache: decoded, then written").
    fn write_decoded(
        &self,
        pool: Option<&rayon::ThreadPool>,
        a: u64,
        b: u64,
    ) -> Result<(), ReadError> {
        use rayon::prelude::*;
        use std::os::unix::fs::FileExt;
        let file = match self.file.lock().as_ref() {
            Some(f) => f.try_clone().map_err(ReadError::Io)?,
            None => return Err(ReadError::Io(io::Error::other("the file is sealed"))),
        };
        let pieces: Vec<u64> = (a..b).step_by(WRITE_PIECE as usize).collect();
        let write = || {
            pieces.par_iter().try_for_each(|&at| {
                let len = WRITE_PIECE.min(b - at) as usize;
                let Some(mut buf) = take_piece_buffer() else {
                    // SAFETY: the chunk is Busy and this piece of it is this task's alone;
                    // its memory is allocated.
                    let place = unsafe { self.range_mut(at, len) };
                    (self.source.fetch)(at, place).map_err(ReadError::Io)?;
                    return (self.source.unlock)(at, place);
                };
                let piece = &mut buf[..len];
                let mapped = self.source.decode_mapped.as_ref();
                match mapped.and_then(|decode| decode(at, piece)) {
                    Some(made) => made,
                    None => (self.source.decode)(at, piece),
                }
                .and_then(|()| file.write_all_at(piece, at).map_err(ReadError::Io))
            })
        };
        let result = std::panic::catch_unwind(AssertUnwindSafe(|| match pool {
            Some(pool) => pool.install(write),
            None => write(),
        }))
        .unwrap_or_else(|_| Err(decode_panicked()));
        if let Some(done) = &self.source.decoded_from_cache {
            done(a, b - a);
        }
        result
    }

    /// Chunk `i` decoded, or not.
    fn chunk_ended(&self, i: usize, result: Result<(), ReadError>, failures: &mut usize) {
        let mut s = self.state.lock();
        s.left -= 1;
        s.chunks[i] = match &result {
            Ok(()) => Chunk::Done,
            Err(e) => {
                if *failures == 0 {
                    let (a, b) = self.range(i);
                    log::warn!(
                        "{}: bytes {a}..{b} not decoded ({e}); reads there decode their own range",
                        self.label
                    );
                }
                *failures += 1;
                Chunk::Failed
            }
        };
        self.changed.notify_all();
    }

    /// Every chunk is over: the verdict, then the file sealed for passthrough or not.
    fn finish(&self, failures: usize) {
        let verdict = match &self.source.check {
            Some(check) => check(),
            None => Ok(()),
        };
        let sealed = match (failures, verdict) {
            (0, Ok(())) => self.seal().inspect(|_| {
                if let Some(completed) = &self.source.completed {
                    completed();
                }
            }),
            (0, Err(e)) => Err(format!("not handed to the kernel: {e}")),
            (n, _) => Err(format!("{n} chunks not decoded; served through FUSE")),
        };
        let mut s = self.state.lock();
        match sealed {
            Ok(m) => {
                log::debug!(
                    "{}: decoded {} bytes in {:?}",
                    self.label,
                    self.len,
                    self.started.elapsed()
                );
                s.complete = Some(Arc::new(m));
                s.progress = Progress::Complete;
            }
            Err(why) => {
                log::warn!("{}: {why}", self.label);
                s.progress = Progress::Broken;
            }
        }
        self.changed.notify_all();
        self.fetch_moved.notify_all();
    }

    /// Allocate the file's memory in order up to `to`, in the steps of the fill's
    /// `priority`; `allocated` is how far it is (0 at the start). Always in file order up to
    /// the chunk decoded, so that the page size stays the step's even when a reader moves
    /// the decoder ahead.
    fn allocate(&self, allocated: &mut u64, to: u64, priority: Priority) -> io::Result<()> {
        if *allocated >= to {
            return Ok(());
        }
        // The file's start takes its own step: a range across its end (chunks fetched
        // ahead are allocated together) is allocated in two.
        if *allocated < AWAITED_START && to > AWAITED_START {
            self.allocate(allocated, AWAITED_START, priority)?;
        }
        let in_page_cache = || {
            let cached = self.source.in_page_cache.as_ref();
            cached.is_some_and(|c| c(*allocated, to - *allocated))
        };
        let step = match priority {
            Priority::Ahead if *allocated >= AWAITED_START && in_page_cache() => {
                self.steps.ahead_cached
            }
            Priority::Ahead => self.steps.ahead,
            Priority::Demand => self.steps.demand,
        };
        match self.file.lock().as_ref() {
            Some(f) => crate::memfs::allocate_range(f, *allocated, to, step)?,
            None => return Err(io::Error::other("the file is sealed")),
        }
        *allocated = to;
        Ok(())
    }

    /// Close the writable descriptor, leave the mapping read-only, and make the file the
    /// kernel gets.
    fn seal(&self) -> Result<MemoryFile, String> {
        if let Some(m) = &self.map {
            // SAFETY: our own mapping, whole; nothing writes to it any more.
            unsafe { libc::mprotect(m.as_mut_ptr().cast(), self.len as usize, libc::PROT_READ) };
        }
        let file = self.file.lock().take().ok_or("sealed twice")?;
        let seal = self.seal.lock().take().ok_or("sealed twice")?;
        seal(file).map_err(|e| format!("cannot seal the decoded copy ({e})"))
    }
}
