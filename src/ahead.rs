//! Decode ahead: right after mounting, decode the locked shards an engine will read, in the
//! order engines read them, within the passthrough memory budget and at low priority.
//!
//! Engines spend 5-60 s importing and starting before they open a weight file; a mount
//! started with the engine (or before it) uses that time, so the first open of each shard
//! finds its copy decoded, or partly decoded and urged to full priority. Shards are decoded
//! one at a time, each on all cores in the background (`SCHED_IDLE`, so the engine's own
//! start keeps the CPU). A shard that does not fit waits until copies are let go; a shard
//! opened meanwhile is left to its open. Copies decoded ahead and not opened yet are the
//! last let go when an open needs room (`OpenTable::make_room`), and are kept until opened:
//! their grace period starts at their last close.
//!
//! Check ahead ([`CheckAhead`]) is the same idea where there are no decoded copies (serving
//! through FUSE): a file under a manifest is hashed whole before its first byte is served,
//! so the files are hashed in the same order right after mounting, in the background, and
//! an open finds the verdict in instead of waiting for a hash of the whole file.
//!
//! Fetch ahead ([`FetchAhead`]) is the same idea through FUSE: the shards' sealed bytes are
//! brought in, in that order (remote parts kept until read, local pages into the page
//! cache), then decoded into the kernel's page cache of the mount; under a manifest, once
//! check ahead is done.

use std::cmp::Ordering;
use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering as AtomicOrdering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;

use crate::background::run_in_background;
use crate::fill::Fill;
use crate::source::Object;
use crate::view::{Content, Ino, View};

/// The index engines read to find the shards of a sharded checkpoint.
const INDEX: &str = "model.safetensors.index.json";
/// How often a shard waiting for room in the budget looks again.
const ROOM_POLL: Duration = Duration::from_secs(1);

/// The locked shards in the order engines load them: those the index lists, by name in
/// natural order (transformers and vLLM sort them so), then any other, by path.
pub fn order(view: &View) -> Vec<Ino> {
    let is_shard = |ino: Ino| {
        matches!(
            view.node(ino).map(|n| &n.content),
            Some(Content::Shard { .. })
        )
    };
    let mut listed: Vec<String> = index_files(view);
    listed.sort_by(|a, b| natural(a, b));
    listed.dedup();
    let mut out: Vec<Ino> = listed
        .iter()
        .filter_map(|name| view.resolve(name))
        .filter(|&ino| is_shard(ino))
        .collect();
    let mut rest: Vec<(String, Ino)> = view
        .file_paths()
        .into_iter()
        .filter(|(_, ino)| is_shard(*ino) && !out.contains(ino))
        .collect();
    rest.sort_by(|a, b| natural(&a.0, &b.0));
    out.extend(rest.into_iter().map(|(_, ino)| ino));
    out
}

