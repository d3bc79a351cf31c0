//! A file being decoded into private memory chunk by chunk, readable while it fills.
//!
//! A whole-shard decode takes seconds for a real shard (2-10 GB), and the kernel can hand a
//! backing file to passthrough opens only once it is complete. A `Fill` lets the first
//! readers start at once: one dispatcher thread makes the file in order, a chunk at a time:
//! it allocates the chunk's memory (the allocation step sets the folio size), fetches its
//! sealed bytes into place (`O_DIRECT` from disk when they are not cached) and has all cores
//! unlock them in place, fetching the next chunk meanwhile so the disk and the decode
//! overlap. A chunk whose sealed bytes are in the page cache (and no digest to feed) is not
//! fetched: the cores decode it a piece at a time into a few kept buffers and write it into
//! place, which spares the copy's fresh pages a clear and a pass. A source that gains
//! from many reads at once (a remote one) has fetcher threads bring many chunks at once,
//! each straight into its place. A reader that needs a chunk not yet decoded waits for it
//! and moves the dispatcher there (then on from there: a sequential reader keeps the
//! decoder just ahead of it). Without `O_DIRECT` a prefetch thread asks the kernel for the
//! sealed bytes a window ahead instead. Once every chunk is decoded and the file's
//! integrity verdict is in, the file is sealed read-only and handed out for passthrough.
//!
//! A chunk that fails to decode (a corrupt value, an I/O error, a rewritten sealed file) is
//! never served from memory: a read that touches it decodes exactly its own range, which
//! fails only if the range holds the bad bytes, and the fill never completes.
//!
//! Fills started ahead of any open (decode-ahead) run in the background: a thread pool and
//! helper threads under `SCHED_IDLE`, which take only the cycles no other thread wants, and
//! reads of a disk that others read a piece at a time (`crate::disk_share`). The first reader
//! or open that waits for one raises it to the normal policy for the rest of the file.

use std::collections::VecDeque;
use std::fs::File;
use std::io;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use crate::background::run_in_background;
use crate::memfs::{MemoryFile, MemoryFs, Reservation};
use crate::view::{Ino, View};
use crate::ReadError;

mod input;
mod pools;
mod sealed_reader;

use input::disk_look;
pub use input::{
    CheckFn, DecodeFn, DiskLook, FetchFn, Input, MappedDecodeFn, PrefetchFn, RangeDoneFn, RangeFn,
    RangeLookFn, SealFn, Steps, Target,
};
pub(crate) use pools::ahead_pool;
use pools::{beside_hash_pool, take_piece_buffer, WRITE_PIECE};
pub use pools::{drain_piece_buffers, PIECE_BUFFERS};
use sealed_reader::SealedReader;

/// Bytes decoded as one step: large enough to spread over all cores, small enough that a
/// first reader waits only milliseconds. A multiple of the 2 MiB page.
pub const CHUNK: u64 = 8 << 20;
/// The most a fill decoding ahead asks at once of a disk that others read. An engine
/// importing beside it pages its libraries in with small reads, and each waits behind what
/// the device is already reading (docs/PERFORMANCE-LOG.md, "Engines"). Alone on the disk, the
/// fill reads whole chunks: 1 MiB reads one at a time fill slower.
pub(crate) const BACKGROUND_PIECE: usize = 1 << 20;
/// How far ahead of the decoder the sealed bytes are asked for.
const PREFETCH_WINDOW: u64 = 64 << 20;
const PREFETCH_STEP: u64 = 16 << 20;
/// Chunk fetches a fill from a source of many parallel reads starts with, then doubled with
/// each chunk decoded up to the source's `parallel_reads`. Few enough that the first chunk
/// comes in soon over a link they share; each doubling costs one fetch's time where every
/// connection has a bandwidth of its own (S3), about two fetch times per fill.
const FIRST_FETCHES: usize = 4;
/// Chunk fetches in flight for a local file: the disk's next chunks read while the cores
/// unlock the ones before, so neither waits on the other chunk by chunk
/// (docs/PERFORMANCE-LOG.md, "True cold: the sealed read, then the decode").
const LOCAL_FETCH_AHEAD: usize = 4;
/// Chunk fetches in flight while a local file decodes ahead: the chunk unlocked and the next
/// one, as a fill of one fetch at a time has them.
const LOCAL_FETCH_AHEAD_IN_BACKGROUND: usize = 2;
/// The start of a file that decode ahead never makes of `Steps::ahead_cached` folios: an
/// open that comes with the mount waits for the first chunk, and the second's memory is
/// allocated beside the first one's unlock.
const AWAITED_START: u64 = 2 * CHUNK;
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

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Priority {
    /// Nobody waits for it yet: decode ahead on idle cores.
    Ahead,
    /// An open or a read waits for it.
    Demand,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Chunk {
    Pending,
    Busy,
    Done,
    Failed,
}

/// Where a fill stands, for the open path and the logs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Progress {
    Filling,
    /// Every chunk decoded and the verdict good: the file can back passthrough opens.
    Complete,
    /// A chunk failed or the verdict is bad: served through the read path only.
    Broken,
}

