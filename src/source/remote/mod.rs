//! What every remote source shares: the runtime that drives the requests, the ranged reads in
//! parts, the parts kept in memory, the prefetch window and the node cache.
//!
//! A remote object is read in aligned parts of [`Tuning::part_size`] bytes, each one ranged
//! GET carrying the object's ETag (`If-Match`), so a part of another version of the object is
//! never served: the server answers 412 and every later read of that object fails with
//! `ReadError::Changed` (EIO), as a rewritten local shard does. Parts are fetched on a tokio
//! runtime the source owns; the caller (a FUSE worker, a rayon thread) blocks until the parts
//! it needs are in. Many parts are in flight at once (bounded by [`Tuning::in_flight`]), and a
//! read that continues where an earlier one ended, and had to wait for a part, widens that
//! stream's prefetch window (up to [`Tuning::max_window`] parts), so a sequential reader finds
//! its next parts already there.
//! Fetched parts are kept in one LRU of [`Tuning::memory`] bytes shared by all objects.
//!
//! Failures: `object_store` retries 5xx, throttling, timeouts and resets with backoff; a body
//! shorter than asked is retried here; a part that cannot be had within [`Tuning::timeout`]
//! fails its read with EIO. Nothing here ever returns bytes that are not the object's.
//!
//! Counted in the mount's [`Stats`] (given in [`RemoteSettings::stats`]): the ranged GETs sent
//! and those of them that were retries (by the HTTP client itself, `counting_connector`),
//! the parts given up, the bytes received, and the node cache's hits and misses.

use std::collections::BTreeMap;
use std::fmt;
use std::num::NonZeroUsize;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant, SystemTime};

use bytes::Bytes;
use futures::future::{BoxFuture, FutureExt, Shared};
use futures::StreamExt;
use object_store::path::Path as StorePath;
use object_store::{ObjectMeta, ObjectStore, ObjectStoreExt};
use parking_lot::Mutex;

use super::node_cache::NodeCache;
use super::{Attr, Kind};
use super::{Entry, Object, Source};
use crate::metrics::Stats;
use crate::{Error, ReadError, Result};

mod client;
mod get;
mod object;
mod prefetch;
pub(crate) use client::{
    client_options, connect_with, counting_connector, one_line, retry_config, Connect,
};
use get::{FetchJob, PartBuffers};
pub use object::RemoteObject;
use prefetch::Streams;

/// How remote reads are cut and bounded.
#[derive(Debug, Clone)]
pub struct Tuning {
    /// Bytes per ranged GET (and per node-cache file).
    pub part_size: u64,
    /// GETs in flight at once, over all objects.
    pub in_flight: usize,
    /// Fetched parts kept in memory, over all objects (bytes).
    pub memory: u64,
    /// The widest prefetch window, in parts.
    pub max_window: u64,
    /// A part not had by then fails its read (EIO); retries happen within it.
    pub timeout: Duration,
}

impl Default for Tuning {
    fn default() -> Self {
        Tuning {
            part_size: 8 << 20,
            in_flight: 32,
            memory: 512 << 20,
            max_window: 32,
            timeout: Duration::from_secs(60),
        }
    }
}

/// The credentials the environment may hold, removed from it once a client holds them.
pub const SECRET_ENV: [&str; 2] = ["AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"];

/// Settings of a remote source, from the command line and the environment.
#[derive(Debug, Clone, Default)]
pub struct RemoteSettings {
    /// An S3 endpoint (`--endpoint-url`); `AWS_ENDPOINT_URL` otherwise.
    pub endpoint_url: Option<String>,
    /// The node cache of sealed bytes (`--cache-dir`) and its bound in bytes.
    pub cache_dir: Option<std::path::PathBuf>,
    pub cache_dir_size: u64,
    /// `--manifest`: for an HTTP source, the list of its files.
    pub manifest: Option<std::path::PathBuf>,
    pub tuning: Tuning,
    /// The mount's counters, which the source's GETs and node-cache lookups bump
    /// (`remote_*`, `node_cache_*`: docs/STATUS.md).
    pub stats: Arc<Stats>,
}

