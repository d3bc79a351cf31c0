//! A fill of one file of the view: where its sealed bytes come from (a local file, by
//! `O_DIRECT` or the page cache; a remote object, by many ranged reads at once), how they
//! are decoded and checked, and when the page cache's copy of them goes.

use std::io;
use std::sync::Arc;

use super::input::disk_look;
use super::sealed_reader::SealedReader;
use super::{
    CheckFn, Fill, Input, MappedDecodeFn, PrefetchFn, Priority, RangeDoneFn, RangeFn, RangeLookFn,
    Steps, Target,
};
use crate::memfs::{MemoryFs, Reservation};
use crate::view::{Ino, View};
use crate::ReadError;

/// Chunk fetches in flight for a local file: the disk's next chunks read while the cores
/// unlock the ones before, so neither waits on the other chunk by chunk
/// (docs/PERFORMANCE-LOG.md, "True cold: the sealed read, then the decode").
const LOCAL_FETCH_AHEAD: usize = 4;

impl Fill {
    /// Decode file `ino` of the view into a new file of `memory`, whose budget
    /// `reservation` claims. Nothing is served before the file's manifest verdict (if the
    /// view has one for it) is good.
    pub fn of_view(
        view: &Arc<View>,
        ino: Ino,
        memory: &MemoryFs,
        reservation: Reservation,
        priority: Priority,
    ) -> io::Result<Fill> {
        let node = view
            .node(ino)
            .ok_or_else(|| io::Error::from(io::ErrorKind::NotFound))?;
        let (v, u, c, p) = (view.clone(), view.clone(), view.clone(), view.clone());
        let decode = move |off: u64, buf: &mut [u8]| match v.read_unchecked(ino, off, buf)? {
            n if n == buf.len() => Ok(()),
            n => Err(ReadError::Io(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                format!("{n} of {} bytes at {off}", buf.len()),
            ))),
        };
        let object = view
            .sealed_object(ino)
            .map_err(|e| io::Error::other(e.to_string()))?
            .cloned();
        // A local sealed file is read with O_DIRECT where it helps (`SealedReader`); any
        // other source by its own ranged reads.
        let local = match &object {
            Some(o) => match o
                .local_file()
                .map_err(|e| io::Error::other(e.to_string()))?
            {
                Some(f) => Some(Arc::new(SealedReader::new(f)?)),
                None => None,
            },
            None => None,
        };
        // Decode ahead yields the disk to other readers, when it reads the disk at all (not
        // sealed bytes in the page cache); where the disk's statistics are not to be had
        // (no block device behind the file system), it reads in pieces always.
        let disk_shared = local.as_ref().map(|r| {
            let share = crate::disk_share::DiskShare::of(&r.file);
            let r = r.clone();
            Box::new(move |off, len| {
                disk_look(r.mostly_cached(off, len), || {
                    share.as_ref().and_then(|s| s.others_read())
                })
            }) as Box<RangeLookFn>
        });
        let in_page_cache = local.as_ref().map(|r| {
            let r = r.clone();
            Box::new(move |off, len| r.mostly_cached(off, len)) as Box<RangeFn>
        });
        // Without O_DIRECT the page cache brings the sealed bytes: ask for them ahead.
        let prefetch: Option<Box<PrefetchFn>> = match &local {
            Some(r) if r.direct.is_none() => {
                Some(Box::new(move |off, len| p.will_read(ino, off, len)))
            }
            _ => None,
        };
        // The page cache's copy of the sealed bytes goes once they are in the copy and the
        // file's hash is done with them (at once when this fill feeds the digest; else the
        // check reads them beside the fill).
        let check: Option<Arc<CheckFn>> = node.integrity.as_ref().map(|_| {
            let reader = local.clone();
            Arc::new(move || {
                let verdict = c.verify(ino);
                if let Some(r) = &reader {
                    r.let_go_kept();
                }
                verdict
            }) as Arc<CheckFn>
        });
        // Any other source by its own reads, as many at once as it gains from.
        let fetch_ahead = match (&local, &object) {
            (None, Some(o)) => o.parallel_reads().max(1),
            (Some(_), _) => LOCAL_FETCH_AHEAD,
            (None, None) => 1,
        };
        // Sealed bytes from the disk or a remote source are hashed as the fill brings them
        // in, each chunk's beside the unlock of the chunk before: read once, for the copy
        // and the check alike. Bytes in the page cache are hashed by the check's own reads
        // instead, on a core of its own: its verdict then comes when the hash ends, not
        // with the fill's last chunk, so readers need not wait for the whole copy.
        let digest = match &local {
            Some(r) if r.mostly_cached(0, node.attr.size) => None,
            _ => view.digest_feeder(ino),
        };
        let completed: Option<Box<dyn Fn() + Send + Sync>> = local.clone().map(|r| {
            let len = node.attr.size;
            Box::new(move || r.drop_cached(0, len, true)) as Box<dyn Fn() + Send + Sync>
        });
        // Pages of the sealed file are kept for a check that reads the file itself, not for
        // the digest this fill feeds.
        let fed = digest.is_some();
        let let_go = local.clone().map(|r| {
            let h = view.clone();
            Arc::new(move |off, len| r.let_go(off, len, || fed || !h.awaits_verdict(ino)))
                as Arc<RangeDoneFn>
        });
        let decoded_from_cache = let_go.clone();
        // Sealed bytes the page cache holds whole are decoded where they lie, through the
        // local file's own mapping (the one FUSE reads use).
        let decode_mapped = local.as_ref().and(object.clone()).map(|o| {
            let v = view.clone();
            Box::new(move |off: u64, out: &mut [u8]| {
                let map = o.cached_mapping(off, out.len() as u64)?;
                map.read(off, out.len(), |sealed| {
                    v.decode_from(ino, off, sealed, out)
                })
            }) as Box<MappedDecodeFn>
        });
        let fetch = move |off: u64, buf: &mut [u8]| match (&local, &object) {
            (Some(r), _) => {
                r.read(off, buf)?;
                if let Some(let_go) = &let_go {
                    let_go(off, buf.len() as u64);
                }
                Ok(())
            }
            (None, Some(o)) => o.read_once_at(buf, off).map_err(io::Error::from),
            (None, None) => Ok(()),
        };
        let source = Input {
            fetch: Box::new(fetch),
            unlock: Box::new(move |off, buf| u.unlock_in_place(ino, off, buf)),
            decode: Box::new(decode),
            decode_mapped,
            check,
            prefetch,
            disk_shared,
            in_page_cache,
            fetch_ahead,
            digest,
            completed,
            decoded_from_cache,
        };
        let target = Target {
            file: memory.create()?,
            len: node.attr.size,
            steps: Steps::of(memory.pages()),
            seal: Box::new(crate::memfs::seal),
            reservation: Some(reservation),
        };
        Fill::start(target, source, priority, view.path_of(ino))
    }
}
