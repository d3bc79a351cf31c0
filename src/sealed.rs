//! Recognize a sealed directory and build its unlocked view.

use std::collections::{BTreeMap, HashSet};
use std::ffi::OsString;
use std::fs::{self, File, Metadata};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, UNIX_EPOCH};

use serde_json::Value;
use sha2::{Digest, Sha256};
use zeroize::Zeroizing;

use crate::blob;
use crate::cache::BlockCache;
use crate::key::{ModelKey, SHIPPED_KEY};
use crate::lock::Version;
use crate::manifest::{self, Manifest};
use crate::metrics::Stats;
use crate::pyjson;
use crate::shard::{Shard, LOCK_META};
use crate::view::{Attr, Content, Ino, Integrity, Kind, Node, Stamp, View, ROOT};
use crate::{Error, Result};

/// Pipelines keep their seal metadata here; LLMs in the `kllm` object of `config.json`.
pub const PIPELINE_META: &str = "kllm.json";
pub const LLM_META: &str = "config.json";
/// Component folders that stay with the user in client mode and are never locked.
const UNLOCKED_DIRS: [&str; 3] = ["tokenizer", "processor", "vae"];

/// The seal metadata of a directory.
#[derive(Debug, Clone)]
pub struct Seal {
    pub root: PathBuf,
    /// `kllm.json` or `config.json`.
    pub meta_file: PathBuf,
    /// That file as read once: the seal metadata, the view's copy and its manifest check
    /// all come from these bytes.
    pub meta_text: String,
    pub pipeline: bool,
    pub scheme: String,
    pub fingerprint: String,
    pub lock: Option<Version>,
}

fn read_json_object(path: &Path) -> Result<(String, serde_json::Map<String, Value>)> {
    let text =
        fs::read_to_string(path).map_err(|e| Error::at(path, format!("cannot read ({e})")))?;
    match serde_json::from_str(&text) {
        Ok(Value::Object(m)) => Ok((text, m)),
        Ok(_) => Err(Error::at(path, "is not a JSON object")),
        Err(e) => Err(Error::at(path, format!("is not valid JSON ({e})"))),
    }
}

impl Seal {
    /// Read the seal metadata of `root`, refusing what this mount cannot serve.
    pub fn read(root: &Path) -> Result<Seal> {
        if !root.is_dir() {
            return Err(Error::at(root, "is not a directory"));
        }
        let pipeline_meta = root.join(PIPELINE_META);
        let llm_meta = root.join(LLM_META);
        let (meta_file, meta_text, pipeline, meta) = if pipeline_meta.is_file() {
            let (text, doc) = read_json_object(&pipeline_meta)?;
            (pipeline_meta, text, true, doc)
        } else if llm_meta.is_file() {
            let (text, doc) = read_json_object(&llm_meta)?;
            match doc.get("kllm") {
                Some(Value::Object(k)) => (llm_meta, text, false, k.clone()),
                _ => {
                    return Err(Error::at(
                        root,
                        "is not a sealed kLLM directory: config.json has no \"kllm\" seal metadata and there is no kllm.json",
                    ))
                }
            }
        } else {
            return Err(Error::at(
                root,
                "is not a sealed kLLM directory: no kllm.json and no config.json with \"kllm\" seal metadata",
            ));
        };
        let text_field = |name: &str| -> Result<String> {
            meta.get(name)
                .and_then(Value::as_str)
                .map(str::to_string)
                .ok_or_else(|| Error::at(&meta_file, format!("seal metadata has no \"{name}\"")))
        };
        let scheme = text_field("scheme")?;
        match scheme.as_str() {
            "l1" | "client" => {}
            "d1-v1" => {
                return Err(Error::at(
                    &meta_file,
                    "scheme d1-v1 keeps trusted tensors outside the weights and is served only by `kllm demo`; kllm-mount cannot show it",
                ))
            }
            other => return Err(Error::at(&meta_file, format!("unknown seal scheme {other:?} (kllm-mount reads l1 and client)"))),
        }
        let fingerprint = text_field("fingerprint")?;
        let lock = match meta.get("lock") {
            None | Some(Value::Null) => None,
            Some(Value::String(v)) => Some(Version::parse(v).ok_or_else(|| {
                Error::at(
                    &meta_file,
                    format!("lock version {v} is not supported (this kllm-mount reads v1 and v2)"),
                )
            })?),
            Some(other) => {
                return Err(Error::at(
                    &meta_file,
                    format!(
                        "lock version {other} is not supported (this kllm-mount reads v1 and v2)"
                    ),
                ))
            }
        };
        Ok(Seal {
            root: root.to_path_buf(),
            meta_file,
            meta_text,
            pipeline,
            scheme,
            fingerprint,
            lock,
        })
    }

