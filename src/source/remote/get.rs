//! One part's GET: ranged, pinned to the mounted version of its object, retried, counted,
//! into a pooled part buffer or straight into the caller's memory, through the node cache
//! when there is one.

use std::ops::Range;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant, SystemTime};

use bytes::Bytes;
use futures::StreamExt;
use object_store::path::Path as StorePath;
use object_store::{GetOptions, GetRange, ObjectStore};
use parking_lot::Mutex;

use super::client::PART_GETS;
use super::Fail;
use crate::metrics::Stats;
use crate::source::node_cache::NodeCache;

/// Part buffers given back after use, for the next GET to fill: a buffer fresh from the
/// allocator costs a page fault and a cleared page per 4 KiB on first touch (5-8% of the
/// daemon's CPU on a cold read over `s3://` here), one kept costs nothing. A few suffice:
/// a buffer is given back about when the next fetch wants one.
#[derive(Default)]
pub(super) struct PartBuffers {
    pub(super) free: Mutex<Vec<Vec<u8>>>,
}

/// Buffers kept between fetches (at most this many part sizes of idle memory).
pub(super) const KEEP_BUFFERS: usize = 8;

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

/// One part's fetch, owning all it needs so it runs on the runtime alone.
pub(super) struct FetchJob {
    pub(super) store: Arc<dyn ObjectStore>,
    pub(super) gets: Arc<tokio::sync::Semaphore>,
    pub(super) location: StorePath,
    pub(super) e_tag: Option<String>,
    pub(super) version: Option<String>,
    pub(super) size: u64,
    pub(super) modified: SystemTime,
    pub(super) range: Range<u64>,
    pub(super) timeout: Duration,
    pub(super) stats: Arc<Stats>,
    pub(super) buffers: Arc<PartBuffers>,
    pub(super) cache: Option<(Arc<NodeCache>, String, u64)>,
}

/// A node-cache lookup's answer, counted as a hit or a miss.
pub(super) fn counted_lookup(stats: &Stats, found: Option<Bytes>) -> Option<Bytes> {
    let counter = if found.is_some() {
        &stats.node_cache_hits
    } else {
        &stats.node_cache_misses
    };
    Stats::add(counter, 1);
    found
}

impl FetchJob {
    pub(super) async fn run(self) -> std::result::Result<Bytes, Fail> {
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
    pub(super) async fn get_into(&self, body: &mut impl Body) -> std::result::Result<(), Fail> {
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
pub(super) trait Body: Send {
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
pub(super) struct CallerMemory<'a> {
    pub(super) buf: &'a mut [u8],
    pub(super) at: usize,
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
