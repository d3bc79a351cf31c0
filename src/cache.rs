//! A bounded LRU of decoded blocks of locked shards.
//!
//! Blocks are fixed-size, aligned pieces of a file, so a run of small kernel reads decodes
//! each block once. Decoding happens outside the lock; two readers that miss the same block
//! at once both decode it, which costs time but never correctness. Evicted blocks are wiped.

use std::num::NonZeroUsize;
use std::sync::Arc;

use crate::secmem::SecureBuf;
use lru::LruCache;
use parking_lot::Mutex;

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

    /// The block size for a budget: 1 MiB (a kernel read is at most that), smaller for
    /// small budgets so the cache still holds a few blocks.
    pub fn block_size_for(budget: u64) -> u64 {
        let b = (budget / 16).clamp(4096, 1 << 20);
        1 << (63 - b.leading_zeros())
    }

    /// Bytes held now (for tests and the RSS benchmark).
    pub fn held_bytes(&self) -> u64 {
        self.lru
            .as_ref()
            .map_or(0, |l| l.lock().iter().map(|(_, b)| b.len() as u64).sum())
    }
}

/// Parse `256M`, `1G`, `4096`, `64k` (binary units).
pub fn parse_size(text: &str) -> Result<u64, String> {
    let t = text.trim();
    let (num, mult) = match t.char_indices().last() {
        Some((i, c)) if c.is_ascii_alphabetic() => {
            let mult = match c.to_ascii_uppercase() {
                'K' => 1u64 << 10,
                'M' => 1 << 20,
                'G' => 1 << 30,
                'T' => 1 << 40,
                _ => {
                    return Err(format!(
                        "unknown size suffix in {text:?} (use K, M, G or T)"
                    ))
                }
            };
            (&t[..i], mult)
        }
        _ => (t, 1),
    };
    let n: u64 = num
        .trim()
        .parse()
        .map_err(|_| format!("{text:?} is not a size (e.g. 512M, 2G)"))?;
    n.checked_mul(mult)
        .ok_or_else(|| format!("{text:?} is too large"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert_eq!(parse_size("64k").unwrap(), 64 << 10);
        assert_eq!(parse_size("512M").unwrap(), 512 << 20);
        assert_eq!(parse_size("2G").unwrap(), 2 << 30);
        assert!(parse_size("12Q").is_err());
        assert!(parse_size("M").is_err());
    }

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
        assert_eq!(BlockCache::block_size_for(256 << 20), 1 << 20);
        assert_eq!(BlockCache::block_size_for(64 << 10), 4096);
        assert_eq!(BlockCache::block_size_for(3 << 20), 128 << 10);
    }
}
