//! Safetensors shards: the header, the byte ranges of locked tensors, the unlocked header,
//! and decoding any byte range of the file.

use std::io;
use std::ops::Range;
use std::path::Path;

use safetensors::tensor::Metadata;
use safetensors::Dtype;
use serde_json::Value;

use crate::key::ModelKey;
use crate::lock::{document, tensor_id, LockEntry, TensorLock};
use crate::ranges::{self, Piece};
use crate::{Error, ReadError, Result};

pub use crate::lock::LOCK_META;
/// safetensors' own limit on the header.
pub const MAX_HEADER: u64 = 100_000_000;

/// Reads sealed bytes at an offset (a `pread` of the shard), from any thread.
pub type RawReader<'a> = dyn Fn(u64, &mut [u8]) -> io::Result<()> + Sync + 'a;

/// Bytes read and decoded in one step: a fraction of a core's L2 cache.
const DECODE_CHUNK: usize = 64 << 10;
/// Reads at least twice this long are decoded on several cores.
const PARALLEL_MIN: usize = 128 << 10;

/// One locked tensor: where its bytes are in the file, and how to decode them.
#[derive(Debug, Clone)]
pub struct LockedTensor {
    pub name: String,
    pub dtype: Dtype,
    /// Absolute file offsets of the tensor's bytes.
    pub start: u64,
    pub end: u64,
    pub lock: TensorLock,
}

/// What the view needs of a shard: its size, its header as the view shows it, and its
/// locked tensors sorted by offset.
#[derive(Debug, Clone)]
pub struct Shard {
    pub file_len: u64,
    /// `8 + header length`: where tensor data starts.
    pub data_start: u64,
    /// The first `data_start` bytes of the view: length prefix and header without
    /// `kllm.lock`, padded with spaces to the original length.
    pub view_header: Vec<u8>,
    pub locked: Vec<LockedTensor>,
}

fn read_exact_at(file: &std::fs::File, buf: &mut [u8], off: u64) -> io::Result<()> {
    std::os::unix::fs::FileExt::read_exact_at(file, buf, off)
}

impl Shard {
    /// Read and check a shard's header. `shard_dir` scopes tensor ids (the shard's folder
    /// relative to the model root, `""` at the root). Tensors named in `kllm.lock` get their
    /// key streams from `key`.
    pub fn open(
        path: &Path,
        file: &std::fs::File,
        shard_dir: &str,
        key: &ModelKey,
    ) -> Result<Shard> {
        let file_len = file
            .metadata()
            .map_err(|e| Error::at(path, format!("cannot stat ({e})")))?
            .len();
        let raw = |at: u64, buf: &mut [u8]| read_exact_at(file, buf, at);
        Shard::read_header(path, file_len, &raw, shard_dir, key)
    }

    /// [`Shard::open`] of a file of `file_len` bytes that `raw` reads.
    pub fn read_header(
        path: &Path,
        file_len: u64,
        raw: &RawReader<'_>,
        shard_dir: &str,
        key: &ModelKey,
    ) -> Result<Shard> {
        let mut prefix = [0u8; 8];
        if file_len < 8 {
            return Err(Error::at(
                path,
                "safetensors header is malformed (file shorter than 8 bytes)",
            ));
        }
        raw(0, &mut prefix).map_err(|e| Error::at(path, format!("cannot read ({e})")))?;
        let n = u64::from_le_bytes(prefix);
        if n > MAX_HEADER {
            return Err(Error::at(
                path,
                format!("safetensors header is oversized ({n} bytes, limit {MAX_HEADER})"),
            ));
        }
        if 8 + n > file_len {
            return Err(Error::at(path, format!("safetensors header ({n} bytes) runs past the end of the file ({file_len} bytes)")));
        }
        let mut header = vec![0u8; n as usize];
        raw(8, &mut header).map_err(|e| Error::at(path, format!("cannot read ({e})")))?;
        Shard::from_header(path, &header, file_len, shard_dir, key)
    }