/// A remote source as mounted: its objects, each fixed to the version seen at mount, by
/// their paths relative to the source's URL. [`super::s3`] lists them, [`super::http`] takes
/// them from the manifest; serving them is the same for both.
pub struct RemoteSource {
    remote: Arc<Remote>,
    /// The URL, as given (never with credentials).
    shown: String,
    objects: BTreeMap<String, ObjectMeta>,
    /// Why a path that is not among the objects cannot be opened.
    unknown: &'static str,
}

impl RemoteSource {
    pub(crate) fn new(
        remote: Arc<Remote>,
        shown: String,
        objects: BTreeMap<String, ObjectMeta>,
        unknown: &'static str,
    ) -> RemoteSource {
        RemoteSource {
            remote,
            shown,
            objects,
            unknown,
        }
    }
}

impl Source for RemoteSource {
    fn describe(&self) -> String {
        self.shown.clone()
    }

    fn at(&self, rel: &Path) -> PathBuf {
        if rel.as_os_str().is_empty() {
            PathBuf::from(&self.shown)
        } else {
            PathBuf::from(format!("{}/{}", self.shown, rel.display()))
        }
    }

    fn list(&self) -> Result<Vec<Entry>> {
        Ok(listing(self.objects.iter().map(|(rel, m)| {
            (rel.as_str(), m.size, m.last_modified.into())
        })))
    }

    fn open(&self, rel: &Path) -> Result<Arc<dyn Object>> {
        let key = rel.to_string_lossy();
        let meta = self
            .objects
            .get(key.as_ref())
            .ok_or_else(|| Error::at(&self.at(rel), self.unknown))?;
        Ok(Arc::new(
            self.remote
                .object(meta.clone(), self.at(rel).display().to_string()),
        ))
    }
}

/// The entries of a source whose objects are named by `/`-separated keys: the root, then
/// each folder's entries sorted by name, depth first, folders implied by the keys. Keys that
/// cannot be a path in the view (empty parts, `.`, `..`, a folder marker) are left out.
fn listing<'a>(objects: impl Iterator<Item = (&'a str, u64, SystemTime)>) -> Vec<Entry> {
    #[derive(Default)]
    struct Dir {
        dirs: BTreeMap<String, Dir>,
        files: BTreeMap<String, (u64, SystemTime)>,
    }
    let mut root = Dir::default();
    for (key, size, mtime) in objects {
        let parts: Vec<&str> = key.split('/').collect();
        if parts
            .iter()
            .any(|p| p.is_empty() || *p == "." || *p == "..")
        {
            if !key.ends_with('/') {
                log::warn!("{key}: not a path the view can show; not shown");
            }
            continue;
        }
        let (name, dirs) = parts.split_last().expect("split gives one part at least");
        let mut d = &mut root;
        for p in dirs {
            d = d.dirs.entry(p.to_string()).or_default();
        }
        d.files.insert(name.to_string(), (size, mtime));
    }
    let (uid, gid) = (
        rustix::process::geteuid().as_raw(),
        rustix::process::getegid().as_raw(),
    );
    let attr = |kind: Kind, size: u64, t: SystemTime| Attr {
        kind,
        size,
        perm: if kind == Kind::Dir { 0o555 } else { 0o444 },
        uid,
        gid,
        atime: t,
        mtime: t,
        ctime: t,
    };
    let now = SystemTime::now();
    let mut out = vec![Entry {
        path: PathBuf::new(),
        content_path: PathBuf::new(),
        attr: attr(Kind::Dir, 0, now),
    }];
    fn walk(
        d: &Dir,
        rel: &std::path::Path,
        out: &mut Vec<Entry>,
        attr: &dyn Fn(Kind, u64, SystemTime) -> Attr,
        now: SystemTime,
    ) {
        // One sorted sequence of names, as a local directory lists them.
        let mut names: Vec<(&String, bool)> = d
            .dirs
            .keys()
            .map(|n| (n, true))
            .chain(
                d.files
                    .keys()
                    .filter(|n| !d.dirs.contains_key(*n))
                    .map(|n| (n, false)),
            )
            .collect();
        names.sort();
        for (name, is_dir) in names {
            let path = rel.join(name);
            if is_dir {
                out.push(Entry {
                    path: path.clone(),
                    content_path: path.clone(),
                    attr: attr(Kind::Dir, 0, now),
                });
                walk(&d.dirs[name], &path, out, attr, now);
            } else {
                let (size, mtime) = d.files[name];
                out.push(Entry {
                    path: path.clone(),
                    content_path: path,
                    attr: attr(Kind::File, size, mtime),
                });
            }
        }
    }
    walk(&root, std::path::Path::new(""), &mut out, &attr, now);
    out
}