    /// Refuse a key of another fingerprint, before anything is decrypted.
    pub fn check_key(&self, key: &ModelKey, source: &dyn std::fmt::Display) -> Result<()> {
        let ours = key.fingerprint();
        if ours != self.fingerprint {
            return Err(Error::at(
                &self.meta_file,
                format!(
                    "sealed under key fingerprint {}, but the key from {source} has fingerprint {ours}",
                    self.fingerprint
                ),
            ));
        }
        Ok(())
    }

    /// The metadata file as the view shows it: the same text without the lock member.
    pub fn unlocked_meta_text(&self) -> Result<Option<String>> {
        if self.lock.is_none() {
            return Ok(None);
        }
        let within = if self.pipeline { None } else { Some("kllm") };
        pyjson::without_member(&self.meta_text, within, "lock")
            .map(Some)
            .ok_or_else(|| {
                Error::at(
                    &self.meta_file,
                    "cannot remove the lock flag (not a JSON object)",
                )
            })
    }
}

/// Whether a shard at `rel` may be locked: kLLM locks safetensors outside the user-side
/// component folders and any `.cache`.
pub fn is_lockable(rel: &Path) -> bool {
    let parts: Vec<&str> = rel.iter().filter_map(|p| p.to_str()).collect();
    rel.extension().is_some_and(|e| e == "safetensors")
        && parts.first().is_some_and(|p| !UNLOCKED_DIRS.contains(p))
        && !parts.contains(&".cache")
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

/// Nodes under construction: children kept by name until the tree is frozen.
struct Builder {
    nodes: Vec<Node>,
    children: Vec<BTreeMap<OsString, Ino>>,
}

impl Builder {
    fn add(&mut self, parent: Ino, name: OsString, attr: Attr, content: Content) -> Ino {
        let ino = self.nodes.len() as Ino + 1;
        self.nodes.push(Node {
            parent,
            name: name.clone(),
            attr,
            content,
            integrity: None,
        });
        // One (possibly empty) child map per node, indexed like `nodes`.
        self.children.push(BTreeMap::new());
        if ino != ROOT {
            self.children[parent as usize - 1].insert(name, ino);
        }
        ino
    }

    fn finish(mut self, cache: BlockCache) -> View {
        for (i, kids) in self.children.into_iter().enumerate() {
            if let Content::Dir(entries) = &mut self.nodes[i].content {
                *entries = kids.into_iter().collect();
            }
        }
        // Verdicts given at mount count like the later ones.
        let stats = Stats::new();
        for node in &self.nodes {
            match node.integrity.as_ref().and_then(Integrity::verdict) {
                Some(Ok(())) => {
                    Stats::add(&stats.verified_files, 1);
                    Stats::add(&stats.verified_bytes, node.attr.size);
                }
                Some(Err(why)) => {
                    Stats::add(&stats.failed_files, 1);
                    log::error!("{why}; its opens and reads fail with EIO");
                }
                None => {}
            }
        }
        View::new(self.nodes, cache, stats)
    }
}

/// When files are checked against the manifest.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum Verify {
    /// Each file on its first use, before its first byte is served.
    #[default]
    Open,
    /// Every file before the mount answers.
    Mount,
    /// Never.
    Off,
}

