//! The kernel edge: a thin `fuser` adapter that hands every request to the view.

use std::ffi::OsStr;
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use fuser::{
    BackingId, Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags, Generation, INodeNo,
    InitFlags, KernelConfig, LockOwner, Notifier, OpenAccMode, OpenFlags, ReplyAttr, ReplyData,
    ReplyDirectory, ReplyEmpty, ReplyEntry, ReplyOpen, ReplyStatfs, ReplyXattr, Request,
};

use crate::ahead::PageCache;
use crate::metrics::Stats;
use crate::passthrough::{Copies, Opened, Opens, Reclaim, ServeMode};
use crate::pressure::Guard;
use crate::secmem::SecureBuf;
use crate::view::{Ino, Kind, View};
use crate::ReadError;

/// The view never changes while mounted, so the kernel may cache everything for long.
const TTL: Duration = Duration::from_secs(3600);
/// Large reads amortize the round trip to the daemon; the kernel caps them at its own
/// maximum.
const MAX_READAHEAD: u32 = 1 << 20;
const MAX_BACKGROUND: u16 = 64;

thread_local! {
    /// Each worker's reply buffer, reused for every read: a fresh buffer a request would
    /// cost an allocation, a zero fill and a wipe. It is locked memory kept out of core
    /// dumps (like the block cache); the next read overwrites it, and it is wiped when the
    /// worker ends.
    static REPLY: std::cell::RefCell<Option<SecureBuf>> = const { std::cell::RefCell::new(None) };
}
/// The smallest reply buffer made, so a run of small reads does not regrow it.
const REPLY_MIN: usize = 128 << 10;

/// Called when the session ends, before fuser drops its mount handle.
pub type OnDestroy = Box<dyn FnMut() + Send + Sync>;

pub struct KllmFs {
    view: Arc<View>,
    opens: Opens<BackingId>,
    on_destroy: Option<OnDestroy>,
    /// The kernel maps files opened with `FOPEN_DIRECT_IO` (`FUSE_DIRECT_IO_ALLOW_MMAP`).
    direct_io_mmap: bool,
    page_cache: Option<Arc<MountPageCache>>,
}

/// The kernel's page cache of the mount, for fetch ahead to decode into: the mount point
/// the files are looked up under, and the session's notifier, which fuser makes from the
/// session only after the session has taken the file system and run INIT (which starts
/// fetch ahead), so it is set a moment later ([`KllmFs::notifier_slot`]).
pub struct MountPageCache {
    mountpoint: PathBuf,
    notifier: Arc<OnceLock<Notifier>>,
}

impl PageCache for MountPageCache {
    /// The lookup is answered once the session runs, which is after its notifier is set.
    fn look_up(&self, path: &str) -> std::io::Result<()> {
        std::fs::symlink_metadata(self.mountpoint.join(path))?;
        match self.notifier.get() {
            Some(_) => Ok(()),
            None => Err(std::io::Error::other("the session has no notifier")),
        }
    }

    /// `FUSE_NOTIFY_STORE`. A file the kernel has let go of since its lookup takes nothing
    /// (fuser reports that as done); its reads then come to the daemon as before.
    fn store(&self, ino: Ino, off: u64, bytes: &[u8]) -> std::io::Result<()> {
        let notifier = self
            .notifier
            .get()
            .ok_or(std::io::ErrorKind::NotConnected)?;
        notifier.store(INodeNo(ino), off, bytes)
    }

    /// `FUSE_NOTIFY_INVAL_INODE` of the whole file (a length of 0: to its end).
    fn invalidate(&self, ino: Ino) -> std::io::Result<()> {
        let notifier = self
            .notifier
            .get()
            .ok_or(std::io::ErrorKind::NotConnected)?;
        notifier.inval_inode(INodeNo(ino), 0, 0)
    }
}

impl KllmFs {
    /// `copies`: how decoded copies are made and kept in passthrough mode.
    /// `guard`: the memory limit a passthrough decode must leave room under.
    pub fn new(view: Arc<View>, mode: Arc<ServeMode>, copies: Copies, guard: Arc<Guard>) -> KllmFs {
        KllmFs {
            opens: Opens::new(view.clone(), mode, copies).with_guard(guard),
            view,
            on_destroy: None,
            direct_io_mmap: false,
            page_cache: None,
        }
    }

    /// Mounted at `mountpoint` (absolute): fetch ahead may decode into the kernel's page
    /// cache of its files.
    pub fn mounted_at(mut self, mountpoint: PathBuf) -> KllmFs {
        self.page_cache = Some(Arc::new(MountPageCache {
            mountpoint,
            notifier: Arc::default(),
        }));
        self
    }

