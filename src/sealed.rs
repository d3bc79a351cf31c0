//! Recognize a sealed directory and build its unlocked view.

use std::collections::{BTreeMap, HashMap};
use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde_json::Value;
use sha2::{Digest, Sha256};
use zeroize::Zeroizing;

use crate::blob;
use crate::cache::BlockCache;
use crate::key::{ModelKey, SHIPPED_KEY};
use crate::lock::Version;
use crate::lock::LOCK_META;
use crate::manifest::{self, Manifest};
use crate::metrics::Stats;
use crate::pyjson;
use crate::shard::Shard;
use crate::source::{self, Entry, LocalDir, Source};
use crate::view::{Attr, Content, Ino, Integrity, Kind, Node, View, ROOT};
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

/// A JSON object file of the source: where messages place it, its text, its members.
fn read_json_object(
    source: &dyn Source,
    entry: &Entry,
) -> Result<(PathBuf, String, serde_json::Map<String, Value>)> {
    let path = source.at(&entry.path);
    let cannot = |e: &dyn std::fmt::Display| Error::at(&path, format!("cannot read ({e})"));
    let object = source.open(&entry.content_path)?;
    let bytes = source::read_all(&*object).map_err(|e| cannot(&std::io::Error::from(e)))?;
    let text =
        String::from_utf8(bytes).map_err(|_| cannot(&"stream did not contain valid UTF-8"))?;
    match serde_json::from_str(&text) {
        Ok(Value::Object(m)) => Ok((path, text, m)),
        Ok(_) => Err(Error::at(&path, "is not a JSON object")),
        Err(e) => Err(Error::at(&path, format!("is not valid JSON ({e})"))),
    }
}

/// The seal metadata file of a source, if there is one: `kllm.json`, else `config.json`.
fn meta_entry(source: &dyn Source) -> Result<Option<(Entry, bool)>> {
    for (name, pipeline) in [(PIPELINE_META, true), (LLM_META, false)] {
        if let Some(e) = source.stat(Path::new(name))? {
            if e.attr.kind == Kind::File {
                return Ok(Some((e, pipeline)));
            }
        }
    }
    Ok(None)
}

impl Seal {
    /// Read the seal metadata of the directory `root`, refusing what this mount cannot serve.
    pub fn read(root: &Path) -> Result<Seal> {
        Seal::from_source(&LocalDir::new(root)?)
    }