/// The shard names of the root index's `weight_map`, or none.
fn index_files(view: &View) -> Vec<String> {
    let Some(ino) = view.resolve(INDEX) else {
        return Vec::new();
    };
    let Some(size) = view.node(ino).map(|n| n.attr.size as usize) else {
        return Vec::new();
    };
    let bytes = match view.read(ino, 0, size) {
        Ok(b) => b,
        Err(e) => {
            log::debug!("decode ahead: {INDEX} not read ({e}); shards in path order");
            return Vec::new();
        }
    };
    let doc: serde_json::Value = match serde_json::from_slice(&bytes) {
        Ok(d) => d,
        Err(e) => {
            log::debug!("decode ahead: {INDEX} is not JSON ({e}); shards in path order");
            return Vec::new();
        }
    };
    doc.get("weight_map")
        .and_then(|m| m.as_object())
        .map(|m| {
            m.values()
                .filter_map(|v| v.as_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default()
}

/// Compare names with runs of digits compared as numbers (`model-2` before `model-10`).
fn natural(a: &str, b: &str) -> Ordering {
    let (mut x, mut y) = (a.as_bytes(), b.as_bytes());
    loop {
        match (x.first(), y.first()) {
            (None, None) => return Ordering::Equal,
            (None, _) => return Ordering::Less,
            (_, None) => return Ordering::Greater,
            (Some(c), Some(d)) if c.is_ascii_digit() && d.is_ascii_digit() => {
                let (nx, ny) = (digits(x), digits(y));
                let (vx, vy) = (&x[..nx], &y[..ny]);
                let (tx, ty) = (trim_zeros(vx), trim_zeros(vy));
                let ord = tx.len().cmp(&ty.len()).then(tx.cmp(ty));
                if ord != Ordering::Equal {
                    return ord;
                }
                x = &x[nx..];
                y = &y[ny..];
            }
            (Some(c), Some(d)) if c != d => return c.cmp(d),
            _ => {
                x = &x[1..];
                y = &y[1..];
            }
        }
    }
}

fn digits(s: &[u8]) -> usize {
    s.iter().take_while(|c| c.is_ascii_digit()).count()
}

fn trim_zeros(s: &[u8]) -> &[u8] {
    let z = s.iter().take_while(|&&c| c == b'0').count();
    &s[z..]
}

/// What a request to decode a file ahead did.
pub enum Ahead {
    Started(Arc<Fill>),
    /// Opened already, or decoded already.
    Skipped,
    /// The budget has no room for it now.
    NoRoom,
}

/// Start decoding ahead on a thread of its own: `decode(ino, rank)` asks for one shard's
/// copy (see `OpenTable::decode_ahead`); `budget()` is the passthrough memory while
/// passthrough is on, `None` once it is off.
pub fn start(
    view: Arc<View>,
    budget: impl Fn() -> Option<u64> + Send + 'static,
    decode: impl Fn(Ino, usize) -> Ahead + Send + 'static,
) {
    let run = move || run(&view, budget, decode);
    spawn(
        "kllm-ahead",
        run,
        "decode ahead",
        "shards are decoded on their first open",
    );
}

/// Start `run` on a thread named `name`; whether it started. If not, say that there is no
/// `what` and what happens instead (`then`).
fn spawn(name: &str, run: impl FnOnce() + Send + 'static, what: &str, then: &str) -> bool {
    match std::thread::Builder::new().name(name.into()).spawn(run) {
        Ok(_) => true,
        Err(e) => {
            log::warn!("no {what} ({e}): {then}");
            false
        }
    }
}

fn run(view: &View, budget: impl Fn() -> Option<u64>, decode: impl Fn(Ino, usize) -> Ahead) {
    let order = order(view);
    log::debug!("decode ahead: {} shards", order.len());
    for (rank, &ino) in order.iter().enumerate() {
        loop {
            let Some(budget) = budget() else {
                return;
            };
            if view.node(ino).map_or(0, |n| n.attr.size) > budget {
                break;
            }
            match decode(ino, rank) {
                Ahead::Started(fill) => {
                    fill.wait_done();
                    break;
                }
                Ahead::Skipped => break,
                Ahead::NoRoom => std::thread::sleep(ROOM_POLL),
            }
        }
    }
    log::debug!("decode ahead: done");
}

/// Check ahead: the files under a manifest hashed right after mounting, in the order
/// engines read them (the shards as [`order`] gives them, then any other file by path), one
/// at a time on a thread of its own in the background (`SCHED_IDLE`). Through FUSE an open
/// of such a file waits for its verdict: hashed ahead, it finds the verdict in, or its hash
/// under way and urged to the normal policy (a hash one waits for must not run only on idle
/// cycles). A local file's sealed bytes are then in the page cache for the reads that
/// follow.
pub struct CheckAhead {
    state: Mutex<Checking>,
}

#[derive(Default)]
struct Checking {
    /// The file being hashed ahead, and whether an open urged its hash.
    current: Option<Ino>,
    urged: bool,
    /// The check-ahead thread.
    tid: Option<libc::pid_t>,
    /// Files an open asked for before their hash ahead began: hashed by the open itself.
    opened: HashSet<Ino>,
}

impl CheckAhead {
    fn new() -> CheckAhead {
        CheckAhead {
            state: Mutex::new(Checking::default()),
        }
    }

    /// Start checking ahead on a thread of its own, then `then` there (fetch ahead, once
    /// the files' verdicts are in); `None` if there is nothing to check or the thread could
    /// not start.
    pub fn start(
        view: Arc<View>,
        then: impl FnOnce(&View) + Send + 'static,
    ) -> Option<Arc<CheckAhead>> {
        let files = check_order(&view);
        if files.is_empty() {
            return None;
        }
        let check = Arc::new(CheckAhead::new());
        let c = check.clone();
        let run = move || {
            // SAFETY: gettid has no preconditions.
            c.state.lock().tid = Some(unsafe { libc::gettid() });
            log::debug!("check ahead: {} files", files.len());
            for ino in files {
                if c.claim(ino) {
                    // A mismatch is logged by the verdict itself; its opens fail.
                    let _ = view.verify(ino);
                    c.done();
                }
            }
            log::debug!("check ahead: done");
            then(&view);
        };
        let hashed_on_open = "files are hashed on their first open";
        spawn("kllm-check", run, "check ahead", hashed_on_open).then_some(check)
    }

    /// Whether the check-ahead thread hashes file `ino` now (in the background), or leaves
    /// it to the open that asked for it first.
    fn claim(&self, ino: Ino) -> bool {
        let mut s = self.state.lock();
        if s.opened.contains(&ino) {
            return false;
        }
        if let Some(tid) = s.tid {
            run_in_background(tid, true);
        }
        s.current = Some(ino);
        s.urged = false;
        true
    }

    fn done(&self) {
        let mut s = self.state.lock();
        s.current = None;
        s.urged = false;
    }

    /// An open is about to wait for file `ino`'s verdict: a hash of it under way ahead is
    /// urged to the normal policy, and one not begun is left to the open. Whether it urged.
    pub fn before_verdict(&self, ino: Ino) -> bool {
        let mut s = self.state.lock();
        if s.current == Some(ino) {
            if !s.urged {
                s.urged = true;
                if let Some(tid) = s.tid {
                    run_in_background(tid, false);
                }
                log::debug!("check ahead urged by an open");
            }
            return true;
        }
        s.opened.insert(ino);
        false
    }
}

/// Fetch ahead: where shards are served through FUSE, their sealed bytes are what an open
/// would wait for (under a manifest, once hashed). Right after mounting (under a manifest,
/// after check ahead), on a thread in the background (`SCHED_IDLE`), the shards are
/// brought in from their starts in the order engines read them, one after another, until a
/// quarter of the memory limit is in, the source takes on no more, or a shard is opened
/// (from then on the reads themselves fetch). A remote source keeps them as parts read
/// ahead, within half of `--source-memory`, until read; a local one reads them into the
/// page cache a piece at a time on a quiet disk, as decode ahead does. Steps of one part,
/// then two, then four, so a reader that opens at once finds the first part come in
/// alone, as fast as it can.
///
/// Given the kernel's page cache of the mount ([`PageCache`]), each step is then decoded on
/// this thread and stored there, so the engine's reads find the view's pages in the kernel
/// and reach the daemon no more: through FUSE, the decode ahead of passthrough mode.
pub struct FetchAhead {
    opened: AtomicBool,
}

/// The kernel's page cache of the mount's files, which the FUSE adapter fills
/// (`FUSE_NOTIFY_STORE`): what fetch ahead decodes goes there.
pub trait PageCache: Send + Sync {
    /// Have the kernel know file `path` of the view (a lookup through the mount): it keeps
    /// pages only for files it knows.
    fn look_up(&self, path: &str) -> std::io::Result<()>;
    /// Put `bytes`, the view's bytes of file `ino` at `off`, into its page cache.
    fn store(&self, ino: Ino, off: u64, bytes: &[u8]) -> std::io::Result<()>;
}

/// The widest step of fetch ahead, in bytes asked for at once (each step waits for its
/// parts: four 8 MiB parts at once keep loopback and a LAN busy).
const FETCH_STEP_MAX: u64 = 32 << 20;
/// Its first step: one default part.
const FETCH_STEP_FIRST: u64 = 8 << 20;
/// Bytes decoded at once to store: small enough to decode on this thread alone (a larger
/// read is spread over the decode pool, which does not run in the background), and at
/// least a readahead request (so it passes the block cache by).
const STORE_DECODE: usize = 128 << 10;
/// Bytes stored in the kernel at once.
const STORE_PIECE: usize = 1 << 20;

impl FetchAhead {
    pub fn new() -> Arc<FetchAhead> {
        Arc::new(FetchAhead {
            opened: AtomicBool::new(false),
        })
    }

    /// Start fetching ahead on a thread of its own ([`FetchAhead::run`]); whether it
    /// started (not if there is no shard).
    pub fn start(
        self: &Arc<Self>,
        view: Arc<View>,
        bound: u64,
        page_cache: Option<Arc<dyn PageCache>>,
    ) -> bool {
        let shards = order(&view);
        if shards.is_empty() {
            return false;
        }
        let f = self.clone();
        let run = move || f.run(&view, shards, bound, page_cache);
        let fetched_on_read = "shards are fetched on their first read";
        spawn("kllm-fetch-ahead", run, "fetch ahead", fetched_on_read)
    }

    /// Fetch `shards` ahead ([`order`]) on this thread, in the background, at most `bound`
    /// bytes in all, decoding into `page_cache` when there is one.
    pub fn run(
        &self,
        view: &View,
        shards: Vec<Ino>,
        bound: u64,
        page_cache: Option<Arc<dyn PageCache>>,
    ) {
        // Nobody waits for it: the engine's own start keeps the CPU.
        // SAFETY: gettid has no preconditions.
        run_in_background(unsafe { libc::gettid() }, true);
        let objects = shards.into_iter().filter_map(|ino| {
            let object = view.sealed_object(ino).ok().flatten()?.clone();
            Some((ino, object))
        });
        let stats = view.stats().clone();
        let mut store = page_cache.and_then(|cache| StoreAhead::new(view, cache));
        let fetched = |ino, off, len| {
            crate::metrics::Stats::add(&stats.bytes_fetched_ahead, len);
            if let Some(s) = store.as_mut() {
                if !s.decode_and_store(ino, off, len, &self.opened) {
                    store = None;
                }
            }
        };
        let total = fetch_in_order(objects, bound, &self.opened, fetched);
        log::debug!("fetch ahead: {total} bytes of sealed shards brought in");
    }

    /// A shard was opened: its reader's prefetch window fetches from now on, and the memory
    /// for reading ahead is left to it.
    pub fn opened(&self) {
        self.opened.store(true, AtomicOrdering::Relaxed);
    }
}

/// Fetch `objects` ahead one after another, from their starts, in growing steps, until
/// `bound` bytes are in, one takes on less than asked (its source's memory for reading
/// ahead is full, or it fetches nothing) or `opened` is set; `fetched(ino, off, len)` is
/// told each step's bytes. How many bytes were fetched.
fn fetch_in_order(
    objects: impl Iterator<Item = (Ino, Arc<dyn Object>)>,
    bound: u64,
    opened: &AtomicBool,
    mut fetched: impl FnMut(Ino, u64, u64),
) -> u64 {
    let mut step = FETCH_STEP_FIRST;
    let mut total = 0;
    for (ino, object) in objects {
        let mut off = 0;
        while off < object.len() {
            if opened.load(AtomicOrdering::Relaxed) || total >= bound {
                return total;
            }
            let want = step.min(object.len() - off).min(bound - total);
            let had = object.fetch_ahead(off, want);
            total += had;
            if had > 0 {
                fetched(ino, off, had);
            }
            if had < want {
                return total;
            }
            off += want;
            step = (2 * step).min(FETCH_STEP_MAX);
        }
    }
    total
}

/// Decodes what fetch ahead brought in and stores it in the kernel's page cache.
struct StoreAhead<'a> {
    view: &'a View,
    cache: Arc<dyn PageCache>,
    /// The file the kernel was last asked to look up.
    known: Option<Ino>,
    /// A file whose bytes could not be had (its reads fail the same way): left to them.
    failed: Option<Ino>,
    /// The decoded bytes, in locked memory like every other decoded byte of the daemon's.
    buf: crate::secmem::SecureBuf,
}

impl<'a> StoreAhead<'a> {
    fn new(view: &'a View, cache: Arc<dyn PageCache>) -> Option<StoreAhead<'a>> {
        match crate::secmem::SecureBuf::new(STORE_PIECE) {
            Ok(buf) => Some(StoreAhead {
                view,
                cache,
                known: None,
                failed: None,
                buf,
            }),
            Err(e) => {
                log::warn!("fetch ahead decodes nothing ahead (no memory: {e})");
                None
            }
        }
    }

    /// Decode bytes `[off, off + len)` of file `ino` and store them, until `opened` is set;
    /// whether to go on (false once the kernel failed, logged). A file that fails to decode
    /// (a bad value, a failed check) is skipped.
    fn decode_and_store(&mut self, ino: Ino, off: u64, len: u64, opened: &AtomicBool) -> bool {
        let path = || self.view.path_of(ino);
        if self.failed == Some(ino) {
            return true;
        }
        if self.known != Some(ino) {
            if let Err(e) = self.cache.look_up(&path()) {
                log::debug!(
                    "fetch ahead: {} not looked up ({e}); nothing decoded ahead",
                    path()
                );
                return false;
            }
            self.known = Some(ino);
        }
        let end = off + len;
        let mut at = off;
        while at < end && !opened.load(AtomicOrdering::Relaxed) {
            let n = (end - at).min(STORE_PIECE as u64) as usize;
            let piece = &mut self.buf[..n];
            for (i, part) in piece.chunks_mut(STORE_DECODE).enumerate() {
                if let Err(e) = self
                    .view
                    .read_into(ino, at + (i * STORE_DECODE) as u64, part)
                {
                    log::debug!("fetch ahead: {} not decoded at {at}: {e}", path());
                    self.failed = Some(ino);
                    return true;
                }
            }
            if let Err(e) = self.cache.store(ino, at, piece) {
                log::debug!("fetch ahead: {} not stored at {at}: {e}", path());
                return false;
            }
            crate::metrics::Stats::add(&self.view.stats().bytes_stored_ahead, n as u64);
            at += n as u64;
        }
        true
    }
}

/// The files check ahead hashes: those whose verdict is not in, shards first.
fn check_order(view: &View) -> Vec<Ino> {
    let paths = view.file_paths();
    if !paths.iter().any(|&(_, ino)| view.awaits_verdict(ino)) {
        // Nothing to hash: not even the index is read (a GET on a remote source).
        return Vec::new();
    }
    let mut files = order(view);
    let rest: Vec<Ino> = paths
        .into_iter()
        .map(|(_, ino)| ino)
        .filter(|ino| !files.contains(ino))
        .collect();
    files.extend(rest);
    files.retain(|&ino| view.awaits_verdict(ino));
    files
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An open that comes first hashes the file itself (check ahead skips it); one that
    /// comes while the file is hashed ahead urges that hash once, and later files go back
    /// to the background.
    #[test]
    fn check_ahead_leaves_a_file_opened_first_and_urges_one_under_way() {
        let c = CheckAhead::new();
        assert!(!c.before_verdict(3), "nothing under way: the open hashes");
        assert!(!c.claim(3), "a file an open asked for first is left to it");
        assert!(c.claim(4));
        assert!(
            c.before_verdict(4),
            "an open of the file under way urges it"
        );
        assert!(c.state.lock().urged);
        assert!(c.before_verdict(4), "a second open finds it urged");
        c.done();
        assert!(c.claim(5));
        assert!(
            !c.state.lock().urged,
            "the next file starts in the background"
        );
        assert!(!c.before_verdict(4), "a file done: its verdict is in");
    }

    /// An object that takes on what it is asked for while its budget lasts, noting each ask.
    struct Budgeted {
        len: u64,
        budget: Arc<Mutex<u64>>,
        asked: Arc<Mutex<Vec<(u64, u64, u64)>>>,
        opens_after: Option<(usize, Arc<AtomicBool>)>,
    }

    impl Object for Budgeted {
        fn len(&self) -> u64 {
            self.len
        }
        fn read_exact_at(&self, _: &mut [u8], _: u64) -> Result<(), crate::ReadError> {
            unreachable!("fetch ahead reads nothing")
        }
        fn fetch_ahead(&self, off: u64, len: u64) -> u64 {
            let mut asked = self.asked.lock();
            asked.push((self.len, off, len));
            if let Some((n, opened)) = &self.opens_after {
                if asked.len() == *n {
                    opened.store(true, AtomicOrdering::Relaxed);
                }
            }
            let mut budget = self.budget.lock();
            let had = len.min(*budget);
            *budget -= had;
            had
        }
        fn check_unchanged(&self) -> Result<(), crate::ReadError> {
            Ok(())
        }
        fn local_file(&self) -> Result<Option<&std::fs::File>, crate::ReadError> {
            Ok(None)
        }
    }

    /// Steps of 8, 16, then 32 MiB from each object's start, one object after another;
    /// fetching ends where the memory runs out, at the bound, or once a shard is opened.
    #[test]
    fn fetch_ahead_ramps_up_in_order_and_stops_when_full_or_opened() {
        const M: u64 = 1 << 20;
        let run = |budget: u64, bound: u64, opens_after: Option<usize>| {
            let budget = Arc::new(Mutex::new(budget));
            let asked = Arc::new(Mutex::new(Vec::new()));
            let opened = Arc::new(AtomicBool::new(false));
            let objects: Vec<(Ino, Arc<dyn Object>)> = [100 * M, 20 * M]
                .into_iter()
                .enumerate()
                .map(|(i, len)| {
                    let object = Arc::new(Budgeted {
                        len,
                        budget: budget.clone(),
                        asked: asked.clone(),
                        opens_after: opens_after.map(|n| (n, opened.clone())),
                    }) as Arc<dyn Object>;
                    (i as Ino, object)
                })
                .collect();
            let total = fetch_in_order(objects.into_iter(), bound, &opened, |_, _, _| {});
            let asked = asked.lock().clone();
            (total, asked)
        };
        let (total, asked) = run(u64::MAX, u64::MAX, None);
        assert_eq!(total, 120 * M);
        assert_eq!(
            asked,
            [
                (100 * M, 0, 8 * M),
                (100 * M, 8 * M, 16 * M),
                (100 * M, 24 * M, 32 * M),
                (100 * M, 56 * M, 32 * M),
                (100 * M, 88 * M, 12 * M),
                (20 * M, 0, 20 * M),
            ]
        );
        let (total, asked) = run(30 * M, u64::MAX, None);
        assert_eq!(
            (total, asked.len()),
            (30 * M, 3),
            "ends at the first short step"
        );
        let (total, asked) = run(u64::MAX, u64::MAX, Some(2));
        assert_eq!(
            (total, asked.len()),
            (24 * M, 2),
            "ends once a shard is opened"
        );
        let (total, asked) = run(u64::MAX, 30 * M, None);
        assert_eq!(
            (total, asked.last().copied()),
            (30 * M, Some((100 * M, 24 * M, 6 * M))),
            "ends at the bound, the last step cut to it"
        );
    }

    #[test]
    fn natural_order_of_shard_names() {
        let mut names = vec![
            "model-10-of-12.safetensors",
            "model-2-of-12.safetensors",
            "model-00001-of-00012.safetensors",
            "a/model.safetensors",
            "model-1-of-12.safetensors",
        ];
        names.sort_by(|a, b| natural(a, b));
        assert_eq!(
            names,
            [
                "a/model.safetensors",
                "model-00001-of-00012.safetensors",
                "model-1-of-12.safetensors",
                "model-2-of-12.safetensors",
                "model-10-of-12.safetensors",
            ]
        );
    }
}
