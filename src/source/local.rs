//! A sealed directory on a local file system.
//!
//! Links are followed only when they stay inside the directory and only to a file: a
//! folder a link points to is shown where it lives, so nothing is shown twice and nothing
//! outside the sealed directory is served. A file is identified by its (device, inode) when
//! opened, so a file or folder swapped in its place later is not served.

use std::collections::HashSet;
use std::fs::{self, File, Metadata};
use std::os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, UNIX_EPOCH};

use super::{Attr, Kind};
use super::{Entry, Object, Source};
use crate::guarded_map::GuardedMap;
use crate::{Error, ReadError, Result};

pub struct LocalDir {
    root: PathBuf,
    canon_root: PathBuf,
}

impl LocalDir {
    pub fn new(root: &Path) -> Result<LocalDir> {
        if !root.is_dir() {
            return Err(Error::at(root, "is not a directory"));
        }
        let canon_root =
            fs::canonicalize(root).map_err(|e| Error::at(root, format!("cannot resolve ({e})")))?;
        Ok(LocalDir {
            root: root.to_path_buf(),
            canon_root,
        })
    }

    pub fn root(&self) -> &Path {
        &self.root
    }
}

impl Source for LocalDir {
    fn describe(&self) -> String {
        self.root.display().to_string()
    }

    fn at(&self, rel: &Path) -> PathBuf {
        if rel.as_os_str().is_empty() {
            self.root.clone()
        } else {
            self.root.join(rel)
        }
    }

    fn list(&self) -> Result<Vec<Entry>> {
        let root_meta = fs::metadata(&self.root)
            .map_err(|e| Error::at(&self.root, format!("cannot stat ({e})")))?;
        let mut walk = Walk {
            canon_root: &self.canon_root,
            visited: HashSet::from([self.canon_root.clone()]),
            out: vec![Entry {
                path: PathBuf::new(),
                content_path: PathBuf::new(),
                attr: attr_of(&root_meta, Kind::Dir, 0),
            }],
        };
        walk.dir(&self.root, Path::new(""))?;
        Ok(walk.out)
    }

    fn stat(&self, rel: &Path) -> Result<Option<Entry>> {
        // Under folders as the walk enters them: not through a link.
        let mut dir = self.root.clone();
        let mut parts = rel.components().peekable();
        while let Some(part) = parts.next() {
            let path = dir.join(part);
            if parts.peek().is_none() {
                let Some(r) = resolve(&self.canon_root, &path, rel, false)? else {
                    return Ok(None);
                };
                let kind = if r.meta.is_dir() {
                    Kind::Dir
                } else if r.meta.is_file() {
                    Kind::File
                } else {
                    return Ok(None);
                };
                let size = if kind == Kind::File { r.meta.len() } else { 0 };
                return Ok(Some(Entry {
                    path: rel.to_path_buf(),
                    content_path: r.content_path,
                    attr: attr_of(&r.meta, kind, size),
                }));
            }
            match fs::symlink_metadata(&path) {
                Ok(m) if m.is_dir() => dir = path,
                _ => return Ok(None),
            }
        }
        Ok(None)
    }

    fn open(&self, rel: &Path) -> Result<Arc<dyn Object>> {
        let path = self.canon_root.join(rel);
        let m = fs::metadata(&path)
            .map_err(|e| Error::at(&self.at(rel), format!("cannot stat ({e})")))?;
        Ok(Arc::new(LocalFile {
            path,
            id: (m.dev(), m.ino()),
            stamp: Stamp::from_meta(&m),
            file: OnceLock::new(),
            map: OnceLock::new(),
        }))
    }
}

/// The walk over the directory: what every level needs, held once.
struct Walk<'a> {
    canon_root: &'a Path,
    /// Directories already listed, so a loop (a bind mount) is listed once.
    visited: HashSet<PathBuf>,
    out: Vec<Entry>,
}

/// Where a directory entry's bytes live: the entry itself, or a link's target.
struct Resolved {
    real: PathBuf,
    meta: Metadata,
    content_path: PathBuf,
}

