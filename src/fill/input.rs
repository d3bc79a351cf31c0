//! What a fill reads from and writes into: the sealed source's functions (fetch, unlock,
//! decode, check), the file it fills and the folio sizes it allocates, and what it is told
//! of the disk and the page cache. The fill itself (`super`) only calls them.

use std::fs::File;
use std::io;
use std::sync::Arc;

use crate::memfs::MemoryFile;
use crate::ReadError;

/// Decoded bytes of the file at an offset, any range (the view's read path).
pub type DecodeFn = dyn Fn(u64, &mut [u8]) -> Result<(), ReadError> + Send + Sync;
/// As [`DecodeFn`], or `None` where the way it reads cannot serve this range.
pub type MappedDecodeFn = dyn Fn(u64, &mut [u8]) -> Option<Result<(), ReadError>> + Send + Sync;
/// The file's integrity verdict; the first call hashes it, later ones return the verdict.
pub type CheckFn = dyn Fn() -> Result<(), ReadError> + Send + Sync;
/// A hint that the sealed bytes of `[off, off + len)` are about to be read.
pub type PrefetchFn = dyn Fn(u64, u64) + Send + Sync;
/// Turns the filled, writable file into the read-only file handed to the kernel.
pub type SealFn = dyn FnOnce(File) -> io::Result<MemoryFile> + Send;

/// Where a fill's bytes go: a writable file, allocated chunk by chunk in file order (the
/// page size follows the step), and what turns it into the file the kernel gets.
pub struct Target {
    pub file: File,
    pub len: u64,
    pub steps: Steps,
    pub seal: Box<SealFn>,
    /// The budget claimed for the file, given back when the fill is dropped.
    pub reservation: Option<crate::memfs::Reservation>,
}

/// Allocation steps (see `memfs::allocate_range`), which set the folio size, by the fill's
/// priority.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Steps {
    /// While no one waits (decode ahead) for bytes from the disk: larger folios than a
    /// waited-for fill's, which leave the smaller free blocks, memory the host still backs, to
    /// the processes that wait meanwhile (an engine importing, then loading; see
    /// `memfs::Pages::ahead_step`).
    pub ahead: u64,
    /// Decode ahead of sealed bytes in the page cache (`Input::in_page_cache`): the folios
    /// of the free blocks a VM's guest reports (see `memfs::Pages`).
    pub ahead_cached: u64,
    /// When an open or a read waits (see `memfs::Pages::step`).
    pub demand: u64,
}

impl Steps {
    /// The steps of a private memory's page size.
    pub fn of(pages: crate::memfs::Pages) -> Steps {
        Steps {
            ahead: pages.ahead_step(),
            ahead_cached: pages.ahead_cached_step(),
            demand: pages.step(),
        }
    }

    /// One step whatever the priority.
    pub fn same(step: u64) -> Steps {
        Steps {
            ahead: step,
            ahead_cached: step,
            demand: step,
        }
    }
}

/// Brings the sealed bytes at an offset into a buffer, to be unlocked in place.
pub type FetchFn = dyn Fn(u64, &mut [u8]) -> io::Result<()> + Send + Sync;

