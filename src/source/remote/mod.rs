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
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant, SystemTime};

use bytes::Bytes;
use futures::future::{BoxFuture, FutureExt, Shared};
use futures::StreamExt;
use object_store::path::Path as StorePath;
use object_store::{GetOptions, GetRange, ObjectMeta, ObjectStore, ObjectStoreExt};
use parking_lot::Mutex;

use super::node_cache::NodeCache;
use super::{Attr, Kind};
use super::{Entry, Object, Source};
use crate::metrics::Stats;
use crate::{Error, ReadError, Result};

mod client;
mod prefetch;
use client::PART_GETS;
pub(crate) use client::{
    client_options, connect_with, counting_connector, one_line, retry_config, Connect,
};
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

/// Part buffers given back after use, for the next GET to fill: a buffer fresh from the
/// allocator costs a page fault and a cleared page per 4 KiB on first touch (5-8% of the
/// daemon's CPU on a cold read over `s3://` here), one kept costs nothing. A few suffice:
/// a buffer is given back about when the next fetch wants one.
struct PartBuffers {
    free: Mutex<Vec<Vec<u8>>>,
}

/// Buffers kept between fetches (at most this many part sizes of idle memory).
const KEEP_BUFFERS: usize = 8;

impl PartBuffers {
    fn take(&self, len: usize) -> Vec<u8> {
        let mut free = self.free.lock();
        match free.iter().position(|b| b.capacity() >= len) {
            Some(i) => free.swap_remove(i),
            None => Vec::with_capacity(len),
        }
    }
}

/// A part's bytes in a buffer that goes back to its pool when the last `Bytes` of it goes.
struct PooledPart {
    buf: Vec<u8>,
    pool: Weak<PartBuffers>,
}

impl AsRef<[u8]> for PooledPart {
    fn as_ref(&self) -> &[u8] {
        &self.buf
    }
}

impl Drop for PooledPart {
    fn drop(&mut self) {
        if let Some(pool) = self.pool.upgrade() {
            let mut free = pool.free.lock();
            if free.len() < KEEP_BUFFERS {
                let mut buf = std::mem::take(&mut self.buf);
                buf.clear();
                free.push(buf);
            }
        }
    }
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
            buffers: Arc::new(PartBuffers {
                free: Mutex::new(Vec::new()),
            }),
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

/// One part's fetch, owning all it needs so it runs on the runtime alone.
struct FetchJob {
    store: Arc<dyn ObjectStore>,
    gets: Arc<tokio::sync::Semaphore>,
    location: StorePath,
    e_tag: Option<String>,
    version: Option<String>,
    size: u64,
    modified: SystemTime,
    range: Range<u64>,
    timeout: Duration,
    stats: Arc<Stats>,
    buffers: Arc<PartBuffers>,
    cache: Option<(Arc<NodeCache>, String, u64)>,
}

/// A node-cache lookup's answer, counted as a hit or a miss.
fn counted_lookup(stats: &Stats, found: Option<Bytes>) -> Option<Bytes> {
    let counter = if found.is_some() {
        &stats.node_cache_hits
    } else {
        &stats.node_cache_misses
    };
    Stats::add(counter, 1);
    found
}

impl FetchJob {
    async fn run(self) -> std::result::Result<Bytes, Fail> {
        let want = (self.range.end - self.range.start) as usize;
        if let Some((cache, key, idx)) = &self.cache {
            let (cache, key, idx) = (cache.clone(), key.clone(), *idx);
            // The lookup fails to run only when the runtime is shutting down (before the
            // daemon forks): no miss to count and no GET to start then.
            let found = tokio::task::spawn_blocking(move || cache.get(&key, idx, want))
                .await
                .map_err(|e| Fail::io(format!("node cache lookup not run ({e})")))?;
            if let Some(bytes) = counted_lookup(&self.stats, found) {
                return Ok(bytes);
            }
        }
        let mut buf = self.buffers.take(want);
        self.get_into(&mut buf).await?;
        let bytes = Bytes::from_owner(PooledPart {
            buf,
            pool: Arc::downgrade(&self.buffers),
        });
        if let Some((cache, key, idx)) = self.cache {
            let b = bytes.clone();
            // Kept before the part is handed out, so a daemon that ends soon after still
            // leaves it for the next mount; a failure to keep it is logged there. Not run
            // (the runtime shutting down before the fork), the part is not had either, so
            // the daemon fetches and keeps it again.
            tokio::task::spawn_blocking(move || cache.put(&key, idx, &b))
                .await
                .map_err(|e| Fail::io(format!("node cache write not run ({e})")))?;
        }
        Ok(bytes)
    }