impl Walk<'_> {
    fn dir(&mut self, dir: &Path, rel_dir: &Path) -> Result<()> {
        let mut entries: Vec<_> = fs::read_dir(dir)
            .map_err(|e| Error::at(dir, format!("cannot list ({e})")))?
            .collect::<std::io::Result<_>>()
            .map_err(|e| Error::at(dir, format!("cannot list ({e})")))?;
        entries.sort_by_key(|e| e.file_name());
        for entry in entries {
            let path = entry.path();
            let rel = rel_dir.join(entry.file_name());
            let Some(Resolved {
                real,
                meta,
                content_path,
            }) = resolve(self.canon_root, &path, &rel, true)?
            else {
                continue;
            };
            if meta.is_dir() {
                let canon = fs::canonicalize(&real)
                    .map_err(|e| Error::at(&path, format!("cannot resolve ({e})")))?;
                if !self.visited.insert(canon) {
                    log::warn!(
                        "{}: directory already shown (link loop); not shown again",
                        path.display()
                    );
                    continue;
                }
                self.out.push(Entry {
                    path: rel.clone(),
                    content_path,
                    attr: attr_of(&meta, Kind::Dir, 0),
                });
                self.dir(&real, &rel)?;
            } else if meta.is_file() {
                self.out.push(Entry {
                    path: rel,
                    content_path,
                    attr: attr_of(&meta, Kind::File, meta.len()),
                });
            } else {
                log::warn!(
                    "{}: not a regular file or directory; not shown",
                    path.display()
                );
            }
        }
        Ok(())
    }
}

/// Follow a link only when it stays inside the directory, and only to a file.
/// `None`: the entry is not shown (with a warning when `warn`).
fn resolve(canon_root: &Path, path: &Path, rel: &Path, warn: bool) -> Result<Option<Resolved>> {
    let lmeta = match fs::symlink_metadata(path) {
        Ok(m) => m,
        Err(e) if !warn && e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(Error::at(path, format!("cannot stat ({e})"))),
    };
    if !lmeta.file_type().is_symlink() {
        return Ok(Some(Resolved {
            real: path.to_path_buf(),
            meta: lmeta,
            content_path: rel.to_path_buf(),
        }));
    }
    let target = match fs::canonicalize(path) {
        Ok(t) => t,
        Err(e) => {
            if warn {
                log::warn!(
                    "{}: dangling symbolic link ({e}); not shown",
                    path.display()
                );
            }
            return Ok(None);
        }
    };
    let Ok(target_rel) = target.strip_prefix(canon_root).map(Path::to_path_buf) else {
        if warn {
            log::warn!(
                "{}: symbolic link to {} leaves the sealed directory; not shown",
                path.display(),
                target.display()
            );
        }
        return Ok(None);
    };
    let meta = fs::metadata(&target)
        .map_err(|e| Error::at(path, format!("cannot stat link target ({e})")))?;
    if meta.is_dir() {
        if warn {
            log::warn!(
                "{}: symbolic link to a folder; not followed",
                path.display()
            );
        }
        return Ok(None);
    }
    Ok(Some(Resolved {
        real: target,
        meta,
        content_path: target_rel,
    }))
}

fn attr_of(meta: &Metadata, kind: Kind, size: u64) -> Attr {
    let t = |secs: i64, nsecs: i64| {
        if secs >= 0 {
            UNIX_EPOCH + Duration::new(secs as u64, nsecs as u32)
        } else {
            UNIX_EPOCH
        }
    };
    Attr {
        kind,
        size,
        perm: (meta.mode() & 0o7777) as u16,
        uid: meta.uid(),
        gid: meta.gid(),
        atime: t(meta.atime(), meta.atime_nsec()),
        mtime: t(meta.mtime(), meta.mtime_nsec()),
        ctime: t(meta.ctime(), meta.ctime_nsec()),
    }
}

/// A file of the directory, opened on its first read.
struct LocalFile {
    path: PathBuf,
    /// (device, inode) when opened.
    id: (u64, u64),
    /// The file as it was when opened.
    stamp: Stamp,
    file: OnceLock<File>,
    /// The file mapped on the first read that finds its bytes in the page cache (`None`
    /// where it cannot be).
    map: OnceLock<Option<GuardedMap>>,
}

impl LocalFile {
    fn file(&self) -> Result<&File, ReadError> {
        if let Some(f) = self.file.get() {
            return Ok(f);
        }
        // Not through a link put in the file's place after it was listed.
        let opened = fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&self.path)?;
        let m = opened.metadata()?;
        if (m.dev(), m.ino()) != self.id {
            return Err(ReadError::Changed);
        }
        Ok(self.file.get_or_init(|| opened))
    }
}

impl Object for LocalFile {
    fn len(&self) -> u64 {
        self.stamp.len
    }

    fn read_exact_at(&self, buf: &mut [u8], off: u64) -> Result<(), ReadError> {
        Ok(self.file()?.read_exact_at(buf, off)?)
    }

