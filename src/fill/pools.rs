//! The threads and buffers fills share: the background pool decode ahead runs on, the pool
//! that unlocks beside a file's hash, and the few locked buffers cached chunks are decoded
//! in before they are written into their copy.

use std::sync::atomic::Ordering;
use std::sync::OnceLock;

use parking_lot::Mutex;

use crate::background::run_in_background;

/// The bytes a chunk made from the page cache (`Inner::write_decoded`) is decoded and
/// written in at a time: small enough to stay in a core's cache between the two, and a
/// multiple of every allocation step, so each write fills whole folios (of a folio that a
/// write leaves in part, the kernel clears the rest).
pub(super) const WRITE_PIECE: u64 = 2 << 20;
/// The most piece buffers made (16 MiB): more pieces at once than that (a machine of more
/// than 4 cores) are fetched into place and unlocked there, as chunks from the disk are.
pub const PIECE_BUFFERS: usize = 8;

/// The pool decode-ahead runs on: as many threads as cores, each in the background, so an
/// engine starting up (and any reader) keeps the cores it needs.
pub(crate) fn ahead_pool() -> Option<&'static rayon::ThreadPool> {
    static POOL: OnceLock<Option<rayon::ThreadPool>> = OnceLock::new();
    POOL.get_or_init(|| {
        rayon::ThreadPoolBuilder::new()
            .thread_name(|i| format!("kllm-ahead-{i}"))
            .start_handler(|_| {
                // SAFETY: gettid has no preconditions.
                run_in_background(unsafe { libc::gettid() }, true)
            })
            .build()
            .map_err(|e| log::warn!("no decode-ahead pool ({e}); decoding ahead at full priority"))
            .ok()
    })
    .as_ref()
}

/// The pool that unlocks a fill someone waits for while the file's hash runs: one thread
/// fewer than the cores the decode has (at least one).
pub(super) fn beside_hash_pool() -> Option<&'static rayon::ThreadPool> {
    static POOL: OnceLock<Option<rayon::ThreadPool>> = OnceLock::new();
    POOL.get_or_init(|| {
        rayon::ThreadPoolBuilder::new()
            .num_threads(rayon::current_num_threads().saturating_sub(1).max(1))
            .thread_name(|i| format!("kllm-unlock-{i}"))
            .build()
            .map_err(|e| log::warn!("no pool beside the hash ({e}); unlocking on every core"))
            .ok()
    })
    .as_ref()
}

/// The buffers the fill's `write_decoded` decodes pieces into, kept for the next pieces
/// (fresh, each would cost its pages' first touch); locked, as they hold view bytes. At most
/// [`PIECE_BUFFERS`] are made, so the daemon's working memory does not grow with its cores
/// (`budget::headroom` counts them).
static PIECE_BUFFERS_FREE: Mutex<Vec<crate::secmem::SecureBuf>> = Mutex::new(Vec::new());
static PIECE_BUFFERS_MADE: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// A piece buffer, if one is free or may still be made.
pub(super) fn take_piece_buffer() -> Option<PieceBuffer> {
    if let Some(b) = PIECE_BUFFERS_FREE.lock().pop() {
        return Some(PieceBuffer(Some(b)));
    }
    let made = PIECE_BUFFERS_MADE.fetch_add(1, Ordering::Relaxed);
    let buf = (made < PIECE_BUFFERS)
        .then(|| crate::secmem::SecureBuf::new(WRITE_PIECE as usize).ok())
        .flatten();
    if buf.is_none() {
        PIECE_BUFFERS_MADE.fetch_sub(1, Ordering::Relaxed);
    }
    buf.map(|b| PieceBuffer(Some(b)))
}

/// Free the piece buffers no decode holds (memory pressure), wiped; as many are made again
/// as pieces need them. Returns their bytes.
pub fn drain_piece_buffers() -> u64 {
    let drained = std::mem::take(&mut *PIECE_BUFFERS_FREE.lock());
    PIECE_BUFFERS_MADE.fetch_sub(drained.len(), Ordering::Relaxed);
    drained.len() as u64 * WRITE_PIECE
}

/// A piece buffer taken; back among the free ones when dropped, a decode that panicked
/// included.
pub(super) struct PieceBuffer(Option<crate::secmem::SecureBuf>);

impl std::ops::Deref for PieceBuffer {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        self.0.as_deref().expect("a live piece buffer")
    }
}

impl std::ops::DerefMut for PieceBuffer {
    fn deref_mut(&mut self) -> &mut [u8] {
        self.0.as_deref_mut().expect("a live piece buffer")
    }
}

impl Drop for PieceBuffer {
    fn drop(&mut self) {
        if let Some(b) = self.0.take() {
            PIECE_BUFFERS_FREE.lock().push(b);
        }
    }
}
