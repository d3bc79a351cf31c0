//! Which opens the kernel serves by itself, and the bookkeeping that keeps it right.
//!
//! With FUSE passthrough the kernel serves `read`, page faults of `mmap` and readahead of an
//! open file straight from a backing file, without the daemon. A locked shard's backing
//! file is its whole decoded copy in private memory ([`crate::memfs`]), made on its first
//! open and shared by every later open; a file shown verbatim is backed by itself.
//!
//! The kernel holds each inode in one I/O mode at a time: while any handle of it is open in
//! passthrough mode every new open must be too, with the same backing file, and while any
//! is open through the page cache none may be passthrough. [`OpenTable`] tracks the handles
//! of each inode to answer every open in the mode the kernel accepts. It is generic over
//! the kernel's backing handle so it can be tested without a kernel.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex, MutexGuard};

use crate::ahead::{Ahead, CheckAhead};
use crate::fill::{Fill, Priority};
use crate::memfs::{MemoryFile, MemoryFs};
use crate::pressure::Guard;
use crate::view::{Content, Ino, Node, View};
use crate::{Error, ReadError, Result};

/// The serving mode asked for on the command line.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Requested {
    /// Passthrough where the kernel and privileges allow it, else FUSE.
    Auto,
    /// Passthrough, or refuse to mount.
    Passthrough,
    /// Every read through the daemon.
    Fuse,
}

/// The mode the daemon serves in, decided at mount and at the kernel's INIT, and turned
/// off for good if the kernel refuses a backing file for a reason no open can fix.
pub struct ServeMode {
    requested: Requested,
    memory: Option<MemoryFs>,
    on: AtomicBool,
    why_not: Mutex<Option<String>>,
    /// The other budgets and the limit they come from, for the log line.
    note: Option<String>,
}

impl ServeMode {
    /// Make the private memory passthrough needs, or say why not: an error only when
    /// passthrough was demanded.
    pub fn choose(requested: Requested, memory_budget: u64) -> Result<ServeMode> {
        let memory = match requested {
            Requested::Fuse => Err("--mode fuse".to_string()),
            _ if !rustix::process::geteuid().is_root() => {
                Err("backing files need root (CAP_SYS_ADMIN)".to_string())
            }
            _ => MemoryFs::new(memory_budget)
                .map_err(|e| format!("no private memory file system ({e})")),
        };
        match memory {
            Ok(m) => Ok(ServeMode {
                requested,
                memory: Some(m),
                on: AtomicBool::new(true),
                why_not: Mutex::new(None),
                note: None,
            }),
            Err(why) if requested == Requested::Passthrough => Err(Error::new(format!(
                "--mode passthrough is not possible here: {why}"
            ))),
            Err(why) => Ok(ServeMode {
                requested,
                memory: None,
                on: AtomicBool::new(false),
                why_not: Mutex::new(Some(why)),
                note: None,
            }),
        }
    }

    /// What the startup log line adds after the mode: the budgets and their limit.
    pub fn with_note(mut self, note: String) -> ServeMode {
        self.note = Some(note);
        self
    }

    pub fn requested(&self) -> Requested {
        self.requested
    }

    /// The private memory, whether passthrough is on or was turned off.
    pub fn memory(&self) -> Option<&MemoryFs> {
        self.memory.as_ref()
    }

    /// The private memory, while passthrough is on.
    pub fn passthrough(&self) -> Option<&MemoryFs> {
        self.memory
            .as_ref()
            .filter(|_| self.on.load(Ordering::Relaxed))
    }

    /// Serve every later open through FUSE, and say why once.
    pub fn turn_off(&self, why: String) {
        if self.on.swap(false, Ordering::Relaxed) {
            log::warn!("passthrough off, serving through FUSE: {why}");
            *self.why_not.lock() = Some(why);
        }
    }

    /// `passthrough`, or `fuse` and why.
    pub fn describe(&self) -> (&'static str, Option<String>) {
        match self.passthrough() {
            Some(_) => ("passthrough", None),
            None => ("fuse", self.why_not.lock().clone()),
        }
    }

    /// The kernel offered no passthrough at INIT: why, as an error if `--mode passthrough`
    /// demanded it, else serve through FUSE.
    pub fn kernel_offers_none(&self) -> std::result::Result<(), &'static str> {
        let why = "the kernel offers no FUSE passthrough (Linux 6.9+ with CONFIG_FUSE_PASSTHROUGH)";
        if self.requested == Requested::Passthrough {
            return Err(why);
        }
        self.turn_off(why.into());
        Ok(())
    }

    /// The one log line saying which mode is in use and why.
    pub fn log(&self) {
        let note = self.note.as_deref().unwrap_or("");
        match (self.describe(), &self.memory) {
            (("passthrough", _), Some(m)) => log::warn!(
                "serving in passthrough mode: the kernel reads decoded shards from private memory (budget {} MiB in {} folios; {note})",
                m.budget() >> 20,
                m.pages().name()
            ),
            ((_, why), _) => log::warn!(
                "serving through FUSE: {} ({note})",
                why.unwrap_or_else(|| "passthrough unavailable".into())
            ),
        }
    }
}

