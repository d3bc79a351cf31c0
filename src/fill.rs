//! A file being decoded into private memory chunk by chunk, readable while it fills.
//!
//! A whole-shard decode takes seconds for a real shard (2-10 GB), and the kernel can hand a
//! backing file to passthrough opens only once it is complete. A `Fill` lets the first
//! readers start at once: one dispatcher thread decodes the file in order, a chunk at a
//! time on all cores; a reader that needs a chunk not yet decoded waits for it and moves
//! the dispatcher there (then on from there: a sequential reader keeps the decoder just
//! ahead of it); a prefetch thread asks the kernel for the sealed bytes a window ahead, so
//! the disk reads while the cores decode. Once every chunk is decoded and the file's
//! integrity verdict is in, the file is sealed read-only and handed out for passthrough.
//!
//! A chunk that fails to decode (a corrupt value, an I/O error, a rewritten sealed file) is
//! never served from memory: a read that touches it decodes exactly its own range, which
//! fails only if the range holds the bad bytes, and the fill never completes.
//!
//! Fills started ahead of any open (decode-ahead) run at low priority: a nice 19 thread
//! pool and nice 19 helper threads. The first reader or open that waits for one raises it
//! to the normal priority for the rest of the file.

use std::collections::VecDeque;
use std::fs::File;
use std::io;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use crate::memfs::{MemoryFile, MemoryFs, Reservation};
use crate::view::{Ino, View};
use crate::ReadError;

/// Bytes decoded as one step: large enough to spread over all cores, small enough that a
/// first reader waits only milliseconds. A multiple of the 2 MiB page.
pub const CHUNK: u64 = 8 << 20;
/// How far ahead of the decoder the sealed bytes are asked for.
const PREFETCH_WINDOW: u64 = 64 << 20;
const PREFETCH_STEP: u64 = 16 << 20;
/// The nice value of work done ahead of any open.
const AHEAD_NICE: i32 = 19;

/// Decoded bytes of the file at an offset, any range (the view's read path).
pub type DecodeFn = dyn Fn(u64, &mut [u8]) -> Result<(), ReadError> + Send + Sync;
/// The file's integrity verdict; the first call hashes it, later ones return the verdict.
pub type CheckFn = dyn Fn() -> Result<(), ReadError> + Send + Sync;
/// A hint that the sealed bytes of `[off, off + len)` are about to be read.
pub type PrefetchFn = dyn Fn(u64, u64) + Send + Sync;
/// Turns the filled, writable file into the read-only file handed to the kernel.
pub type SealFn = dyn FnOnce(File) -> io::Result<MemoryFile> + Send;

/// Where a fill's bytes go: a writable file, allocated chunk by chunk in file order (the
/// page size follows the step), and what turns it into the file the kernel gets.
pub struct Target {
    pub file: File,
    pub len: u64,
    /// Allocation step (see `memfs::allocate_range`); 0 when the file is allocated already.
    pub step: u64,
    pub seal: Box<SealFn>,
    /// The budget claimed for the file, given back when the fill is dropped.
    pub reservation: Option<crate::memfs::Reservation>,
}

/// Where a fill's bytes come from.
pub struct Source {
    pub decode: Box<DecodeFn>,
    pub check: Option<Box<CheckFn>>,
    pub prefetch: Option<Box<PrefetchFn>>,
}

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
    /// Threads working for this fill, reniced when it is urged.
    tids: Vec<libc::pid_t>,
}