/// Why a part could not be had; cloned to every reader waiting for it.
#[derive(Debug, Clone)]
pub(crate) enum Fail {
    /// The object is not the version that was mounted.
    Changed,
    Io(Arc<str>),
}

impl Fail {
    fn io(why: impl fmt::Display) -> Fail {
        Fail::Io(why.to_string().into())
    }

    fn to_read_error(&self) -> ReadError {
        match self {
            Fail::Changed => ReadError::Changed,
            Fail::Io(why) => ReadError::Io(std::io::Error::other(why.to_string())),
        }
    }
}

type PartFuture = Shared<BoxFuture<'static, std::result::Result<Bytes, Fail>>>;

/// One part, fetched or in flight.
struct Slot {
    fut: PartFuture,
    /// When its fetch began.
    began: Instant,
    /// Fetched ahead of its reader, and not read yet.
    unread: bool,
    /// Bytes of it handed to readers so far.
    consumed: u64,
}

/// A part a reader waits for: its fetch (its own, or one it joined), and when that began.
struct Joined {
    fut: PartFuture,
    began: Instant,
}

/// The parts kept, over all objects of a source, least recently used first.
struct Parts {
    lru: lru::LruCache<(u64, u64), Slot>,
    /// How many slots hold parts read ahead and not read yet, and how many may.
    ahead: usize,
    max_ahead: usize,
}

/// What [`Remote::head_all`] gives: each key with its HEAD's answer, or the error that ended
/// them all (no answer in time).
pub(crate) type Heads<K> =
    std::result::Result<Vec<(K, object_store::Result<ObjectMeta>)>, object_store::Error>;

/// A runtime and the client made on it, in the process that made them.
struct Live {
    runtime: tokio::runtime::Runtime,
    store: Arc<dyn ObjectStore>,
}

/// Every remote source of this process, so [`quiesce_for_fork`] can stop their threads.
static REMOTES: Mutex<Vec<Weak<Remote>>> = Mutex::new(Vec::new());

/// Stop every remote source's runtime (its threads) before the process forks: the daemon
/// forks with one thread. Each source starts a new runtime and client on its next use, in
/// whichever process that is.
pub fn quiesce_for_fork() {
    for remote in REMOTES.lock().iter().filter_map(Weak::upgrade) {
        // Parts had stay (the headers read at mount); fetches not done are dropped with the
        // runtime that ran them.
        let mut parts = remote.parts.lock();
        let unfinished: Vec<(u64, u64)> = parts
            .lru
            .iter()
            .filter(|(_, slot)| !matches!(slot.fut.peek(), Some(Ok(_))))
            .map(|(k, _)| *k)
            .collect();
        for k in unfinished {
            if let Some(slot) = parts.lru.pop(&k) {
                parts.ahead -= slot.unread as usize;
            }
        }
        drop(parts);
        if let Some(live) = remote.live.lock().take() {
            match Arc::try_unwrap(live) {
                Ok(live) => live.runtime.shutdown_timeout(Duration::from_secs(2)),
                // Still in use somewhere: never dropped here, so never waited for.
                Err(live) => std::mem::forget(live),
            }
        }
    }
}

/// The runtime, the client and the parts every object of one source shares.
pub(crate) struct Remote {
    connect: Connect,
    live: Mutex<Option<Arc<Live>>>,
    tuning: Tuning,
    /// What messages call the store: a URL without credentials.
    name: String,
    gets: Arc<tokio::sync::Semaphore>,
    parts: Mutex<Parts>,
    next_id: AtomicU64,
    node_cache: Option<Arc<NodeCache>>,
    stats: Arc<Stats>,
    buffers: Arc<PartBuffers>,
}