/// Everything a mount needs to know, fixed at mount time.
pub struct Options {
    pub cache_bytes: u64,
    pub block_size: u64,
    pub verify: Verify,
    /// A manifest from elsewhere; by default `kllm-manifest.json` in the sealed directory.
    pub manifest: Option<PathBuf>,
    /// Refuse to mount unless the manifest's SHA-256 is this (hex).
    pub manifest_sha256: Option<String>,
}

impl Options {
    /// A cache of `cache_bytes` in blocks sized for it.
    pub fn with_cache(cache_bytes: u64) -> Options {
        Options {
            cache_bytes,
            block_size: BlockCache::block_size_for(cache_bytes),
            verify: Verify::Open,
            manifest: None,
            manifest_sha256: None,
        }
    }
}

impl Default for Options {
    fn default() -> Self {
        Options::with_cache(256 << 20)
    }
}

/// Open a sealed directory for serving: read its seal metadata, refuse a key of another
/// fingerprint before anything is decrypted, and build its view. `key_source` names where
/// the key came from, for the error.
pub fn open(
    root: &Path,
    key: &ModelKey,
    key_source: &dyn std::fmt::Display,
    opts: &Options,
) -> Result<View> {
    let seal = Seal::read(root)?;
    seal.check_key(key, key_source)?;
    let manifest = load_manifest(root, opts)?;
    let view = build(&seal, key, opts, manifest.as_ref())?;
    if manifest.is_some() && opts.verify == Verify::Mount {
        verify_now(&view)?;
    }
    log::info!(
        "{}: {} nodes, lock {}, cache {} bytes, manifest {}",
        root.display(),
        view.len(),
        seal.lock.map_or("none", |v| v.label()),
        view.cache().capacity_bytes(),
        manifest
            .as_ref()
            .map_or("none".into(), |m| m.path().display().to_string())
    );
    Ok(view)
}

/// The manifest to check files against: `--manifest`, else the sealed directory's own,
/// pinned to `--manifest-sha256` when given. Every file it lists must exist.
fn load_manifest(root: &Path, opts: &Options) -> Result<Option<Manifest>> {
    if opts.verify == Verify::Off {
        return Ok(None);
    }
    let path = match &opts.manifest {
        Some(p) => Some(p.clone()),
        None => Some(root.join(manifest::FILE_NAME)).filter(|p| p.exists()),
    };
    let Some(path) = path else {
        if opts.manifest_sha256.is_some() {
            return Err(Error::at(
                root,
                format!(
                    "--manifest-sha256 is given, but there is no {} (give --manifest FILE)",
                    manifest::FILE_NAME
                ),
            ));
        }
        return Ok(None);
    };
    let manifest = Manifest::load(&path)?;
    if let Some(pin) = &opts.manifest_sha256 {
        manifest.check_pin(pin)?;
    }
    for (rel, _) in manifest.files() {
        let p = root.join(rel);
        match fs::metadata(&p) {
            Ok(m) if m.is_file() => {}
            Ok(_) => {
                return Err(Error::at(
                    &p,
                    format!("is listed in {} but is not a file", path.display()),
                ))
            }
            Err(e) => {
                return Err(Error::at(
                    &p,
                    format!("is listed in {} but missing ({e})", path.display()),
                ))
            }
        }
    }
    Ok(Some(manifest))
}

