//! How much memory a mount uses for decoded data, decided in one place from the flags and
//! the memory the process may use (src/limits.rs).
//!
//! Two budgets: the private memory of passthrough mode (`--passthrough-memory`), which holds
//! every decoded copy (open, filling, decoded ahead, kept for `--keep-decoded` after the
//! last close), and the FUSE path's block cache (`--cache-size`). [`Budgets::decide`] is the
//! whole rule. Decoded shards live in the private memory, kept ones included, so what the
//! daemon holds by default is at most the
//! passthrough memory, the block cache and its own working memory ([`headroom`]), which
//! together stay within the limit: a container or unit with a memory limit is never pushed
//! past it by default, and a shard that does not fit is served through FUSE.

use crate::limits::{Limit, Origin};

const MIB: u64 = 1 << 20;

/// `--cache-size` when none is given, if the limit leaves room for it.
pub const DEFAULT_CACHE: u64 = 256 * MIB;

/// The memory flags as given on the command line (`None`: not given).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Flags {
    /// `--cache-size`: the FUSE path's block cache.
    pub cache_size: Option<u64>,
    /// `--passthrough-memory`.
    pub passthrough_memory: Option<u64>,
}

/// The budgets of one mount, in bytes, and what they were decided from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Budgets {
    /// The private tmpfs holding decoded shards in passthrough mode; an open past it is
    /// served through FUSE.
    pub passthrough_memory: u64,
    /// The FUSE path's cache of decoded blocks.
    pub block_cache: u64,
    /// The memory the process may use.
    pub limit: Limit,
    /// Kept free of budgets: the daemon's own working memory, and what was in use already.
    pub reserved: u64,
}

/// The daemon's working memory besides its budgets: code, heap and the view (32 MiB), up
/// to 16 wiped buffers kept for reuse (src/secmem.rs, 16 MiB), the buffers fills decode
/// cached chunks into (`fill::PIECE_BUFFERS`, 16 MiB), and per serving thread a reply
/// buffer of up to 1 MiB (src/fuse.rs), the two 4 MiB buffers of a file hashed on its first
/// open (src/digest.rs) and a stack.
pub fn headroom(threads: usize) -> u64 {
    64 * MIB + threads as u64 * 10 * MIB
}

/// What threads reserve of the address space beyond what they use (an allocator arena of
/// 64 MiB, a stack, fuser's request buffer): counted only against `RLIMIT_AS` and
/// `RLIMIT_DATA`, for the serving threads and as many decode threads. Measured: 675 MiB for 4 + 2 threads.
fn address_space_reserve(threads: usize) -> u64 {
    2 * threads as u64 * 96 * MIB
}

impl Budgets {
    /// The budgets for `flags` in a process that may use `limit`, of which `in_use` cannot
    /// be reclaimed already, serving on `threads` threads.
    ///
    /// Under a limit set for the process (a memory cgroup, an rlimit) the budgets fill what
    /// it leaves after [`headroom`]: the block cache a quarter of it (at most
    /// [`DEFAULT_CACHE`]), passthrough memory the rest. When only the machine's memory
    /// limits it, passthrough memory is half of it, the rest left to the engine. What a flag gives
    /// is taken as given ([`Budgets::warnings`] says when that is past the limit).
    pub fn decide(flags: Flags, limit: Limit, in_use: u64, threads: usize) -> Budgets {
        let mut reserved = in_use.saturating_add(headroom(threads));
        if matches!(limit.source, Origin::RlimitAs | Origin::RlimitData) {
            reserved = reserved.saturating_add(address_space_reserve(threads));
        }
        let usable = limit.bytes.saturating_sub(reserved);
        let block_cache = flags.cache_size.unwrap_or(DEFAULT_CACHE.min(usable / 4));
        let passthrough_memory = flags.passthrough_memory.unwrap_or(match limit.source {
            Origin::Machine => limit.bytes / 2,
            _ => usable.saturating_sub(block_cache),
        });
        Budgets {
            passthrough_memory,
            block_cache,
            limit,
            reserved,
        }
    }

    /// What the daemon may hold at most: both budgets and its reserve.
    pub fn total(&self) -> u64 {
        self.passthrough_memory
            .saturating_add(self.block_cache)
            .saturating_add(self.reserved)
    }