impl Remote {
    /// A source's shared state; the client is made now, so bad settings fail the mount.
    pub(crate) fn new(
        connect: Connect,
        name: String,
        settings: &RemoteSettings,
    ) -> Result<Arc<Remote>> {
        let tuning = settings.tuning.clone();
        let node_cache = match &settings.cache_dir {
            Some(dir) => Some(Arc::new(NodeCache::open(
                dir,
                settings.cache_dir_size,
                tuning.part_size,
            )?)),
            None => None,
        };
        let slots = (tuning.memory / tuning.part_size).max(2) as usize;
        let remote = Arc::new(Remote {
            connect,
            live: Mutex::new(None),
            gets: Arc::new(tokio::sync::Semaphore::new(tuning.in_flight.max(1))),
            parts: Mutex::new(Parts {
                lru: lru::LruCache::new(NonZeroUsize::new(slots).unwrap()),
                ahead: 0,
                max_ahead: slots / 2,
            }),
            next_id: AtomicU64::new(1),
            tuning,
            name,
            node_cache,
            stats: settings.stats.clone(),
            buffers: Arc::new(PartBuffers::default()),
        });
        remote.live()?;
        REMOTES.lock().push(Arc::downgrade(&remote));
        Ok(remote)
    }

    /// The runtime and client, made on first use (and after a fork).
    fn live(&self) -> Result<Arc<Live>> {
        let mut live = self.live.lock();
        if let Some(l) = &*live {
            return Ok(l.clone());
        }
        // Its threads serve every GET, for whoever made the runtime: often a thread of
        // work ahead (decode or check ahead, under `SCHED_IDLE`), whose policy they would
        // inherit for good, leaving an urged fill's GETs to idle cycles.
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(4)
            .thread_name("kllm-remote")
            .on_thread_start(|| {
                // SAFETY: gettid has no preconditions.
                crate::background::run_in_background(unsafe { libc::gettid() }, false)
            })
            .enable_all()
            .build()
            .map_err(|e| {
                Error::at(
                    Path::new(&self.name),
                    format!("cannot start the I/O runtime ({e})"),
                )
            })?;
        // The client registers its connections with the runtime that is current.
        let store = {
            let _entered = runtime.enter();
            (self.connect)()?
        };
        let l = Arc::new(Live { runtime, store });
        *live = Some(l.clone());
        Ok(l)
    }

    pub(crate) fn name(&self) -> &str {
        &self.name
    }

    /// Run `f` with the client on the source's runtime from a synchronous caller, bounded in
    /// time (mount-time work: listing, HEADs).
    pub(crate) fn call<T, F, Fut>(
        &self,
        what: &str,
        f: F,
    ) -> Result<std::result::Result<T, object_store::Error>>
    where
        F: FnOnce(Arc<dyn ObjectStore>) -> Fut,
        Fut: std::future::Future<Output = std::result::Result<T, object_store::Error>>,
    {
        let live = self.live()?;
        let timeout = self.tuning.timeout;
        let fut = f(live.store.clone());
        Ok(live.runtime.block_on(async move {
            match tokio::time::timeout(timeout, fut).await {
                Ok(r) => r,
                Err(_) => Err(object_store::Error::Generic {
                    store: "remote",
                    source: format!("{what}: no answer within {} s", timeout.as_secs()).into(),
                }),
            }
        }))
    }

    /// A HEAD of each location, [`Tuning::in_flight`] at once, each answer beside its `K`
    /// (mount-time: the sizes and versions later reads must match).
    pub(crate) fn head_all<K>(&self, what: &str, items: Vec<(K, StorePath)>) -> Result<Heads<K>> {
        let in_flight = self.tuning.in_flight.max(1);
        self.call(what, |store| async move {
            Ok(
                futures::stream::iter(items.into_iter().map(|(k, location)| {
                    let store = store.clone();
                    async move {
                        let r = store.head(&location).await;
                        (k, r)
                    }
                }))
                .buffer_unordered(in_flight)
                .collect::<Vec<_>>()
                .await,
            )
        })
    }

