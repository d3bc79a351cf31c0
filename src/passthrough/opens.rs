//! Opens in passthrough mode: each locked shard (and each file under a manifest) served from
//! its whole decoded copy in private memory, started on its first open or decoded ahead,
//! within the memory budget and limit; what can be given back under pressure.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::{Backing, OpenMode, OpenPolicy, OpenTable, Opened, ServeMode};
use crate::ahead::{Ahead, CheckAhead, FetchAhead, FetchPlan, PageCache};
use crate::fill::{Fill, Priority};
use crate::memfs::{MemoryFile, MemoryFs};
use crate::pressure::Guard;
use crate::view::{Content, Ino, Node, View};
use crate::ReadError;

/// How decoded copies are made and kept in passthrough mode.
#[derive(Debug, Clone)]
pub struct Copies {
    /// How long a decoded copy outlives the last close of its file.
    pub grace: Duration,
    /// Decode the shards an engine will read right after mounting (src/ahead/).
    pub decode_ahead: bool,
    /// How long an open waits for a copy still filling before it is served through FUSE
    /// from the part decoded so far.
    pub open_wait: Duration,
}

impl Default for Copies {
    fn default() -> Copies {
        Copies {
            grace: Duration::from_secs(60),
            decode_ahead: true,
            open_wait: OPEN_WAIT,
        }
    }
}

/// How long an open waits for a decoded copy still filling: a copy nearly done is worth
/// the wait (passthrough then reads at memory speed), and the first byte of any open stays
/// within tens of milliseconds.
pub const OPEN_WAIT: Duration = Duration::from_millis(10);

/// How long an open waits for a copy more than half decoded, and the most it waits for one
/// that has been filling a while (as long again). Its rest takes at most about as long as
/// what is done took, and an engine that opens a shard as decode ahead is on it would
/// otherwise read the whole file through FUSE: seconds for a GiB on two cores against
/// tenths of one (docs/PERFORMANCE-LOG.md). A bound, not a pace: the wait ends early once
/// the copy's pace cannot end it in time (a slow remote source, [`PACE_PROBE`]).
pub const PAST_HALF_WAIT: Duration = Duration::from_secs(2);

/// How far into a long wait for a copy its pace is first judged, at least (a quarter of the
/// wait when that is longer): enough chunks end in it to measure the pace an urged decode
/// keeps (8 MiB chunks at 1-3 GB/s a core), and a copy too far from done costs its open no
/// more.
pub const PACE_PROBE: Duration = Duration::from_millis(50);

/// A copy with more than this left to decode cannot be done within [`OPEN_WAIT`] (the cores
/// decode 2-7 GB/s): its open is served through FUSE at once rather than after the wait.
pub const NEAR_DONE: u64 = 2 * crate::fill::CHUNK;

/// Every open answered in a mode the kernel accepts: the serving mode, the handles open,
/// the decoded copies, and how a backing file is made. `B` is the kernel's backing handle;
/// the adapter passes in the call that makes one from a file, so this runs without a
/// kernel in tests.
pub struct Opens<B> {
    view: Arc<View>,
    mode: Arc<ServeMode>,
    table: Arc<OpenTable<B>>,
    copies: Copies,
    guard: Option<Arc<Guard>>,
    /// Files already logged as served through FUSE for lack of memory.
    told: Arc<Mutex<HashSet<Ino>>>,
    /// Through FUSE: the files under a manifest hashed ahead of their opens.
    check_ahead: std::sync::OnceLock<Arc<CheckAhead>>,
    /// Through FUSE: the shards fetched ahead of their opens (remote parts kept in memory,
    /// local pages in the page cache) and decoded into the kernel's page cache.
    fetch_ahead: std::sync::OnceLock<Arc<FetchAhead>>,
}

