//! A bounded LRU of decoded blocks of locked shards.
//!
//! Blocks are fixed-size, aligned pieces of a file, so a run of small kernel reads decodes
//! each block once; the kernel's readahead requests ([`DIRECT_MIN`] and more) pass it by.
//! Decoding happens outside the lock; two readers that miss the same block
//! at once both decode it, which costs time but never correctness. Evicted blocks are wiped.

use std::num::NonZeroUsize;
use std::sync::Arc;

use lru::LruCache;
use parking_lot::Mutex;

use crate::ranges::{self, Piece};
use crate::secmem::SecureBuf;
use crate::shard::{RawReader, Shard};
use crate::ReadError;

pub type Block = Arc<SecureBuf>;

/// Reads of this size or more bypass the cache ([`BlockCache::read_shard`]): the kernel's
/// readahead requests (128 KiB by default, up to the window raised at mount).
pub const DIRECT_MIN: u64 = 128 << 10;

/// What one read through the cache did: blocks found and decoded for it, and the bytes
/// run through the decoder (whole blocks for misses).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Decoded {
    pub hits: u64,
    pub misses: u64,
    pub bytes: u64,
}

pub struct BlockCache {
    block_size: u64,
    lru: Option<Mutex<LruCache<(u64, u64), Block>>>,
}

impl BlockCache {
    /// A cache of at most `budget` bytes of decoded data in blocks of `block_size`. A budget
    /// below one block disables it: every read then decodes exactly what it returns.
    pub fn new(budget: u64, block_size: u64) -> BlockCache {
        assert!(block_size > 0);
        let lru =
            NonZeroUsize::new((budget / block_size) as usize).map(|n| Mutex::new(LruCache::new(n)));
        BlockCache { block_size, lru }
    }

    pub fn block_size(&self) -> u64 {
        self.block_size
    }

    pub fn enabled(&self) -> bool {
        self.lru.is_some()
    }

    pub fn capacity_bytes(&self) -> u64 {
        self.lru
            .as_ref()
            .map_or(0, |l| l.lock().cap().get() as u64 * self.block_size)
    }

    pub fn get(&self, file: u64, block: u64) -> Option<Block> {
        self.lru.as_ref()?.lock().get(&(file, block)).cloned()
    }

    pub fn insert(&self, file: u64, block: u64, data: Block) {
        if let Some(lru) = &self.lru {
            // The evicted block is dropped (and wiped) after the lock is released.
            let _evicted = lru.lock().push((file, block), data);
        }
    }

    /// Drop the least recently used blocks until `bytes` are freed (or none is left), to
    /// give memory back under pressure; returns the bytes freed.
    pub fn shed(&self, bytes: u64) -> u64 {
        let Some(lru) = &self.lru else {
            return 0;
        };
        let mut evicted = Vec::new();
        let mut freed = 0;
        {
            let mut lru = lru.lock();
            while freed < bytes {
                match lru.pop_lru() {
                    Some((_, b)) => {
                        freed += b.len() as u64;
                        evicted.push(b);
                    }
                    None => break,
                }
            }
        }
        // Wiped and unmapped here, after the lock is released.
        drop(evicted);
        freed
    }

    /// The block size for a budget: 1 MiB (a kernel read is at most that), smaller for
    /// small budgets so the cache still holds a few blocks.
    pub fn block_size_for(budget: u64) -> u64 {
        let b = (budget / 16).clamp(4096, 1 << 20);
        1 << (63 - b.leading_zeros())
    }