    /// One object, fixed to the version `meta` describes.
    pub(crate) fn object(self: &Arc<Self>, meta: ObjectMeta, shown: String) -> RemoteObject {
        RemoteObject {
            remote: self.clone(),
            id: self.next_id.fetch_add(1, Ordering::Relaxed),
            shown,
            meta,
            changed: AtomicBool::new(false),
            streams: Mutex::new(Streams::default()),
        }
    }

    /// The part `idx` of `obj`: kept, in flight, or fetched now. A part read ahead
    /// (`ahead`) is not fetched when the parts read ahead and not yet read fill half the
    /// memory: the other half is for the parts readers wait for.
    fn part(&self, live: &Live, obj: &RemoteObject, idx: u64, ahead: bool) -> Option<Joined> {
        let mut parts = self.parts.lock();
        let Parts {
            lru,
            ahead: unread,
            max_ahead,
        } = &mut *parts;
        if let Some(slot) = lru.get_mut(&(obj.id, idx)) {
            // A failed fetch is not kept: the next read tries again. One read ahead has had
            // no reader yet, so its result is looked at here.
            let failed = match slot.fut.peek() {
                Some(r) => r.is_err(),
                None => matches!(slot.fut.clone().now_or_never(), Some(Err(_))),
            };
            if !failed {
                if !ahead && slot.unread {
                    slot.unread = false;
                    *unread -= 1;
                }
                return Some(Joined {
                    fut: slot.fut.clone(),
                    began: slot.began,
                });
            }
        }
        if ahead && *unread >= *max_ahead {
            return None;
        }
        let began = Instant::now();
        let fut = self.fetch(live, obj, idx);
        let slot = Slot {
            fut: fut.clone(),
            began,
            unread: ahead,
            consumed: 0,
        };
        *unread += ahead as usize;
        if let Some((_, gone)) = lru.push((obj.id, idx), slot) {
            *unread -= gone.unread as usize;
        }
        Some(Joined { fut, began })
    }

    /// Readers took `n` more bytes of part `idx` of object `id`. A part read through is let
    /// go at once: a loader (or a fill) reads each part once, and keeping it would only
    /// make every later part land in fresh memory (on this VM the dearest kind), and hold
    /// sealed bytes the decoded copy or block cache already answers for.
    fn consumed(&self, id: u64, idx: u64, n: u64, part_len: u64) {
        let mut parts = self.parts.lock();
        let through = match parts.lru.peek_mut(&(id, idx)) {
            Some(slot) => {
                slot.consumed += n;
                slot.consumed >= part_len && !slot.unread
            }
            None => false,
        };
        if through {
            parts.lru.pop(&(id, idx));
        }
    }

    /// Start fetching part `idx` of `obj` on the runtime; the future resolves to its bytes.
    fn fetch(&self, live: &Live, obj: &RemoteObject, idx: u64) -> PartFuture {
        let handle = live.runtime.spawn(self.job(live, obj, idx).run());
        async move {
            match handle.await {
                Ok(r) => r,
                Err(e) => Err(Fail::io(format!("fetch task failed ({e})"))),
            }
        }
        .boxed()
        .shared()
    }

    /// Whether part `idx` of object `id` is kept or in flight.
    fn holds(&self, id: u64, idx: u64) -> bool {
        self.parts.lock().lru.contains(&(id, idx))
    }

    /// The fetch of part `idx` of `obj`.
    fn job(&self, live: &Live, obj: &RemoteObject, idx: u64) -> FetchJob {
        let range = obj.part_range(idx);
        FetchJob {
            store: live.store.clone(),
            gets: self.gets.clone(),
            location: obj.meta.location.clone(),
            e_tag: obj.meta.e_tag.clone(),
            version: obj.meta.version.clone(),
            size: obj.meta.size,
            modified: obj.meta.last_modified.into(),
            range,
            timeout: self.tuning.timeout,
            stats: self.stats.clone(),
            buffers: self.buffers.clone(),
            cache: self
                .node_cache
                .clone()
                .map(|c| (c, obj.cache_key(&self.name), idx)),
        }
    }
}

#[cfg(test)]
mod tests;