struct Inner {
    len: u64,
    step: u64,
    _reservation: Option<crate::memfs::Reservation>,
    /// The writable shared mapping of the file being filled; read-only once complete.
    map: Option<memmap2::MmapRaw>,
    file: Mutex<Option<File>>,
    seal: Mutex<Option<Box<SealFn>>>,
    source: Source,
    state: Mutex<State>,
    changed: Condvar,
    started: Instant,
    label: String,
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
        source: Source,
        priority: Priority,
        label: String,
    ) -> io::Result<Fill> {
        let Target {
            file,
            len,
            step,
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
            step,
            _reservation: reservation,
            map,
            file: Mutex::new(Some(file)),
            seal: Mutex::new(Some(seal)),
            source,
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
            }),
            changed: Condvar::new(),
            started: Instant::now(),
            label,
        });
        if inner.source.check.is_some() {
            let i = inner.clone();
            spawn("kllm-hash", move || {
                i.enlist();
                if let Some(check) = &i.source.check {
                    let _ = check();
                }
            })?;
        }
        if inner.source.prefetch.is_some() && len > 0 {
            let i = inner.clone();
            spawn("kllm-prefetch", move || {
                i.enlist();
                i.prefetch();
            })?;
        }
        let i = inner.clone();
        spawn("kllm-fill", move || {
            i.enlist();
            i.dispatch();
        })?;
        Ok(Fill { inner })
    }

    /// Decode file `ino` of the view into a new file of `memory`, whose budget
    /// `reservation` claims. Reads are checked against the manifest the view holds for
    /// the file, and the sealed bytes are read ahead of the decoder.
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
        let (v, c, p) = (view.clone(), view.clone(), view.clone());
        let decode = move |off: u64, buf: &mut [u8]| match v.read_unchecked(ino, off, buf)? {
            n if n == buf.len() => Ok(()),
            n => Err(ReadError::Io(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                format!("{n} of {} bytes at {off}", buf.len()),
            ))),
        };
        let check: Option<Box<CheckFn>> = match node.integrity {
            Some(_) => Some(Box::new(move || c.verify(ino))),
            None => None,
        };
        let source = Source {
            decode: Box::new(decode),
            check,
            prefetch: Some(Box::new(move |off, len| p.will_read(ino, off, len))),
        };
        let target = Target {
            file: memory.create()?,
            len: node.attr.size,
            step: memory.pages().step(),
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

    pub fn priority(&self) -> Priority {
        self.inner.state.lock().priority
    }

    /// Bytes `[off, off + out.len())` of the file, cut at its end: from memory once decoded
    /// (waiting for the chunks not yet, and moving the decoder to them), else decoded for
    /// this read alone. Never before the file's integrity verdict is good.
    pub fn read(&self, off: u64, out: &mut [u8]) -> Result<usize, ReadError> {
        let inner = &self.inner;
        if let Some(check) = &inner.source.check {
            check()?;
        }
        let len = inner.len.saturating_sub(off).min(out.len() as u64) as usize;
        if len == 0 {
            return Ok(0);
        }
        let end = off + len as u64;
        let (first, last) = ((off / CHUNK) as usize, ((end - 1) / CHUNK) as usize);
        let mut ready = Vec::with_capacity(last - first + 1);
        {
            let mut s = inner.state.lock();
            for i in first..=last {
                while matches!(s.chunks[i], Chunk::Pending | Chunk::Busy) && !s.cancelled {
                    if s.chunks[i] == Chunk::Pending && !s.wanted.contains(&i) {
                        s.wanted.push_back(i);
                    }
                    inner.urge(&mut s);
                    inner.changed.notify_all();
                    inner.changed.wait(&mut s);
                }
                ready.push(s.chunks[i] == Chunk::Done);
            }
        }
        let map = inner.map.as_ref().expect("a non-empty file is mapped");
        for (k, i) in (first..=last).enumerate() {
            let a = off.max(i as u64 * CHUNK);
            let b = end.min((i as u64 + 1) * CHUNK);
            let dst = &mut out[(a - off) as usize..(b - off) as usize];
            if ready[k] {
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
        Ok(len)
    }
}

impl Drop for Fill {
    fn drop(&mut self) {
        let mut s = self.inner.state.lock();
        s.cancelled = true;
        self.inner.changed.notify_all();
    }
}

impl Inner {
    /// Record the calling thread as working for this fill, at its priority.
    fn enlist(&self) {
        // SAFETY: gettid has no preconditions.
        let tid = unsafe { libc::gettid() };
        let mut s = self.state.lock();
        if s.priority == Priority::Ahead {
            renice(tid, AHEAD_NICE);
        }
        s.tids.push(tid);
    }

    fn urge(&self, s: &mut State) {
        if s.priority == Priority::Ahead {
            s.priority = Priority::Demand;
            for &tid in &s.tids {
                renice(tid, 0);
            }
            log::debug!("{}: decode ahead urged by an open", self.label);
        }
    }

    fn range(&self, i: usize) -> (u64, u64) {
        let a = i as u64 * CHUNK;
        (a, (a + CHUNK).min(self.len))
    }

    /// Decode every chunk, wanted ones first, else in order from the cursor.
    fn dispatch(self: &Arc<Self>) {
        let mut failures = 0usize;
        // Memory is allocated in file order up to the chunk decoded, so that the page size
        // stays the step's even when a reader moves the decoder ahead.
        let mut allocated = if self.step == 0 { self.len } else { 0 };
        loop {
            let (i, priority) = {
                let mut s = self.state.lock();
                if s.cancelled {
                    return;
                }
                let Some(i) = s.next_chunk() else { break };
                s.chunks[i] = Chunk::Busy;
                s.cursor = i + 1;
                self.changed.notify_all();
                (i, s.priority)
            };
            let (a, b) = self.range(i);
            let map = self.map.as_ref().expect("a non-empty file is mapped");
            // SAFETY: chunk `i` is Busy: only this thread touches its bytes until it is
            // marked Done or Failed below.
            let buf = unsafe {
                std::slice::from_raw_parts_mut(map.as_mut_ptr().add(a as usize), (b - a) as usize)
            };
            let mut decode = move || (self.source.decode)(a, buf);
            let result = match self.allocate(allocated, b) {
                Err(e) => Err(ReadError::Io(e)),
                Ok(()) => {
                    allocated = allocated.max(b);
                    match priority {
                        Priority::Demand => decode(),
                        Priority::Ahead => match ahead_pool() {
                            Some(pool) => pool.install(decode),
                            None => decode(),
                        },
                    }
                }
            };
            let mut s = self.state.lock();
            s.left -= 1;
            s.chunks[i] = match &result {
                Ok(()) => Chunk::Done,
                Err(e) => {
                    if failures == 0 {
                        log::warn!(
                            "{}: bytes {a}..{b} not decoded ({e}); reads there decode their own range",
                            self.label
                        );
                    }
                    failures += 1;
                    Chunk::Failed
                }
            };
            self.changed.notify_all();
        }
        let verdict = match &self.source.check {
            Some(check) => check(),
            None => Ok(()),
        };
        let sealed = match (failures, verdict) {
            (0, Ok(())) => self.seal(),
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
    }

    fn allocate(&self, from: u64, to: u64) -> io::Result<()> {
        if from >= to {
            return Ok(());
        }
        match self.file.lock().as_ref() {
            Some(f) => crate::memfs::allocate_range(f, from, to, self.step),
            None => Err(io::Error::other("the file is sealed")),
        }
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
    fn next_chunk(&mut self) -> Option<usize> {
        while let Some(w) = self.wanted.pop_front() {
            if self.chunks[w] == Chunk::Pending {
                return Some(w);
            }
        }
        let n = self.chunks.len();
        (self.cursor..n)
            .chain(0..self.cursor.min(n))
            .find(|&i| self.chunks[i] == Chunk::Pending)
    }
}

/// The pool decode-ahead runs on: as many threads as cores, each at nice 19, so an engine
/// starting up (and any reader) keeps the cores it needs.
fn ahead_pool() -> Option<&'static rayon::ThreadPool> {
    static POOL: OnceLock<Option<rayon::ThreadPool>> = OnceLock::new();
    POOL.get_or_init(|| {
        rayon::ThreadPoolBuilder::new()
            .thread_name(|i| format!("kllm-ahead-{i}"))
            .start_handler(|_| {
                // SAFETY: gettid has no preconditions.
                renice(unsafe { libc::gettid() }, AHEAD_NICE)
            })
            .build()
            .map_err(|e| log::warn!("no decode-ahead pool ({e}); decoding ahead at full priority"))
            .ok()
    })
    .as_ref()
}

fn renice(tid: libc::pid_t, nice: i32) {
    // SAFETY: setpriority on one thread id; on Linux PRIO_PROCESS with a thread id affects
    // that thread alone. Lowering the value again needs CAP_SYS_NICE, which passthrough's
    // root has; without it the thread stays niced, which costs speed, not correctness.
    unsafe { libc::setpriority(libc::PRIO_PROCESS, tid as libc::id_t, nice) };
}

fn spawn(name: &str, f: impl FnOnce() + Send + 'static) -> io::Result<()> {
    std::thread::Builder::new()
        .name(name.into())
        .spawn(f)
        .map(drop)
}

#[cfg(test)]
mod tests {
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
            step: 1 << 20,
            seal: Box::new(crate::memfs::seal),
            reservation: None,
        }
    }

    fn source(
        decode: impl Fn(u64, &mut [u8]) -> Result<(), ReadError> + Send + Sync + 'static,
    ) -> Source {
        Source {
            decode: Box::new(decode),
            check: None,
            prefetch: None,
        }
    }

    fn start(len: u64, src: Source, p: Priority) -> Fill {
        Fill::start(scratch(len), src, p, "test".into()).unwrap()
    }

    fn expect(off: u64, got: &[u8]) {
        for (i, &b) in got.iter().enumerate() {
            assert_eq!(b, byte(off + i as u64), "byte {}", off + i as u64);
        }
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

    #[test]
    fn nothing_is_served_before_a_good_verdict() {
        let checked = Arc::new(AtomicBool::new(false));
        let c = checked.clone();
        let src = Source {
            decode: Box::new(decode_ok),
            check: Some(Box::new(move || {
                std::thread::sleep(Duration::from_millis(100));
                c.store(true, Ordering::SeqCst);
                Ok(())
            })),
            prefetch: None,
        };
        let f = start(2 * CHUNK, src, Priority::Demand);
        let mut out = vec![0u8; 16];
        // The check runs once on its thread; a reader's call here stands in for the
        // view's verdict, which waits for that one hash.
        f.read(0, &mut out).unwrap();
        assert!(f.wait_complete(Duration::from_secs(30)).is_some());
        assert!(checked.load(Ordering::SeqCst));

        let bad = Source {
            decode: Box::new(decode_ok),
            check: Some(Box::new(|| Err(ReadError::Unverified("altered".into())))),
            prefetch: None,
        };
        let f = start(2 * CHUNK, bad, Priority::Demand);
        assert!(matches!(f.read(0, &mut out), Err(ReadError::Unverified(_))));
        assert!(f.wait_complete(Duration::from_secs(30)).is_none());
        assert_eq!(f.progress(), Progress::Broken);
    }

    #[test]
    fn prefetch_runs_ahead_of_the_decoder() {
        let asked = Arc::new(AtomicUsize::new(0));
        let a = asked.clone();
        let src = Source {
            decode: Box::new(decode_ok),
            check: None,
            prefetch: Some(Box::new(move |_off, len| {
                a.fetch_add(len as usize, Ordering::SeqCst);
            })),
        };
        let len = 20 * CHUNK;
        let f = start(len, src, Priority::Ahead);
        assert!(f.wait_complete(Duration::from_secs(60)).is_some());
        assert!(asked.load(Ordering::SeqCst) as u64 >= PREFETCH_WINDOW.min(len));
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
        std::thread::sleep(Duration::from_millis(50));
        drop(f);
        std::thread::sleep(Duration::from_millis(200));
        let n = calls.load(Ordering::SeqCst);
        std::thread::sleep(Duration::from_millis(200));
        assert_eq!(
            calls.load(Ordering::SeqCst),
            n,
            "still decoding after the drop"
        );
        assert!(n < 100);
    }

    #[test]
    fn an_empty_file_completes_at_once() {
        let f = start(0, source(decode_ok), Priority::Demand);
        assert!(f.wait_complete(Duration::from_secs(5)).is_some());
        assert_eq!(f.read(0, &mut [0u8; 8]).unwrap(), 0);
    }
}