struct State {
    chunks: Vec<Chunk>,
    /// The chunk the dispatcher takes next when no reader waits.
    cursor: usize,
    /// Chunks readers wait for, first come first served.
    wanted: VecDeque<usize>,
    /// Chunks not yet decoded or failed.
    left: usize,
    progress: Progress,
    priority: Priority,
    complete: Option<Arc<MemoryFile>>,
    /// Set when the last handle of the fill is dropped: its threads stop.
    cancelled: bool,
    /// Threads working for this fill, moved to the normal policy when it is urged.
    tids: Vec<libc::pid_t>,
    /// Each chunk's fetch, and the chunks queued for the fetchers, in the order they take
    /// them.
    fetches: Vec<Fetch>,
    queued: VecDeque<usize>,
    /// Chunks being unlocked each as a task of its own (`Inner::unlock_beside`), and how
    /// many of those failed.
    unlocking: usize,
    failed_beside: usize,
}

/// A chunk's fetch when many run at once.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Fetch {
    Idle,
    Queued,
    Running,
    Fetched,
    Failed(String),
}

struct Inner {
    len: u64,
    steps: Steps,
    /// The writable shared mapping of the file being filled; read-only once complete.
    map: Option<memmap2::MmapRaw>,
    file: Mutex<Option<File>>,
    seal: Mutex<Option<Box<SealFn>>>,
    source: Input,
    /// `Input::digest`, taken out of the input: the dispatcher feeds it.
    digest: Mutex<Option<crate::digest::DigestFeeder>>,
    state: Mutex<State>,
    changed: Condvar,
    /// Wakes the fetchers (a chunk queued, the fill over) and the dispatcher (a fetch in).
    fetch_moved: Condvar,
    /// Held by a fetcher of decode ahead for its chunk's reads of a disk (`fetch_chunk`).
    background_read: Mutex<()>,
    started: Instant,
    label: String,
    /// The file's verdict is not in: its check runs on a thread of its own, waiting for the
    /// digest this fill feeds or reading the file itself (see [`Inner::unlock_pool`]).
    hashing: AtomicBool,
    /// Last, so dropped last (fields drop in order): the budget comes back only once the
    /// mapping and the file above have let the tmpfs's pages go, or a fill that takes it
    /// at once could find the tmpfs still full.
    _reservation: Option<crate::memfs::Reservation>,
}

/// A file filling in the background. Dropping the last handle stops the fill and frees its
/// memory once its threads have let go.
pub struct Fill {
    inner: Arc<Inner>,
}

