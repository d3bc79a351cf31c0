//! Where sealed bytes come from: the one seam between the view and the storage behind it.
//!
//! A [`Source`] is a sealed directory somewhere (a local folder today; object storage
//! next): it lists what is under its root and opens one file for ranged reads. An
//! [`Object`] is one opened file: its length, `pread`-like reads, and whether it still
//! holds the bytes it held when opened. The walk that builds the view (`sealed`), the view's
//! reads and the manifest check go through these two traits only; none of them knows which
//! source they read.
//!
//! What stays out of a source: which files are hidden, lockable or listed in the manifest
//! (format facts, in `sealed`), and decoding (in `shard` and `lock`).
//!
//! - [`local`]: a local directory, with the link rules of the mount.
//! - [`s3`]: a prefix of an S3-compatible bucket; [`http`]: any server answering ranged
//!   GETs, its files named by the manifest. Both read through [`remote`] (parts, prefetch,
//!   retries, version checks), with the optional [`node_cache`] on local disk; [`profile`]
//!   reads `AWS_PROFILE`.
//! - [`location`]: `<SEALED>` on the command line (a path or a URL) and the source it names.
//!
//! The remote sources are the cargo feature `remote` (on by default).

#[cfg(feature = "remote")]
pub mod http;
pub mod local;
pub mod location;
#[cfg(feature = "remote")]
pub mod node_cache;
#[cfg(feature = "remote")]
pub mod profile;
#[cfg(feature = "remote")]
pub mod remote;
#[cfg(feature = "remote")]
pub mod s3;

use std::fs::File;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::SystemTime;

use sha2::{Digest, Sha256};

pub use local::LocalDir;
pub use location::Location;

use crate::guarded_map::GuardedMap;
use crate::{ReadError, Result};

/// A sealed directory to serve from.
pub trait Source: Send + Sync {
    /// The root for messages: a path, or a URL without credentials.
    fn describe(&self) -> String;

    /// Every file and folder under the root, the root itself first (path `""`), then each
    /// folder's entries sorted by name, depth first. Only folders and regular files are
    /// listed; what cannot be shown is left out with a warning.
    fn list(&self) -> Result<Vec<Entry>>;

    /// The entry [`Source::list`] would give for `rel` (a path as shown), without listing
    /// everything: `None` when it would not be listed.
    fn stat(&self, rel: &Path) -> Result<Option<Entry>> {
        Ok(self.list()?.into_iter().find(|e| e.path == rel))
    }

    /// One file for ranged reads, by its [`Entry::content_path`]. Cheap: a source may open
    /// the file on its first read, but its version is fixed here.
    fn open(&self, rel: &Path) -> Result<Arc<dyn Object>>;

    /// A path under the root as messages name it.
    fn at(&self, rel: &Path) -> PathBuf {
        let root = PathBuf::from(self.describe());
        if rel.as_os_str().is_empty() {
            root
        } else {
            root.join(rel)
        }
    }
}

/// A file or a folder.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Dir,
    File,
}

/// What `stat` shows of a node.
#[derive(Debug, Clone, Copy)]
pub struct Attr {
    pub kind: Kind,
    pub size: u64,
    /// Permission bits only.
    pub perm: u16,
    pub uid: u32,
    pub gid: u32,
    pub atime: SystemTime,
    pub mtime: SystemTime,
    pub ctime: SystemTime,
}

/// One file or folder under a source's root.
#[derive(Debug, Clone)]
pub struct Entry {
    /// Where the view shows it, relative to the root.
    pub path: PathBuf,
    /// Where its bytes live, relative to the root: the target's path for a link to a file
    /// (kLLM scopes tensor ids by the real path), else `path`.
    pub content_path: PathBuf,
    /// Kind, size, permissions, owner and times; a source without them gives defaults.
    pub attr: Attr,
}

/// One sealed file, opened for ranged reads from any thread.
pub trait Object: Send + Sync {
    /// Its length when opened.
    fn len(&self) -> u64;

    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Fill `buf` with the bytes at `off`; fewer bytes than asked is an error.
    fn read_exact_at(&self, buf: &mut [u8], off: u64) -> Result<(), ReadError>;

    /// As `read_exact_at`, for a caller that reads each range once and keeps the bytes
    /// itself (a fill): a remote object reads whole parts straight into `buf`.
    fn read_once_at(&self, buf: &mut [u8], off: u64) -> Result<(), ReadError> {
        self.read_exact_at(buf, off)
    }