/// `--verify mount`: hash every file under the manifest on all cores, and refuse the mount
/// naming the first (by path) that differs.
fn verify_now(view: &View) -> Result<()> {
    use rayon::prelude::*;
    let files: Vec<(String, Ino)> = view
        .file_paths()
        .into_iter()
        .filter(|(_, ino)| view.node(*ino).is_some_and(|n| n.integrity.is_some()))
        .collect();
    let total: u64 = files
        .iter()
        .map(|(_, i)| view.node(*i).map_or(0, |n| n.attr.size))
        .sum();
    let progress = crate::progress::Progress::new("verifying");
    let done = std::sync::atomic::AtomicU64::new(0);
    let results: Vec<_> = files
        .par_iter()
        .map(|(_, ino)| {
            let r = view.verify(*ino);
            let size = view.node(*ino).map_or(0, |n| n.attr.size);
            let now = done.fetch_add(size, std::sync::atomic::Ordering::Relaxed) + size;
            progress.update(now, total);
            r
        })
        .collect();
    progress.finish();
    for ((rel, _), r) in files.iter().zip(results) {
        if let Err(e) = r {
            return Err(Error::new(format!(
                "{rel}: {e}; refusing to mount (--verify mount)"
            )));
        }
    }
    Ok(())
}

/// The view of a sealed directory whose key was checked. Reads the seal metadata, every
/// lockable shard's header and `trusted.kllm`; tensor data is left for reads.
fn build(seal: &Seal, key: &ModelKey, opts: &Options, manifest: Option<&Manifest>) -> Result<View> {
    let root = &seal.root;
    let canon_root =
        fs::canonicalize(root).map_err(|e| Error::at(root, format!("cannot resolve ({e})")))?;
    let root_meta =
        fs::metadata(root).map_err(|e| Error::at(root, format!("cannot stat ({e})")))?;
    let mut walker = Walker {
        seal,
        key,
        manifest,
        visited: HashSet::from([canon_root.clone()]),
        canon_root,
        b: Builder {
            nodes: Vec::new(),
            children: Vec::new(),
        },
    };
    walker.b.add(
        ROOT,
        OsString::new(),
        attr_of(&root_meta, Kind::Dir, 0),
        Content::Dir(Vec::new()),
    );
    walker.walk(root, Path::new(""), ROOT)?;
    let mut b = walker.b;

    // The metadata file without its lock flag, checked as the bytes the seal was read from.
    let meta_name = seal.meta_file.file_name().expect("a file name");
    if let Some(text) = seal.unlocked_meta_text()? {
        if let Some(&ino) = b.children[0].get(meta_name) {
            let node = &mut b.nodes[ino as usize - 1];
            node.attr.size = text.len() as u64;
            node.content = Content::Memory(Zeroizing::new(text.into_bytes()));
            node.integrity = node.integrity.take().map(|i| {
                let got = Sha256::digest(seal.meta_text.as_bytes()).into();
                Integrity::decided(i.listed_as, i.want, got)
            });
        }
    }

    // The secret files of trusted.kllm, at their paths; under a manifest only when it lists
    // the blob, each checked as the blob's bytes.
    let blob_path = root.join(blob::FILE_NAME);
    if blob_path.is_file() {
        let blob_meta = fs::metadata(&blob_path)
            .map_err(|e| Error::at(&blob_path, format!("cannot stat ({e})")))?;
        let data = blob::read_bytes(&blob_path)?;
        let files = blob::secret_files(&blob_path, &blob::open(&blob_path, &data, key)?)?;
        let integrity = match manifest {
            None => Some(None),
            Some(m) => m
                .digest(blob::FILE_NAME)
                .map(|want| Some((want, <[u8; 32]>::from(Sha256::digest(&data))))),
        };
        match integrity {
            None => log::warn!(
                "{}: not listed in the manifest; its secret files are not shown",
                blob_path.display()
            ),
            Some(check) => {
                for (rel, data) in files {
                    crate::secmem::lock_slice(&data);
                    let ino = add_secret_file(&mut b, &blob_path, &blob_meta, &rel, data)?;
                    b.nodes[ino as usize - 1].integrity = check.map(|(want, got)| {
                        Integrity::decided(blob::FILE_NAME.to_string(), want, got)
                    });
                }
            }
        }
    }
    Ok(b.finish(BlockCache::new(opts.cache_bytes, opts.block_size)))
}