impl Fill {
    /// Start decoding `source` into `target` in the background. `label` names the file in
    /// log lines.
    pub fn start(
        target: Target,
        mut source: Input,
        priority: Priority,
        label: String,
    ) -> io::Result<Fill> {
        let digest = Mutex::new(source.digest.take());
        let source_has_check = source.check.is_some();
        let Target {
            file,
            len,
            steps,
            seal,
            reservation,
        } = target;
        let map = if len > 0 {
            // The file is private to this daemon (nameless, just made, mode 0600) and holds
            // `len` bytes; chunks are written only by the dispatcher while Busy and read
            // only once Done (see `State`).
            let m = memmap2::MmapOptions::new()
                .len(len as usize)
                .map_raw(&file)?;
            // SAFETY: advising our own mapping.
            unsafe { libc::madvise(m.as_mut_ptr().cast(), len as usize, libc::MADV_DONTDUMP) };
            Some(m)
        } else {
            None
        };
        let n = len.div_ceil(CHUNK) as usize;
        let inner = Arc::new(Inner {
            len,
            steps,
            _reservation: reservation,
            map,
            file: Mutex::new(Some(file)),
            seal: Mutex::new(Some(seal)),
            source,
            digest,
            state: Mutex::new(State {
                chunks: vec![Chunk::Pending; n],
                cursor: 0,
                wanted: VecDeque::new(),
                left: n,
                progress: Progress::Filling,
                priority,
                complete: None,
                cancelled: false,
                tids: Vec::new(),
                fetches: vec![Fetch::Idle; n],
                queued: VecDeque::new(),
                unlocking: 0,
                failed_beside: 0,
            }),
            changed: Condvar::new(),
            background_read: Mutex::new(()),
            fetch_moved: Condvar::new(),
            started: Instant::now(),
            label,
            hashing: AtomicBool::new(source_has_check),
        });
        if let Some(check) = inner.source.check.clone() {
            // Only a weak handle: a fill dropped while the file is hashed frees its memory
            // without waiting for the hash.
            let i = Arc::downgrade(&inner);
            spawn("kllm-hash", move || {
                let _enlisted = Inner::enlist(&i);
                let _ended = HashEnded(i.clone());
                let _ = check();
            })?;
        }
        if inner.source.prefetch.is_some() && len > 0 {
            let i = inner.clone();
            spawn("kllm-prefetch", move || {
                let _enlisted = Inner::enlist(&Arc::downgrade(&i));
                i.prefetch();
            })?;
        }
        for _ in 0..inner.source.fetch_ahead.max(1).min(n) {
            let i = inner.clone();
            spawn("kllm-fetch", move || {
                let _enlisted = Inner::enlist(&Arc::downgrade(&i));
                i.fetcher();
            })?;
        }
        let i = inner.clone();
        spawn("kllm-fill", move || {
            let _enlisted = Inner::enlist(&Arc::downgrade(&i));
            let _ended = DispatchEnded(Arc::downgrade(&i));
            i.dispatch();
        })?;
        Ok(Fill { inner })
    }

