//! The unlocked view: an immutable tree of nodes built at mount time, and reads of any
//! byte range of any file. Nothing here knows about the kernel.

use std::ffi::{OsStr, OsString};
use std::fs::File;
use std::sync::{Arc, OnceLock};

use zeroize::Zeroizing;

use crate::cache::BlockCache;
use crate::metrics::Stats;
use crate::secmem::Wiped;
use crate::shard::Shard;
use crate::source::{self, Object};
pub use crate::source::{Attr, Kind};
use crate::ReadError;

pub type Ino = u64;
pub const ROOT: Ino = 1;

pub enum Content {
    Dir(Vec<(OsString, Ino)>),
    /// A file shown byte for byte as its source holds it.
    Verbatim(Arc<dyn Object>),
    /// Bytes that exist only in memory: secret files and the metadata file without its
    /// lock flag.
    Memory(Zeroizing<Vec<u8>>),
    /// A locked shard, decoded on read.
    Shard {
        object: Arc<dyn Object>,
        shard: Shard,
    },
}

pub struct Node {
    pub parent: Ino,
    pub name: OsString,
    pub attr: Attr,
    pub content: Content,
    /// What the manifest says the file must hash to; `None` without a manifest.
    pub integrity: Option<Integrity>,
}

/// A file's digest in the manifest, and the verdict once the file was hashed: decided at
/// mount for bytes read then (the metadata file, the secret files), else on first use.
pub struct Integrity {
    /// The manifest's path of the file whose bytes are checked.
    pub listed_as: String,
    pub want: [u8; 32],
    verdict: OnceLock<Result<(), String>>,
    /// The digest a fill computes from the bytes it fetches, when it does (a remote file):
    /// the verdict waits for it instead of reading the file again.
    feed: parking_lot::Mutex<Option<Arc<crate::digest::DigestFeed>>>,
}

impl Integrity {
    pub fn new(listed_as: String, want: [u8; 32]) -> Integrity {
        Integrity {
            listed_as,
            want,
            verdict: OnceLock::new(),
            feed: parking_lot::Mutex::new(None),
        }
    }

    /// A verdict on bytes already read: `got` is their digest.
    pub fn decided(listed_as: String, want: [u8; 32], got: [u8; 32]) -> Integrity {
        let i = Integrity::new(listed_as, want);
        let _ = i.verdict.set(i.judge(Ok(got)));
        i
    }

    pub fn verdict(&self) -> Option<&Result<(), String>> {
        self.verdict.get()
    }

    fn judge(&self, got: std::io::Result<[u8; 32]>) -> Result<(), String> {
        match got {
            Ok(got) if got == self.want => Ok(()),
            Ok(got) => Err(format!(
                "{} does not match kllm-manifest.json (SHA-256 {}, listed {}): altered after sealing",
                self.listed_as,
                hex::encode(got),
                hex::encode(self.want)
            )),
            Err(e) => Err(format!(
                "{} cannot be checked against kllm-manifest.json ({e})",
                self.listed_as
            )),
        }
    }
}

/// The whole view: nodes indexed by inode number (`ino - 1`).
pub struct View {
    nodes: Vec<Node>,
    cache: BlockCache,
    stats: Arc<Stats>,
}

impl View {
    /// `nodes[0]` must be the root directory.
    pub fn new(nodes: Vec<Node>, cache: BlockCache, stats: Arc<Stats>) -> View {
        View {
            nodes,
            cache,
            stats,
        }
    }

    pub fn stats(&self) -> &Arc<Stats> {
        &self.stats
    }