    /// [`Seal::read`] of any source.
    pub fn from_source(source: &dyn Source) -> Result<Seal> {
        const NO_META: &str = "is not a sealed kLLM directory: no kllm.json and no config.json with \"kllm\" seal metadata";
        const NO_KLLM: &str = "is not a sealed kLLM directory: config.json has no \"kllm\" seal metadata and there is no kllm.json";
        let root = source.at(Path::new(""));
        let Some((entry, pipeline)) = meta_entry(source)? else {
            return Err(Error::at(&root, NO_META));
        };
        let (meta_file, meta_text, doc) = read_json_object(source, &entry)?;
        let meta = match (pipeline, doc.get("kllm")) {
            (true, _) => doc,
            (false, Some(Value::Object(k))) => k.clone(),
            (false, _) => return Err(Error::at(&root, NO_KLLM)),
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
                    format!(
                        "lock version {v} is not supported (this kllm-mount reads {})",
                        Version::supported_text()
                    ),
                )
            })?),
            Some(other) => {
                return Err(Error::at(
                    &meta_file,
                    format!(
                        "lock version {other} is not supported (this kllm-mount reads {})",
                        Version::supported_text()
                    ),
                ))
            }
        };
        Ok(Seal {
            root,
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

    fn finish(mut self, cache: BlockCache, stats: Arc<Stats>) -> View {
        for (i, kids) in self.children.into_iter().enumerate() {
            if let Content::Dir(entries) = &mut self.nodes[i].content {
                *entries = kids.into_iter().collect();
            }
        }
        // Verdicts given at mount count like the later ones.
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
    /// The counters the view bumps, from the mount's start: a remote source opened with the
    /// same ones (`RemoteSettings::stats`) counts its fetches into them.
    pub stats: Arc<Stats>,
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
            stats: Stats::new(),
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
    open_source(&LocalDir::new(root)?, key, key_source, opts)
}

/// [`open`] of a sealed directory in any source.
pub fn open_source(
    source: &dyn Source,
    key: &ModelKey,
    key_source: &dyn std::fmt::Display,
    opts: &Options,
) -> Result<View> {
    let seal = Seal::from_source(source)?;
    seal.check_key(key, key_source)?;
    let listing = Listing::new(source.list()?);
    let manifest = load_manifest(source, &listing, opts)?;
    let view = build(&seal, source, &listing, key, opts, manifest.as_ref())?;
    if manifest.is_some() && opts.verify == Verify::Mount {
        verify_now(&view)?;
    }
    log::info!(
        "{}: {} nodes, lock {}, cache {} bytes, manifest {}",
        source.describe(),
        view.len(),
        seal.lock.map_or("none", |v| v.label()),
        view.cache().capacity_bytes(),
        manifest
            .as_ref()
            .map_or("none".into(), |m| m.path().display().to_string())
    );
    Ok(view)
}

/// A source's listing, looked up by the path the view shows.
struct Listing {
    entries: Vec<Entry>,
    index: HashMap<PathBuf, usize>,
}

impl Listing {
    fn new(entries: Vec<Entry>) -> Listing {
        let index = entries
            .iter()
            .enumerate()
            .map(|(i, e)| (e.path.clone(), i))
            .collect();
        Listing { entries, index }
    }

    fn get(&self, rel: &Path) -> Option<&Entry> {
        self.index.get(rel).map(|&i| &self.entries[i])
    }
}

/// The manifest to check files against: `--manifest`, else the sealed directory's own,
/// pinned to `--manifest-sha256` when given. Every file it lists must exist.
fn load_manifest(
    source: &dyn Source,
    listing: &Listing,
    opts: &Options,
) -> Result<Option<Manifest>> {
    if opts.verify == Verify::Off {
        return Ok(None);
    }
    let manifest = match (&opts.manifest, listing.get(Path::new(manifest::FILE_NAME))) {
        (Some(p), _) => Manifest::load(p)?,
        (None, Some(entry)) => read_manifest(source, entry)?,
        (None, None) => {
            if opts.manifest_sha256.is_some() {
                return Err(Error::at(
                    &source.at(Path::new("")),
                    format!(
                        "--manifest-sha256 is given, but there is no {} (give --manifest FILE)",
                        manifest::FILE_NAME
                    ),
                ));
            }
            return Ok(None);
        }
    };
    if let Some(pin) = &opts.manifest_sha256 {
        manifest.check_pin(pin)?;
    }
    let path = manifest.path();
    for (rel, _) in manifest.files() {
        let p = source.at(Path::new(rel));
        match listing.get(Path::new(rel)) {
            Some(e) if e.attr.kind == Kind::File => {}
            Some(_) => {
                return Err(Error::at(
                    &p,
                    format!("is listed in {} but is not a file", path.display()),
                ))
            }
            None => {
                return Err(Error::at(
                    &p,
                    format!("is listed in {} but missing (not found)", path.display()),
                ))
            }
        }
    }
    Ok(Some(manifest))
}

/// The sealed directory's own manifest, bounded before it is read.
fn read_manifest(source: &dyn Source, entry: &Entry) -> Result<Manifest> {
    let path = source.at(&entry.path);
    if entry.attr.kind != Kind::File {
        return Err(Error::at(&path, "not a regular file"));
    }
    let object = source.open(&entry.content_path)?;
    if object.len() > crate::manifest::MAX_BYTES {
        return Err(Error::at(
            &path,
            format!(
                "{} bytes is larger than any kLLM manifest (at most {} MiB)",
                object.len(),
                crate::manifest::MAX_BYTES >> 20
            ),
        ));
    }
    let bytes = source::read_all(&*object).map_err(|e| Error::at(&path, e))?;
    Manifest::parse(&path, &bytes)
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
    let check = |(_, ino): &(String, Ino)| {
        let r = view.verify(*ino);
        let size = view.node(*ino).map_or(0, |n| n.attr.size);
        let now = done.fetch_add(size, std::sync::atomic::Ordering::Relaxed) + size;
        progress.update(now, total);
        r
    };
    // On a pool of its own, not rayon's global one: this runs before the daemon forks, and
    // a global pool started here would have no threads in the daemon, where every decode
    // handed to it would wait forever.
    let results: Vec<_> = match rayon::ThreadPoolBuilder::new().build() {
        Ok(pool) => pool.install(|| files.par_iter().map(check).collect()),
        Err(_) => files.iter().map(check).collect(),
    };
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
fn build(
    seal: &Seal,
    source: &dyn Source,
    listing: &Listing,
    key: &ModelKey,
    opts: &Options,
    manifest: Option<&Manifest>,
) -> Result<View> {
    let mut b = Builder {
        nodes: Vec::new(),
        children: Vec::new(),
    };
    let mut headers = read_headers(seal, source, listing, key);
    // Shown folders by path: an entry is shown only under a shown folder.
    let mut dirs: HashMap<&Path, Ino> = HashMap::new();
    for (i, entry) in listing.entries.iter().enumerate() {
        let path = entry.path.as_path();
        let Some(name) = path.file_name() else {
            let ino = b.add(ROOT, OsString::new(), entry.attr, Content::Dir(Vec::new()));
            dirs.insert(path, ino);
            continue;
        };
        let Some(&parent) = path.parent().and_then(|p| dirs.get(p)) else {
            continue;
        };
        // A link to a hidden file hides it too.
        if hidden(path) || hidden(&entry.content_path) {
            continue;
        }
        let name = name.to_os_string();
        if entry.attr.kind == Kind::Dir {
            let ino = b.add(parent, name, entry.attr, Content::Dir(Vec::new()));
            dirs.insert(path, ino);
            continue;
        }
        let integrity = match manifest {
            None => None,
            Some(m) => {
                let listed_as = manifest_path(path);
                let Some(want) = m.digest(&listed_as) else {
                    log::warn!(
                        "{}: not in the manifest; not shown",
                        source.at(path).display()
                    );
                    continue;
                };
                Some(Integrity::new(listed_as, want))
            }
        };
        let content = match headers.remove(&i) {
            Some(read) => read?,
            None => file_content(seal, key, source, entry)?,
        };
        let ino = b.add(parent, name, entry.attr, content);
        b.nodes[ino as usize - 1].integrity = integrity;
    }

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
    let blob_entry = listing
        .get(Path::new(blob::FILE_NAME))
        .filter(|e| e.attr.kind == Kind::File);
    if let Some(entry) = blob_entry {
        let blob_path = source.at(&entry.path);
        let data = blob::read_object(&blob_path, &*source.open(&entry.content_path)?)?;
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
                    let ino = add_secret_file(&mut b, &blob_path, &entry.attr, &rel, data)?;
                    b.nodes[ino as usize - 1].integrity = check.map(|(want, got)| {
                        Integrity::decided(blob::FILE_NAME.to_string(), want, got)
                    });
                }
            }
        }
    }
    Ok(b.finish(
        BlockCache::new(opts.cache_bytes, opts.block_size),
        opts.stats.clone(),
    ))
}