    /// Decode file `ino` of the view into a new file of `memory`, whose budget
    /// `reservation` claims. Nothing is served before the file's manifest verdict (if the
    /// view has one for it) is good.
    pub fn of_view(
        view: &Arc<View>,
        ino: Ino,
        memory: &MemoryFs,
        reservation: Reservation,
        priority: Priority,
    ) -> io::Result<Fill> {
        let node = view
            .node(ino)
            .ok_or_else(|| io::Error::from(io::ErrorKind::NotFound))?;
        let (v, u, c, p) = (view.clone(), view.clone(), view.clone(), view.clone());
        let decode = move |off: u64, buf: &mut [u8]| match v.read_unchecked(ino, off, buf)? {
            n if n == buf.len() => Ok(()),
            n => Err(ReadError::Io(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                format!("{n} of {} bytes at {off}", buf.len()),
            ))),
        };
        let object = view
            .sealed_object(ino)
            .map_err(|e| io::Error::other(e.to_string()))?
            .cloned();
        // A local sealed file is read with O_DIRECT where it helps (`SealedReader`); any
        // other source by its own ranged reads.
        let local = match &object {
            Some(o) => match o
                .local_file()
                .map_err(|e| io::Error::other(e.to_string()))?
            {
                Some(f) => Some(Arc::new(SealedReader::new(f)?)),
                None => None,
            },
            None => None,
        };
        // Decode ahead yields the disk to other readers, when it reads the disk at all (not
        // sealed bytes in the page cache); where the disk's statistics are not to be had
        // (no block device behind the file system), it reads in pieces always.
        let disk_shared = local.as_ref().map(|r| {
            let share = crate::disk_share::DiskShare::of(&r.file);
            let r = r.clone();
            Box::new(move |off, len| {
                disk_look(r.mostly_cached(off, len), || {
                    share.as_ref().and_then(|s| s.others_read())
                })
            }) as Box<RangeLookFn>
        });
        let in_page_cache = local.as_ref().map(|r| {
            let r = r.clone();
            Box::new(move |off, len| r.mostly_cached(off, len)) as Box<RangeFn>
        });
        // Without O_DIRECT the page cache brings the sealed bytes: ask for them ahead.
        let prefetch: Option<Box<PrefetchFn>> = match &local {
            Some(r) if r.direct.is_none() => {
                Some(Box::new(move |off, len| p.will_read(ino, off, len)))
            }
            _ => None,
        };
        // The page cache's copy of the sealed bytes goes once they are in the copy and the
        // file's hash is done with them (at once when this fill feeds the digest; else the
        // check reads them beside the fill).
        let check: Option<Arc<CheckFn>> = node.integrity.as_ref().map(|_| {
            let reader = local.clone();
            Arc::new(move || {
                let verdict = c.verify(ino);
                if let Some(r) = &reader {
                    r.let_go_kept();
                }
                verdict
            }) as Arc<CheckFn>
        });
        // Any other source by its own reads, as many at once as it gains from.
        let fetch_ahead = match (&local, &object) {
            (None, Some(o)) => o.parallel_reads().max(1),
            (Some(_), _) => LOCAL_FETCH_AHEAD,
            (None, None) => 1,
        };
        // Sealed bytes from the disk or a remote source are hashed as the fill brings them
        // in, each chunk's beside the unlock of the chunk before: read once, for the copy
        // and the check alike. Bytes in the page cache are hashed by the check's own reads
        // instead, on a core of its own: its verdict then comes when the hash ends, not
        // with the fill's last chunk, so readers need not wait for the whole copy.
        let digest = match &local {
            Some(r) if r.mostly_cached(0, node.attr.size) => None,
            _ => view.digest_feeder(ino),
        };
        let completed: Option<Box<dyn Fn() + Send + Sync>> = local.clone().map(|r| {
            let len = node.attr.size;
            Box::new(move || r.drop_cached(0, len, true)) as Box<dyn Fn() + Send + Sync>
        });
        // Pages of the sealed file are kept for a check that reads the file itself, not for
        // the digest this fill feeds.
        let fed = digest.is_some();
        let let_go = local.clone().map(|r| {
            let h = view.clone();
            Arc::new(move |off, len| r.let_go(off, len, || fed || !h.awaits_verdict(ino)))
                as Arc<RangeDoneFn>
        });
        let decoded_from_cache = let_go.clone();
        // Sealed bytes the page cache holds whole are decoded where they lie, through the
        // local file's own mapping (the one FUSE reads use).
        let decode_mapped = local.as_ref().and(object.clone()).map(|o| {
            let v = view.clone();
            Box::new(move |off: u64, out: &mut [u8]| {
                let map = o.cached_mapping(off, out.len() as u64)?;
                map.read(off, out.len(), |sealed| {
                    v.decode_from(ino, off, sealed, out)
                })
            }) as Box<MappedDecodeFn>
        });
        let fetch = move |off: u64, buf: &mut [u8]| match (&local, &object) {
            (Some(r), _) => {
                r.read(off, buf)?;
                if let Some(let_go) = &let_go {
                    let_go(off, buf.len() as u64);
                }
                Ok(())
            }
            (None, Some(o)) => o.read_once_at(buf, off).map_err(io::Error::from),
            (None, None) => Ok(()),
        };
        let source = Input {
            fetch: Box::new(fetch),
            unlock: Box::new(move |off, buf| u.unlock_in_place(ino, off, buf)),
            decode: Box::new(decode),
            decode_mapped,
            check,
            prefetch,
            disk_shared,
            in_page_cache,
            fetch_ahead,
            digest,
            completed,
            decoded_from_cache,
        };
        let target = Target {
            file: memory.create()?,
            len: node.attr.size,
            steps: Steps::of(memory.pages()),
            seal: Box::new(crate::memfs::seal),
            reservation: Some(reservation),
        };
        Fill::start(target, source, priority, view.path_of(ino))
    }

    pub fn len(&self) -> u64 {
        self.inner.len
    }

    pub fn is_empty(&self) -> bool {
        self.inner.len == 0
    }

    pub fn progress(&self) -> Progress {
        self.inner.state.lock().progress
    }

    /// Bytes not yet decoded (whole chunks: at most `CHUNK - 1` more than exact).
    pub fn left_bytes(&self) -> u64 {
        (self.inner.state.lock().left as u64 * CHUNK).min(self.inner.len)
    }

    /// The sealed read-only file, once complete.
    pub fn complete(&self) -> Option<Arc<MemoryFile>> {
        self.inner.state.lock().complete.clone()
    }

    /// Wait up to `timeout` for the fill to end, raising it to demand priority; the sealed
    /// file if it completed.
    pub fn wait_complete(&self, timeout: Duration) -> Option<Arc<MemoryFile>> {
        let deadline = Instant::now() + timeout;
        let mut s = self.inner.state.lock();
        if s.progress == Progress::Filling {
            self.inner.urge(&mut s);
        }
        while s.progress == Progress::Filling && !s.cancelled {
            if self.inner.changed.wait_until(&mut s, deadline).timed_out() {
                break;
            }
        }
        s.complete.clone()
    }

    /// Wait until the fill ends (complete or broken) or is dropped, at its own priority.
    pub fn wait_done(&self) {
        let mut s = self.inner.state.lock();
        while s.progress == Progress::Filling && !s.cancelled {
            self.inner.changed.wait(&mut s);
        }
    }

    /// Raise the fill to demand priority (an open is coming for it).
    pub fn urge(&self) {
        let mut s = self.inner.state.lock();
        self.inner.urge(&mut s);
    }

    /// Whether the file's hash is still running: until it ends nothing of the copy is
    /// served.
    pub fn awaits_verdict(&self) -> bool {
        self.inner.hashing.load(Ordering::Relaxed)
    }

    /// Wait until the file's hash has ended (or the fill was dropped), raising the fill to
    /// demand priority.
    pub fn wait_verdict(&self) {
        let mut s = self.inner.state.lock();
        self.inner.urge(&mut s);
        while self.inner.hashing.load(Ordering::Relaxed) && !s.cancelled {
            self.inner.changed.wait(&mut s);
        }
    }

    pub fn priority(&self) -> Priority {
        self.inner.state.lock().priority
    }

    /// Bytes `[off, off + out.len())` of the file, cut at its end: from memory once decoded
    /// (waiting for the chunks not yet, and moving the decoder to them), else decoded for
    /// this read alone. Never before the file's integrity verdict is good.
    pub fn read(&self, off: u64, out: &mut [u8]) -> Result<usize, ReadError> {
        let Some((end, ready)) = self.wait_for(off, out.len())? else {
            return Ok(0);
        };
        let inner = &self.inner;
        let map = inner.map.as_ref().expect("a non-empty file is mapped");
        let first = (off / CHUNK) as usize;
        for (k, &done) in ready.iter().enumerate() {
            let i = first + k;
            let a = off.max(i as u64 * CHUNK);
            let b = end.min((i as u64 + 1) * CHUNK);
            let dst = &mut out[(a - off) as usize..(b - off) as usize];
            if done {
                // SAFETY: a Done chunk is never written again and the mapping lives as long
                // as `inner`.
                let src = unsafe {
                    std::slice::from_raw_parts(map.as_ptr().add(a as usize), (b - a) as usize)
                };
                dst.copy_from_slice(src);
            } else {
                (inner.source.decode)(a, dst)?;
            }
        }
        Ok((end - off) as usize)
    }

    /// The decoded bytes `[off, off + len)`, cut at the file's end, in place in the copy
    /// (waiting for chunks as `read` does), so a reply needs no copy of its own. `None`
    /// where a chunk of the range failed: `read` decodes such a range by itself.
    pub fn decoded(&self, off: u64, len: usize) -> Result<Option<&[u8]>, ReadError> {
        let Some((end, ready)) = self.wait_for(off, len)? else {
            return Ok(Some(&[]));
        };
        if !ready.iter().all(|&done| done) {
            return Ok(None);
        }
        let map = self.inner.map.as_ref().expect("a non-empty file is mapped");
        // SAFETY: every chunk of the range is Done, so never written again, and the mapping
        // lives as long as `self.inner`, which outlives the borrow of `self`.
        Ok(Some(unsafe {
            std::slice::from_raw_parts(map.as_ptr().add(off as usize), (end - off) as usize)
        }))
    }

    /// Wait until every chunk of `[off, off + len)` (cut at the file's end) is decoded or
    /// failed, moving the decoder to them; the range's end and, per chunk, whether it is
    /// decoded. `None` for an empty range. Never before the file's verdict is good.
    fn wait_for(&self, off: u64, len: usize) -> Result<Option<(u64, Vec<bool>)>, ReadError> {
        let inner = &self.inner;
        if let Some(check) = &inner.source.check {
            check()?;
        }
        let len = inner.len.saturating_sub(off).min(len as u64);
        if len == 0 {
            return Ok(None);
        }
        let end = off + len;
        let (first, last) = ((off / CHUNK) as usize, ((end - 1) / CHUNK) as usize);
        let mut ready = Vec::with_capacity(last - first + 1);
        let mut s = inner.state.lock();
        for i in first..=last {
            while matches!(s.chunks[i], Chunk::Pending | Chunk::Busy) && !s.cancelled {
                if s.chunks[i] == Chunk::Pending && !s.wanted.contains(&i) {
                    s.wanted.push_back(i);
                }
                inner.urge(&mut s);
                // Only the dispatcher's progress wakes a reader: a reader waking the
                // others would have every waiting reader wake each other in turn, and
                // spin for as long as the chunk takes.
                inner.changed.wait(&mut s);
            }
            ready.push(s.chunks[i] == Chunk::Done);
        }
        Ok(Some((end, ready)))
    }
}