impl<B: Send + Sync + 'static> Opens<B> {
    pub fn new(view: Arc<View>, mode: Arc<ServeMode>, copies: Copies) -> Opens<B> {
        Opens {
            view,
            mode,
            table: Arc::new(OpenTable::new(copies.grace)),
            copies,
            guard: None,
            told: Arc::new(Mutex::new(HashSet::new())),
            check_ahead: std::sync::OnceLock::new(),
            fetch_ahead: std::sync::OnceLock::new(),
        }
    }

    /// Decode a shard only while the memory limit has room for it (src/pressure.rs).
    pub fn with_guard(mut self, guard: Arc<Guard>) -> Opens<B> {
        self.guard = Some(guard);
        self
    }

    /// What can be given back under memory pressure.
    pub fn reclaim(&self) -> Reclaim {
        let table = self.table.clone();
        Reclaim {
            copies: Arc::new(move |bytes| table.make_room(bytes)),
            view: self.view.clone(),
        }
    }

    /// What a new decoded copy needs checked first: the memory limit's room, and how to
    /// say once why a file is served through FUSE.
    fn copy_rules(&self) -> CopyRules {
        CopyRules {
            guard: self.guard.clone(),
            reclaim: self.reclaim(),
            told: self.told.clone(),
        }
    }

    pub fn mode(&self) -> &ServeMode {
        &self.mode
    }

    /// Start what runs beside the opens: in passthrough mode the keeper that lets go of
    /// copies whose grace period ended, and decode ahead (src/ahead/); through FUSE, check
    /// ahead, or fetch ahead into `page_cache` (the kernel's, of the mount). Neither ahead
    /// when turned off.
    pub fn start_background(&self, page_cache: Option<Arc<dyn PageCache>>) {
        if self.mode.passthrough().is_none() {
            if self.copies.decode_ahead {
                let fetch = FetchAhead::new();
                let plan = FetchPlan {
                    ahead: fetch.clone(),
                    bound: self.fetch_bound(),
                    page_cache,
                };
                // The index (a GET on a remote source) read once, for both.
                let shards = crate::ahead::order(&self.view);
                if crate::ahead::awaits_any_verdict(&self.view) {
                    // Under a manifest no byte is decoded before its file's verdict: each
                    // shard is fetched ahead right after its check, on the same thread.
                    if let Some(check) = CheckAhead::start(self.view.clone(), shards, Some(plan)) {
                        let _ = self.check_ahead.set(check);
                        let _ = self.fetch_ahead.set(fetch);
                    }
                } else if fetch.start(self.view.clone(), shards, plan) {
                    let _ = self.fetch_ahead.set(fetch);
                }
            }
            return;
        }
        let table = Arc::downgrade(&self.table);
        let tick = self
            .copies
            .grace
            .clamp(Duration::from_millis(100), Duration::from_secs(1));
        let keeper = move || {
            while let Some(table) = table.upgrade() {
                let freed = table.expire(Instant::now());
                if freed > 0 {
                    log::debug!("let go of {freed} bytes of decoded copies closed a while ago");
                }
                drop(table);
                std::thread::sleep(tick);
            }
        };
        if let Err(e) = std::thread::Builder::new()
            .name("kllm-keeper".into())
            .spawn(keeper)
        {
            log::warn!("decoded copies are kept until memory is needed: no keeper thread ({e})");
        }
        if self.copies.decode_ahead {
            let start = {
                let (view, mode, table) =
                    (self.view.clone(), self.mode.clone(), self.table.clone());
                let rules = self.copy_rules();
                move |ino: Ino, rank: usize| {
                    let Some(memory) = mode.passthrough() else {
                        return Ahead::Skipped;
                    };
                    let start =
                        || start_copy(&view, memory, &table, &rules, ino, Priority::Ahead, false);
                    table.decode_ahead(ino, rank, start)
                }
            };
            let mode = self.mode.clone();
            let budget = move || mode.passthrough().map(|m| m.budget());
            crate::ahead::start(self.view.clone(), budget, start);
        }
    }

    /// The most fetch ahead brings in: a quarter of the memory limit. For a local source that
    /// is page cache (which the kernel takes back first, but which counts against a
    /// container's limit); a remote one also keeps within half of `--source-memory`.
    fn fetch_bound(&self) -> u64 {
        let limit = match &self.guard {
            Some(guard) => guard.limits().effective(),
            None => crate::limits::Limits::of_this_process().effective(),
        };
        limit.bytes / 4
    }

    /// Open file `ino` in passthrough mode when possible, backed through `open_backing`,
    /// else through FUSE. A file under a manifest opened through FUSE is hashed first (a
    /// passthrough open checked it while decoding); a mismatch refuses the open.
    pub fn open(
        &self,
        ino: Ino,
        node: &Node,
        open_backing: impl Fn(&std::fs::File) -> std::io::Result<B>,
    ) -> std::result::Result<Opened<B>, ReadError> {
        let opened = match self.mode.passthrough() {
            Some(memory) => self.open_passthrough(ino, node, memory, &open_backing),
            None => Opened::Fuse {
                fh: self.table.open_fuse(ino),
                fill: None,
            },
        };
        if let Opened::Fuse { fh, .. } = opened {
            if let Some(fetch) = self.fetch_ahead.get() {
                if matches!(node.content, Content::Shard { .. }) {
                    fetch.opened(ino);
                }
            }
            if let Some(check) = self.check_ahead.get() {
                if self.view.awaits_verdict(ino) {
                    check.before_verdict(ino);
                }
            }
            if let Err(e) = self.view.verify(ino) {
                self.table.release(fh);
                return Err(e);
            }
        }
        Ok(opened)
    }

    /// The kernel released handle `fh`.
    pub fn release(&self, fh: u64) -> Option<(Ino, OpenMode)> {
        self.table.release(fh)
    }

    /// The decoded copy (filling or complete) a FUSE handle reads from, if any.
    pub fn fill_of(&self, fh: u64) -> Option<Arc<Fill>> {
        self.table.fill_of(fh)
    }

    /// Bytes `[off, off + out.len())` of file `ino` for a read through FUSE on handle `fh`:
    /// from the file's decoded copy when the handle has one (filling or complete), else
    /// decoded for this read.
    pub fn read(&self, fh: u64, ino: Ino, off: u64, out: &mut [u8]) -> Result<usize, ReadError> {
        match self.table.fill_of(fh) {
            Some(fill) => fill.read(off, out),
            None => self.view.read_into(ino, off, out),
        }
    }

    /// Open `node` in passthrough mode where the kernel allows it. A locked shard (and,
    /// under a manifest, a verbatim file, so a later rewrite of the sealed file cannot
    /// reach the kernel unchecked) is served from its decoded copy in private memory; any
    /// other verbatim file is backed by the sealed file itself; bytes held in memory are
    /// served through FUSE.
    fn open_passthrough(
        &self,
        ino: Ino,
        node: &Node,
        memory: &MemoryFs,
        open_backing: &impl Fn(&std::fs::File) -> std::io::Result<B>,
    ) -> Opened<B> {
        // Under a manifest a verbatim file is copied into memory as it is checked, so a
        // later rewrite of the sealed file cannot reach the kernel unchecked; so is one with
        // no local file to hand the kernel (a remote source's).
        let copy = match &node.content {
            Content::Shard { .. } => true,
            Content::Verbatim(object) => {
                node.integrity.is_some() || !matches!(object.local_file(), Ok(Some(_)))
            }
            Content::Memory(_) | Content::Dir(_) => {
                return Opened::Fuse {
                    fh: self.table.open_fuse(ino),
                    fill: None,
                }
            }
        };
        if !copy {
            return self
                .table
                .open_direct(ino, || match self.view.verbatim_file(node) {
                    Ok(f) => self.backing(ino, f, None, open_backing),
                    Err(e) => {
                        log::error!("{}: {e}", self.view.path_of(ino));
                        None
                    }
                });
        }
        let rules = self.copy_rules();
        let start = || {
            start_copy(
                &self.view,
                memory,
                &self.table,
                &rules,
                ino,
                Priority::Demand,
                true,
            )
        };
        let make = |m: &Arc<MemoryFile>| self.backing(ino, m.file(), Some(m.clone()), open_backing);
        let policy = OpenPolicy {
            wait: self.copies.open_wait,
            near: NEAR_DONE,
            past_half: PAST_HALF_WAIT,
            probe: PACE_PROBE,
        };
        let asked = Instant::now();
        let opened = self.table.open_copy(ino, &policy, start, make);
        if log::log_enabled!(log::Level::Debug) {
            let how = match &opened {
                Opened::Passthrough { .. } => "by passthrough".to_string(),
                Opened::Fuse { fill: Some(f), .. } => {
                    format!("through FUSE, {} of {} bytes left", f.left_bytes(), f.len())
                }
                Opened::Fuse { fill: None, .. } => "through FUSE, no copy".to_string(),
            };
            log::debug!(
                "{}: opened {how} after {:?}",
                self.view.path_of(ino),
                asked.elapsed()
            );
        }
        opened
    }

    /// Hand `file` to the kernel as a backing file, or `None` to serve through FUSE.
    fn backing(
        &self,
        ino: Ino,
        file: &std::fs::File,
        memory: Option<Arc<MemoryFile>>,
        open_backing: &impl Fn(&std::fs::File) -> std::io::Result<B>,
    ) -> Option<Backing<B>> {
        match open_backing(file) {
            Ok(id) => Some(Backing {
                id: Arc::new(id),
                memory,
            }),
            Err(e) if e.raw_os_error() == Some(libc::EPERM) => {
                self.mode.turn_off(format!(
                    "the kernel refuses backing files to this process ({e})"
                ));
                None
            }
            Err(e) => {
                log::warn!(
                    "{}: no backing file ({e}); served through FUSE",
                    self.view.path_of(ino)
                );
                None
            }
        }
    }

    /// Handles open now, by mode.
    pub fn open_handles(&self) -> (u64, u64) {
        self.table.open_handles()
    }

    /// Bytes of decoded copies no handle uses (kept after a close, or decoded ahead).
    pub fn kept_bytes(&self) -> u64 {
        self.table.kept_bytes()
    }

    /// Let go of decoded copies no handle uses until `need` bytes are let go (memory
    /// pressure); bytes let go. See [`OpenTable::make_room`] for the order.
    pub fn make_room(&self, need: u64) -> u64 {
        self.table.make_room(need)
    }
}