    /// Where the session's notifier goes once the session exists (after [`KllmFs::mounted_at`]).
    pub fn notifier_slot(&self) -> Option<Arc<OnceLock<Notifier>>> {
        self.page_cache.as_ref().map(|c| c.notifier.clone())
    }

    /// What can be given back under memory pressure (src/pressure.rs).
    pub fn reclaim(&self) -> Reclaim {
        self.opens.reclaim()
    }

    /// Run `f` when the session ends. fuser 0.18 unmounts the mount point path again when
    /// its session ends on its own (an inverted "still mounted" check), which would
    /// unmount a new mount made there meanwhile; the daemon exits in `f` before that.
    pub fn on_destroy(mut self, f: OnDestroy) -> KllmFs {
        self.on_destroy = Some(f);
        self
    }

    fn attr(&self, ino: Ino) -> Option<FileAttr> {
        let a = self.view.node(ino)?.attr;
        let (kind, nlink) = match a.kind {
            Kind::Dir => (FileType::Directory, 2),
            Kind::File => (FileType::RegularFile, 1),
        };
        Some(FileAttr {
            ino: INodeNo(ino),
            size: a.size,
            blocks: a.size.div_ceil(512),
            atime: a.atime,
            mtime: a.mtime,
            ctime: a.ctime,
            crtime: a.ctime,
            kind,
            perm: a.perm,
            nlink,
            uid: a.uid,
            gid: a.gid,
            rdev: 0,
            blksize: 1 << 20,
            flags: 0,
        })
    }
}

impl Filesystem for KllmFs {
    fn init(&mut self, _req: &Request, config: &mut KernelConfig) -> std::io::Result<()> {
        if let Err(max) = config.set_max_readahead(MAX_READAHEAD) {
            let _ = config.set_max_readahead(max);
        }
        // fuser derives max_pages (the largest request) from max_write: 1 MiB lets one
        // request carry a whole readahead window once the window is raised (see cli).
        if let Err(max) = config.set_max_write(MAX_READAHEAD) {
            let _ = config.set_max_write(max);
        }
        let _ = config.set_max_background(MAX_BACKGROUND);
        let mode = self.opens.mode();
        if mode.passthrough().is_some() {
            // Depth 1: backing files on a plain file system (our tmpfs, the sealed files),
            // and this mount can still be the lower layer of an overlay.
            let offered = config
                .add_capabilities(InitFlags::FUSE_PASSTHROUGH)
                .and_then(|_| {
                    config
                        .set_max_stack_depth(1)
                        .map(drop)
                        .map_err(|_| InitFlags::FUSE_PASSTHROUGH)
                });
            if offered.is_err() {
                if let Err(why) = mode.kernel_offers_none() {
                    log::error!("--mode passthrough: {why}");
                    return Err(std::io::Error::other(why));
                }
            }
            self.direct_io_mmap = config
                .add_capabilities(InitFlags::FUSE_DIRECT_IO_ALLOW_MMAP)
                .is_ok();
            log::debug!(
                "reads of copies still filling bypass the page cache: {}",
                self.direct_io_mmap
            );
        }
        mode.log();
        let page_cache = self.page_cache.clone().map(|c| c as Arc<dyn PageCache>);
        self.opens.start_background(page_cache);
        Ok(())
    }