    /// View bytes `[off, off + out.len())` of the locked shard `file`, through the cache.
    ///
    /// A read of [`DIRECT_MIN`] or more (or of a block) decodes straight into `out`, cache
    /// or not: it is one of the kernel's readahead requests, whose pages the kernel keeps
    /// (FOPEN_KEEP_CACHE), and the bytes next to it come in requests of their own, often at
    /// once on other threads. Decoding the blocks it cuts whole would decode them twice
    /// (after a reader's first small read the kernel's windows are not block-aligned, and
    /// with small windows several requests in one block miss it at once). The cache serves
    /// smaller reads, so a run of them decodes each block once.
    pub fn read_shard(
        &self,
        file: u64,
        shard: &Shard,
        off: u64,
        out: &mut [u8],
        raw: &RawReader<'_>,
    ) -> Result<Decoded, ReadError> {
        let bs = self.block_size;
        let len = out.len() as u64;
        if !self.enabled() || len >= bs.min(DIRECT_MIN) {
            shard.read(off, out, raw)?;
            return Ok(Decoded {
                bytes: len,
                ..Decoded::default()
            });
        }
        let mut done = Decoded::default();
        let end = off + len;
        let cut = ranges::cut(off, end, bs, shard.file_len);
        let whole = cut.whole_bytes(bs, shard.file_len);
        if !whole.is_empty() {
            let at = (whole.start - off) as usize..(whole.end - off) as usize;
            shard.read(whole.start, &mut out[at], raw)?;
            done.bytes += whole.end - whole.start;
        }
        for Piece { block, bytes } in [cut.head, cut.tail].into_iter().flatten() {
            let b_start = block * bs;
            let data = match self.get(file, block) {
                Some(d) => {
                    done.hits += 1;
                    d
                }
                None => {
                    done.misses += 1;
                    let b_end = (b_start + bs).min(shard.file_len);
                    let mut buf = SecureBuf::new((b_end - b_start) as usize)?;
                    if let Err(e) = shard.read(b_start, &mut buf, raw) {
                        // A bad value elsewhere in the block must not fail this read: serve
                        // exactly the range asked for, which fails only if it holds one.
                        log::debug!("block {block} of file {file} not cached: {e}");
                        shard.read(off, out, raw)?;
                        done.bytes += len;
                        return Ok(done);
                    }
                    done.bytes += b_end - b_start;
                    let d = Arc::new(buf);
                    self.insert(file, block, d.clone());
                    d
                }
            };
            out[(bytes.start - off) as usize..(bytes.end - off) as usize].copy_from_slice(
                &data[(bytes.start - b_start) as usize..(bytes.end - b_start) as usize],
            );
        }
        Ok(done)
    }

