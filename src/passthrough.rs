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

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;

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
                "serving in passthrough mode: the kernel reads decoded shards from private memory (budget {} MiB; {note})",
                m.budget() >> 20
            ),
            ((_, why), _) => log::warn!(
                "serving through FUSE: {} ({note})",
                why.unwrap_or_else(|| "passthrough unavailable".into())
            ),
        }
    }
}

/// Every open answered in a mode the kernel accepts: the serving mode, the handles open,
/// and how a backing file is made. `B` is the kernel's backing handle; the adapter passes
/// in the call that makes one from a file, so this runs without a kernel in tests.
pub struct Opens<B> {
    view: Arc<View>,
    mode: Arc<ServeMode>,
    table: OpenTable<B>,
    guard: Option<Arc<Guard>>,
    /// Files already logged as served through FUSE for lack of memory.
    told: Mutex<HashSet<Ino>>,
}

impl<B> Opens<B> {
    /// `kept_shards`: bytes of decoded shards kept after their last close, for a reopen.
    pub fn new(view: Arc<View>, mode: Arc<ServeMode>, kept_shards: u64) -> Opens<B> {
        Opens {
            view,
            mode,
            table: OpenTable::new(kept_shards),
            guard: None,
            told: Mutex::new(HashSet::new()),
        }
    }

    /// Decode a shard only while the memory limit has room for it (src/pressure.rs).
    pub fn with_guard(mut self, guard: Arc<Guard>) -> Opens<B> {
        self.guard = Some(guard);
        self
    }

    /// What can be given back under memory pressure.
    pub fn reclaim(&self) -> Reclaim {
        Reclaim {
            kept: self.table.kept.clone(),
            view: self.view.clone(),
        }
    }

    /// Whether the memory limit has room for `bytes` more, after giving back what must be.
    fn room_for(&self, bytes: u64) -> bool {
        let Some(guard) = &self.guard else {
            return true;
        };
        match guard.shortfall(bytes) {
            0 => true,
            short => self.reclaim().give_back(short) > 0 && guard.room_for(bytes),
        }
    }

    /// Log once per file why it is served through FUSE.
    fn tell_once(&self, ino: Ino, why: std::fmt::Arguments<'_>) {
        if self.told.lock().insert(ino) {
            log::warn!("{}: {why}; served through FUSE", self.view.path_of(ino));
        }
    }