impl Drop for Fill {
    fn drop(&mut self) {
        let mut s = self.inner.state.lock();
        s.cancelled = true;
        self.inner.changed.notify_all();
        self.inner.fetch_moved.notify_all();
    }
}

/// A thread working for a fill, moved with it until the thread ends (a thread id is
/// reused once its thread is gone, so it must not stay on the list).
struct Enlisted {
    inner: std::sync::Weak<Inner>,
    tid: libc::pid_t,
}

impl Drop for Enlisted {
    fn drop(&mut self) {
        if let Some(i) = self.inner.upgrade() {
            i.state.lock().tids.retain(|&t| t != self.tid);
        }
    }
}

impl Inner {
    /// Record the calling thread as working for the fill, at its priority.
    fn enlist(inner: &std::sync::Weak<Inner>) -> Enlisted {
        // SAFETY: gettid has no preconditions.
        let tid = unsafe { libc::gettid() };
        if let Some(i) = inner.upgrade() {
            let mut s = i.state.lock();
            if s.priority == Priority::Ahead {
                run_in_background(tid, true);
            }
            s.tids.push(tid);
        }
        Enlisted {
            inner: inner.clone(),
            tid,
        }
    }

    fn urge(&self, s: &mut State) {
        if s.priority == Priority::Ahead {
            s.priority = Priority::Demand;
            for &tid in &s.tids {
                run_in_background(tid, false);
            }
            log::debug!("{}: decode ahead urged by an open", self.label);
        }
    }

