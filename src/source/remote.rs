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
use object_store::client::{
    HttpClient, HttpConnector, HttpError, HttpRequest, HttpResponse, HttpService, ReqwestConnector,
};
use object_store::path::Path as StorePath;
use object_store::{
    BackoffConfig, ClientOptions, GetOptions, GetRange, ObjectMeta, ObjectStore, ObjectStoreExt,
    RetryConfig,
};
use parking_lot::Mutex;

use super::node_cache::NodeCache;
use super::{Attr, Kind};
use super::{Entry, Object, Source};
use crate::metrics::Stats;
use crate::{Error, ReadError, Result};

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

/// The HTTP client's settings: each request bounded in time; plain `http://` only when the
/// endpoint asks for it. Where `tls` is false no request can go over TLS, and the system's
/// trust store is not loaded: 30-50 ms of each mount from a cold page cache here (paid twice,
/// since the client is made again after the fork).
pub(crate) fn client_options(tuning: &Tuning, allow_http: bool, tls: bool) -> ClientOptions {
    let request = tuning.timeout.min(Duration::from_secs(30));
    ClientOptions::new()
        .with_allow_http(allow_http)
        .with_no_system_certificates(!tls)
        .with_timeout(request)
        .with_connect_timeout(request.min(Duration::from_secs(5)))
        .with_pool_max_idle_per_host(tuning.in_flight.max(1))
}

/// Retries with backoff on 5xx, throttling, timeouts and resets, all within the read's bound.
pub(crate) fn retry_config(tuning: &Tuning) -> RetryConfig {
    RetryConfig {
        backoff: BackoffConfig {
            init_backoff: Duration::from_millis(50),
            max_backoff: Duration::from_secs(2),
            base: 2.0,
        },
        max_retries: 6,
        retry_timeout: tuning.timeout,
    }
}