/// What a new decoded copy is checked against: the memory limit (src/pressure.rs), what can
/// be given back to make room under it, and the files already said to go through FUSE.
struct CopyRules {
    guard: Option<Arc<Guard>>,
    reclaim: Reclaim,
    told: Arc<Mutex<HashSet<Ino>>>,
}

impl CopyRules {
    /// Whether the memory limit has room for `bytes` more, after giving back what must be
    /// (only when `give_back`: decoding ahead never lets other copies go).
    fn room_for(&self, bytes: u64, give_back: bool) -> bool {
        let Some(guard) = &self.guard else {
            return true;
        };
        match guard.shortfall(bytes) {
            0 => true,
            short if give_back => self.reclaim.give_back(short) > 0 && guard.room_for(bytes),
            _ => false,
        }
    }

    /// Log once per file why it is served through FUSE.
    fn tell_once(&self, view: &View, ino: Ino, why: std::fmt::Arguments<'_>) {
        if self.told.lock().insert(ino) {
            log::warn!("{}: {why}; served through FUSE", view.path_of(ino));
        }
    }
}

/// Start a decoded copy of file `ino` in `memory`. A file larger than the whole budget is
/// never copied. When the budget or the memory limit is full and `make_room`, copies no
/// handle uses are let go first (see [`OpenTable::make_room`]). `None` (said once per file)
/// when there is no room or no copy could be made: the file is then served through FUSE.
fn start_copy<B>(
    view: &Arc<View>,
    memory: &MemoryFs,
    table: &OpenTable<B>,
    rules: &CopyRules,
    ino: Ino,
    priority: Priority,
    make_room: bool,
) -> Option<Arc<Fill>> {
    let len = view.node(ino)?.attr.size;
    if len > memory.budget() {
        if make_room {
            rules.tell_once(
                view,
                ino,
                format_args!(
                    "its {} MiB do not fit the passthrough memory ({} MiB)",
                    len >> 20,
                    memory.budget() >> 20
                ),
            );
        }
        return None;
    }
    if !rules.room_for(len, make_room) {
        if make_room {
            rules.tell_once(
                view,
                ino,
                format_args!("the memory limit has no room for its {} MiB now", len >> 20),
            );
        }
        return None;
    }
    let mut reservation = memory.reserve(len);
    if reservation.is_none() && make_room && table.make_room(len) > 0 {
        // What was let go is freed as its fill threads stop (within one chunk).
        let deadline = Instant::now() + Duration::from_secs(2);
        while reservation.is_none() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
            reservation = memory.reserve(len);
        }
    }
    let Some(reservation) = reservation else {
        if make_room {
            log::warn!(
                "{}: the passthrough memory budget is full; served through FUSE",
                view.path_of(ino)
            );
        }
        return None;
    };
    match Fill::of_view(view, ino, memory, reservation, priority) {
        Ok(f) => Some(Arc::new(f)),
        Err(e) => {
            log::warn!(
                "{}: no decoded copy ({e}); served through FUSE",
                view.path_of(ino)
            );
            None
        }
    }
}

/// What a mount can let go of at any time, to stay under its memory limit: decoded copies
/// no file uses (closed longest ago first, then those decoded ahead), then the FUSE path's
/// cached blocks, then the buffers kept for reuse (the fills' piece buffers, the wiped
/// ones). Shared with the pressure watcher (src/pressure.rs).
#[derive(Clone)]
pub struct Reclaim {
    copies: Arc<dyn Fn(u64) -> u64 + Send + Sync>,
    view: Arc<View>,
}

impl Reclaim {
    /// Free at least `bytes` if that much can be freed; returns the bytes freed. A copy
    /// still mapped by a reader is freed by the kernel at its last unmap.
    pub fn give_back(&self, bytes: u64) -> u64 {
        let mut freed = (self.copies)(bytes);
        if freed < bytes {
            freed += self.view.cache().shed(bytes - freed);
        }
        if freed < bytes {
            // Dropped, the piece buffers go to the pool of wiped buffers: drained first.
            crate::fill::drain_piece_buffers();
            freed += crate::secmem::drain_pool();
        }
        freed
    }
}
