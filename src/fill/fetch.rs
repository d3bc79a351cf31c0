//! How a fill brings a chunk's sealed bytes into place: the fetcher threads, each taking
//! queued chunks (from a disk that others read, a piece at a time while the fill decodes
//! ahead), and the prefetch thread that asks the page cache for the sealed bytes a window
//! ahead of the decoder where they are not read with `O_DIRECT`.

use std::io;
use std::panic::AssertUnwindSafe;

use super::input::DiskLook;
use super::{Fetch, Inner, Priority, Progress, BACKGROUND_PIECE, CHUNK};

/// How far ahead of the decoder the sealed bytes are asked for.
pub(super) const PREFETCH_WINDOW: u64 = 64 << 20;
const PREFETCH_STEP: u64 = 16 << 20;

impl Inner {
    /// Fetch a chunk's sealed bytes into `buf`: whole, unless the fill decodes ahead and
    /// others read the same disk, in pieces of [`BACKGROUND_PIECE`] then, each once the
    /// disk is quiet (the priority is asked again before each piece, so an open that urges
    /// the fill gets whole reads at once).
    fn fetch_chunk(&self, off: u64, buf: &mut [u8]) -> io::Result<()> {
        // The disk is asked about only while decoding ahead (a fill someone waits for
        // reads whole chunks whoever else reads the disk).
        let ahead = || self.state.lock().priority == Priority::Ahead;
        // Decode ahead's fetchers take turns on a disk others may read, a chunk each, as
        // one fetcher would: its looks answer for the time since the one before, and each
        // read in flight is one more that an engine's own reads wait behind.
        let _turn =
            (self.source.disk_shared.is_some() && ahead()).then(|| self.background_read.lock());
        let whole = buf.len();
        let look = |from: usize| {
            let len = (whole - from) as u64;
            self.source
                .disk_shared
                .as_ref()
                .map_or(DiskLook::Alone, |s| s(off + from as u64, len))
        };
        // A look answers for the time since the one before, so the chunk's own look is
        // the first piece's: looking again at once would ask about no time at all.
        let mut seen = if ahead() { look(0) } else { DiskLook::Alone };
        let shared = seen != DiskLook::Alone;
        let mut done = 0;
        while done < buf.len() {
            if shared {
                if done > 0 {
                    seen = look(done);
                }
                crate::disk_share::yield_to_others(
                    seen == DiskLook::OthersRead,
                    || look(done) == DiskLook::OthersRead,
                    ahead,
                );
            }
            let end = if shared && ahead() {
                (done + BACKGROUND_PIECE).min(buf.len())
            } else {
                buf.len()
            };
            (self.source.fetch)(off + done as u64, &mut buf[done..end])?;
            done = end;
        }
        Ok(())
    }

    /// A fetcher: takes queued chunks and brings their sealed bytes into place, until the
    /// fill is over.
    pub(super) fn fetcher(&self) {
        loop {
            let j = {
                let mut s = self.state.lock();
                loop {
                    if s.cancelled || s.progress != Progress::Filling {
                        return;
                    }
                    if let Some(j) = s.queued.pop_front() {
                        s.fetches[j] = Fetch::Running;
                        break j;
                    }
                    self.fetch_moved.wait(&mut s);
                }
            };
            let (c, _) = self.range(j);
            // SAFETY: a queued chunk is allocated, Pending or Busy with its fetch running:
            // nothing else touches its bytes until its fetch is marked over.
            let buf = unsafe { self.chunk_mut(j) };
            // A fetch that panics fails its chunk: left Running, the dispatcher would wait
            // for it forever.
            let got = std::panic::catch_unwind(AssertUnwindSafe(|| self.fetch_chunk(c, buf)))
                .unwrap_or_else(|_| Err(io::Error::other("fetch panicked")));
            let mut s = self.state.lock();
            s.fetches[j] = match got {
                Ok(()) => Fetch::Fetched,
                Err(e) => Fetch::Failed(e.to_string()),
            };
            self.fetch_moved.notify_all();
        }
    }

    /// Ask for the sealed bytes a window ahead of the decoder, following it when a reader
    /// moves it.
    pub(super) fn prefetch(&self) {
        let Some(prefetch) = &self.source.prefetch else {
            return;
        };
        let mut fetched = 0u64;
        loop {
            let (from, to) = {
                let mut s = self.state.lock();
                loop {
                    if s.cancelled || s.progress != Progress::Filling || s.left == 0 {
                        return;
                    }
                    let at = (s.cursor as u64 * CHUNK).min(self.len);
                    if fetched < at || fetched > at + PREFETCH_WINDOW {
                        fetched = at;
                    }
                    if fetched < (at + PREFETCH_WINDOW).min(self.len) {
                        break;
                    }
                    self.changed.wait(&mut s);
                }
                (fetched, (fetched + PREFETCH_STEP).min(self.len))
            };
            prefetch(from, to - from);
            fetched = to;
        }
    }
}