    /// The part's bytes into `body` by GET (no node cache), its failure counted.
    async fn get_into(&self, body: &mut impl Body) -> std::result::Result<(), Fail> {
        let got = PART_GETS
            .scope(std::cell::Cell::new(0), self.get_checked(body))
            .await;
        if got.is_err() {
            Stats::add(&self.stats.remote_get_failures, 1);
        }
        got
    }

    /// The GET, retried here when the body comes back short (object_store retries the
    /// request itself on 5xx, throttling, timeouts and resets), all within the timeout
    /// from when it may start (waiting behind other GETs does not count: they are bounded
    /// the same way).
    async fn get_checked(&self, body: &mut impl Body) -> std::result::Result<(), Fail> {
        let want = self.range.end - self.range.start;
        let mut attempt = 0u32;
        let mut deadline = None;
        loop {
            attempt += 1;
            let _permit = self.gets.acquire().await.map_err(Fail::io)?;
            let until = *deadline.get_or_insert_with(|| Instant::now() + self.timeout);
            body.clear();
            let Ok(got) = tokio::time::timeout_at(until.into(), self.get_once(body)).await else {
                return Err(Fail::io(format!(
                    "{}: bytes {}..{} not had within {} s",
                    self.location,
                    self.range.start,
                    self.range.end,
                    self.timeout.as_secs()
                )));
            };
            match got {
                Ok(()) if body.len() as u64 == want => return Ok(()),
                Ok(()) => {
                    log::warn!(
                        "{}: bytes {}..{}: {} of {want} bytes came back; asking again",
                        self.location,
                        self.range.start,
                        self.range.end,
                        body.len()
                    );
                    if attempt >= 5 {
                        return Err(Fail::io(format!(
                            "{}: bytes {}..{}: the body stays short ({} of {want} bytes)",
                            self.location,
                            self.range.start,
                            self.range.end,
                            body.len()
                        )));
                    }
                }
                Err(Fail::Changed) => return Err(Fail::Changed),
                Err(Fail::Io(why)) if attempt >= 3 => return Err(Fail::Io(why)),
                Err(Fail::Io(why)) => {
                    log::warn!("{why}; asking again");
                }
            }
            drop(_permit);
            tokio::time::sleep(Duration::from_millis(100 << attempt.min(5))).await;
        }
    }

    async fn get_once(&self, body: &mut impl Body) -> std::result::Result<(), Fail> {
        let opts = GetOptions {
            if_match: self.e_tag.clone(),
            version: self.version.clone(),
            range: Some(GetRange::Bounded(self.range.clone())),
            ..Default::default()
        };
        let r = match self.store.get_opts(&self.location, opts).await {
            Ok(r) => r,
            Err(object_store::Error::Precondition { .. })
            | Err(object_store::Error::NotFound { .. }) => return Err(Fail::Changed),
            Err(e) => return Err(Fail::io(format!("{}: {e}", self.location))),
        };
        // A server that ignores If-Match still says which version it sent; one without ETags
        // says when it was last modified.
        let other_version = match (&self.e_tag, &r.meta.e_tag) {
            (Some(mine), Some(theirs)) => mine != theirs,
            // HTTP dates have whole seconds; a listing may have had more.
            (None, _) => whole_seconds(r.meta.last_modified.into()) != whole_seconds(self.modified),
            (Some(_), None) => false,
        };
        if r.meta.size != self.size || other_version {
            return Err(Fail::Changed);
        }
        if r.range != self.range {
            return Err(Fail::io(format!(
                "{}: asked for bytes {}..{}, the server sent {}..{}",
                self.location, self.range.start, self.range.end, r.range.start, r.range.end
            )));
        }
        let mut stream = r.into_stream();
        while let Some(chunk) = stream.next().await {
            let chunk = chunk.map_err(|e| Fail::io(format!("{}: {e}", self.location)))?;
            body.put(&chunk)
                .map_err(|why| Fail::io(format!("{}: {why}", self.location)))?;
        }
        Stats::add(&self.stats.remote_bytes_fetched, body.len() as u64);
        Ok(())
    }
}

/// Where a GET's body goes: a part buffer, or the caller's own memory.
trait Body: Send {
    fn clear(&mut self);
    fn put(&mut self, bytes: &[u8]) -> std::result::Result<(), &'static str>;
    fn len(&self) -> usize;
}

impl Body for Vec<u8> {
    fn clear(&mut self) {
        Vec::clear(self)
    }