fn add_secret_file(
    b: &mut Builder,
    blob_path: &Path,
    blob_attr: &Attr,
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
                let attr = Attr {
                    kind: Kind::Dir,
                    size: 0,
                    perm: 0o755,
                    ..*blob_attr
                };
                b.add(dir, name, attr, Content::Dir(Vec::new()))
            }
        };
    }
    let name = OsString::from(parts[parts.len() - 1]);
    let attr = Attr {
        kind: Kind::File,
        size: data.len() as u64,
        ..*blob_attr
    };
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

/// The contents of the listing's shards by their index in it, their headers read by up to
/// [`HEADER_READS`] threads at once: one at a time, a remote model waits a round trip per
/// shard before it mounts. A shard that is not shown after all (outside the manifest, under
/// a hidden folder) is read for nothing, and its error ignored.
fn read_headers(
    seal: &Seal,
    source: &dyn Source,
    listing: &Listing,
    key: &ModelKey,
) -> HashMap<usize, Result<Content>> {
    let shards: Vec<(usize, &Entry)> = listing
        .entries
        .iter()
        .enumerate()
        .filter(|(_, e)| {
            e.attr.kind == Kind::File && is_lockable(&e.content_path) && !hidden(&e.path)
        })
        .collect();
    if shards.len() < 2 {
        return HashMap::new();
    }
    let next = std::sync::atomic::AtomicUsize::new(0);
    let read = parking_lot::Mutex::new(HashMap::new());
    std::thread::scope(|s| {
        for _ in 0..HEADER_READS.min(shards.len()) {
            // A thread that cannot start leaves its shards to the caller's own reads.
            let _ = std::thread::Builder::new()
                .name("kllm-headers".into())
                .spawn_scoped(s, || loop {
                    let n = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    let Some(&(i, entry)) = shards.get(n) else {
                        break;
                    };
                    let content = file_content(seal, key, source, entry);
                    read.lock().insert(i, content);
                });
        }
    });
    read.into_inner()
}