    /// Read through the page cache (where the reads to come find the bytes) a piece at a
    /// time, as decode ahead reads a disk: each piece once others have left the disk quiet
    /// (an engine importing reads it too), after at most a short wait.
    fn fetch_ahead(&self, off: u64, len: u64) -> u64 {
        use crate::fill::BACKGROUND_PIECE;
        let Ok(file) = self.file() else {
            return 0;
        };
        let end = off.saturating_add(len).min(self.len());
        let share = crate::disk_share::DiskShare::of(file);
        let mut piece = vec![0u8; BACKGROUND_PIECE.min(end.saturating_sub(off) as usize)];
        let mut at = off;
        while at < end {
            if let Some(share) = &share {
                share.wait_quiet();
            }
            let n = (end - at).min(piece.len() as u64) as usize;
            if let Err(e) = file.read_exact_at(&mut piece[..n], at) {
                log::debug!("{}: not read ahead past {at}: {e}", self.path.display());
                break;
            }
            at += n as u64;
        }
        at.saturating_sub(off)
    }

    fn check_unchanged(&self) -> Result<(), ReadError> {
        let now = Stamp::from_meta(&self.file()?.metadata()?);
        if now != self.stamp {
            return Err(ReadError::Changed);
        }
        Ok(())
    }

    fn local_file(&self) -> Result<Option<&File>, ReadError> {
        self.file().map(Some)
    }

    fn cached_mapping(&self, off: u64, len: u64) -> Option<&GuardedMap> {
        let file = self.file().ok()?;
        if !all_cached(file, off, len) {
            return None;
        }
        let map = self
            .map
            .get_or_init(|| GuardedMap::new(file, self.stamp.len));
        map.as_ref().filter(|m| !m.failed())
    }
}

/// The size, modification and change times of a file: writing to the mounted inode changes
/// the change time even when the writer sets the modification time back. Any change counts
/// (stat cannot tell an append, or a rename over the file, from a rewrite).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Stamp {
    len: u64,
    mtime: (i64, i64),
    /// The change time, which no writer can set back.
    ctime: (i64, i64),
}

impl Stamp {
    fn from_meta(m: &Metadata) -> Stamp {
        Stamp {
            len: m.len(),
            mtime: (m.mtime(), m.mtime_nsec()),
            ctime: (m.ctime(), m.ctime_nsec()),
        }
    }
}

/// Whether at least half of `[off, off + len)` of `file` is in the page cache (`cachestat`,
/// Linux 6.5+); if it cannot say, no.
pub(crate) fn mostly_cached(file: &File, off: u64, len: u64) -> bool {
    cached_pages(file, off, len).is_some_and(|(cached, _)| cached * 4096 >= len / 2)
}

/// Whether every page of `[off, off + len)` of `file` is in the page cache: a reader of its
/// mapping then never waits for the disk page by page.
pub(crate) fn all_cached(file: &File, off: u64, len: u64) -> bool {
    cached_pages(file, off, len).is_some_and(|(cached, pages)| cached >= pages)
}