    /// Fetch a chunk's sealed bytes into `buf`: whole, unless the fill decodes ahead and
    /// others read the same disk, in pieces of [`BACKGROUND_PIECE`] then, each once the
    /// disk is quiet (the priority is asked again before each piece, so an open that urges
    /// the fill gets whole reads at once).
    fn fetch_chunk(&self, off: u64, buf: &mut [u8]) -> io::Result<()> {
        // The disk is asked about only while decoding ahead (a fill someone waits for
        // reads whole chunks whoever else reads the disk).
        let ahead = || self.state.lock().priority == Priority::Ahead;
        // Decode ahead's fetchers take turns on a disk others may read, a chunk each, as
        // one fetcher would: its looks answer for the time since the one before, and each
        // read in flight is one more that an engine's own reads wait behind.
        let _turn =
            (self.source.disk_shared.is_some() && ahead()).then(|| self.background_read.lock());
        let whole = buf.len();
        let look = |from: usize| {
            let len = (whole - from) as u64;
            self.source
                .disk_shared
                .as_ref()
                .map_or(DiskLook::Alone, |s| s(off + from as u64, len))
        };
        // A look answers for the time since the one before, so the chunk's own look is
        // the first piece's: looking again at once would ask about no time at all.
        let mut seen = if ahead() { look(0) } else { DiskLook::Alone };
        let shared = seen != DiskLook::Alone;
        let mut done = 0;
        while done < buf.len() {
            if shared {
                if done > 0 {
                    seen = look(done);
                }
                crate::disk_share::yield_to_others(
                    seen == DiskLook::OthersRead,
                    || look(done) == DiskLook::OthersRead,
                    ahead,
                );
            }
            let end = if shared && ahead() {
                (done + BACKGROUND_PIECE).min(buf.len())
            } else {
                buf.len()
            };
            (self.source.fetch)(off + done as u64, &mut buf[done..end])?;
            done = end;
        }
        Ok(())
    }

