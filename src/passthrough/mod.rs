//! Which opens the kernel serves by itself, and the bookkeeping that keeps it right.
//!
//! With FUSE passthrough the kernel serves `read`, page faults of `mmap` and readahead of an
//! open file straight from a backing file, without the daemon. A locked shard's backing
//! file is its whole decoded copy in private memory ([`crate::memfs`]), made on its first
//! open and shared by every later open; a file shown verbatim is backed by itself.
//!
//! The kernel holds each inode in one I/O mode at a time: while any handle of it is open in
//! passthrough mode every new open must be too, with the same backing file, and while any
//! is open through the page cache none may be passthrough. [`OpenTable`] tracks the handles
//! of each inode to answer every open in the mode the kernel accepts. It is generic over
//! the kernel's backing handle so it can be tested without a kernel.
//!
//! Here: [`ServeMode`], the mode in use. `opens.rs`: [`Opens`], which answers each open,
//! starting or reusing the file's decoded copy. `table.rs`: [`OpenTable`].

use std::sync::atomic::{AtomicBool, Ordering};

use parking_lot::Mutex;

use crate::memfs::MemoryFs;
use crate::{Error, Result};

mod opens;
mod table;
#[cfg(test)]
mod tests;

pub use opens::{Copies, Opens, Reclaim, NEAR_DONE, OPEN_WAIT, PACE_PROBE, PAST_HALF_WAIT};
pub use table::{Backing, OpenMode, OpenPolicy, OpenTable, Opened};

/// The serving mode asked for on the command line.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Requested {
    /// Passthrough where the kernel and privileges allow it, else FUSE.
    Auto,
    /// Passthrough, or refuse to mount.
    Passthrough,
    /// Every read through the daemon.
    Fuse,
}

/// The mode the daemon serves in, decided at mount and at the kernel's INIT, and turned
/// off for good if the kernel refuses a backing file for a reason no open can fix.
pub struct ServeMode {
    requested: Requested,
    memory: Option<MemoryFs>,
    on: AtomicBool,
    why_not: Mutex<Option<String>>,
    /// The other budgets and the limit they come from, for the log line.
    note: Option<String>,
}

impl ServeMode {
    /// Make the private memory passthrough needs, or say why not: an error only when
    /// passthrough was demanded.
    pub fn choose(requested: Requested, memory_budget: u64) -> Result<ServeMode> {
        let memory = match requested {
            Requested::Fuse => Err("--mode fuse".to_string()),
            _ if !rustix::process::geteuid().is_root() => {
                Err("backing files need root (CAP_SYS_ADMIN)".to_string())
            }
            _ => MemoryFs::new(memory_budget)
                .map_err(|e| format!("no private memory file system ({e})")),
        };
        match memory {
            Ok(m) => Ok(ServeMode {
                requested,
                memory: Some(m),
                on: AtomicBool::new(true),
                why_not: Mutex::new(None),
                note: None,
            }),
            Err(why) if requested == Requested::Passthrough => Err(Error::new(format!(
                "--mode passthrough is not possible here: {why}"
            ))),
            Err(why) => Ok(ServeMode {
                requested,
                memory: None,
                on: AtomicBool::new(false),
                why_not: Mutex::new(Some(why)),
                note: None,
            }),
        }
    }

    /// What the startup log line adds after the mode: the budgets and their limit.
    pub fn with_note(mut self, note: String) -> ServeMode {
        self.note = Some(note);
        self
    }

    pub fn requested(&self) -> Requested {
        self.requested
    }

    /// The private memory, whether passthrough is on or was turned off.
    pub fn memory(&self) -> Option<&MemoryFs> {
        self.memory.as_ref()
    }

    /// The private memory, while passthrough is on.
    pub fn passthrough(&self) -> Option<&MemoryFs> {
        self.memory
            .as_ref()
            .filter(|_| self.on.load(Ordering::Relaxed))
    }

    /// Serve every later open through FUSE, and say why once.
    pub fn turn_off(&self, why: String) {
        if self.on.swap(false, Ordering::Relaxed) {
            log::warn!("passthrough off, serving through FUSE: {why}");
            *self.why_not.lock() = Some(why);
        }
    }

    /// `passthrough`, or `fuse` and why.
    pub fn describe(&self) -> (&'static str, Option<String>) {
        match self.passthrough() {
            Some(_) => ("passthrough", None),
            None => ("fuse", self.why_not.lock().clone()),
        }
    }

    /// The kernel offered no passthrough at INIT: why, as an error if `--mode passthrough`
    /// demanded it, else serve through FUSE.
    pub fn kernel_offers_none(&self) -> std::result::Result<(), &'static str> {
        let why = "the kernel offers no FUSE passthrough (Linux 6.9+ with CONFIG_FUSE_PASSTHROUGH)";
        if self.requested == Requested::Passthrough {
            return Err(why);
        }
        self.turn_off(why.into());
        Ok(())
    }

    /// The one log line saying which mode is in use and why.
    pub fn log(&self) {
        let note = self.note.as_deref().unwrap_or("");
        match (self.describe(), &self.memory) {
            (("passthrough", _), Some(m)) => log::warn!(
                "serving in passthrough mode: the kernel reads decoded shards from private memory (budget {} MiB in {} folios; {note})",
                m.budget() >> 20,
                m.pages().name()
            ),
            ((_, why), _) => log::warn!(
                "serving through FUSE: {} ({note})",
                why.unwrap_or_else(|| "passthrough unavailable".into())
            ),
        }
    }
}
