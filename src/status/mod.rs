//! What a running mount is doing, on a Unix socket that answers each connection with one
//! JSON line (`kllm-mount --status MOUNTPOINT`) or with the counters of [`crate::metrics`]
//! in Prometheus' text format. docs/STATUS.md describes every field.
//!
//! The socket lives in `$XDG_RUNTIME_DIR/kllm-mount/` (else `/run/kllm-mount/`), a 0700
//! folder, as a 0600 file named after the canonical mount point; the server also checks
//! the peer's uid (`SO_PEERCRED`) and answers only its own user and root. This module says
//! where the socket is; [`server`] answers on it, [`client`] asks it, [`report`] writes the
//! answers.

use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use crate::{Error, Result};

pub mod client;
pub mod report;
pub mod server;

pub use client::{metrics, metrics_in, query, query_in};
pub use report::rfc3339;
pub use server::{peer_allowed, StatusServer};

/// Folder of the sockets under `$XDG_RUNTIME_DIR` or `/run`.
pub const DIR_NAME: &str = "kllm-mount";

/// The socket folders, in the order `query` looks: `$XDG_RUNTIME_DIR/kllm-mount` when the
/// variable is set (and absolute), then `/run/kllm-mount`.
pub fn runtime_dirs() -> Vec<PathBuf> {
    let mut dirs = Vec::new();
    if let Some(xdg) = std::env::var_os("XDG_RUNTIME_DIR") {
        let xdg = PathBuf::from(xdg);
        if xdg.is_absolute() {
            dirs.push(xdg.join(DIR_NAME));
        }
    }
    dirs.push(Path::new("/run").join(DIR_NAME));
    dirs
}

/// The folder a daemon puts its socket in: the first of [`runtime_dirs`].
pub fn runtime_dir() -> PathBuf {
    runtime_dirs().remove(0)
}

/// The mount point as the kernel names it, without asking the mount itself (a hung daemon
/// must not hang `--status`): the parent is canonicalized and the last part, when a
/// symbolic link, followed by hand.
pub fn canonical_mount_point(mountpoint: &Path) -> Result<PathBuf> {
    let mut path = std::path::absolute(mountpoint).map_err(|e| Error::at(mountpoint, e))?;
    for _ in 0..40 {
        let (Some(parent), Some(name)) = (path.parent(), path.file_name()) else {
            // `/`, or a path ending in `..`: nothing to keep the mount out of.
            return std::fs::canonicalize(&path).map_err(|e| Error::at(mountpoint, e));
        };
        let parent = std::fs::canonicalize(parent).map_err(|e| Error::at(mountpoint, e))?;
        let joined = parent.join(name);
        match std::fs::read_link(&joined) {
            Ok(target) => path = parent.join(target),
            Err(_) => return Ok(joined),
        }
    }
    Err(Error::at(mountpoint, "too many levels of symbolic links"))
}

/// The socket's file name for a mount point: 16 bytes of the SHA-256 of the canonical
/// path's bytes, in hex, then `.sock` (fixed length, whatever the path).
pub fn socket_name(mountpoint: &Path) -> Result<String> {
    use std::os::unix::ffi::OsStrExt;
    let canonical = canonical_mount_point(mountpoint)?;
    let digest = Sha256::digest(canonical.as_os_str().as_bytes());
    Ok(format!("{}.sock", hex::encode(&digest[..16])))
}