fn add_secret_file(
    b: &mut Builder,
    blob_path: &Path,
    blob_meta: &Metadata,
    rel: &str,
    data: Zeroizing<Vec<u8>>,
) -> Result<Ino> {
    let parts: Vec<&str> = rel.split('/').collect();
    let mut dir = ROOT;
    for part in &parts[..parts.len() - 1] {
        let name = OsString::from(part);
        dir = match b.children[dir as usize - 1].get(&name) {
            Some(&ino) if b.nodes[ino as usize - 1].attr.kind == Kind::Dir => ino,
            Some(_) => {
                return Err(Error::at(
                    blob_path,
                    format!("secret file {rel:?} lies under a file of the same name"),
                ))
            }
            None => {
                let mut attr = attr_of(blob_meta, Kind::Dir, 0);
                attr.perm = 0o755;
                b.add(dir, name, attr, Content::Dir(Vec::new()))
            }
        };
    }
    let name = OsString::from(parts[parts.len() - 1]);
    let attr = attr_of(blob_meta, Kind::File, data.len() as u64);
    match b.children[dir as usize - 1].get(&name) {
        Some(&ino) if b.nodes[ino as usize - 1].attr.kind == Kind::Dir => Err(Error::at(
            blob_path,
            format!("secret file {rel:?} has the name of a directory"),
        )),
        Some(&ino) => {
            log::warn!(
                "{}: secret file {rel} replaces the file of the same name",
                blob_path.display()
            );
            let node = &mut b.nodes[ino as usize - 1];
            node.attr = attr;
            node.content = Content::Memory(data);
            Ok(ino)
        }
        None => Ok(b.add(dir, name, attr, Content::Memory(data))),
    }
}

/// A path as the manifest writes it: relative, `/` between parts.
fn manifest_path(rel: &Path) -> String {
    rel.iter()
        .map(|p| p.to_string_lossy())
        .collect::<Vec<_>>()
        .join("/")
}

/// Hidden from the view: the encrypted blob, a key shipped beside the weights, and the
/// manifest (the seal's records, not the checkpoint's).
fn hidden(rel: &Path) -> bool {
    rel.parent() == Some(Path::new(""))
        && rel
            .file_name()
            .is_some_and(|n| n == blob::FILE_NAME || n == SHIPPED_KEY || n == manifest::FILE_NAME)
}

/// The walk over the sealed directory: what every level needs, held once.
struct Walker<'a> {
    seal: &'a Seal,
    key: &'a ModelKey,
    /// Only the files it lists are shown, each checked against it.
    manifest: Option<&'a Manifest>,
    canon_root: PathBuf,
    /// Directories already shown, so a link loop is shown once.
    visited: HashSet<PathBuf>,
    b: Builder,
}

/// Where a directory entry's bytes live: the entry itself, or a link's target.
struct Resolved {
    real: PathBuf,
    meta: Metadata,
    /// The path relative to the root that scopes tensor ids: kLLM scopes them by the real
    /// path, and hidden files stay hidden behind a link.
    content_rel: PathBuf,
}

