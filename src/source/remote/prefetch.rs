//! The prefetch window of each sequential reader of a remote object: how many parts to
//! fetch ahead of its reads.

use std::ops::Range;

/// Recent sequential readers of one object: where each will read next and how wide its
/// prefetch window has grown.
#[derive(Default)]
pub(super) struct Streams {
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
    pub(super) fn note(&mut self, range: Range<u64>, part: u64, max_window: u64) -> u64 {
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
    pub(super) fn waited(&mut self, end: u64) {
        if let Some(s) = self.recent.iter_mut().rev().find(|s| s.next == end) {
            s.waited = true;
        }
    }
}