    /// The part of [`Shard::open`] after the header bytes are read.
    pub fn from_header(
        path: &Path,
        header: &[u8],
        file_len: u64,
        shard_dir: &str,
        key: &ModelKey,
    ) -> Result<Shard> {
        let malformed =
            |why: String| Error::at(path, format!("safetensors header is malformed ({why})"));
        let n = header.len() as u64;
        let text = std::str::from_utf8(header).map_err(|_| malformed("not UTF-8".into()))?;
        if !text.starts_with('{') {
            return Err(malformed("does not start with '{'".into()));
        }
        let meta: Metadata = serde_json::from_str(text).map_err(|e| malformed(e.to_string()))?;
        let data_start = 8 + n;
        let data_len = meta.data_len() as u64;
        if data_start + data_len > file_len {
            return Err(Error::at(
                path,
                format!("tensor data runs past the end of the file (needs {} bytes, file has {file_len})", data_start + data_len),
            ));
        }
        let mut doc: serde_json::Map<String, Value> =
            serde_json::from_str(text).map_err(|e| malformed(e.to_string()))?;
        let lock_text = take_lock_text(path, &mut doc)?;
        let mut locked = match &lock_text {
            Some(lock_text) => document::parse(path, lock_text)?
                .into_iter()
                .map(|entry| locked_tensor(path, &meta, data_start, shard_dir, key, entry))
                .collect::<Result<Vec<_>>>()?,
            None => Vec::new(),
        };
        locked.sort_by_key(|t| t.start);
        let view_header = match lock_text {
            Some(_) => unlocked_header(path, &doc, data_start)?,
            None => [&n.to_le_bytes()[..], header].concat(),
        };
        Ok(Shard {
            file_len,
            data_start,
            view_header,
            locked,
        })
    }

    pub fn is_locked(&self) -> bool {
        !self.locked.is_empty()
    }

    /// View bytes `[off, off + out.len())` (the caller clamps to `file_len`). `raw` reads
    /// sealed bytes at an offset; tensor bytes are read into `out` and decoded in place.
    pub fn read(
        &self,
        off: u64,
        out: &mut [u8],
        raw: &RawReader<'_>,
    ) -> std::result::Result<(), ReadError> {
        self.to_view(off, out, |at, data| self.read_data(at, data, raw))
    }

    /// Turn `buf`, which holds the sealed bytes at `pos`, into view bytes in place: the
    /// header part replaced by the unlocked header, locked values decoded, on all cores
    /// when large. `raw` reads the sealed bytes of values cut by either end.
    pub fn unlock_in_place(
        &self,
        pos: u64,
        buf: &mut [u8],
        raw: &RawReader<'_>,
    ) -> std::result::Result<(), ReadError> {
        self.to_view(pos, buf, |at, data| self.decode_span(at, None, data, raw))
    }

    /// The view bytes at `pos` into `out`, from `sealed`, the sealed bytes there (as many, left
    /// as they are: a mapping of the sealed file's page cache). As
    /// [`Shard::unlock_in_place`], but the kernels read each locked code once, where a read
    /// into `out` first would copy every byte. `raw` reads the sealed bytes of values cut by
    /// either end.
    pub fn decode_from(
        &self,
        pos: u64,
        sealed: &[u8],
        out: &mut [u8],
        raw: &RawReader<'_>,
    ) -> std::result::Result<(), ReadError> {
        assert_eq!(sealed.len(), out.len(), "as many bytes written as read");
        self.to_view(pos, out, |at, data| {
            let from = &sealed[(at - pos) as usize..][..data.len()];
            self.decode_span(at, Some(from), data, raw)
        })
    }