    pub fn node(&self, ino: Ino) -> Option<&Node> {
        self.nodes.get(ino.checked_sub(1)? as usize)
    }

    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }

    pub fn cache(&self) -> &BlockCache {
        &self.cache
    }

    pub fn children(&self, ino: Ino) -> Option<&[(OsString, Ino)]> {
        match &self.node(ino)?.content {
            Content::Dir(entries) => Some(entries),
            _ => None,
        }
    }

    pub fn lookup(&self, parent: Ino, name: &OsStr) -> Option<Ino> {
        let entries = self.children(parent)?;
        entries
            .binary_search_by(|(n, _)| n.as_os_str().cmp(name))
            .ok()
            .map(|i| entries[i].1)
    }

    /// The inode of a path relative to the root (`a/b/c`, `""` for the root).
    pub fn resolve(&self, path: &str) -> Option<Ino> {
        path.split('/')
            .filter(|p| !p.is_empty())
            .try_fold(ROOT, |ino, part| self.lookup(ino, OsStr::new(part)))
    }

    /// Every file's path, for tests and tools.
    pub fn file_paths(&self) -> Vec<(String, Ino)> {
        let mut out = Vec::new();
        let mut stack = vec![(String::new(), ROOT)];
        while let Some((prefix, ino)) = stack.pop() {
            for (name, child) in self.children(ino).unwrap_or(&[]) {
                let path = format!("{prefix}{}", name.to_string_lossy());
                match self.nodes[*child as usize - 1].attr.kind {
                    Kind::Dir => stack.push((format!("{path}/"), *child)),
                    Kind::File => out.push((path, *child)),
                }
            }
        }
        out.sort();
        out
    }

    /// The path of a node, for log lines.
    pub fn path_of(&self, ino: Ino) -> String {
        let mut parts = Vec::new();
        let mut cur = ino;
        while cur != ROOT {
            let Some(n) = self.node(cur) else { break };
            parts.push(n.name.to_string_lossy().into_owned());
            cur = n.parent;
        }
        parts.reverse();
        parts.join("/")
    }

    /// Bytes `[off, off + size)` of a file, cut at its end.
    pub fn read(&self, ino: Ino, off: u64, size: usize) -> Result<Wiped, ReadError> {
        let node = self.node(ino).ok_or(ReadError::NotFound)?;
        let len = node.attr.size.saturating_sub(off).min(size as u64) as usize;
        let mut out = Wiped::zeroed(len);
        self.read_into(ino, off, &mut out)?;
        Ok(out)
    }

    /// Fill `out` with the bytes at `off`, cut at the end of the file, and return how many
    /// were written, so a caller can reuse one buffer for every read. A file under a
    /// manifest is hashed whole before its first byte is served.
    pub fn read_into(&self, ino: Ino, off: u64, out: &mut [u8]) -> Result<usize, ReadError> {
        self.verify(ino)?;
        self.read_unverified(ino, off, out)
    }

    /// Whether the file may be served: always without a manifest, else once its bytes
    /// hashed to what the manifest lists. Concurrent first callers wait for one hash.
    pub fn verify(&self, ino: Ino) -> Result<(), ReadError> {
        let node = self.node(ino).ok_or(ReadError::NotFound)?;
        match &node.integrity {
            None => Ok(()),
            Some(i) => self
                .verdict(ino, node, i)
                .clone()
                .map_err(ReadError::Unverified),
        }
    }

    /// Whether file `ino` is under a manifest and its verdict is not in yet (its hash may
    /// still read its sealed bytes).
    pub fn awaits_verdict(&self, ino: Ino) -> bool {
        self.node(ino)
            .and_then(|n| n.integrity.as_ref())
            .is_some_and(|i| i.verdict.get().is_none())
    }

    /// Whether file `ino`'s check is done and failed (never waits for a hash).
    pub fn failed_check(&self, ino: Ino) -> bool {
        self.node(ino)
            .and_then(|n| n.integrity.as_ref())
            .and_then(|i| i.verdict.get())
            .is_some_and(|v| v.is_err())
    }

    fn verdict<'a>(&self, ino: Ino, node: &Node, i: &'a Integrity) -> &'a Result<(), String> {
        i.verdict.get_or_init(|| {
            let verdict = i.judge(self.hash(node));
            let stats = &self.stats;
            match &verdict {
                Ok(()) => {
                    Stats::add(&stats.verified_files, 1);
                    Stats::add(&stats.verified_bytes, node.attr.size);
                }
                Err(why) => {
                    Stats::add(&stats.failed_files, 1);
                    log::error!(
                        "{}: {why}; its opens and reads fail with EIO",
                        self.path_of(ino)
                    );
                }
            }
            verdict
        })
    }

    /// A feeder for the digest of file `ino`'s sealed bytes, for a fill that reads them all
    /// in order anyway: its verdict, when first asked for, waits for that digest (or hashes
    /// the file itself if the feeder gives up). `None` when the file has no manifest digest
    /// or its verdict is in.
    pub fn digest_feeder(&self, ino: Ino) -> Option<crate::digest::DigestFeeder> {
        let node = self.node(ino)?;
        let i = node.integrity.as_ref()?;
        if i.verdict.get().is_some() {
            return None;
        }
        let object = match &node.content {
            Content::Shard { object, .. } | Content::Verbatim(object) => object,
            Content::Memory(_) | Content::Dir(_) => return None,
        };
        let (feed, feeder) = crate::digest::DigestFeed::start(object.len());
        *i.feed.lock() = Some(feed);
        Some(feeder)
    }

    /// SHA-256 of the sealed file behind a node: fed by its fill when there is one that
    /// hashes, else read here.
    fn hash(&self, node: &Node) -> std::io::Result<[u8; 32]> {
        let fed = node.integrity.as_ref().and_then(|i| i.feed.lock().clone());
        if let Some(digest) = fed.and_then(|f| f.wait()) {
            return Ok(digest);
        }
        match &node.content {
            Content::Verbatim(object) | Content::Shard { object, .. } => source::sha256(&**object),
            Content::Memory(_) | Content::Dir(_) => Err(std::io::Error::other(
                "no file to hash (its verdict is given at mount)",
            )),
        }
    }

    /// Bytes at `off` without the integrity check, for a caller that serves nothing before
    /// the verdict ([`crate::fill::Fill`]); how many, cut at the end of the file.
    pub fn read_unchecked(&self, ino: Ino, off: u64, out: &mut [u8]) -> Result<usize, ReadError> {
        self.read_unverified(ino, off, out)
    }

    /// The source object whose bytes a file of the view shows (decoded or not); `None`
    /// for bytes held in memory.
    pub fn sealed_object(&self, ino: Ino) -> Result<Option<&Arc<dyn Object>>, ReadError> {
        let node = self.node(ino).ok_or(ReadError::NotFound)?;
        match &node.content {
            Content::Shard { object, .. } | Content::Verbatim(object) => Ok(Some(object)),
            Content::Memory(_) => Ok(None),
            Content::Dir(_) => Err(ReadError::IsDir),
        }
    }

    /// Turn `buf`, which holds the bytes of [`View::sealed_object`] at `off` (nothing for
    /// bytes held in memory), into the file's view bytes in place, without the integrity
    /// check, for a copy that serves nothing before the verdict ([`crate::fill::Fill`]).
    /// Fails if the sealed file changed since mounting.
    pub fn unlock_in_place(&self, ino: Ino, off: u64, buf: &mut [u8]) -> Result<(), ReadError> {
        let node = self.node(ino).ok_or(ReadError::NotFound)?;
        if off + buf.len() as u64 > node.attr.size {
            return Err(ReadError::Io(std::io::Error::other(
                "past the end of the file",
            )));
        }
        match &node.content {
            Content::Dir(_) => return Err(ReadError::IsDir),
            Content::Memory(bytes) => {
                buf.copy_from_slice(&bytes[off as usize..off as usize + buf.len()]);
            }
            Content::Verbatim(object) => {
                // Under a manifest the bytes checked must be the bytes served.
                if node.integrity.is_some() {
                    object.check_unchanged()?;
                }
            }
            Content::Shard { object, shard } => {
                let raw = |at: u64, b: &mut [u8]| source::raw_read(&**object, at, b);
                shard.unlock_in_place(off, buf, &raw)?;
                Stats::add(&self.stats.bytes_decoded, buf.len() as u64);
                // Checked after the sealed bytes were fetched: a change before or during
                // the fetch is caught.
                if off + buf.len() as u64 > shard.data_start {
                    object.check_unchanged()?;
                }
            }
        }
        Ok(())
    }

    /// The view bytes `[off, off + out.len())` of a shard into `out`, from `sealed`, its sealed
    /// bytes there (left as they are: a mapping of the sealed file's page cache), as
    /// [`View::unlock_in_place`] makes them from a copy of those bytes in `out`.
    pub fn decode_from(
        &self,
        ino: Ino,
        off: u64,
        sealed: &[u8],
        out: &mut [u8],
    ) -> Result<(), ReadError> {
        let node = self.node(ino).ok_or(ReadError::NotFound)?;
        if off + out.len() as u64 > node.attr.size || sealed.len() != out.len() {
            return Err(ReadError::Io(std::io::Error::other(
                "past the end of the file",
            )));
        }
        let Content::Shard { object, shard } = &node.content else {
            out.copy_from_slice(sealed);
            return self.unlock_in_place(ino, off, out);
        };
        self.decode_shard_from(&**object, shard, off, sealed, out)?;
        // As in `unlock_in_place`: a change of the file before or during the read is caught.
        if off + out.len() as u64 > shard.data_start {
            object.check_unchanged()?;
        }
        Ok(())
    }

    /// A shard's view bytes `[off, off + out.len())` from `sealed`, its sealed bytes there,
    /// counted as decoded (the caller checks the file unchanged after).
    fn decode_shard_from(
        &self,
        object: &dyn Object,
        shard: &Shard,
        off: u64,
        sealed: &[u8],
        out: &mut [u8],
    ) -> Result<(), ReadError> {
        let raw = |at: u64, b: &mut [u8]| source::raw_read(object, at, b);
        shard.decode_from(off, sealed, out, &raw)?;
        Stats::add(&self.stats.bytes_decoded, out.len() as u64);
        Ok(())
    }

    /// Tell the kernel the sealed bytes behind `[off, off + len)` of a file will be read
    /// soon, so the disk reads them while the cores decode what came before (local files).
    pub fn will_read(&self, ino: Ino, off: u64, len: u64) {
        let Ok(Some(object)) = self.sealed_object(ino) else {
            return;
        };
        let Ok(Some(file)) = object.local_file() else {
            return;
        };
        use std::os::fd::AsRawFd;
        // SAFETY: advice on an open descriptor; the kernel reads ahead asynchronously.
        unsafe {
            libc::posix_fadvise(
                file.as_raw_fd(),
                off as libc::off_t,
                len as libc::off_t,
                libc::POSIX_FADV_WILLNEED,
            )
        };
    }

    fn read_unverified(&self, ino: Ino, off: u64, out: &mut [u8]) -> Result<usize, ReadError> {
        let node = self.node(ino).ok_or(ReadError::NotFound)?;
        let len = node.attr.size.saturating_sub(off).min(out.len() as u64) as usize;
        let out = &mut out[..len];
        match &node.content {
            Content::Dir(_) => return Err(ReadError::IsDir),
            _ if len == 0 => {}
            Content::Memory(bytes) => out.copy_from_slice(&bytes[off as usize..off as usize + len]),
            Content::Verbatim(object) => {
                object.read_exact_at(out, off)?;
                // Under a manifest the bytes checked must be the bytes served.
                if node.integrity.is_some() {
                    object.check_unchanged()?;
                }
            }
            Content::Shard { object, shard } => {
                let raw = |at: u64, buf: &mut [u8]| source::raw_read(&**object, at, buf);
                // Sealed bytes in the page cache are decoded where they lie: each read once,
                // and only the bytes asked for (no block of the cache to fill).
                let mapped = object.cached_mapping(off, len as u64).and_then(|map| {
                    map.read(off, len, |sealed| {
                        self.decode_shard_from(&**object, shard, off, sealed, out)
                    })
                });
                match mapped {
                    Some(made) => made?,
                    None => {
                        let done = self.cache.read_shard(ino, shard, off, out, &raw)?;
                        Stats::add(&self.stats.cache_hits, done.hits);
                        Stats::add(&self.stats.cache_misses, done.misses);
                        Stats::add(&self.stats.bytes_decoded, done.bytes);
                    }
                }
                // Bytes decoded from a file rewritten since mounting are wrong: checked
                // after reading, so a change before or during the read is caught.
                let touched_data = off + len as u64 > shard.data_start;
                if touched_data {
                    object.check_unchanged()?;
                }
            }
        }
        Ok(len)
    }

    /// The local file behind a verbatim node (for a passthrough backing file), opened on
    /// first use; `NotFound` when its source has no local file.
    pub fn verbatim_file<'a>(&self, node: &'a Node) -> Result<&'a File, ReadError> {
        let Content::Verbatim(object) = &node.content else {
            return Err(ReadError::NotFound);
        };
        object.local_file()?.ok_or(ReadError::NotFound)
    }

    /// A path-based read, the core's whole contract: bytes `[off, off+len)` of path P.
    pub fn read_path(&self, path: &str, off: u64, len: usize) -> Result<Wiped, ReadError> {
        self.read(self.resolve(path).ok_or(ReadError::NotFound)?, off, len)
    }
}