    fn put(&mut self, bytes: &[u8]) -> std::result::Result<(), &'static str> {
        self.extend_from_slice(bytes);
        Ok(())
    }

    fn len(&self) -> usize {
        Vec::len(self)
    }
}

/// The caller's memory, written from its start.
struct CallerMemory<'a> {
    buf: &'a mut [u8],
    at: usize,
}

impl Body for CallerMemory<'_> {
    fn clear(&mut self) {
        self.at = 0;
    }

    fn put(&mut self, bytes: &[u8]) -> std::result::Result<(), &'static str> {
        let end = self.at + bytes.len();
        self.buf
            .get_mut(self.at..end)
            .ok_or("the body is longer than the range asked for")?
            .copy_from_slice(bytes);
        self.at = end;
        Ok(())
    }

    fn len(&self) -> usize {
        self.at
    }
}

fn whole_seconds(t: SystemTime) -> u64 {
    t.duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// One object of a remote source at the version it had when mounted.
pub struct RemoteObject {
    remote: Arc<Remote>,
    id: u64,
    /// How messages name it.
    shown: String,
    meta: ObjectMeta,
    changed: AtomicBool,
    streams: Mutex<Streams>,
}

impl RemoteObject {
    fn part_range(&self, idx: u64) -> Range<u64> {
        let p = self.remote.tuning.part_size;
        let start = idx * p;
        start..(start + p).min(self.meta.size)
    }

    /// What the node cache files this version under: the store, the object and its version.
    fn cache_key(&self, store: &str) -> String {
        format!(
            "{store}\n{}\n{}\n{}\n{}",
            self.meta.location,
            self.meta.size,
            self.meta.e_tag.as_deref().unwrap_or(""),
            self.meta.version.as_deref().unwrap_or(""),
        )
    }

    pub fn modified(&self) -> SystemTime {
        self.meta.last_modified.into()
    }

    /// `dst.len()` bytes at `lo` from part `idx`, kept, in flight or fetched now, with nothing
    /// read ahead.
    fn copy_from_part(
        &self,
        live: &Live,
        idx: u64,
        dst: &mut [u8],
        lo: u64,
        asked: Instant,
    ) -> std::result::Result<(), ReadError> {
        let part = self
            .remote
            .part(live, self, idx, false)
            .expect("a part a reader waits for is always fetched");
        self.copy_from(live, idx, part, dst, lo, asked)
    }

    /// `dst.len()` bytes at `lo` from part `idx` once `part` has it, counted as consumed. A
    /// read asked at `asked` that joined a fetch begun before it, which then failed (its
    /// tries spent while the source was down, say, and back by now), fetches the part once
    /// itself before it fails: its own time to EIO stays one fetch's.
    fn copy_from(
        &self,
        live: &Live,
        idx: u64,
        part: Joined,
        dst: &mut [u8],
        lo: u64,
        asked: Instant,
    ) -> std::result::Result<(), ReadError> {
        let range = self.part_range(idx);
        let bytes = match live.runtime.block_on(part.fut) {
            Err(Fail::Io(why)) if part.began < asked => {
                log::warn!(
                    "{}: bytes {}..{}: a fetch begun before this read failed ({why}); asking again",
                    self.shown,
                    range.start,
                    range.end
                );
                let again = (self.remote.part(live, self, idx, false))
                    .expect("a part a reader waits for is always fetched");
                live.runtime.block_on(again.fut)
            }
            got => got,
        }
        .map_err(|f| self.fail(&f, &range))?;
        let at = (lo - range.start) as usize;
        dst.copy_from_slice(&bytes[at..at + dst.len()]);
        drop(bytes);
        self.remote
            .consumed(self.id, idx, dst.len() as u64, range.end - range.start);
        Ok(())
    }

    /// The source's runtime and client, made again if a fork stopped them.
    fn live(&self) -> std::result::Result<Arc<Live>, ReadError> {
        self.remote
            .live()
            .map_err(|e| ReadError::Io(std::io::Error::other(format!("{}: {e}", self.shown))))
    }

    /// What every read checks first: the object unchanged since the mount, the range within
    /// it. The range's end, or `None` for an empty read.
    fn begin_read(&self, off: u64, len: usize) -> std::result::Result<Option<u64>, ReadError> {
        self.check_unchanged()?;
        let end = self.end_of(off, len)?;
        Ok((len > 0).then_some(end))
    }

    /// The end of `len` bytes at `off`, if within the object.
    fn end_of(&self, off: u64, len: usize) -> std::result::Result<u64, ReadError> {
        off.checked_add(len as u64)
            .filter(|&e| e <= self.meta.size)
            .ok_or_else(|| {
                ReadError::Io(std::io::Error::new(
                    std::io::ErrorKind::UnexpectedEof,
                    format!(
                        "{}: bytes {off}..+{len} are past its end ({})",
                        self.shown, self.meta.size
                    ),
                ))
            })
    }

    fn fail(&self, f: &Fail, range: &Range<u64>) -> ReadError {
        if matches!(f, Fail::Changed) {
            if !self.changed.swap(true, Ordering::Relaxed) {
                log::error!(
                    "{}: the object changed on {} after it was mounted; its reads fail from now on",
                    self.shown,
                    self.remote.name()
                );
            }
        } else {
            log::error!(
                "{}: bytes {}..{}: {}",
                self.shown,
                range.start,
                range.end,
                f.to_read_error()
            );
        }
        f.to_read_error()
    }
}

impl Object for RemoteObject {
    fn len(&self) -> u64 {
        self.meta.size
    }

    fn read_exact_at(&self, buf: &mut [u8], off: u64) -> std::result::Result<(), ReadError> {
        let asked = Instant::now();
        let Some(end) = self.begin_read(off, buf.len())? else {
            return Ok(());
        };
        let t = &self.remote.tuning;
        let p = t.part_size;
        let first = off / p;
        let last = (end - 1) / p;
        let ahead = self.streams.lock().note(off..end, p, t.max_window);
        let parts_total = self.meta.size.div_ceil(p);
        // Ask for the parts this read needs in order, a bounded number ahead of the one waited
        // for (so a huge read does not hold all its parts at once), then the window past it.
        let live = self.live()?;
        let lookahead = (t.in_flight as u64).max(1);
        let mut pending = std::collections::VecDeque::new();
        let mut next = first;
        let mut window_started = false;
        let mut waited = false;
        loop {
            while next <= last && (pending.len() as u64) < lookahead {
                let part = self.remote.part(&live, self, next, false);
                pending.push_back((
                    next,
                    part.expect("a part a reader waits for is always fetched"),
                ));
                next += 1;
            }
            if next > last && !window_started {
                window_started = true;
                for i in last + 1..(last + 1 + ahead).min(parts_total) {
                    if self.remote.part(&live, self, i, true).is_none() {
                        break;
                    }
                }
            }
            let Some((idx, part)) = pending.pop_front() else {
                break;
            };
            waited |= part.fut.peek().is_none();
            let range = self.part_range(idx);
            let (lo, hi) = (off.max(range.start), end.min(range.end));
            self.copy_from(
                &live,
                idx,
                part,
                &mut buf[(lo - off) as usize..(hi - off) as usize],
                lo,
                asked,
            )?;
        }
        if waited {
            self.streams.lock().waited(end);
        }
        Ok(())
    }

    /// Whole parts straight into `buf` by their own GETs (or from the node cache), neither
    /// kept nor read ahead: the caller (a fill) keeps the bytes and runs many such reads at
    /// once. A part cut by the range's ends, or one already kept or in flight, comes through
    /// the kept parts (nothing read ahead either).
    fn read_once_at(&self, buf: &mut [u8], off: u64) -> std::result::Result<(), ReadError> {
        let asked = Instant::now();
        let Some(end) = self.begin_read(off, buf.len())? else {
            return Ok(());
        };
        let p = self.remote.tuning.part_size;
        let live = self.live()?;
        for idx in off / p..=(end - 1) / p {
            let range = self.part_range(idx);
            let (lo, hi) = (off.max(range.start), end.min(range.end));
            let dst = &mut buf[(lo - off) as usize..(hi - off) as usize];
            if lo != range.start || hi != range.end || self.remote.holds(self.id, idx) {
                self.copy_from_part(&live, idx, dst, lo, asked)?;
                continue;
            }
            let job = self.remote.job(&live, self, idx);
            if let Some((cache, key, _)) = &job.cache {
                let found = cache.get(key, idx, dst.len());
                if let Some(bytes) = counted_lookup(&self.remote.stats, found) {
                    dst.copy_from_slice(&bytes);
                    continue;
                }
            }
            live.runtime
                .block_on(job.get_into(&mut CallerMemory { buf: dst, at: 0 }))
                .map_err(|f| self.fail(&f, &range))?;
            if let Some((cache, key, _)) = &job.cache {
                cache.put(key, idx, dst);
            }
        }
        Ok(())
    }

    /// By GETs of just the bytes asked for, kept nowhere: a mount reads each shard's
    /// header this way, where a read would fetch (and keep) a whole part per shard before
    /// the mount answers. The bytes of a part kept, in flight or in the node cache come
    /// from there; each run of the others by one GET.
    fn read_small_at(&self, buf: &mut [u8], off: u64) -> std::result::Result<(), ReadError> {
        let asked = Instant::now();
        let Some(end) = self.begin_read(off, buf.len())? else {
            return Ok(());
        };
        let p = self.remote.tuning.part_size;
        let live = self.live()?;
        let cache =
            (self.remote.node_cache.as_ref()).map(|c| (c, self.cache_key(&self.remote.name)));
        // The start of the bytes not had yet, fetched when a part that has them (or the
        // end) comes.
        let mut missing: Option<u64> = None;
        let fetch = |from: u64, to: u64, buf: &mut [u8]| {
            let mut job = self.remote.job(&live, self, from / p);
            job.cache = None;
            job.range = from..to;
            let dst = &mut buf[(from - off) as usize..(to - off) as usize];
            live.runtime
                .block_on(job.get_into(&mut CallerMemory { buf: dst, at: 0 }))
                .map_err(|f| self.fail(&f, &(from..to)))
        };
        for idx in off / p..=(end - 1) / p {
            let part = self.part_range(idx);
            let (lo, hi) = (off.max(part.start), end.min(part.end));
            let dst = (lo - off) as usize..(hi - off) as usize;
            let had = if self.remote.holds(self.id, idx) {
                self.copy_from_part(&live, idx, &mut buf[dst], lo, asked)?;
                true
            } else if let Some((cache, key)) = &cache {
                let found = cache.get(key, idx, (part.end - part.start) as usize);
                let at = (lo - part.start) as usize;
                counted_lookup(&self.remote.stats, found)
                    .map(|b| buf[dst].copy_from_slice(&b[at..at + (hi - lo) as usize]))
                    .is_some()
            } else {
                false
            };
            match (had, missing) {
                (true, Some(from)) => {
                    fetch(from, lo, buf)?;
                    missing = None;
                }
                (false, None) => missing = Some(lo),
                _ => {}
            }
        }
        if let Some(from) = missing {
            fetch(from, end, buf)?;
        }
        Ok(())
    }

    fn holds_fetched_ahead(&self) -> bool {
        true
    }

    /// The parts that hold the range, each fetched as a part read ahead (kept until read)
    /// until the parts read ahead and not read yet fill half of the source's memory.
    fn fetch_ahead(&self, off: u64, len: u64) -> u64 {
        let end = off.saturating_add(len).min(self.meta.size);
        if off >= end || self.check_unchanged().is_err() {
            return 0;
        }
        let Ok(live) = self.live() else {
            return 0;
        };
        let p = self.remote.tuning.part_size;
        let mut taken = Vec::new();
        for idx in off / p..=(end - 1) / p {
            match self.remote.part(&live, self, idx, true) {
                Some(part) => taken.push((idx, part)),
                None => break,
            }
        }
        let mut had = 0;
        for (idx, part) in taken {
            let range = self.part_range(idx);
            match live.runtime.block_on(part.fut) {
                Ok(_) => had += end.min(range.end) - off.max(range.start),
                // Not kept: a reader fetches it again, and meets the failure itself.
                Err(f) => log::debug!(
                    "{}: bytes {}..{} not fetched ahead: {}",
                    self.shown,
                    range.start,
                    range.end,
                    f.to_read_error()
                ),
            }
        }
        had
    }

    fn parallel_reads(&self) -> usize {
        self.remote.tuning.in_flight.max(1)
    }

    fn check_unchanged(&self) -> std::result::Result<(), ReadError> {
        if self.changed.load(Ordering::Relaxed) {
            return Err(ReadError::Changed);
        }
        Ok(())
    }

    fn local_file(&self) -> std::result::Result<Option<&std::fs::File>, ReadError> {
        Ok(None)
    }
}

#[cfg(test)]
mod tests;