/// How decoded copies are made and kept in passthrough mode.
#[derive(Debug, Clone)]
pub struct Copies {
    /// How long a decoded copy outlives the last close of its file.
    pub grace: Duration,
    /// Decode the shards an engine will read right after mounting (src/ahead.rs).
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
    /// copies whose grace period ended, and decode ahead (src/ahead.rs); through FUSE, check
    /// ahead. Neither ahead when turned off.
    pub fn start_background(&self) {
        if self.mode.passthrough().is_none() {
            if self.copies.decode_ahead {
                if let Some(check) = CheckAhead::start(self.view.clone()) {
                    let _ = self.check_ahead.set(check);
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
        };
        self.table.open_copy(ino, &policy, start, make)
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
/// cached blocks, then the wiped buffers kept for reuse. Shared with the pressure watcher
/// (src/pressure.rs).
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
            freed += crate::secmem::drain_pool();
        }
        freed
    }
}

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
}

struct InodeOpens<B> {
    passthrough: u32,
    fuse: u32,
    backing: Option<Backing<B>>,
    /// The file's decoded copy, filling or complete. It outlives the last close by the
    /// table's grace period, so the next open of a normal load finds it.
    fill: Option<Arc<Fill>>,
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
struct InodeSlot<B> {
    state: Mutex<InodeOpens<B>>,
    released: Condvar,
}

type Inode<B> = Arc<InodeSlot<B>>;

/// How long an open that waited for a file's verdict then waits for a copy already decoded
/// whole to be sealed and handed out (a check of the verdict, a `fchmod` and a reopen:
/// milliseconds, more on a loaded machine). A bound, not a pace.
const SEAL_WAIT: Duration = Duration::from_secs(5);

/// How long an open of a file whose copy is complete waits for the inode's FUSE handles to
/// go: the kernel sends RELEASE after `close` returns, so a reopen right after a close
/// would otherwise find the inode still open through the page cache.
const RELEASE_WAIT: Duration = Duration::from_millis(20);

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

    fn inode(&self, ino: Ino) -> Inode<B> {
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
    /// waited for up to `policy.wait`: complete, it backs a passthrough open (`make`);
    /// still filling, the open is served through FUSE from the part already decoded, so no
    /// open waits for a whole decode. Without a copy (no memory for one) the open is served
    /// through FUSE, decoded per read. `start` and `make` run under the inode's lock, so
    /// concurrent first opens share one decode.
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
        if fill.complete().is_none() && fill.awaits_verdict() {
            // No byte of the copy is served before the file's verdict, so a handle opened
            // through FUSE now would wait for it as long, then read the whole file through
            // the daemon; waiting here gets the copy to the kernel instead. The inode is
            // not held meanwhile: what other opens and closes did is asked again after.
            MutexGuard::unlocked(&mut state, || {
                fill.wait_verdict();
                if fill.left_bytes() == 0 {
                    fill.wait_complete(SEAL_WAIT);
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

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
        let (Opened::Passthrough { id: ia, .. }, Opened::Passthrough { id: ib, .. }) = (&a, &b)
        else {
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
        let make = move |off, buf: &mut [u8]| {
            std::thread::sleep(per_chunk);
            for (i, b) in buf.iter_mut().enumerate() {
                *b = ((off + i as u64) % 253) as u8;
            }
            Ok(())
        };
        let unlock = move |off, buf: &mut [u8]| {
            make(off, buf)?;
            made.fetch_add(buf.len() as u64, Ordering::SeqCst);
            Ok(())
        };
        let source = Input {
            fetch: Box::new(|_, _| Ok(())),
            unlock: Box::new(unlock),
            decode: Box::new(make),
            check,
            prefetch: None,
            fetch_is_dma: Box::new(|_, _| false),
            disk_shared: None,
            in_page_cache: None,
            fetch_ahead: 1,
            digest: None,
            completed: None,
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
        // A one-chunk fill finishes within the wait (or the open is served from it).
        if let Opened::Fuse { fill, .. } = &o {
            assert!(fill.is_some(), "a FUSE open without the copy");
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
                if m.load(Ordering::SeqCst) >= len
                    && started.elapsed() >= Duration::from_millis(300)
                {
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
        let started = Instant::now();
        let a = t.open_copy(
            9,
            &WAIT,
            || Some(fill(20 * CHUNK, Duration::from_millis(25))),
            backed(&live),
        );
        assert!(started.elapsed() < Duration::from_millis(400));
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
}