/// Shard headers read at once at mount.
const HEADER_READS: usize = 16;

/// The bytes a mount reads at the start of each shard in one read: a header with a few
/// hundred tensors fits.
const HEADER_PREFIX: u64 = 64 << 10;

/// What a listed file shows: a locked shard is decoded on read, anything else is shown as
/// it is. Reads the header of every lockable shard.
fn file_content(
    seal: &Seal,
    key: &ModelKey,
    source: &dyn Source,
    entry: &Entry,
) -> Result<Content> {
    let object = source.open(&entry.content_path)?;
    let rel = &entry.content_path;
    if !is_lockable(rel) {
        return Ok(Content::Verbatim(object));
    }
    let shown = source.at(&entry.path);
    let shard_dir = rel
        .parent()
        .map(|p| p.to_string_lossy().into_owned())
        .unwrap_or_default();
    // One small read brings the header (most fit in the prefix); any bytes past it come by
    // small reads of their own. A shard no longer than the prefix is read as it will be
    // read again, whole (a remote one then keeps it for the reads that follow).
    let prefix = if object.len() <= HEADER_PREFIX {
        Vec::new()
    } else {
        let mut prefix = vec![0u8; HEADER_PREFIX as usize];
        object
            .read_small_at(&mut prefix, 0)
            .map_err(|e| Error::at(&shown, format!("cannot read ({e})")))?;
        prefix
    };
    let raw = |at: u64, buf: &mut [u8]| {
        let end = at as usize + buf.len();
        match prefix.get(at as usize..end) {
            Some(bytes) => buf.copy_from_slice(bytes),
            None if prefix.is_empty() => object.read_exact_at(buf, at)?,
            None => object.read_small_at(buf, at)?,
        }
        Ok(())
    };
    let shard = Shard::read_header(&shown, object.len(), &raw, &shard_dir, key)?;
    if !shard.is_locked() {
        return Ok(Content::Verbatim(object));
    }
    if seal.lock.is_none() {
        return Err(Error::at(
            &shown,
            format!(
                "carries {LOCK_META}, but {} has no lock flag; refusing to guess",
                seal.meta_file.display()
            ),
        ));
    }
    Ok(Content::Shard { object, shard })
}