    fn range(&self, i: usize) -> (u64, u64) {
        let a = i as u64 * CHUNK;
        (a, (a + CHUNK).min(self.len))
    }

    /// Decode every chunk, wanted ones first, else in order from the cursor. Each chunk is
    /// fetched (its sealed bytes brought into its place) and then unlocked in place; the
    /// next chunk is fetched on this thread while the cores unlock the current one, so the
    /// disk and the decode overlap, and the memory of the chunk after it is faulted in
    /// beside them when the disk writes it by DMA.
    fn dispatch(self: &Arc<Self>) {
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

    /// A fetcher: takes queued chunks and brings their sealed bytes into place, until the
    /// fill is over.
    fn fetcher(&self) {
        loop {
            let j = {
                let mut s = self.state.lock();
                loop {
                    if s.cancelled || s.progress != Progress::Filling {
                        return;
                    }
                    if let Some(j) = s.queued.pop_front() {
                        s.fetches[j] = Fetch::Running;
                        break j;
                    }
                    self.fetch_moved.wait(&mut s);
                }
            };
            let (c, _) = self.range(j);
            // SAFETY: a queued chunk is allocated, Pending or Busy with its fetch running:
            // nothing else touches its bytes until its fetch is marked over.
            let buf = unsafe { self.chunk_mut(j) };
            // A fetch that panics fails its chunk: left Running, the dispatcher would wait
            // for it forever.
            let got = std::panic::catch_unwind(AssertUnwindSafe(|| self.fetch_chunk(c, buf)))
                .unwrap_or_else(|_| Err(io::Error::other("fetch panicked")));
            let mut s = self.state.lock();
            s.fetches[j] = match got {
                Ok(()) => Fetch::Fetched,
                Err(e) => Fetch::Failed(e.to_string()),
            };
            self.fetch_moved.notify_all();
        }
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

    /// The bytes of chunk `i` in the mapping.
    ///
    /// # Safety
    /// The caller must be the only one touching chunk `i` (the dispatcher, while the chunk
    /// is not Done) and its memory must be allocated.
    #[allow(clippy::mut_from_ref)]
    unsafe fn chunk_mut(&self, i: usize) -> &mut [u8] {
        let (a, b) = self.range(i);
        self.range_mut(a, (b - a) as usize)
    }

    /// The bytes `[a, a + len)` in the mapping.
    ///
    /// # Safety
    /// As for [`Inner::chunk_mut`], for the chunk that holds the range.
    #[allow(clippy::mut_from_ref)]
    unsafe fn range_mut(&self, a: u64, len: usize) -> &mut [u8] {
        let map = self.map.as_ref().expect("a non-empty file is mapped");
        std::slice::from_raw_parts_mut(map.as_mut_ptr().add(a as usize), len)
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

    /// Ask for the sealed bytes a window ahead of the decoder, following it when a reader
    /// moves it.
    fn prefetch(&self) {
        let Some(prefetch) = &self.source.prefetch else {
            return;
        };
        let mut fetched = 0u64;
        loop {
            let (from, to) = {
                let mut s = self.state.lock();
                loop {
                    if s.cancelled || s.progress != Progress::Filling || s.left == 0 {
                        return;
                    }
                    let at = (s.cursor as u64 * CHUNK).min(self.len);
                    if fetched < at || fetched > at + PREFETCH_WINDOW {
                        fetched = at;
                    }
                    if fetched < (at + PREFETCH_WINDOW).min(self.len) {
                        break;
                    }
                    self.changed.wait(&mut s);
                }
                (fetched, (fetched + PREFETCH_STEP).min(self.len))
            };
            prefetch(from, to - from);
            fetched = to;
        }
    }
}

impl State {
    /// The chunk to decode next (wanted ones first, else in order from the cursor), marked
    /// Busy with the cursor past it.
    fn take_next_chunk(&mut self) -> Option<usize> {
        let mut wanted = None;
        while let Some(w) = self.wanted.pop_front() {
            if self.chunks[w] == Chunk::Pending {
                wanted = Some(w);
                break;
            }
        }
        let n = self.chunks.len();
        let i = wanted.or_else(|| {
            (self.cursor..n)
                .chain(0..self.cursor.min(n))
                .find(|&i| self.chunks[i] == Chunk::Pending)
        })?;
        self.chunks[i] = Chunk::Busy;
        self.cursor = i + 1;
        Some(i)
    }
}

/// Ends the fill as broken if its dispatcher ends without ending it (an unwinding panic
/// outside a chunk's fetch and unlock: the verdict, the seal): the chunks it left are
/// failed, so their reads decode their own range and an open serves through FUSE, where
/// they would wait for a dispatcher that is gone.
struct DispatchEnded(std::sync::Weak<Inner>);

impl Drop for DispatchEnded {
    fn drop(&mut self) {
        let Some(i) = self.0.upgrade() else { return };
        let mut s = i.state.lock();
        if s.progress != Progress::Filling || s.cancelled {
            return;
        }
        for c in s.chunks.iter_mut() {
            if matches!(c, Chunk::Pending | Chunk::Busy) {
                *c = Chunk::Failed;
            }
        }
        s.left = 0;
        s.progress = Progress::Broken;
        log::error!(
            "{}: the fill ended early (a bug: its thread panicked); served through FUSE",
            i.label
        );
        i.changed.notify_all();
        i.fetch_moved.notify_all();
    }
}

/// Marks the fill's hash over when its thread ends, however it ends (an unwinding panic
/// too): opens wait for it.
struct HashEnded(std::sync::Weak<Inner>);

impl Drop for HashEnded {
    fn drop(&mut self) {
        if let Some(i) = self.0.upgrade() {
            let _s = i.state.lock();
            i.hashing.store(false, Ordering::Relaxed);
            i.changed.notify_all();
        }
    }
}

/// The error of an unlock that panicked (a bug): its chunk fails alone.
fn decode_panicked() -> ReadError {
    ReadError::Io(io::Error::other("decode panicked"))
}

fn spawn(name: &str, f: impl FnOnce() + Send + 'static) -> io::Result<()> {
    std::thread::Builder::new()
        .name(name.into())
        .spawn(f)
        .map(drop)
}

#[cfg(test)]
pub(crate) mod tests;
