//! The node cache (`--cache-dir`): sealed bytes of remote objects kept on local disk, so a
//! restart or a second mount on the node does not download them again.
//!
//! Only sealed bytes are kept (locked tensors stay locked; what is plain here is plain in the
//! bucket too). A file holds one part of one object version: its name is derived from the
//! store, the object's path, size, ETag and version, so another version of the object never
//! finds it. Each file ends with the SHA-256 of its part; a file that is short or does not
//! match is deleted and fetched again. The files are kept within a size bound, least recently
//! used out first; a manifest, when there is one, still checks every file's bytes as read.

use std::fs::{self, File, OpenOptions};
use std::io::{Read, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::time::SystemTime;

use bytes::Bytes;
use parking_lot::Mutex;
use sha2::{Digest, Sha256};

use crate::{Error, Result};

/// The folder under `--cache-dir` this layout uses; a later layout takes another name.
const LAYOUT: &str = "kllm-parts-v1";
const DIGEST: usize = 32;

pub struct NodeCache {
    dir: PathBuf,
    bound: u64,
    index: Mutex<Index>,
}

/// The files kept, least recently used first, and their total size.
struct Index {
    lru: lru::LruCache<String, u64>,
    total: u64,
}

impl NodeCache {
    /// Open (or make) the cache under `dir`, bounded to `bound` bytes. Files past the bound
    /// (from a run with a larger one) are removed now.
    pub fn open(dir: &Path, bound: u64, _part_size: u64) -> Result<NodeCache> {
        let root = dir.join(LAYOUT);
        fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&root)
            .map_err(|e| Error::at(dir, format!("cannot make the cache folder ({e})")))?;
        let mut files: Vec<(SystemTime, String, u64)> = Vec::new();
        for e in fs::read_dir(&root)
            .map_err(|e| Error::at(&root, format!("cannot list the cache folder ({e})")))?
            .flatten()
        {
            let name = e.file_name().to_string_lossy().into_owned();
            let Ok(m) = e.metadata() else { continue };
            if !m.is_file() {
                continue;
            }
            if name.starts_with('.') {
                // A part another run was writing when it ended.
                let _ = fs::remove_file(e.path());
                continue;
            }
            files.push((
                m.modified().unwrap_or(SystemTime::UNIX_EPOCH),
                name,
                m.len(),
            ));
        }
        files.sort();
        let mut index = Index {
            lru: lru::LruCache::unbounded(),
            total: 0,
        };
        for (_, name, len) in files {
            index.total += len;
            index.lru.put(name, len);
        }
        let cache = NodeCache {
            dir: root,
            bound,
            index: Mutex::new(index),
        };
        cache.evict(&mut cache.index.lock());
        log::info!(
            "node cache {}: {} bytes in {} files, bound {bound}",
            cache.dir.display(),
            cache.index.lock().total,
            cache.index.lock().lru.len()
        );
        Ok(cache)
    }

    fn file_name(key: &str, idx: u64) -> String {
        let h = Sha256::digest(key.as_bytes());
        format!("{}.{idx}", hex::encode(&h[..20]))
    }

    /// Part `idx` of the object version `key`, when kept whole and intact.
    pub fn get(&self, key: &str, idx: u64, len: usize) -> Option<Bytes> {
        let name = Self::file_name(key, idx);
        let path = self.dir.join(&name);
        let mut f = File::open(&path).ok()?;
        let mut data = Vec::with_capacity(len + DIGEST);
        let intact = f.read_to_end(&mut data).is_ok()
            && data.len() == len + DIGEST
            && Sha256::digest(&data[..len]).as_slice() == &data[len..];
        if !intact {
            log::warn!("{}: damaged cache file; fetching it again", path.display());
            let _ = fs::remove_file(&path);
            let mut ix = self.index.lock();
            if let Some(n) = ix.lru.pop(&name) {
                ix.total -= n;
            }
            return None;
        }
        // Recency survives a restart through the modification time.
        let _ = f.set_modified(SystemTime::now());
        self.index.lock().lru.promote(&name);
        data.truncate(len);
        Some(Bytes::from(data))
    }

    /// Keep part `idx` of the object version `key`.
    pub fn put(&self, key: &str, idx: u64, data: &[u8]) {
        let len = (data.len() + DIGEST) as u64;
        if len > self.bound {
            return;
        }
        let name = Self::file_name(key, idx);
        if let Err(e) = self.write(&name, data) {
            log::warn!(
                "node cache {}: cannot keep a part ({e})",
                self.dir.display()
            );
            return;
        }
        let mut ix = self.index.lock();
        if let Some(old) = ix.lru.put(name, len) {
            ix.total -= old;
        }
        ix.total += len;
        self.evict(&mut ix);
    }

    fn write(&self, name: &str, data: &[u8]) -> std::io::Result<()> {
        let tmp = self.dir.join(format!(
            ".{name}.{}.{:?}",
            std::process::id(),
            std::thread::current().id()
        ));
        let mut f = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&tmp)?;
        let written = f
            .write_all(data)
            .and_then(|_| f.write_all(&Sha256::digest(data)));
        drop(f);
        match written.and_then(|_| fs::rename(&tmp, self.dir.join(name))) {
            Ok(()) => Ok(()),
            Err(e) => {
                let _ = fs::remove_file(&tmp);
                Err(e)
            }
        }
    }

    fn evict(&self, ix: &mut Index) {
        while ix.total > self.bound {
            let Some((name, len)) = ix.lru.pop_lru() else {
                break;
            };
            ix.total -= len;
            let _ = fs::remove_file(self.dir.join(name));
        }
    }

    /// Bytes kept now.
    pub fn size(&self) -> u64 {
        self.index.lock().total
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parts_come_back_intact_or_not_at_all() {
        let dir = tempfile::tempdir().unwrap();
        let c = NodeCache::open(dir.path(), 1 << 20, 1024).unwrap();
        c.put("obj\netag1", 0, b"hello");
        assert_eq!(c.get("obj\netag1", 0, 5).as_deref(), Some(&b"hello"[..]));
        // Another version, another part, another length: not found.
        assert!(c.get("obj\netag2", 0, 5).is_none());
        assert!(c.get("obj\netag1", 1, 5).is_none());
        // A damaged file is dropped.
        let name = NodeCache::file_name("obj\netag1", 0);
        let path = dir.path().join(LAYOUT).join(&name);
        let mut bytes = fs::read(&path).unwrap();
        bytes[1] ^= 1;
        fs::write(&path, bytes).unwrap();
        assert!(c.get("obj\netag1", 0, 5).is_none());
        assert!(!path.exists());
        // So is one of another length than asked.
        c.put("obj\netag1", 0, b"hello");
        assert!(c.get("obj\netag1", 0, 4).is_none());
        assert_eq!(c.size(), 0);
    }

    #[test]
    fn the_bound_holds_and_survives_a_reopen() {
        let dir = tempfile::tempdir().unwrap();
        let part = vec![7u8; 1000];
        let c = NodeCache::open(dir.path(), 3 * 1032, 1000).unwrap();
        for i in 0..5 {
            c.put("k", i, &part);
        }
        assert_eq!(c.size(), 3 * 1032);
        assert!(c.get("k", 0, 1000).is_none());
        assert!(c.get("k", 4, 1000).is_some());
        drop(c);
        let c = NodeCache::open(dir.path(), 1032, 1000).unwrap();
        assert_eq!(c.size(), 1032);
    }
}
