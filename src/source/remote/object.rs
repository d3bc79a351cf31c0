//! One object of a remote source, read at the version it had when mounted: its reads cut
//! into parts (kept, joined in flight or fetched), its prefetch window, and the whole-part
//! and small reads that keep nothing.

use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Instant, SystemTime};

use object_store::ObjectMeta;
use parking_lot::Mutex;

use super::get::{counted_lookup, CallerMemory};
use super::prefetch::Streams;
use super::{Fail, Joined, Live, Remote};
use crate::source::Object;
use crate::ReadError;

/// One object of a remote source at the version it had when mounted.
pub struct RemoteObject {
    pub(super) remote: Arc<Remote>,
    pub(super) id: u64,
    /// How messages name it.
    pub(super) shown: String,
    pub(super) meta: ObjectMeta,
    pub(super) changed: AtomicBool,
    pub(super) streams: Mutex<Streams>,
}

impl RemoteObject {
    pub(super) fn part_range(&self, idx: u64) -> Range<u64> {
        let p = self.remote.tuning.part_size;
        let start = idx * p;
        start..(start + p).min(self.meta.size)
    }

    /// The parts `[off, end)` covers, in order: each one's index, its range, and the
    /// stretch of it asked for.
    fn parts_of(
        &self,
        off: u64,
        end: u64,
    ) -> impl Iterator<Item = (u64, Range<u64>, Range<u64>)> + '_ {
        let p = self.remote.tuning.part_size;
        (off / p..=(end - 1) / p).map(move |idx| {
            let range = self.part_range(idx);
            let asked = off.max(range.start)..end.min(range.end);
            (idx, range, asked)
        })
    }

    /// What the node cache files this version under: the store, the object and its version.
    pub(super) fn cache_key(&self, store: &str) -> String {
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
        let live = self.live()?;
        for (idx, range, Range { start: lo, end: hi }) in self.parts_of(off, end) {
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
        for (idx, part, Range { start: lo, end: hi }) in self.parts_of(off, end) {
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
