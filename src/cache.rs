//! A bounded LRU of decoded blocks of locked shards.
//!
//! Blocks are fixed-size, aligned pieces of a file, so a run of small kernel reads decodes
//! each block once. Decoding happens outside the lock; two readers that miss the same block
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

    /// View bytes `[off, off + out.len())` of the locked shard `file`, through the cache;
    /// how many blocks were found in it and how many were decoded for it.
    ///
    /// A read that covers whole blocks decodes straight into `out`: the kernel keeps those
    /// pages (FOPEN_KEEP_CACHE), so caching them here too would only cost a copy. The cache
    /// serves the pieces of blocks that reads cut, so a run of small reads decodes each
    /// block once.
    pub fn read_shard(
        &self,
        file: u64,
        shard: &Shard,
        off: u64,
        out: &mut [u8],
        raw: &RawReader<'_>,
    ) -> Result<(u64, u64), ReadError> {
        if !self.enabled() {
            return shard.read(off, out, raw).map(|()| (0, 0));
        }
        let (mut hits, mut misses) = (0, 0);
        let bs = self.block_size;
        let end = off + out.len() as u64;
        let cut = ranges::cut(off, end, bs, shard.file_len);
        let whole = cut.whole_bytes(bs, shard.file_len);
        if !whole.is_empty() {
            let at = (whole.start - off) as usize..(whole.end - off) as usize;
            shard.read(whole.start, &mut out[at], raw)?;
        }
        for Piece { block, bytes } in [cut.head, cut.tail].into_iter().flatten() {
            let b_start = block * bs;
            let data = match self.get(file, block) {
                Some(d) => {
                    hits += 1;
                    d
                }
                None => {
                    misses += 1;
                    let b_end = (b_start + bs).min(shard.file_len);
                    let mut buf = SecureBuf::new((b_end - b_start) as usize)?;
                    if let Err(e) = shard.read(b_start, &mut buf, raw) {
                        // A bad value elsewhere in the block must not fail this read: serve
                        // exactly the range asked for, which fails only if it holds one.
                        log::debug!("block {block} of file {file} not cached: {e}");
                        return shard.read(off, out, raw).map(|()| (hits, misses));
                    }
                    let d = Arc::new(buf);
                    self.insert(file, block, d.clone());
                    d
                }
            };
            out[(bytes.start - off) as usize..(bytes.end - off) as usize].copy_from_slice(
                &data[(bytes.start - b_start) as usize..(bytes.end - b_start) as usize],
            );
        }
        Ok((hits, misses))
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
}