    /// Warnings for flags that give more than the limit allows: such a mount works until
    /// its memory fills, and then the kernel kills it.
    pub fn warnings(&self, flags: Flags) -> Option<String> {
        let given: Vec<String> = [
            ("--passthrough-memory", flags.passthrough_memory),
            ("--cache-size", flags.cache_size),
        ]
        .iter()
        .filter_map(|(name, v)| v.map(|v| format!("{name} {} MiB", v >> 20)))
        .collect();
        if given.is_empty() || self.total() <= self.limit.bytes {
            return None;
        }
        Some(format!(
            "{} with {} MiB for the daemon itself exceed the memory it may use ({}); it will be killed once they fill. Lower them, or raise the limit",
            given.join(" and "),
            self.reserved >> 20,
            self.limit
        ))
    }

    /// The budgets in one line, for the startup log.
    pub fn describe(&self) -> String {
        format!(
            "cache {} MiB, of a memory limit of {}",
            self.block_cache >> 20,
            self.limit
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

    const GIB: u64 = 1 << 30;

    fn machine(bytes: u64) -> Limit {
        Limit {
            bytes,
            source: Origin::Machine,
        }
    }

    fn cgroup(bytes: u64) -> Limit {
        Limit {
            bytes,
            source: Origin::Cgroup {
                file: PathBuf::from("/sys/fs/cgroup/memory.max"),
                key: None,
            },
        }
    }

    #[test]
    fn on_a_machine_passthrough_memory_is_half_of_it() {
        let b = Budgets::decide(Flags::default(), machine(64 * GIB), GIB, 4);
        assert_eq!(b.passthrough_memory, 32 * GIB);
        assert_eq!(b.block_cache, DEFAULT_CACHE);
        assert!(b.total() < 64 * GIB);
    }

    #[test]
    fn under_a_cgroup_limit_everything_fits() {
        for limit in [64 * MIB, 256 * MIB, GIB, 16 * GIB] {
            for threads in [4, 16] {
                let in_use = 8 * MIB;
                let b = Budgets::decide(Flags::default(), cgroup(limit), in_use, threads);
                assert!(b.total() <= limit.max(b.reserved), "{limit}: {b:?}");
                assert_eq!(b.reserved, in_use + headroom(threads));
                assert!(b.warnings(Flags::default()).is_none());
            }
        }
        // 256 MiB on 4 threads: 104 MiB reserved and 8 in use leave 144: a quarter of it for
        // the cache, the rest for passthrough; a 512 MiB shard goes through FUSE.
        let b = Budgets::decide(Flags::default(), cgroup(256 * MIB), 8 * MIB, 4);
        assert_eq!(b.block_cache, 36 * MIB);
        assert_eq!(b.passthrough_memory, 108 * MIB);
        // 1 GiB: a 512 MiB shard fits passthrough memory.
        let b = Budgets::decide(Flags::default(), cgroup(GIB), 8 * MIB, 4);
        assert_eq!(b.block_cache, 228 * MIB);
        assert_eq!(b.passthrough_memory, 684 * MIB);
        // A limit below the reserve leaves no budget at all, rather than wrapping around.
        let b = Budgets::decide(Flags::default(), cgroup(64 * MIB), 8 * MIB, 4);
        assert_eq!((b.passthrough_memory, b.block_cache), (0, 0));
    }

    #[test]
    fn rlimit_as_keeps_the_threads_address_space_back() {
        let limit = Limit {
            bytes: 4 * GIB,
            source: Origin::RlimitAs,
        };
        let b = Budgets::decide(Flags::default(), limit, 8 * MIB, 4);
        assert_eq!(b.reserved, 8 * MIB + headroom(4) + 768 * MIB);
        assert!(b.total() <= 4 * GIB);
    }

    #[test]
    fn flags_are_taken_as_given_with_a_warning_past_the_limit() {
        let flags = Flags {
            cache_size: Some(0),
            passthrough_memory: Some(100 * GIB),
        };
        let b = Budgets::decide(flags, cgroup(8 * GIB), 0, 4);
        assert_eq!((b.passthrough_memory, b.block_cache), (100 * GIB, 0));
        let w = b.warnings(flags).expect("a warning");
        assert!(
            w.contains("--passthrough-memory 102400 MiB and --cache-size 0 MiB"),
            "{w}"
        );
        assert!(w.contains("8192 MiB, the memory cgroup's limit"), "{w}");
        let fits = Flags {
            cache_size: Some(GIB),
            passthrough_memory: Some(4 * GIB),
        };
        assert!(Budgets::decide(fits, cgroup(8 * GIB), 0, 4)
            .warnings(fits)
            .is_none());
        // An explicit cache alone shrinks the default passthrough memory to fit.
        let cache = Flags {
            cache_size: Some(GIB),
            passthrough_memory: None,
        };
        let b = Budgets::decide(cache, cgroup(2 * GIB), 0, 4);
        assert_eq!(b.passthrough_memory, GIB - headroom(4));
        assert!(b.warnings(cache).is_none());
    }
}
