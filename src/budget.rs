//! How much memory a mount uses for decoded data, decided in one place from the flags and
//! the memory the process may use.
//!
//! Two budgets: the private memory of passthrough mode (`--passthrough-memory`), which
//! holds every decoded copy (those open, those kept after their last close for
//! `--keep-decoded`, those decoded ahead), and the FUSE path's block cache
//! (`--cache-size`). [`Budgets::decide`] is the whole rule; [`process_memory`] is what it is
//! decided from.

/// The memory flags as given on the command line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Flags {
    /// `--cache-size`: the FUSE path's block cache.
    pub cache_size: u64,
    /// `--passthrough-memory`, if given.
    pub passthrough_memory: Option<u64>,
}

/// The budgets of one mount, in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Budgets {
    /// The private tmpfs holding decoded shards in passthrough mode; an open past it is
    /// served through FUSE.
    pub passthrough_memory: u64,
    /// The FUSE path's cache of decoded blocks.
    pub block_cache: u64,
}

impl Budgets {
    /// The budgets for `flags` in a process that may use `process_memory` bytes: what a
    /// flag gives is taken as given; passthrough memory defaults to half of
    /// `process_memory`.
    pub fn decide(flags: Flags, process_memory: u64) -> Budgets {
        Budgets {
            passthrough_memory: flags.passthrough_memory.unwrap_or(process_memory / 2),
            block_cache: flags.cache_size,
        }
    }
}

/// The memory this process may use: today the machine's physical memory.
pub fn process_memory() -> u64 {
    // SAFETY: sysconf with valid names.
    let (pages, page) = unsafe {
        (
            libc::sysconf(libc::_SC_PHYS_PAGES),
            libc::sysconf(libc::_SC_PAGESIZE),
        )
    };
    pages.max(0) as u64 * page.max(0) as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    #[test]
    fn passthrough_memory_defaults_to_half_of_the_process_memory() {
        let flags = Flags {
            cache_size: 256 << 20,
            passthrough_memory: None,
        };
        assert_eq!(
            Budgets::decide(flags, 64 * GIB),
            Budgets {
                passthrough_memory: 32 * GIB,
                block_cache: 256 << 20,
            }
        );
        assert_eq!(Budgets::decide(flags, 3).passthrough_memory, 1);
        assert_eq!(Budgets::decide(flags, 0).passthrough_memory, 0);
    }

    #[test]
    fn flags_are_taken_as_given() {
        let flags = Flags {
            cache_size: 0,
            passthrough_memory: Some(100 * GIB),
        };
        assert_eq!(
            Budgets::decide(flags, 8 * GIB),
            Budgets {
                passthrough_memory: 100 * GIB,
                block_cache: 0,
            }
        );
    }

    #[test]
    fn the_machine_has_memory() {
        assert!(process_memory() > 0);
    }
}