impl Walker<'_> {
    fn walk(&mut self, dir: &Path, rel_dir: &Path, dir_ino: Ino) -> Result<()> {
        let mut entries: Vec<_> = fs::read_dir(dir)
            .map_err(|e| Error::at(dir, format!("cannot list ({e})")))?
            .collect::<std::io::Result<_>>()
            .map_err(|e| Error::at(dir, format!("cannot list ({e})")))?;
        entries.sort_by_key(|e| e.file_name());
        for entry in entries {
            let name = entry.file_name();
            let path = entry.path();
            let rel = rel_dir.join(&name);
            if hidden(&rel) {
                continue;
            }
            let Some(Resolved {
                real,
                meta,
                content_rel,
            }) = self.resolve(&path, &rel)?
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
                let attr = attr_of(&meta, Kind::Dir, 0);
                let ino = self.b.add(dir_ino, name, attr, Content::Dir(Vec::new()));
                self.walk(&real, &rel, ino)?;
            } else if meta.is_file() {
                let integrity = match self.manifest {
                    None => None,
                    Some(m) => {
                        let listed_as = manifest_path(&rel);
                        let Some(want) = m.digest(&listed_as) else {
                            log::warn!("{}: not in the manifest; not shown", path.display());
                            continue;
                        };
                        Some(Integrity::new(listed_as, want))
                    }
                };
                let content = file_content(self.seal, self.key, &real, &path, &content_rel)?;
                let attr = attr_of(&meta, Kind::File, meta.len());
                let ino = self.b.add(dir_ino, name, attr, content);
                self.b.nodes[ino as usize - 1].integrity = integrity;
            } else {
                log::warn!(
                    "{}: not a regular file or directory; not shown",
                    path.display()
                );
            }
        }
        Ok(())
    }

    /// Follow a link only when it stays inside the sealed directory, and only to a file: the
    /// folder it points to is shown where it lives. `None`: the entry is not shown.
    fn resolve(&self, path: &Path, rel: &Path) -> Result<Option<Resolved>> {
        let lmeta = fs::symlink_metadata(path)
            .map_err(|e| Error::at(path, format!("cannot stat ({e})")))?;
        if !lmeta.file_type().is_symlink() {
            return Ok(Some(Resolved {
                real: path.to_path_buf(),
                meta: lmeta,
                content_rel: rel.to_path_buf(),
            }));
        }
        let target = match fs::canonicalize(path) {
            Ok(t) => t,
            Err(e) => {
                log::warn!(
                    "{}: dangling symbolic link ({e}); not shown",
                    path.display()
                );
                return Ok(None);
            }
        };
        let Ok(target_rel) = target.strip_prefix(&self.canon_root).map(Path::to_path_buf) else {
            log::warn!(
                "{}: symbolic link to {} leaves the sealed directory; not shown",
                path.display(),
                target.display()
            );
            return Ok(None);
        };
        let meta = fs::metadata(&target)
            .map_err(|e| Error::at(path, format!("cannot stat link target ({e})")))?;
        if meta.is_dir() {
            log::warn!(
                "{}: symbolic link to a folder; not followed",
                path.display()
            );
            return Ok(None);
        }
        if hidden(&target_rel) {
            return Ok(None);
        }
        Ok(Some(Resolved {
            real: target,
            meta,
            content_rel: target_rel,
        }))
    }
}

fn file_content(
    seal: &Seal,
    key: &ModelKey,
    real: &Path,
    shown: &Path,
    rel: &Path,
) -> Result<Content> {
    if !is_lockable(rel) {
        let m = fs::metadata(real).map_err(|e| Error::at(shown, format!("cannot stat ({e})")))?;
        return Ok(Content::Verbatim {
            path: real.to_path_buf(),
            file: Default::default(),
            id: (m.dev(), m.ino()),
            stamp: Stamp::from_meta(&m),
        });
    }
    let file = File::open(real).map_err(|e| Error::at(shown, format!("cannot open ({e})")))?;
    let shard_dir = rel
        .parent()
        .map(|p| p.to_string_lossy().into_owned())
        .unwrap_or_default();
    let shard = Shard::open(shown, &file, &shard_dir, key)?;
    if !shard.is_locked() {
        let m = file
            .metadata()
            .map_err(|e| Error::at(shown, format!("cannot stat ({e})")))?;
        return Ok(Content::Verbatim {
            path: real.to_path_buf(),
            file: std::sync::OnceLock::from(std::sync::Arc::new(file)),
            id: (m.dev(), m.ino()),
            stamp: Stamp::from_meta(&m),
        });
    }
    if seal.lock.is_none() {
        return Err(Error::at(
            shown,
            format!(
                "carries {LOCK_META}, but {} has no lock flag; refusing to guess",
                seal.meta_file.display()
            ),
        ));
    }
    let stamp = crate::view::Stamp::of(&file)
        .map_err(|e| Error::at(shown, format!("cannot stat ({e})")))?;
    Ok(Content::Shard {
        path: real.to_path_buf(),
        file,
        shard,
        stamp,
    })
}