    /// The view bytes at `off` in `out`: the part in the header copied from the unlocked
    /// header, the data bytes past it given to `data(at, bytes)`, on all cores when large.
    fn to_view(
        &self,
        off: u64,
        out: &mut [u8],
        data: impl Fn(u64, &mut [u8]) -> std::result::Result<(), ReadError> + Sync,
    ) -> std::result::Result<(), ReadError> {
        let end = off + out.len() as u64;
        debug_assert!(end <= self.file_len);
        let header = ranges::overlap(off..end, 0..self.data_start);
        if !header.is_empty() {
            out[..(header.end - off) as usize]
                .copy_from_slice(&self.view_header[header.start as usize..header.end as usize]);
        }
        // The header's end, or `off` when the request starts past it.
        let pos = header.end;
        if pos >= end {
            return Ok(());
        }
        let bytes = &mut out[(pos - off) as usize..];
        let threads = rayon::current_num_threads();
        if bytes.len() >= 2 * PARALLEL_MIN && threads > 1 {
            // One reader keeps about one request in flight: spread its decoding over the
            // cores. Pieces may cut values; each decodes its own bytes of a cut value.
            use rayon::prelude::*;
            let piece = bytes.len().div_ceil(threads).max(PARALLEL_MIN);
            bytes
                .par_chunks_mut(piece)
                .enumerate()
                .try_for_each(|(i, part)| data(pos + (i * piece) as u64, part))
        } else {
            data(pos, bytes)
        }
    }

    /// Read and decode data bytes a cache-sized chunk at a time: each chunk is decoded
    /// while the copy that brought it is still in the core's cache.
    fn read_data(
        &self,
        pos: u64,
        buf: &mut [u8],
        raw: &RawReader<'_>,
    ) -> std::result::Result<(), ReadError> {
        for (i, chunk) in buf.chunks_mut(DECODE_CHUNK).enumerate() {
            let at = pos + (i * DECODE_CHUNK) as u64;
            raw(at, chunk)?;
            self.decode_span(at, None, chunk, raw)?;
        }
        Ok(())
    }

    /// The view bytes of the data at `pos` in `buf`: the locked tensors' bytes decoded from
    /// `sealed` (the sealed bytes at `pos`; `None`: `buf` holds them, decoded in place), any
    /// other bytes copied from there.
    fn decode_span(
        &self,
        pos: u64,
        sealed: Option<&[u8]>,
        buf: &mut [u8],
        raw: &RawReader<'_>,
    ) -> std::result::Result<(), ReadError> {
        let end = pos + buf.len() as u64;
        let first = self.locked.partition_point(|t| t.end <= pos);
        let mut plain_from = pos;
        let copy_plain = |from: u64, to: u64, buf: &mut [u8]| {
            if let Some(sealed) = sealed {
                let r = (from - pos) as usize..(to - pos) as usize;
                buf[r.clone()].copy_from_slice(&sealed[r]);
            }
        };
        for t in self.locked[first..].iter().take_while(|t| t.start < end) {
            let Range { start: a, end: b } = ranges::overlap(t.start..t.end, pos..end);
            copy_plain(plain_from, a, buf);
            let r = (a - pos) as usize..(b - pos) as usize;
            decode_range(t, a, b, sealed.map(|s| &s[r.clone()]), &mut buf[r], raw)?;
            plain_from = b;
        }
        copy_plain(plain_from, end, buf);
        Ok(())
    }
}

/// Remove `kllm.lock` from the header's `__metadata__`, returning its text.
fn take_lock_text(path: &Path, doc: &mut serde_json::Map<String, Value>) -> Result<Option<String>> {
    match doc.get_mut("__metadata__") {
        Some(Value::Object(m)) => match m.shift_remove(LOCK_META) {
            Some(Value::String(s)) => Ok(Some(s)),
            Some(_) => Err(Error::at(path, format!("{LOCK_META} is not a string"))),
            None => Ok(None),
        },
        _ => Ok(None),
    }
}

