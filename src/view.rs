//! The unlocked view: an immutable tree of nodes built at mount time, and reads of any
//! byte range of any file. Nothing here knows about the kernel.

use std::ffi::{OsStr, OsString};
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};
use std::time::SystemTime;

use zeroize::Zeroizing;

use crate::cache::BlockCache;
use crate::secmem::Wiped;
use crate::shard::Shard;
use crate::ReadError;

pub type Ino = u64;
pub const ROOT: Ino = 1;

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

pub enum Content {
    Dir(Vec<(OsString, Ino)>),
    /// A file shown byte for byte as it is on disk, opened on first read; `id` is its
    /// (device, inode) at mount time, so a file or folder swapped in its place is not served.
    Verbatim {
        path: PathBuf,
        file: OnceLock<Arc<File>>,
        id: (u64, u64),
    },
    /// Bytes that exist only in memory: secret files and the metadata file without its
    /// lock flag.
    Memory(Zeroizing<Vec<u8>>),
    /// A locked shard, decoded on read.
    Shard {
        path: PathBuf,
        file: File,
        shard: Shard,
        /// The file as it was at mount time.
        stamp: Stamp,
    },
}

/// The size, modification and change times of a sealed file at mount time: writing to the
/// mounted inode changes the change time even when the writer sets the modification time
/// back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stamp {
    len: u64,
    mtime: (i64, i64),
    /// The change time, which no writer can set back.
    ctime: (i64, i64),
}

impl Stamp {
    pub fn of(file: &File) -> std::io::Result<Stamp> {
        use std::os::unix::fs::MetadataExt;
        let m = file.metadata()?;
        Ok(Stamp {
            len: m.len(),
            mtime: (m.mtime(), m.mtime_nsec()),
            ctime: (m.ctime(), m.ctime_nsec()),
        })
    }

    /// Whether `now` may hold other bytes than `self` where `self`'s bytes were: any
    /// change (stat cannot tell an append, or a rename over the file, from a rewrite).
    pub fn rewritten(&self, now: &Stamp) -> bool {
        now != self
    }
}

pub struct Node {
    pub parent: Ino,
    pub name: OsString,
    pub attr: Attr,
    pub content: Content,
}

/// The whole view: nodes indexed by inode number (`ino - 1`).
pub struct View {
    nodes: Vec<Node>,
    cache: BlockCache,
}

impl View {
    /// `nodes[0]` must be the root directory.
    pub fn new(nodes: Vec<Node>, cache: BlockCache) -> View {
        View { nodes, cache }
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
    /// were written, so a caller can reuse one buffer for every read.
    pub fn read_into(&self, ino: Ino, off: u64, out: &mut [u8]) -> Result<usize, ReadError> {
        let node = self.node(ino).ok_or(ReadError::NotFound)?;
        let len = node.attr.size.saturating_sub(off).min(out.len() as u64) as usize;
        let out = &mut out[..len];
        match &node.content {
            Content::Dir(_) => return Err(ReadError::IsDir),
            _ if len == 0 => {}
            Content::Memory(bytes) => out.copy_from_slice(&bytes[off as usize..off as usize + len]),
            Content::Verbatim { .. } => {
                self.verbatim_file(node)?.read_exact_at(out, off)?;
            }
            Content::Shard {
                file, shard, stamp, ..
            } => {
                let raw = |at: u64, buf: &mut [u8]| file.read_exact_at(buf, at);
                self.cache.read_shard(ino, shard, off, out, &raw)?;
                // Bytes decoded from a file rewritten since mounting are wrong: checked
                // after reading, so a change before or during the read is caught.
                let touched_data = off + len as u64 > shard.data_start;
                if touched_data && stamp.rewritten(&Stamp::of(file)?) {
                    return Err(ReadError::Changed);
                }
            }
        }
        Ok(len)
    }

    /// The open file behind a verbatim node, opened on first use.
    pub fn verbatim_file<'a>(&self, node: &'a Node) -> Result<&'a Arc<File>, ReadError> {
        let Content::Verbatim { path, file, id } = &node.content else {
            return Err(ReadError::NotFound);
        };
        if let Some(f) = file.get() {
            return Ok(f);
        }
        // Not through a link put in the file's place after mounting.
        use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
        let opened = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NOFOLLOW)
            .open(path)?;
        let m = opened.metadata()?;
        if (m.dev(), m.ino()) != *id {
            return Err(ReadError::Changed);
        }
        Ok(file.get_or_init(|| Arc::new(opened)))
    }

    /// A path-based read, the core's whole contract: bytes `[off, off+len)` of path P.
    pub fn read_path(&self, path: &str, off: u64, len: usize) -> Result<Wiped, ReadError> {
        self.read(self.resolve(path).ok_or(ReadError::NotFound)?, off, len)
    }
}