/// An `object_store` error as one line (some carry a response body over several).
pub(crate) fn one_line(e: &dyn std::fmt::Display) -> String {
    e.to_string()
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ")
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

/// The HTTP client of [`object_store`]'s own (reqwest), counting the ranged GETs it sends:
/// every one, the store's retries included, so `remote_gets` and `remote_get_retries` say what
/// the source was asked.
pub(crate) fn counting_connector(stats: &Arc<Stats>) -> impl HttpConnector {
    CountingConnector(stats.clone())
}

#[derive(Debug)]
struct CountingConnector(Arc<Stats>);

impl HttpConnector for CountingConnector {
    fn connect(&self, options: &ClientOptions) -> object_store::Result<HttpClient> {
        Ok(HttpClient::new(CountingClient {
            inner: ReqwestConnector::default().connect(options)?,
            stats: self.0.clone(),
        }))
    }
}

#[derive(Debug)]
struct CountingClient {
    inner: HttpClient,
    stats: Arc<Stats>,
}

tokio::task_local! {
    /// The ranged GETs sent so far for the part a fetch task is getting: past the first,
    /// each is a retry (the store's, on 5xx, throttling, timeouts and resets, or ours).
    static PART_GETS: std::cell::Cell<u64>;
}

// `object_store` declares `HttpService` with `#[async_trait]`; this is that signature.
impl HttpService for CountingClient {
    fn call<'s, 'f>(
        &'s self,
        req: HttpRequest,
    ) -> std::pin::Pin<
        Box<
            dyn std::future::Future<Output = std::result::Result<HttpResponse, HttpError>>
                + Send
                + 'f,
        >,
    >
    where
        's: 'f,
        Self: 'f,
    {
        if req.method() == "GET" && req.headers().contains_key("range") {
            Stats::add(&self.stats.remote_gets, 1);
            // Outside a part's fetch (none such today) a GET is no one's retry.
            let earlier = PART_GETS.try_with(|n| n.replace(n.get() + 1)).unwrap_or(0);
            if earlier > 0 {
                Stats::add(&self.stats.remote_get_retries, 1);
            }
        }
        Box::pin(self.inner.execute(req))
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
    /// Fetched ahead of its reader, and not read yet.
    unread: bool,
    /// Bytes of it handed to readers so far.
    consumed: u64,
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

/// Makes the store's client: again after a fork, since a client's connections belong to the
/// runtime that made them.
pub(crate) type Connect = Box<dyn Fn() -> Result<Arc<dyn ObjectStore>> + Send + Sync>;

/// A [`Connect`] that makes the client with `build`; its failure names the source `shown`
/// and says `bad` (the settings it came from) with the reason.
pub(crate) fn connect_with<S: ObjectStore>(
    shown: &str,
    bad: &'static str,
    build: impl Fn() -> object_store::Result<S> + Send + Sync + 'static,
) -> Connect {
    let shown = shown.to_string();
    Box::new(move || {
        let store = build()
            .map_err(|e| Error::at(Path::new(&shown), format!("{bad} ({})", one_line(&e))))?;
        Ok(Arc::new(store) as Arc<dyn ObjectStore>)
    })
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
    fn part(&self, live: &Live, obj: &RemoteObject, idx: u64, ahead: bool) -> Option<PartFuture> {
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
                return Some(slot.fut.clone());
            }
        }
        if ahead && *unread >= *max_ahead {
            return None;
        }
        let fut = self.fetch(live, obj, idx);
        let slot = Slot {
            fut: fut.clone(),
            unread: ahead,
            consumed: 0,
        };
        *unread += ahead as usize;
        if let Some((_, gone)) = lru.push((obj.id, idx), slot) {
            *unread -= gone.unread as usize;
        }
        Some(fut)
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

/// Recent sequential readers of one object: where each will read next and how wide its
/// prefetch window has grown.
#[derive(Default)]
struct Streams {
    /// Most recent last.
    recent: Vec<Stream>,
}

struct Stream {
    /// Where its next read starts.
    next: u64,
    /// Parts fetched ahead of it, at most.
    window: u64,
    /// Its last read waited for a part: the window was too narrow to hide the fetches.
    waited: bool,
}

/// The number of sequential readers of one object followed at once (ranks, engines' loader
/// threads).
const STREAMS: usize = 8;

impl Streams {
    /// Note a read of `range`; how many parts past its end to fetch ahead. A stream's window
    /// doubles each time its reader had to wait for a part, and stays where it is while the
    /// parts are there in time: a reader slower than the source (one that decodes each
    /// read) keeps a few parts ahead, not the widest window, each part in flight a buffer
    /// of fresh memory.
    fn note(&mut self, range: Range<u64>, part: u64, max_window: u64) -> u64 {
        // A read continuing a stream: near where the last one ended (readers may be a
        // little out of order).
        let near = |next: u64| range.start <= next + part && next <= range.start + part;
        let window = match self.recent.iter().position(|s| near(s.next)) {
            Some(i) => {
                let s = self.recent.remove(i);
                let w = if s.waited { s.window * 2 } else { s.window };
                w.clamp(1, max_window)
            }
            None => 0,
        };
        self.recent.push(Stream {
            next: range.end,
            window: window.max(1),
            waited: false,
        });
        if self.recent.len() > STREAMS {
            self.recent.remove(0);
        }
        window
    }

    /// The read that ended at `end` had to wait for a part.
    fn waited(&mut self, end: u64) {
        if let Some(s) = self.recent.iter_mut().rev().find(|s| s.next == end) {
            s.waited = true;
        }
    }
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
    ) -> std::result::Result<(), ReadError> {
        let fut = self
            .remote
            .part(live, self, idx, false)
            .expect("a part a reader waits for is always fetched");
        self.copy_from(live, idx, fut, dst, lo)
    }

    /// `dst.len()` bytes at `lo` from part `idx` once `fut` has it, counted as consumed.
    fn copy_from(
        &self,
        live: &Live,
        idx: u64,
        fut: PartFuture,
        dst: &mut [u8],
        lo: u64,
    ) -> std::result::Result<(), ReadError> {
        let range = self.part_range(idx);
        let bytes = live
            .runtime
            .block_on(fut)
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
        self.check_unchanged()?;
        let end = self.end_of(off, buf.len())?;
        if buf.is_empty() {
            return Ok(());
        }
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
                let fut = self.remote.part(&live, self, next, false);
                pending.push_back((
                    next,
                    fut.expect("a part a reader waits for is always fetched"),
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
            let Some((idx, fut)) = pending.pop_front() else {
                break;
            };
            waited |= fut.peek().is_none();
            let range = self.part_range(idx);
            let (lo, hi) = (off.max(range.start), end.min(range.end));
            self.copy_from(
                &live,
                idx,
                fut,
                &mut buf[(lo - off) as usize..(hi - off) as usize],
                lo,
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
        self.check_unchanged()?;
        let end = self.end_of(off, buf.len())?;
        if buf.is_empty() {
            return Ok(());
        }
        let p = self.remote.tuning.part_size;
        let live = self.live()?;
        for idx in off / p..=(end - 1) / p {
            let range = self.part_range(idx);
            let (lo, hi) = (off.max(range.start), end.min(range.end));
            let dst = &mut buf[(lo - off) as usize..(hi - off) as usize];
            if lo != range.start || hi != range.end || self.remote.holds(self.id, idx) {
                self.copy_from_part(&live, idx, dst, lo)?;
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
        self.check_unchanged()?;
        let end = self.end_of(off, buf.len())?;
        if buf.is_empty() {
            return Ok(());
        }
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
                self.copy_from_part(&live, idx, &mut buf[dst], lo)?;
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
mod tests {
    use super::*;
    use object_store::memory::InMemory;
    use object_store::ObjectStoreExt;

    fn settings(part: u64) -> RemoteSettings {
        RemoteSettings {
            tuning: Tuning {
                part_size: part,
                in_flight: 4,
                memory: 8 * part,
                max_window: 4,
                timeout: Duration::from_secs(5),
            },
            ..Default::default()
        }
    }

    /// A source over `mem`.
    fn remote_over(mem: &Arc<InMemory>, settings: &RemoteSettings) -> Arc<Remote> {
        let store = mem.clone();
        let connect: Connect = Box::new(move || Ok(store.clone() as Arc<dyn ObjectStore>));
        Remote::new(connect, "mem://".into(), settings).unwrap()
    }

    /// Another version of `obj` in `mem`, `bytes` long.
    fn replace(remote: &Remote, mem: &Arc<InMemory>, bytes: Vec<u8>) {
        remote
            .call("replace", |_| {
                let mem = mem.clone();
                async move { mem.put(&StorePath::from("obj"), bytes.into()).await }
            })
            .unwrap()
            .unwrap();
    }

    /// A source over an in-memory store holding `bytes` at `obj`, and that object.
    fn one_object(bytes: &[u8], part: u64) -> (Arc<InMemory>, Arc<Remote>, RemoteObject) {
        let mem = Arc::new(InMemory::new());
        let remote = remote_over(&mem, &settings(part));
        let path = StorePath::from("obj");
        let meta = remote
            .call("put", |s| {
                let bytes = bytes.to_vec();
                async move {
                    s.put(&path, bytes.into()).await?;
                    s.head(&path).await
                }
            })
            .unwrap()
            .unwrap();
        let obj = remote.object(meta, "mem://obj".into());
        (mem, remote, obj)
    }

    /// A source over `mem` with a node cache in `dir`, counting into `stats`, and its
    /// object as [`one_object`] put it.
    fn cached_object(
        mem: &Arc<InMemory>,
        dir: &Path,
        stats: &Arc<Stats>,
    ) -> (Arc<Remote>, RemoteObject) {
        let s = RemoteSettings {
            cache_dir: Some(dir.into()),
            cache_dir_size: 1 << 20,
            stats: stats.clone(),
            ..settings(1000)
        };
        let remote = remote_over(mem, &s);
        let meta = remote
            .call(
                "head",
                |s| async move { s.head(&StorePath::from("obj")).await },
            )
            .unwrap()
            .unwrap();
        let obj = remote.object(meta, "mem://obj".into());
        (remote, obj)
    }

    /// The runtime's threads serve in the foreground even when a thread in the background
    /// (decode or check ahead, the first to read after the daemon's fork) makes them.
    #[test]
    fn the_runtime_runs_in_the_foreground_whoever_starts_it() {
        use crate::background::{place_of, run_in_background, Background};
        let made_by = std::thread::spawn(move || {
            // SAFETY: gettid has no preconditions.
            let me = unsafe { libc::gettid() };
            run_in_background(me, true);
            let remote = remote_over(&Arc::new(InMemory::new()), &settings(1000));
            let live = remote.live().unwrap();
            let served = live.runtime.block_on(async {
                // SAFETY: gettid has no preconditions.
                let worker = tokio::spawn(async { place_of(unsafe { libc::gettid() }) });
                worker.await.unwrap()
            });
            (place_of(me), served)
        });
        let (maker, served) = made_by.join().unwrap();
        assert_ne!(
            maker,
            (libc::SCHED_OTHER, 0),
            "the maker runs in the background"
        );
        // Without leave to come back from nice 19 (`Background::Nice`) no thread can.
        if Background::chosen() == Background::Idle {
            assert_eq!(
                served,
                (libc::SCHED_OTHER, 0),
                "a GET's thread: (policy, nice)"
            );
        }
    }

    #[test]
    fn any_range_reads_exactly_across_parts() {
        let bytes: Vec<u8> = (0..10_000u32).map(|i| (i * 7 + i / 251) as u8).collect();
        let (_, _, obj) = one_object(&bytes, 1000);
        for (off, len) in [
            (0, 1),
            (0, 10_000),
            (999, 2),
            (1000, 1000),
            (4321, 3333),
            (9999, 1),
        ] {
            let mut buf = vec![0u8; len];
            obj.read_exact_at(&mut buf, off as u64).unwrap();
            assert_eq!(buf, bytes[off..off + len], "{off}+{len}");
        }
        // Sequential reads grow a window and still read exactly.
        let mut out = Vec::new();
        for off in (0..10_000).step_by(700) {
            let len = 700.min(10_000 - off);
            let mut buf = vec![0u8; len];
            obj.read_exact_at(&mut buf, off as u64).unwrap();
            out.extend_from_slice(&buf);
        }
        assert_eq!(out, bytes);
        let mut past = vec![0u8; 2];
        assert!(obj.read_exact_at(&mut past, 9_999).is_err());
    }

    #[test]
    fn small_reads_fetch_only_their_bytes_and_use_parts_held() {
        let bytes: Vec<u8> = (0..10_000u32).map(|i| (i * 13 + i / 97) as u8).collect();
        let (_, remote, obj) = one_object(&bytes, 1000);
        let fetched = || remote.stats.remote_bytes_fetched.load(Ordering::Relaxed);
        let kept = || remote.parts.lock().lru.len();
        let mut buf = vec![0u8; 1500];
        obj.read_small_at(&mut buf, 300).unwrap();
        assert_eq!(buf, bytes[300..1800]);
        assert_eq!(
            fetched(),
            1500,
            "just the bytes asked for, not parts 0 and 1"
        );
        assert_eq!(kept(), 0, "nothing kept");
        // Part 2 held: a small read across parts 1-3 takes part 2's bytes from it and fetches
        // the runs on either side.
        let mut part2 = vec![0u8; 10];
        obj.read_exact_at(&mut part2, 2000).unwrap();
        let before = fetched();
        let mut buf = vec![0u8; 2200];
        obj.read_small_at(&mut buf, 1400).unwrap();
        assert_eq!(buf, bytes[1400..3600]);
        assert_eq!(fetched() - before, 600 + 600, "parts 1 and 3's bytes only");
        let mut past = vec![0u8; 2];
        assert!(obj.read_small_at(&mut past, 9_999).is_err());
    }

    #[test]
    fn parts_read_through_are_let_go() {
        let bytes: Vec<u8> = (0..10_000u32).map(|i| (i % 253) as u8).collect();
        let (_, remote, obj) = one_object(&bytes, 1000);
        let kept = || remote.parts.lock().lru.len();
        let mut head = vec![0u8; 10];
        obj.read_exact_at(&mut head, 0).unwrap();
        assert_eq!(kept(), 1, "a part read in part stays for the rest of it");
        let mut out = Vec::new();
        for off in (0..10_000).step_by(700) {
            let mut buf = vec![0u8; 700.min(10_000 - off)];
            obj.read_exact_at(&mut buf, off as u64).unwrap();
            out.extend_from_slice(&buf);
        }
        assert_eq!(out, bytes);
        assert_eq!(kept(), 0, "every part was read through");
    }

    #[test]
    fn part_buffers_are_given_back_and_reused() {
        let bytes: Vec<u8> = (0..10_000u32).map(|i| (i % 241) as u8).collect();
        let (_, remote, obj) = one_object(&bytes, 1000);
        let kept = || remote.buffers.free.lock().len();
        for round in 0..2 {
            let mut out = vec![0u8; 10_000];
            obj.read_exact_at(&mut out, 0).unwrap();
            assert_eq!(out, bytes, "round {round}");
            // Every part was read through and let go: its buffer is back for the next GET.
            assert!(
                kept() > 0 && kept() <= KEEP_BUFFERS,
                "round {round}: {}",
                kept()
            );
        }
    }

    #[test]
    fn reads_once_go_straight_into_the_callers_memory_and_keep_nothing() {
        let bytes: Vec<u8> = (0..10_000u32).map(|i| (i * 13 + i / 97) as u8).collect();
        let (_, remote, obj) = one_object(&bytes, 1000);
        let kept = || remote.parts.lock().lru.len();
        // Whole parts, one or many: none kept, none read ahead.
        for (off, len) in [(0, 1000), (1000, 3000), (9000, 1000), (0, 10_000)] {
            let mut buf = vec![0u8; len];
            obj.read_once_at(&mut buf, off as u64).unwrap();
            assert!(buf == bytes[off..off + len], "bytes {off}..+{len}");
            assert_eq!(kept(), 0, "after bytes {off}..+{len}");
        }
        // Parts cut by the range's ends come through the kept parts, with nothing read
        // ahead: the two cut parts of 500..2500 at most are kept. The bytes are exact.
        for (off, len) in [(500, 2000), (9999, 1), (1, 9998)] {
            let mut buf = vec![0u8; len];
            obj.read_once_at(&mut buf, off as u64).unwrap();
            assert!(buf == bytes[off..off + len], "bytes {off}..+{len}");
            if off == 500 {
                assert!(kept() <= 2, "{} parts kept", kept());
            }
        }
        let mut buf = vec![0u8; 2];
        assert!(obj.read_once_at(&mut buf, 9999).is_err());
    }

    #[test]
    fn a_read_once_of_a_replaced_object_fails() {
        let bytes = vec![1u8; 4000];
        let (mem, remote, obj) = one_object(&bytes, 1000);
        replace(&remote, &mem, vec![2u8; 4000]);
        let mut buf = vec![0u8; 1000];
        assert!(matches!(
            obj.read_once_at(&mut buf, 1000),
            Err(ReadError::Changed)
        ));
        assert!(matches!(
            obj.read_exact_at(&mut buf, 0),
            Err(ReadError::Changed)
        ));
    }

    #[test]
    fn a_replaced_object_is_never_served() {
        let bytes = vec![1u8; 4000];
        let (mem, remote, obj) = one_object(&bytes, 1000);
        let mut buf = vec![0u8; 10];
        obj.read_exact_at(&mut buf, 0).unwrap();
        replace(&remote, &mem, vec![2u8; 4000]);
        assert!(matches!(
            obj.read_exact_at(&mut buf, 3000),
            Err(ReadError::Changed)
        ));
        // Sticky: parts had before fail too.
        assert!(matches!(
            obj.read_exact_at(&mut buf, 0),
            Err(ReadError::Changed)
        ));
        assert!(matches!(obj.check_unchanged(), Err(ReadError::Changed)));
    }

    #[test]
    fn a_fork_quiesce_keeps_parts_and_restarts_the_runtime() {
        let bytes: Vec<u8> = (0..3000u32).map(|i| i as u8).collect();
        let (_, remote, obj) = one_object(&bytes, 1000);
        let mut buf = vec![0u8; 3000];
        obj.read_exact_at(&mut buf, 0).unwrap();
        quiesce_for_fork();
        assert!(remote.live.lock().is_none());
        obj.read_exact_at(&mut buf, 0).unwrap();
        assert_eq!(buf, bytes);
    }

    #[test]
    fn fetched_bytes_node_cache_lookups_and_failures_are_counted() {
        let bytes: Vec<u8> = (0..4500u32).map(|i| (i % 253) as u8).collect();
        let (mem, _, _) = one_object(&bytes, 1000);
        let cache = tempfile::tempdir().unwrap();
        let with_cache = |stats: &Arc<Stats>| cached_object(&mem, cache.path(), stats);
        let count = |s: &Stats| {
            let c = s.snapshot();
            (
                c.remote_bytes_fetched,
                c.node_cache_hits,
                c.node_cache_misses,
                c.remote_get_failures,
            )
        };
        let mut buf = vec![0u8; bytes.len()];

        // Reads once into an empty cache keep what they fetch there.
        {
            let once = Stats::new();
            let (_remote, obj) = with_cache(&once);
            obj.read_once_at(&mut buf, 0).unwrap();
            assert_eq!(buf, bytes);
            assert_eq!(count(&once), (4500, 0, 5, 0));
            obj.read_exact_at(&mut buf, 0).unwrap();
            assert_eq!(count(&once), (4500, 5, 5, 0));
            std::fs::remove_dir_all(cache.path().join("kllm-parts-v1")).unwrap();
        }

        // An empty cache: five parts looked for, fetched (4500 bytes), kept.
        let first = Stats::new();
        let (_remote, obj) = with_cache(&first);
        obj.read_exact_at(&mut buf, 0).unwrap();
        assert_eq!(buf, bytes);
        assert_eq!(count(&first), (4500, 0, 5, 0));
        // Read again: the parts read through were let go, and the cache gives them back;
        // nothing fetched.
        obj.read_exact_at(&mut buf, 0).unwrap();
        assert_eq!(buf, bytes);
        assert_eq!(count(&first), (4500, 5, 5, 0));

        // Another source on the node: every part from the cache.
        let second = Stats::new();
        let (remote, obj) = with_cache(&second);
        obj.read_exact_at(&mut buf, 0).unwrap();
        assert_eq!(buf, bytes);
        assert_eq!(count(&second), (0, 5, 0, 0));
        // Reads once (a fill's) find the parts there too.
        obj.read_once_at(&mut buf, 0).unwrap();
        assert_eq!(buf, bytes);
        assert_eq!(count(&second), (0, 10, 0, 0));

        // The object replaced in the store: a part not in memory or in the cache is asked
        // for, the store says the object changed, and that part is a failure (nothing fetched).
        let third = Stats::new();
        let (_remote3, obj) = with_cache(&third);
        replace(&remote, &mem, vec![9u8; 4600]);
        // The cache still holds the mounted version's parts, and would serve them: empty it.
        std::fs::remove_dir_all(cache.path().join("kllm-parts-v1")).unwrap();
        assert!(matches!(
            obj.read_exact_at(&mut buf[..10], 0),
            Err(ReadError::Changed)
        ));
        assert_eq!(count(&third), (0, 0, 1, 1));
    }

    #[test]
    fn a_fetch_whose_cache_lookup_never_runs_fails_without_a_miss_or_a_get() {
        let bytes: Vec<u8> = (0..2000u32).map(|i| (i % 251) as u8).collect();
        let (mem, _, _) = one_object(&bytes, 1000);
        let cache = tempfile::tempdir().unwrap();
        let stats = Stats::new();
        let (remote, obj) = cached_object(&mem, cache.path(), &stats);
        let job = remote.job(&remote.live().unwrap(), &obj, 0);
        // As before the fork: the runtime is shutting down when the fetch asks for its
        // lookup, which tokio then cancels instead of running.
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let handle = runtime.handle().clone();
        runtime.shutdown_background();
        let _in_it = handle.enter();
        let got = futures::executor::block_on(job.run());
        assert!(got.is_err(), "a part not looked for is not had");
        let c = stats.snapshot();
        assert_eq!(
            (c.node_cache_misses, c.remote_gets, c.remote_bytes_fetched),
            (0, 0, 0),
            "no miss counted, no GET begun"
        );
    }

    #[test]
    fn a_fetched_part_whose_cache_write_never_runs_is_not_had() {
        use futures::task::{waker, ArcWake};
        use std::future::Future;
        use std::task::Context;
        struct Woken(AtomicBool);
        impl ArcWake for Woken {
            fn wake_by_ref(w: &Arc<Self>) {
                w.0.store(true, Ordering::SeqCst);
            }
        }
        let bytes: Vec<u8> = (0..2000u32).map(|i| (i % 251) as u8).collect();
        let (mem, _, _) = one_object(&bytes, 1000);
        let cache = tempfile::tempdir().unwrap();
        let stats = Stats::new();
        let (remote, obj) = cached_object(&mem, cache.path(), &stats);
        let job = remote.job(&remote.live().unwrap(), &obj, 0);
        // The lookup runs; the runtime then shuts down (as before the fork), so tokio
        // cancels the write that follows the GET instead of running it. The one blocking
        // thread is held until the fetch has asked for its lookup, so that the lookup
        // cannot end before the first poll does (and the write run within that poll).
        let runtime = tokio::runtime::Builder::new_current_thread()
            .max_blocking_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let handle = runtime.handle().clone();
        let _in_it = handle.enter();
        let (unplug, plugged) = std::sync::mpsc::channel::<()>();
        let (started, plug_started) = std::sync::mpsc::channel::<()>();
        handle.spawn_blocking(move || {
            started.send(()).unwrap();
            plugged.recv()
        });
        plug_started.recv().unwrap();
        let woken = Arc::new(Woken(AtomicBool::new(false)));
        let waker = waker(woken.clone());
        let mut run = std::pin::pin!(job.run());
        let pending = run.as_mut().poll(&mut Context::from_waker(&waker));
        assert!(
            pending.is_pending(),
            "the lookup waits for the blocking thread"
        );
        unplug.send(()).unwrap();
        while !woken.0.load(Ordering::SeqCst) {
            std::thread::sleep(Duration::from_millis(1));
        }
        runtime.shutdown_background();
        let got = futures::executor::block_on(run);
        let c = stats.snapshot();
        assert_eq!(
            (c.node_cache_misses, c.remote_bytes_fetched),
            (1, 1000),
            "the lookup and the GET ran"
        );
        assert!(got.is_err(), "a part not kept is not had");
        let node_cache = remote.node_cache.as_ref().unwrap();
        let kept = node_cache.get(&obj.cache_key(&remote.name), 0, 1000);
        assert!(kept.is_none(), "nothing was written to the node cache");
    }

    #[test]
    fn listing_is_depth_first_and_sorted_with_implied_folders() {
        let t = SystemTime::UNIX_EPOCH;
        let keys = ["b/x", "a.json", "b/c/y", "b0", "bad//key", "dir/", "./z"];
        let got: Vec<String> = listing(keys.iter().map(|k| (*k, 1, t)))
            .iter()
            .map(|e| {
                format!(
                    "{}{}",
                    e.path.display(),
                    if e.attr.kind == Kind::Dir { "/" } else { "" }
                )
            })
            .collect();
        assert_eq!(got, ["/", "a.json", "b/", "b/c/", "b/c/y", "b/x", "b0"]);
    }

    #[test]
    fn windows_grow_only_for_sequential_readers_that_wait() {
        let mut s = Streams::default();
        let p = 8;
        // A reader that waits for its parts at each read.
        let waiting = |s: &mut Streams, r: Range<u64>| {
            let w = s.note(r.clone(), p, 16);
            s.waited(r.end);
            w
        };
        assert_eq!(waiting(&mut s, 0..8), 0);
        assert_eq!(waiting(&mut s, 8..16), 2);
        assert_eq!(waiting(&mut s, 16..24), 4);
        // Another reader elsewhere starts its own stream.
        assert_eq!(waiting(&mut s, 1000..1008), 0);
        assert_eq!(waiting(&mut s, 24..32), 8);
        assert_eq!(waiting(&mut s, 32..40), 16);
        assert_eq!(waiting(&mut s, 40..48), 16);
        assert_eq!(waiting(&mut s, 1008..1016), 2);
        // Its parts there in time, a stream keeps its window.
        assert_eq!(s.note(48..56, p, 16), 16);
        assert_eq!(s.note(1016..1024, p, 16), 4);
        assert_eq!(s.note(1024..1032, p, 16), 4);
        assert_eq!(s.note(1032..1040, p, 16), 4);
        s.waited(1040);
        assert_eq!(s.note(1040..1048, p, 16), 8);
    }
}