    fn destroy(&mut self) {
        if let Some(f) = self.on_destroy.as_mut() {
            f();
        }
    }

    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        match self
            .view
            .lookup(parent.0, name)
            .and_then(|ino| self.attr(ino))
        {
            Some(attr) => reply.entry(&TTL, &attr, Generation(0)),
            None => reply.error(Errno::ENOENT),
        }
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        match self.attr(ino.0) {
            Some(attr) => reply.attr(&TTL, &attr),
            None => reply.error(Errno::ENOENT),
        }
    }

    fn open(&self, _req: &Request, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        let Some(node) = self.view.node(ino.0) else {
            return reply.error(Errno::ENOENT);
        };
        if node.attr.kind == Kind::Dir {
            return reply.error(Errno::EISDIR);
        }
        if flags.acc_mode() != OpenAccMode::O_RDONLY {
            return reply.error(Errno::EROFS);
        }
        let stats = self.view.stats();
        let opened = match self.opens.open(ino.0, node, |f| reply.open_backing(f)) {
            Ok(opened) => opened,
            Err(e) => {
                Stats::add(&stats.read_errors, 1);
                log::error!("open of {} refused: {e}", self.view.path_of(ino.0));
                return reply.error(Errno::from_i32(e.errno()));
            }
        };
        stats.opened(matches!(opened, Opened::Passthrough { .. }));
        match opened {
            Opened::Passthrough { fh, id } => {
                reply.opened_passthrough(FileHandle(fh), FopenFlags::empty(), &id)
            }
            // A file served from its decoded copy while the copy fills: reads go straight
            // to the copy, not through the page cache (no second copy of the shard in
            // fresh pages, nothing to drop when the next open gets passthrough); a mapping
            // still goes through the page cache.
            Opened::Fuse { fh, fill: Some(_) } if self.direct_io_mmap => reply.opened(
                FileHandle(fh),
                FopenFlags::FOPEN_DIRECT_IO | FopenFlags::FOPEN_KEEP_CACHE,
            ),
            // The view is immutable: pages the kernel cached stay valid across opens.
            Opened::Fuse { fh, .. } => reply.opened(FileHandle(fh), FopenFlags::FOPEN_KEEP_CACHE),
        }
    }

    fn release(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        _flush: bool,
        reply: ReplyEmpty,
    ) {
        if self.opens.release(fh.0).is_some() {
            self.view.stats().released();
        }
        reply.ok();
    }

    fn read(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        // The bytes read, or why not, as the reply says them.
        let answer = |got: std::result::Result<&[u8], ReadError>, reply: ReplyData| match got {
            Ok(bytes) => {
                Stats::add(&self.view.stats().bytes_served, bytes.len() as u64);
                reply.data(bytes)
            }
            Err(e) => {
                Stats::add(&self.view.stats().read_errors, 1);
                log::error!(
                    "read of {} at {offset} (+{size}) failed: {e}",
                    self.view.path_of(ino.0)
                );
                reply.error(Errno::from_i32(e.errno()))
            }
        };
        // From a decoded copy the reply is the copy's own bytes: no copy of our own.
        // `None` where a chunk of the range failed: the read path decodes that range itself.
        if let Some(fill) = self.opens.fill_of(fh.0) {
            if let Some(got) = fill.decoded(offset, size as usize).transpose() {
                return answer(got, reply);
            }
        }
        REPLY.with_borrow_mut(|buf| {
            let size = size as usize;
            if buf.as_ref().is_none_or(|b| b.len() < size) {
                match SecureBuf::new(size.max(REPLY_MIN)) {
                    Ok(b) => *buf = Some(b),
                    Err(e) => {
                        log::error!("no memory for a read of {size} bytes: {e}");
                        return reply.error(Errno::EIO);
                    }
                }
            }
            let out = &mut buf.as_mut().expect("just made")[..size];
            let got = self.opens.read(fh.0, ino.0, offset, out);
            answer(got.map(|n| &out[..n]), reply)
        });
    }

    fn flush(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _lock_owner: LockOwner,
        reply: ReplyEmpty,
    ) {
        reply.ok();
    }

    fn opendir(&self, _req: &Request, ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        match self.view.children(ino.0) {
            Some(_) => reply.opened(
                FileHandle(0),
                FopenFlags::FOPEN_KEEP_CACHE | FopenFlags::FOPEN_CACHE_DIR,
            ),
            None => reply.error(Errno::ENOTDIR),
        }
    }

    fn readdir(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectory,
    ) {
        let Some(children) = self.view.children(ino.0) else {
            return reply.error(Errno::ENOTDIR);
        };
        let parent = self.view.node(ino.0).map_or(ino.0, |n| n.parent);
        let dots = [
            (OsStr::new("."), ino.0, Kind::Dir),
            (OsStr::new(".."), parent, Kind::Dir),
        ];
        let entries = dots.into_iter().chain(children.iter().map(|(name, child)| {
            let kind = self.view.node(*child).map_or(Kind::File, |n| n.attr.kind);
            (name.as_os_str(), *child, kind)
        }));
        for (i, (name, child, kind)) in entries.enumerate().skip(offset as usize) {
            let ft = if kind == Kind::Dir {
                FileType::Directory
            } else {
                FileType::RegularFile
            };
            if reply.add(INodeNo(child), i as u64 + 1, ft, name) {
                break;
            }
        }
        reply.ok();
    }

    fn statfs(&self, _req: &Request, _ino: INodeNo, reply: ReplyStatfs) {
        let bytes: u64 = (1..=self.view.len() as Ino)
            .filter_map(|i| self.view.node(i))
            .map(|n| n.attr.size)
            .sum();
        reply.statfs(
            bytes.div_ceil(4096),
            0,
            0,
            self.view.len() as u64,
            0,
            4096,
            255,
            4096,
        );
    }

    fn getxattr(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _name: &OsStr,
        _size: u32,
        reply: ReplyXattr,
    ) {
        reply.error(Errno::ENODATA);
    }

    fn listxattr(&self, _req: &Request, _ino: INodeNo, size: u32, reply: ReplyXattr) {
        if size == 0 {
            reply.size(0);
        } else {
            reply.data(&[]);
        }
    }
}