    pub fn mode(&self) -> &ServeMode {
        &self.mode
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
            Some(_) => self
                .table
                .open(ino, |kept| self.backing(ino, node, kept, &open_backing)),
            None => Opened::Fuse {
                fh: self.table.open_fuse(ino),
            },
        };
        if let Opened::Fuse { fh } = opened {
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

    /// A backing file for a passthrough open of `node`, or `None` to serve it through
    /// FUSE: the decoded copy of a locked shard (`kept` if an earlier open left one), or
    /// the sealed file itself for a file shown verbatim.
    fn backing(
        &self,
        ino: Ino,
        node: &Node,
        kept: Option<Arc<MemoryFile>>,
        open_backing: &impl Fn(&std::fs::File) -> std::io::Result<B>,
    ) -> Option<Backing<B>> {
        // Under a manifest a verbatim file is copied into memory as it is checked, so a
        // later rewrite of the sealed file cannot reach the kernel unchecked; so is one with
        // no local file to hand the kernel (a remote source's).
        let copy = match &node.content {
            Content::Shard { .. } => true,
            Content::Verbatim(object) => {
                node.integrity.is_some() || !matches!(object.local_file(), Ok(Some(_)))
            }
            Content::Memory(_) | Content::Dir(_) => return None,
        };
        let memory = match (copy, kept) {
            (false, _) => None,
            (true, Some(m)) => Some(m),
            (true, None) => Some(self.decode(ino, node)?),
        };
        let opened = match &memory {
            Some(m) => open_backing(m.file()),
            None => match self.view.verbatim_file(node) {
                Ok(f) => open_backing(f),
                Err(e) => {
                    log::error!("{}: {e}", self.view.path_of(ino));
                    return None;
                }
            },
        };
        match opened {
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

    /// Decode a whole locked shard into private memory, on all cores, checking it against
    /// the manifest at the same time. When the budget is full, shards kept after their
    /// last close make room; failing that, the open is served through FUSE.
    fn decode(&self, ino: Ino, node: &Node) -> Option<Arc<MemoryFile>> {
        let memory = self.mode.passthrough()?;
        let size = node.attr.size;
        if size > memory.budget() {
            self.tell_once(
                ino,
                format_args!(
                    "its {} MiB do not fit the passthrough memory ({} MiB)",
                    size >> 20,
                    memory.budget() >> 20
                ),
            );
            return None;
        }
        if !self.room_for(size) {
            self.tell_once(
                ino,
                format_args!(
                    "the memory limit has no room for its {} MiB now",
                    size >> 20
                ),
            );
            return None;
        }
        let fill = |buf: &mut [u8]| self.view.read_whole(ino, buf);
        let started = std::time::Instant::now();
        let mut result = memory.fill(node.attr.size, fill);
        if result.as_ref().is_err_and(is_full) && self.table.drop_kept() > 0 {
            result = memory.fill(node.attr.size, fill);
        }
        match result {
            Ok(m) => {
                log::debug!(
                    "{}: decoded {} bytes in {:?}",
                    self.view.path_of(ino),
                    m.len(),
                    started.elapsed()
                );
                Some(Arc::new(m))
            }
            Err(e) => {
                let why = if is_full(&e) {
                    "the passthrough memory budget is full".to_string()
                } else {
                    format!("not decoded whole ({e})")
                };
                log::warn!("{}: {why}; served through FUSE", self.view.path_of(ino));
                None
            }
        }
    }
}

/// The kernel refused memory past the private tmpfs's size: the budget is full.
fn is_full(e: &ReadError) -> bool {
    matches!(e, ReadError::Io(e) if e.raw_os_error() == Some(libc::ENOSPC))
}

/// What a mount can let go of at any time, to stay under its memory limit: decoded shards
/// kept after their last close (oldest first), then the FUSE path's cached blocks, then
/// the wiped buffers kept for reuse. Shared with the pressure watcher (src/pressure.rs).
#[derive(Clone)]
pub struct Reclaim {
    kept: Arc<Mutex<Kept>>,
    view: Arc<View>,
}

impl Reclaim {
    /// Free at least `bytes` if that much can be freed; returns the bytes freed. A kept
    /// shard still mapped by a reader is freed by the kernel at its last unmap.
    pub fn give_back(&self, bytes: u64) -> u64 {
        let mut freed = self.kept.lock().shed(bytes);
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

/// What an open got.
pub enum Opened<B> {
    Passthrough { fh: u64, id: Arc<B> },
    Fuse { fh: u64 },
}

#[derive(Default)]
struct InodeOpens<B> {
    passthrough: u32,
    fuse: u32,
    backing: Option<Backing<B>>,
}

/// The open handles of every inode, and decoded shards kept after their last close.
pub struct OpenTable<B> {
    inodes: Mutex<HashMap<Ino, Arc<Mutex<InodeOpens<B>>>>>,
    handles: Mutex<HashMap<u64, (Ino, OpenMode)>>,
    next_fh: AtomicU64,
    kept: Arc<Mutex<Kept>>,
}

/// Decoded shards with no open handle, newest last, held within `budget` bytes so a
/// reopen (a second reader, a warm re-read) finds them decoded.
struct Kept {
    shards: VecDeque<(Ino, Arc<MemoryFile>)>,
    budget: u64,
}

impl Kept {
    fn bytes(&self) -> u64 {
        self.shards.iter().map(|(_, m)| m.len()).sum()
    }

    fn take(&mut self, ino: Ino) -> Option<Arc<MemoryFile>> {
        let i = self.shards.iter().position(|(i, _)| *i == ino)?;
        self.shards.remove(i).map(|(_, m)| m)
    }

    /// Let go of the oldest kept shards until `bytes` are freed (or none is left).
    fn shed(&mut self, bytes: u64) -> u64 {
        let mut freed = 0;
        while freed < bytes {
            match self.shards.pop_front() {
                Some((_, m)) => freed += m.len(),
                None => break,
            }
        }
        freed
    }

    fn keep(&mut self, ino: Ino, memory: Arc<MemoryFile>) {
        if memory.len() > self.budget {
            return;
        }
        self.shards.push_back((ino, memory));
        while self.bytes() > self.budget {
            self.shards.pop_front();
        }
    }
}

impl<B> OpenTable<B> {
    /// `keep_budget`: bytes of decoded shards kept after their last close.
    pub fn new(keep_budget: u64) -> OpenTable<B> {
        OpenTable {
            inodes: Mutex::new(HashMap::new()),
            handles: Mutex::new(HashMap::new()),
            next_fh: AtomicU64::new(1),
            kept: Arc::new(Mutex::new(Kept {
                shards: VecDeque::new(),
                budget: keep_budget,
            })),
        }
    }

    fn inode(&self, ino: Ino) -> Arc<Mutex<InodeOpens<B>>> {
        self.inodes
            .lock()
            .entry(ino)
            .or_insert_with(|| {
                Arc::new(Mutex::new(InodeOpens {
                    passthrough: 0,
                    fuse: 0,
                    backing: None,
                }))
            })
            .clone()
    }

    fn handle(&self, ino: Ino, mode: OpenMode) -> u64 {
        let fh = self.next_fh.fetch_add(1, Ordering::Relaxed);
        self.handles.lock().insert(fh, (ino, mode));
        fh
    }

    /// Open `ino` through the page cache (passthrough is off, or the file is not one the
    /// kernel can be handed).
    pub fn open_fuse(&self, ino: Ino) -> u64 {
        let inode = self.inode(ino);
        let mut state = inode.lock();
        state.fuse += 1;
        self.handle(ino, OpenMode::Fuse)
    }

    /// Open `ino` in passthrough mode when the kernel allows it: through the inode's
    /// backing if it has one, else through a new one from `make`, which gets the decoded
    /// memory kept from an earlier open, if any. `make` runs under the inode's lock, so
    /// concurrent first opens decode once; `None` from it opens through the page cache.
    pub fn open(
        &self,
        ino: Ino,
        make: impl FnOnce(Option<Arc<MemoryFile>>) -> Option<Backing<B>>,
    ) -> Opened<B> {
        let inode = self.inode(ino);
        let mut state = inode.lock();
        if state.fuse == 0 {
            if let Some(b) = &state.backing {
                let id = b.id.clone();
                state.passthrough += 1;
                let fh = self.handle(ino, OpenMode::Passthrough);
                return Opened::Passthrough { fh, id };
            }
            let kept = self.kept.lock().take(ino);
            if let Some(backing) = make(kept) {
                let id = backing.id.clone();
                state.backing = Some(backing);
                state.passthrough += 1;
                let fh = self.handle(ino, OpenMode::Passthrough);
                return Opened::Passthrough { fh, id };
            }
        }
        state.fuse += 1;
        Opened::Fuse {
            fh: self.handle(ino, OpenMode::Fuse),
        }
    }

    /// The kernel released handle `fh`. After the last passthrough handle of an inode its
    /// backing is closed, and its decoded memory is kept for a reopen or let go.
    pub fn release(&self, fh: u64) -> Option<(Ino, OpenMode)> {
        let (ino, mode) = self.handles.lock().remove(&fh)?;
        let inode = self.inode(ino);
        let mut state = inode.lock();
        match mode {
            OpenMode::Fuse => state.fuse = state.fuse.saturating_sub(1),
            OpenMode::Passthrough => {
                state.passthrough = state.passthrough.saturating_sub(1);
                if state.passthrough == 0 {
                    if let Some(Backing {
                        memory: Some(m), ..
                    }) = state.backing.take()
                    {
                        self.kept.lock().keep(ino, m);
                    }
                }
            }
        }
        Some((ino, mode))
    }

    /// Let go of every kept shard, to make room for a new one.
    pub fn drop_kept(&self) -> u64 {
        let mut kept = self.kept.lock();
        let bytes = kept.bytes();
        kept.shards.clear();
        bytes
    }

    /// Handles open now, by mode.
    pub fn open_handles(&self) -> (u64, u64) {
        let handles = self.handles.lock();
        let pt = handles
            .values()
            .filter(|(_, m)| *m == OpenMode::Passthrough)
            .count() as u64;
        (pt, handles.len() as u64 - pt)
    }

    /// Bytes of decoded shards kept with no open handle.
    pub fn kept_bytes(&self) -> u64 {
        self.kept.lock().bytes()
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
        let opens = Opens::new(view.clone(), Arc::new(mode), 0);
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

    fn make(
        live: &Arc<AtomicUsize>,
    ) -> impl FnOnce(Option<Arc<MemoryFile>>) -> Option<Backing<Id>> {
        let live = live.clone();
        move |_| {
            live.fetch_add(1, Ordering::SeqCst);
            Some(Backing {
                id: Arc::new(Id(live)),
                memory: None,
            })
        }
    }

    fn fh<B>(o: &Opened<B>) -> u64 {
        match o {
            Opened::Passthrough { fh, .. } | Opened::Fuse { fh } => *fh,
        }
    }

    #[test]
    fn opens_share_one_backing_until_the_last_release() {
        let t = OpenTable::new(0);
        let live = Arc::new(AtomicUsize::new(0));
        let a = t.open(7, make(&live));
        let b = t.open(7, |_| panic!("a second backing was made"));
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
        let c = t.open(7, make(&live));
        assert!(matches!(c, Opened::Passthrough { .. }));
        assert_eq!(live.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn an_inode_open_through_the_page_cache_stays_there() {
        let t = OpenTable::new(0);
        let live = Arc::new(AtomicUsize::new(0));
        // The first open falls back (no backing could be made).
        let a = t.open(3, |_| None);
        assert!(matches!(a, Opened::Fuse { .. }));
        // While it is open, a passthrough open would be refused by the kernel.
        let b = t.open(3, |_| panic!("passthrough asked for a cached inode"));
        assert!(matches!(b, Opened::Fuse { .. }));
        t.release(fh(&a));
        t.release(fh(&b));
        // Once all are closed, passthrough is possible again.
        assert!(matches!(t.open(3, make(&live)), Opened::Passthrough { .. }));
        // And while that is open, even a plain FUSE-only file keeps its own inode's mode.
        assert!(matches!(t.open(4, |_| None), Opened::Fuse { .. }));
    }

    #[test]
    fn handles_are_unique_and_released_once() {
        let t: OpenTable<Id> = OpenTable::new(0);
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
}