    /// As `read_exact_at`, for the few small reads of a mount (shard headers): a remote
    /// object fetches just those bytes, where a read would fetch the whole part.
    fn read_small_at(&self, buf: &mut [u8], off: u64) -> Result<(), ReadError> {
        self.read_exact_at(buf, off)
    }

    /// Bring in the bytes `[off, off + len)` for reads expected soon (an engine still
    /// starting), and wait until they are in: a remote object fetches them as parts read
    /// ahead, kept until read within the memory its source keeps for reading ahead; a local
    /// file reads them into the page cache. How many bytes it took on: fewer than asked once
    /// that memory is full, past the end, or on a failure (a source with nothing to bring
    /// in takes on none).
    fn fetch_ahead(&self, _off: u64, _len: u64) -> u64 {
        0
    }

    /// Whether what `fetch_ahead` brought in is held in the daemon's own memory until read
    /// (a remote object's parts), rather than in the kernel's page cache.
    fn holds_fetched_ahead(&self) -> bool {
        false
    }

    /// How many `read_once_at` calls gain from running at once (many GETs in flight).
    fn parallel_reads(&self) -> usize {
        1
    }

    /// `Err(ReadError::Changed)` when the file may no longer hold the bytes it held when
    /// opened (local: size, modification and change times; remote: its version).
    fn check_unchanged(&self) -> Result<(), ReadError>;

    /// The local file behind it, if any: passthrough hands it to the kernel as a backing
    /// file, and hashing reads it on its own thread.
    fn local_file(&self) -> Result<Option<&File>, ReadError>;

    /// Its bytes mapped, for a read of `[off, off + len)` that the page cache holds whole (a
    /// local file): a reader that decodes them there reads each byte once, where
    /// `read_exact_at` would copy every byte into a buffer first. `None`: read them.
    fn cached_mapping(&self, _off: u64, _len: u64) -> Option<&GuardedMap> {
        None
    }
}

/// [`Object::read_exact_at`] as a shard decoder's raw reader wants it.
pub fn raw_read(object: &dyn Object, at: u64, buf: &mut [u8]) -> io::Result<()> {
    object.read_exact_at(buf, at).map_err(io::Error::from)
}

/// The whole object's bytes (for small files read at mount: metadata, the blob).
pub fn read_all(object: &dyn Object) -> Result<Vec<u8>, ReadError> {
    let mut out = vec![0u8; object.len() as usize];
    object.read_exact_at(&mut out, 0)?;
    Ok(out)
}

/// SHA-256 of a whole object: a local file by the manifest's reader, anything else by
/// ranged reads in order.
pub fn sha256(object: &dyn Object) -> io::Result<[u8; 32]> {
    if let Some(f) = object.local_file().map_err(io::Error::from)? {
        return crate::digest::sha256_file(f);
    }
    const CHUNK: u64 = 8 << 20;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; CHUNK.min(object.len()) as usize];
    let mut off = 0;
    while off < object.len() {
        let n = CHUNK.min(object.len() - off) as usize;
        raw_read(object, off, &mut buf[..n])?;
        hasher.update(&buf[..n]);
        off += n as u64;
    }
    Ok(hasher.finalize().into())
}

/// A URL as an error may repeat it, parsed or not: without what comes before its last `@`
/// (user and password; a password may hold a `/`), its query and its fragment (a signed
/// URL's token). A path with an `@` in it loses its start, which only an error shows.
pub(crate) fn without_secrets(text: &str) -> String {
    let (scheme, rest) = match text.split_once("://") {
        Some((scheme, rest)) => (format!("{scheme}://"), rest),
        None => (String::new(), text),
    };
    let rest = rest.split(['?', '#']).next().unwrap_or_default();
    let rest = rest.rsplit_once('@').map_or(rest, |(_, after)| after);
    format!("{scheme}{rest}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secrets_are_cut_from_a_named_url() {
        assert_eq!(without_secrets("s3://k:s@b/m?t=1#f"), "s3://b/m");
        assert_eq!(without_secrets("https://u:p/w@h/x/"), "https://h/x/");
        assert_eq!(without_secrets("http://h:9/a/b"), "http://h:9/a/b");
        assert_eq!(without_secrets("u:p@h:9?t"), "h:9");
    }
}