/// Where a fill's bytes come from.
pub struct Input {
    /// The sealed bytes of a chunk into its place in the copy.
    pub fetch: Box<FetchFn>,
    /// The fetched bytes of a chunk turned into view bytes in place.
    pub unlock: Box<DecodeFn>,
    /// View bytes of any range, for reads of chunks that failed.
    pub decode: Box<DecodeFn>,
    /// View bytes of a range decoded from the sealed bytes where the page cache holds them (a
    /// local file's mapping), with no copy of them into a buffer first; `None` where that
    /// cannot be done (`decode` then). `None`: never (any other source).
    pub decode_mapped: Option<Box<MappedDecodeFn>>,
    pub check: Option<Arc<CheckFn>>,
    pub prefetch: Option<Box<PrefetchFn>>,
    /// Whether other processes read the disk that `fetch` of `[off, off + len)` reads
    /// from, since it was last asked: decode ahead then fetches in pieces of
    /// `BACKGROUND_PIECE`, each once the disk is quiet (`disk_share::yield_to_others`). `None`:
    /// fetched whole whatever the priority (a source that is not a local disk).
    pub disk_shared: Option<Box<RangeLookFn>>,
    /// Whether the sealed bytes of `[off, off + len)` are in the page cache (a local file):
    /// such a chunk is decoded from there and written into place (`Inner::write_decoded`)
    /// rather than fetched, and decode ahead reads them at memory speed, so it has time to
    /// take the folios that are dear to touch (`Steps::ahead_cached`). `None`: never (any
    /// other source).
    pub in_page_cache: Option<Box<RangeFn>>,
    /// How many chunks may be fetched at once, each by a fetcher thread straight into its
    /// place, ahead of the unlock (a local disk: a few; a remote source: many GETs in
    /// flight). 1: one fetch at a time, none beside an unlock (a source with nothing to
    /// fetch).
    pub fetch_ahead: usize,
    /// Fed each chunk's fetched (sealed) bytes in file order, so the file's check need not
    /// read them again. Given up if chunks come out of order (they do not before the
    /// verdict: no reader moves the decoder until then) or one fails.
    pub digest: Option<crate::digest::DigestFeeder>,
    /// Called once the copy is complete (every chunk in, the verdict good), before it is
    /// handed out: nothing reads the sealed bytes any more.
    pub completed: Option<Box<dyn Fn() + Send + Sync>>,
    /// Called once a chunk made by `decode` from sealed bytes in the page cache
    /// (`in_page_cache`) is in the copy: a local file lets their pages go, as its `fetch`
    /// does for the chunks it brings into place.
    pub decoded_from_cache: Option<Arc<RangeDoneFn>>,
}

#[cfg(test)]
impl Input {
    /// A source whose chunks `make` makes alone (nothing fetched, no check, on no disk);
    /// tests set the fields they are about and take the rest from here.
    pub(crate) fn made_by(
        make: impl Fn(u64, &mut [u8]) -> Result<(), ReadError> + Send + Sync + 'static,
    ) -> Input {
        let make = Arc::new(make);
        let unlock = make.clone();
        Input {
            fetch: Box::new(|_, _| Ok(())),
            unlock: Box::new(move |off, buf| unlock(off, buf)),
            decode: Box::new(move |off, buf| make(off, buf)),
            decode_mapped: None,
            check: None,
            prefetch: None,
            disk_shared: None,
            in_page_cache: None,
            fetch_ahead: 1,
            digest: None,
            completed: None,
            decoded_from_cache: None,
        }
    }
}

/// A question about the sealed bytes of `[off, off + len)`.
pub type RangeFn = dyn Fn(u64, u64) -> bool + Send + Sync;
/// Word that the sealed bytes of `[off, off + len)` are done with.
pub type RangeDoneFn = dyn Fn(u64, u64) + Send + Sync;

/// A look at the disk for a fetch of `[off, off + len)` (see [`Input::disk_shared`]).
pub type RangeLookFn = dyn Fn(u64, u64) -> DiskLook + Send + Sync;

/// What others did on the disk a fill reads, since the last look.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DiskLook {
    /// No one else read it.
    Alone,
    /// Others read it.
    OthersRead,
    /// Not to be told (no block device behind the file system): read in pieces, but
    /// without waiting for a quiet disk, which would never be seen.
    Unknown,
}

/// The look at the disk for a fetch whose bytes are mostly in the page cache (`cached`:
/// it reads no disk, so it need not yield) or else the bytes others read since the last
/// look (`others_read`: `None` where the disk cannot tell).
pub(super) fn disk_look(cached: bool, others_read: impl FnOnce() -> Option<u64>) -> DiskLook {
    if cached {
        return DiskLook::Alone;
    }
    match others_read() {
        Some(0) => DiskLook::Alone,
        Some(_) => DiskLook::OthersRead,
        None => DiskLook::Unknown,
    }
}