/// The pages of `[off, off + len)` of `file` in the page cache, and all its pages
/// (`cachestat`, Linux 6.5+); `None` if it cannot say.
fn cached_pages(file: &File, off: u64, len: u64) -> Option<(u64, u64)> {
    use std::os::fd::AsRawFd;
    #[repr(C)]
    struct Range {
        off: u64,
        len: u64,
    }
    #[repr(C)]
    #[derive(Default)]
    struct Cachestat {
        nr_cache: u64,
        nr_dirty: u64,
        nr_writeback: u64,
        nr_evicted: u64,
        nr_recently_evicted: u64,
    }
    // The number of cachestat on every architecture (new calls share one table).
    const SYS_CACHESTAT: libc::c_long = 451;
    let range = Range { off, len };
    let mut st = Cachestat::default();
    // SAFETY: cachestat reads `range` and writes `st`, both valid for the call.
    let r = unsafe {
        libc::syscall(
            SYS_CACHESTAT,
            file.as_raw_fd(),
            &range as *const Range,
            &mut st as *mut Cachestat,
            0,
        )
    };
    let pages = (off + len).div_ceil(4096) - off / 4096;
    (r == 0).then_some((st.nr_cache, pages))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;

    /// `stat` of a path answers as the walk does: links inside to files followed, to
    /// folders, dangling or leaving the root not shown.
    #[test]
    fn stat_agrees_with_list() {
        let outside = tempfile::tempdir().unwrap();
        std::fs::write(outside.path().join("far"), b"x").unwrap();
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        std::fs::create_dir(root.join("sub")).unwrap();
        std::fs::write(root.join("sub/a"), b"abc").unwrap();
        symlink("sub/a", root.join("to_file")).unwrap();
        symlink("sub", root.join("to_dir")).unwrap();
        symlink("nowhere", root.join("dangling")).unwrap();
        symlink(outside.path().join("far"), root.join("escapes")).unwrap();
        let src = LocalDir::new(root).unwrap();
        let listed = src.list().unwrap();
        let paths: Vec<_> = listed.iter().map(|e| e.path.clone()).collect();
        assert_eq!(
            paths,
            ["", "sub", "sub/a", "to_file"].map(PathBuf::from).to_vec()
        );
        for name in [
            "sub", "sub/a", "to_file", "to_dir", "dangling", "escapes", "missing",
        ] {
            let got = src.stat(Path::new(name)).unwrap();
            let want = listed.iter().find(|e| e.path == Path::new(name));
            assert_eq!(
                got.as_ref()
                    .map(|e| (&e.content_path, e.attr.kind, e.attr.size)),
                want.map(|e| (&e.content_path, e.attr.kind, e.attr.size)),
                "{name}"
            );
        }
        let link = src.stat(Path::new("to_file")).unwrap().unwrap();
        assert_eq!(link.content_path, Path::new("sub/a"));
        let obj = src.open(&link.content_path).unwrap();
        let mut buf = [0u8; 3];
        obj.read_exact_at(&mut buf, 0).unwrap();
        assert_eq!((&buf, obj.len()), (b"abc", 3));
        obj.check_unchanged().unwrap();
        std::fs::write(root.join("sub/a"), b"abcd").unwrap();
        assert!(matches!(obj.check_unchanged(), Err(ReadError::Changed)));
    }

    /// Reads find the file's bytes mapped while the page cache holds them; a file cut short
    /// under the mapping faults there once, and is read by `pread` from then on.
    #[test]
    fn cached_bytes_are_lent_mapped_until_a_page_faults() {
        let dir = tempfile::tempdir().unwrap();
        let bytes: Vec<u8> = (0..256u32 << 10).map(|i| (i % 253) as u8).collect();
        std::fs::write(dir.path().join("f"), &bytes).unwrap();
        let object = LocalDir::new(dir.path())
            .unwrap()
            .open(Path::new("f"))
            .unwrap();
        let map = object
            .cached_mapping(0, 64 << 10)
            .expect("written just now: cached");
        let same = map.read(4096, 8192, |b| b == &bytes[4096..4096 + 8192]);
        assert_eq!(same, Some(true));
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(dir.path().join("f"))
            .unwrap();
        f.set_len(64 << 10).unwrap();
        assert_eq!(map.read(128 << 10, 4096, |b| b[0]), None, "past the cut");
        assert!(
            object.cached_mapping(0, 4096).is_none(),
            "a mapping that faulted"
        );
        let mut buf = [0u8; 16];
        assert!(
            object.read_exact_at(&mut buf, 0).is_ok(),
            "pread before the cut"
        );
    }

    /// A fill's decode reads the same mapping: a file cut short while a decode reads it
    /// faults there, the decode is refused, and so is every range after (before the cut too);
    /// `pread` then tells the truth (a short file).
    #[test]
    fn a_file_cut_short_inside_a_mapped_read_refuses_it_and_every_read_after() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        let bytes: Vec<u8> = (0..256u32 << 10).map(|i| (i % 251) as u8).collect();
        std::fs::write(&path, &bytes).unwrap();
        let object = LocalDir::new(dir.path())
            .unwrap()
            .open(Path::new("f"))
            .unwrap();
        let copy = |sealed: &[u8], out: &mut [u8]| out.copy_from_slice(sealed);
        let mut out = vec![0u8; 128 << 10];
        let map = object.cached_mapping(4096, 128 << 10).expect("cached");
        assert_eq!(map.read(4096, 128 << 10, |s| copy(s, &mut out)), Some(()));
        assert!(out[..] == bytes[4096..4096 + (128 << 10)]);
        let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
        let map = object.cached_mapping(0, 128 << 10).expect("cached");
        let cut_and_copy = |sealed: &[u8]| {
            f.set_len(64 << 10).unwrap();
            copy(sealed, &mut out);
        };
        assert_eq!(map.read(0, 128 << 10, cut_and_copy), None);
        assert_eq!(
            map.read(0, 4096, |s| s[0]),
            None,
            "before the cut, after a fault"
        );
        assert!(
            object.cached_mapping(0, 4096).is_none(),
            "a mapping that faulted"
        );
        let mut buf = vec![0u8; 64 << 10];
        assert!(
            object.read_exact_at(&mut buf, 128 << 10).is_err(),
            "read past the cut"
        );
        assert!(
            object.read_exact_at(&mut buf, 0).is_ok(),
            "read before the cut"
        );
    }
}