    /// Bytes held now (for tests and the RSS benchmark).
    pub fn held_bytes(&self) -> u64 {
        self.lru
            .as_ref()
            .map_or(0, |l| l.lock().iter().map(|(_, b)| b.len() as u64).sum())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounded_and_evicting() {
        let c = BlockCache::new(3 * 10, 10);
        for i in 0..5 {
            let mut b = SecureBuf::new(10).unwrap();
            b.fill(i as u8);
            c.insert(1, i, Arc::new(b));
        }
        assert_eq!(c.held_bytes(), 30);
        assert!(c.get(1, 0).is_none());
        assert_eq!(c.get(1, 4).unwrap()[0], 4);
        assert!(!BlockCache::new(5, 10).enabled());
        assert_eq!(c.shed(15), 20, "whole blocks, oldest first");
        assert!(c.get(1, 2).is_none() && c.get(1, 4).is_some());
        assert_eq!(c.shed(100), 10);
        assert_eq!(c.held_bytes(), 0);
        assert_eq!(BlockCache::block_size_for(256 << 20), 1 << 20);
        assert_eq!(BlockCache::block_size_for(64 << 10), 4096);
        assert_eq!(BlockCache::block_size_for(3 << 20), 128 << 10);
    }

    /// A sealed shard of one 8 MiB BF16 tensor in memory, and its view.
    #[cfg(feature = "seal")]
    fn sealed_shard() -> (crate::testseal::MemoryShard, Vec<u8>) {
        use crate::key::ModelKey;
        use crate::lock::Version;
        use crate::testseal::{safetensors_bytes, sample_bf16, MemoryShard, Tensor};
        let mut tensors = vec![Tensor {
            name: "w".into(),
            dtype: safetensors::Dtype::BF16,
            shape: vec![4 << 20],
            data: sample_bf16(1, 4 << 20),
        }];
        let plain = safetensors_bytes(&tensors, &Default::default());
        let key = ModelKey::new([3; 32]);
        let s = MemoryShard::seal(&mut tensors, &key, Version::V2, "", &|_| false).unwrap();
        let mut view = vec![0u8; s.sealed.len()];
        s.shard
            .read(0, &mut view, &|at, buf| s.raw(at, buf))
            .unwrap();
        let data = s.shard.data_start as usize;
        assert_eq!(&view[data..], &plain[plain.len() - (4 << 21)..]);
        (s, view)
    }

    /// Read `reads` (offset, length) of the shard through a cache of 1 MiB blocks, on
    /// `threads` threads taking every `threads`-th read; checks every byte against `view`
    /// and returns the totals.
    #[cfg(feature = "seal")]
    fn read_through(
        s: &crate::testseal::MemoryShard,
        view: &[u8],
        reads: &[(u64, usize)],
        threads: usize,
    ) -> Decoded {
        let cache = BlockCache::new(16 << 20, 1 << 20);
        let raw = |at: u64, buf: &mut [u8]| s.raw(at, buf);
        let per_thread: Vec<Decoded> = std::thread::scope(|scope| {
            let (cache, raw) = (&cache, &raw);
            let handles: Vec<_> = (0..threads)
                .map(|t| {
                    scope.spawn(move || {
                        let mut sum = Decoded::default();
                        for &(off, len) in reads.iter().skip(t).step_by(threads) {
                            let len = len.min(view.len() - off as usize);
                            let mut out = vec![0u8; len];
                            let d = cache.read_shard(1, &s.shard, off, &mut out, raw).unwrap();
                            assert!(out[..] == view[off as usize..][..len], "at {off} (+{len})");
                            sum.hits += d.hits;
                            sum.misses += d.misses;
                            sum.bytes += d.bytes;
                        }
                        sum
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        per_thread.iter().fold(Decoded::default(), |a, d| Decoded {
            hits: a.hits + d.hits,
            misses: a.misses + d.misses,
            bytes: a.bytes + d.bytes,
        })
    }

    /// A loader reads its header, then the rest in 1 MiB reads; the kernel's readahead
    /// then asks for windows that are not block-aligned, several at once. Each byte is
    /// decoded once, not once for each read that cuts its block.
    #[cfg(feature = "seal")]
    #[test]
    fn readahead_windows_cutting_blocks_decode_each_byte_once() {
        let (s, view) = sealed_shard();
        let len = view.len() as u64;
        let mut reads = vec![(0, 4096)];
        reads.extend((4096..len).step_by(1 << 20).map(|off| (off, 1 << 20)));
        let d = read_through(&s, &view, &reads, 4);
        assert_eq!(
            (d.hits, d.misses),
            (0, 1),
            "only the small first read is cached"
        );
        assert!(d.bytes <= len + (1 << 20), "decoded {} of {len}", d.bytes);

        // The kernel's own 128 KiB windows, four at a time, eight to a block.
        let reads: Vec<_> = (0..len)
            .step_by(128 << 10)
            .map(|o| (o, 128 << 10))
            .collect();
        let d = read_through(&s, &view, &reads, 4);
        assert_eq!(d.bytes, len, "{d:?}");

        // Small reads in order (a header probe, records): each block decoded once.
        let reads: Vec<_> = (0..len).step_by(48 << 10).map(|o| (o, 48 << 10)).collect();
        let d = read_through(&s, &view, &reads, 1);
        assert_eq!(d.bytes, len, "{d:?}");
        assert!(d.hits > d.misses, "{d:?}");
    }
}