/// One `kllm.lock` entry checked against the tensor it names: the codec its dtype and
/// format call for, a possible domain, a length one key stream covers.
fn locked_tensor(
    path: &Path,
    meta: &Metadata,
    data_start: u64,
    shard_dir: &str,
    key: &ModelKey,
    entry: LockEntry,
) -> Result<LockedTensor> {
    let info = meta.info(&entry.name).ok_or_else(|| {
        Error::at(
            path,
            format!(
                "{LOCK_META} names tensor {:?}, which the shard lacks",
                entry.name
            ),
        )
    })?;
    let codec = entry
        .codec(info.dtype)
        .map_err(|why| Error::at(path, why))?;
    let LockEntry {
        name, version, m, ..
    } = entry;
    let lock = TensorLock::new(key, version, codec, m, &tensor_id(shard_dir, &name));
    let (s, e) = info.data_offsets;
    let units = (e - s) as u64 / codec.unit_bytes() as u64;
    if units > lock.max_units() {
        return Err(Error::at(
            path,
            format!("tensor {name:?} is longer than one key stream covers"),
        ));
    }
    Ok(LockedTensor {
        name,
        dtype: info.dtype,
        start: data_start + s as u64,
        end: data_start + e as u64,
        lock,
    })
}

/// The first `data_start` bytes of the view: the length prefix, then the header without
/// `kllm.lock`, padded with spaces to the original length so no offset moves.
fn unlocked_header(
    path: &Path,
    doc: &serde_json::Map<String, Value>,
    data_start: u64,
) -> Result<Vec<u8>> {
    let n = data_start - 8;
    let json = serde_json::to_vec(doc).expect("a JSON map serializes");
    if json.len() as u64 > n {
        return Err(Error::at(
            path,
            "unlocked header would be longer than the original",
        ));
    }
    let mut out = Vec::with_capacity(data_start as usize);
    out.extend_from_slice(&n.to_le_bytes());
    out.extend_from_slice(&json);
    out.resize(data_start as usize, b' ');
    Ok(out)
}

/// Decode the sealed bytes `[a, b)` of tensor `t` into `buf`, which holds them (`sealed`
/// none: whole units decoded in place) or takes them from `sealed`; a unit cut by either end
/// is read whole and decoded on the side.
fn decode_range(
    t: &LockedTensor,
    a: u64,
    b: u64,
    sealed: Option<&[u8]>,
    buf: &mut [u8],
    raw: &RawReader<'_>,
) -> std::result::Result<(), ReadError> {
    let ub = t.lock.codec.unit_bytes() as u64;
    let corrupt = |e: crate::lock::OutOfDomain| ReadError::Corrupt {
        tensor: t.name.clone(),
        unit: e.unit,
    };
    let rel_a = a - t.start;
    let rel_b = b - t.start;
    // Units all of `ub` bytes: a cut unit at the end is read whole.
    let total = rel_b.div_ceil(ub) * ub;
    let cut = ranges::cut(rel_a, rel_b, ub, total);
    let partial = |p: &Piece, buf: &mut [u8]| -> std::result::Result<(), ReadError> {
        let mut tmp = [0u8; 8];
        let tmp = &mut tmp[..ub as usize];
        let u0 = p.block * ub;
        raw(t.start + u0, tmp)?;
        t.lock.decode(p.block, tmp).map_err(corrupt)?;
        buf[(p.bytes.start - rel_a) as usize..(p.bytes.end - rel_a) as usize]
            .copy_from_slice(&tmp[(p.bytes.start - u0) as usize..(p.bytes.end - u0) as usize]);
        Ok(())
    };
    if let Some(p) = &cut.head {
        partial(p, buf)?;
    }
    let whole = cut.whole_bytes(ub, total);
    if !whole.is_empty() {
        let at = (whole.start - rel_a) as usize..(whole.end - rel_a) as usize;
        match sealed {
            Some(sealed) => t
                .lock
                .decode_from(cut.whole.start, &sealed[at.clone()], &mut buf[at]),
            None => t.lock.decode(cut.whole.start, &mut buf[at]),
        }
        .map_err(corrupt)?;
    }
    if let Some(p) = &cut.tail {
        partial(p, buf)?;
    }
    Ok(())
}
