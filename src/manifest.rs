//! kLLM's catalog manifest (`kllm-manifest.json`) and the check of a sealed directory
//! against it (the hashing itself is in [`crate::digest`]).
//!
//! kLLM 0.1.0 (`kllm.keyed.catalog.write_manifest`, run by the catalog build of official
//! sealed models, not by `kllm seal`) writes the manifest into the sealed directory with
//! `json.dumps(doc, indent=2)`: an object with `"format": "kllm-catalog"`, `"version": 1`,
//! descriptive members (`name`, `base`, `modality`, `transform`, `client`, `key`
//! {`fingerprint`, `key_version`}, `kllm`, `embargo_days`, `gated`), and `files`: every
//! regular file under the directory by its relative POSIX path (`/` between parts, nested
//! folders included, a symbolic link to a file hashed as its target) mapped to the
//! lowercase hex SHA-256 of its bytes. kLLM leaves out any file named `kllm-manifest.json`
//! and anything under a `.cache` folder. `kllm verify`, `kllm check` and `kllm pull` compare
//! the directory with `files`; a listed file that is missing or differs, or an unlisted one,
//! is a difference.
//!
//! Parsing here is stricter than kLLM's (which accepts any JSON with `files`): a manifest is
//! a security boundary once a mount trusts it, so anything kLLM would never write is refused
//! with an error naming the file and the problem.

use std::collections::BTreeMap;
use std::io::{self, Read};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use rayon::prelude::*;
use serde::de::{self, Deserializer, MapAccess, Visitor};
use serde::Deserialize;
use sha2::{Digest, Sha256};

use crate::digest::{open_regular, sha256_file_counting};
use crate::{Error, Result};

/// The manifest's file name in a sealed directory (`kllm.keyed.catalog.MANIFEST`).
pub const FILE_NAME: &str = "kllm-manifest.json";
/// `kllm.keyed.catalog.FORMAT` and `VERSION`.
pub const FORMAT: &str = "kllm-catalog";
pub const VERSION: u64 = 1;
/// Real manifests are a few KiB (about 100 bytes per file); 64 MiB is half a million files,
/// far past any checkpoint, and keeps a hostile file from being read into memory whole.
pub const MAX_BYTES: u64 = 64 << 20;
/// Longest listed path, in bytes (Linux's PATH_MAX).
const MAX_PATH_BYTES: usize = 4096;

/// A parsed, validated catalog manifest.
#[derive(Debug, Clone)]
pub struct Manifest {
    path: PathBuf,
    sha256: [u8; 32],
    files: BTreeMap<String, [u8; 32]>,
    name: Option<String>,
    fingerprint: Option<String>,
    kllm: Option<String>,
}

#[derive(Deserialize)]
struct Document {
    format: Option<serde_json::Value>,
    version: Option<serde_json::Value>,
    files: Option<Files>,
    name: Option<serde_json::Value>,
    key: Option<serde_json::Value>,
    kllm: Option<serde_json::Value>,
}

/// `files` as written, in document order, refusing duplicate keys (Python's `json.loads`
/// keeps the last one silently, so a duplicate could hide a digest from a reviewer).
struct Files(Vec<(String, String)>);

impl<'de> Deserialize<'de> for Files {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        struct FilesVisitor;
        impl<'de> Visitor<'de> for FilesVisitor {
            type Value = Files;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("an object mapping relative paths to SHA-256 hex digests")
            }
            fn visit_map<A: MapAccess<'de>>(
                self,
                mut map: A,
            ) -> std::result::Result<Files, A::Error> {
                let mut seen = std::collections::HashSet::new();
                let mut out = Vec::new();
                while let Some((k, v)) = map.next_entry::<String, serde_json::Value>()? {
                    if !seen.insert(k.clone()) {
                        return Err(de::Error::custom(format_args!("`files` lists {k:?} twice")));
                    }
                    let serde_json::Value::String(v) = v else {
                        return Err(de::Error::custom(format_args!(
                            "`files` maps {k:?} to {v}, not to a SHA-256 hex string"
                        )));
                    };
                    out.push((k, v));
                }
                Ok(Files(out))
            }
        }
        d.deserialize_map(FilesVisitor)
    }
}

impl Manifest {
    /// Reads and validates the manifest at `path` (at most [`MAX_BYTES`]).
    pub fn load(path: &Path) -> Result<Manifest> {
        let file = open_regular(path).map_err(|e| Error::at(path, e))?;
        let meta = file.metadata().map_err(|e| Error::at(path, e))?;
        if meta.len() > MAX_BYTES {
            return Err(Error::at(
                path,
                format!(
                    "{} bytes is larger than any kLLM manifest (at most {} MiB)",
                    meta.len(),
                    MAX_BYTES >> 20
                ),
            ));
        }
        // The file may grow after the size check: read one byte past the bound to notice.
        let mut bytes = Vec::with_capacity(meta.len() as usize);
        (&file)
            .take(MAX_BYTES + 1)
            .read_to_end(&mut bytes)
            .map_err(|e| Error::at(path, e))?;
        if bytes.len() as u64 > MAX_BYTES {
            return Err(Error::at(
                path,
                "grew past the manifest size bound while read",
            ));
        }
        Manifest::parse(path, &bytes)
    }

    /// Validates manifest bytes; `path` only names the file in errors.
    pub fn parse(path: &Path, bytes: &[u8]) -> Result<Manifest> {
        let doc: Document = serde_json::from_slice(bytes)
            .map_err(|e| Error::at(path, format!("not a kLLM manifest: {e}")))?;
        match &doc.format {
            Some(serde_json::Value::String(f)) if f == FORMAT => {}
            Some(other) => {
                return Err(Error::at(
                    path,
                    format!("format is {other}, not \"{FORMAT}\" (not a kLLM catalog manifest)"),
                ))
            }
            None => {
                return Err(Error::at(
                    path,
                    format!("no \"format\": \"{FORMAT}\" member (not a kLLM catalog manifest)"),
                ))
            }
        }
        match &doc.version {
            Some(v) if v.as_u64() == Some(VERSION) => {}
            Some(v) => {
                return Err(Error::at(
                    path,
                    format!("manifest version {v} is not supported (this build reads {VERSION})"),
                ))
            }
            None => return Err(Error::at(path, "no \"version\" member")),
        }
        let Some(Files(raw)) = doc.files else {
            return Err(Error::at(
                path,
                "no \"files\" member: the manifest lists nothing",
            ));
        };
        if raw.is_empty() {
            return Err(Error::at(
                path,
                "\"files\" is empty: the manifest guards nothing",
            ));
        }
        let mut files = BTreeMap::new();
        for (rel, hex_digest) in raw {
            check_relative_path(&rel).map_err(|why| Error::at(path, format!("{rel:?}: {why}")))?;
            let digest = parse_digest(&hex_digest).ok_or_else(|| {
                Error::at(
                    path,
                    format!("{rel:?}: digest {hex_digest:?} is not 64 lowercase hex digits"),
                )
            })?;
            files.insert(rel, digest);
        }
        // A path cannot be both a file and a folder of other listed files.
        for rel in files.keys() {
            let folder = format!("{rel}/");
            if let Some((inner, _)) = files.range(folder.clone()..).next() {
                if inner.starts_with(&folder) {
                    return Err(Error::at(
                        path,
                        format!("{rel:?} is listed as a file and as the folder of {inner:?}"),
                    ));
                }
            }
        }
        let text = |v: Option<&serde_json::Value>| v.and_then(|v| v.as_str()).map(str::to_owned);
        Ok(Manifest {
            path: path.to_path_buf(),
            sha256: Sha256::digest(bytes).into(),
            files,
            name: text(doc.name.as_ref()),
            fingerprint: text(doc.key.as_ref().and_then(|k| k.get("fingerprint"))),
            kllm: text(doc.kllm.as_ref()),
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// SHA-256 of the manifest's exact bytes.
    pub fn sha256(&self) -> [u8; 32] {
        self.sha256
    }

    pub fn sha256_hex(&self) -> String {
        hex::encode(self.sha256)
    }

    /// Checks the manifest against a pinned digest (`--manifest-sha256`), hex in either case.
    pub fn check_pin(&self, want_hex: &str) -> Result<()> {
        let want = want_hex.trim().to_ascii_lowercase();
        if parse_digest(&want).is_none() {
            return Err(Error::new(format!(
                "--manifest-sha256 {want_hex:?}: not 64 hex digits"
            )));
        }
        if want != self.sha256_hex() {
            return Err(Error::at(
                &self.path,
                format!(
                    "SHA-256 is {}, not the pinned {want}: the manifest was changed",
                    self.sha256_hex()
                ),
            ));
        }
        Ok(())
    }

    /// The listed digest of `rel` (a relative POSIX path, as in the manifest).
    pub fn digest(&self, rel: &str) -> Option<[u8; 32]> {
        self.files.get(rel).copied()
    }

    /// Every listed path with its digest, in byte order of the paths.
    pub fn files(&self) -> impl ExactSizeIterator<Item = (&str, &[u8; 32])> {
        self.files.iter().map(|(k, v)| (k.as_str(), v))
    }

    pub fn len(&self) -> usize {
        self.files.len()
    }

    pub fn is_empty(&self) -> bool {
        self.files.is_empty()
    }

    /// `name`: the published repository name, when the manifest has one.
    pub fn name(&self) -> Option<&str> {
        self.name.as_deref()
    }

    /// `key.fingerprint`: the key the catalog sealed with (kLLM's `kllm check` compares it
    /// with the sealed config's fingerprint).
    pub fn fingerprint(&self) -> Option<&str> {
        self.fingerprint.as_deref()
    }

    /// `kllm`: the kLLM version that wrote the manifest.
    pub fn kllm_version(&self) -> Option<&str> {
        self.kllm.as_deref()
    }

    /// One check per listed file of the sealed directory `dir`, in the manifest's order.
    pub fn checks(&self, dir: &Path) -> Vec<FileCheck> {
        self.files
            .iter()
            .map(|(rel, want)| FileCheck {
                rel: rel.clone(),
                path: dir.join(rel),
                want: *want,
            })
            .collect()
    }

    /// Files under `dir` that kLLM would list but this manifest does not, sorted (kLLM
    /// counts them as differences). Walks as kLLM's `rglob` does: symbolic links to files
    /// count, symbolic links to folders are not entered.
    pub fn unlisted(&self, dir: &Path) -> io::Result<Vec<String>> {
        let mut out = Vec::new();
        let mut stack = vec![(dir.to_path_buf(), String::new())];
        while let Some((folder, prefix)) = stack.pop() {
            for entry in std::fs::read_dir(&folder)? {
                let entry = entry?;
                let Some(name) = entry.file_name().to_str().map(str::to_owned) else {
                    // kLLM could not write such a name into JSON either.
                    out.push(format!("{prefix}{}", entry.file_name().to_string_lossy()));
                    continue;
                };
                if name == ".cache" {
                    continue;
                }
                let rel = format!("{prefix}{name}");
                if entry.file_type()?.is_dir() {
                    stack.push((entry.path(), format!("{rel}/")));
                } else if std::fs::metadata(entry.path()).is_ok_and(|m| m.is_file())
                    && name != FILE_NAME
                    && !self.files.contains_key(&rel)
                {
                    out.push(rel);
                }
            }
        }
        out.sort();
        Ok(out)
    }
}

/// Why a listed path is refused, or Ok: relative, `/`-separated, no empty, `.` or `..`
/// parts, no control characters (NUL included) or backslashes, nothing kLLM leaves out.
fn check_relative_path(rel: &str) -> std::result::Result<(), &'static str> {
    if rel.is_empty() {
        return Err("empty path");
    }
    if rel.len() > MAX_PATH_BYTES {
        return Err("path longer than 4096 bytes");
    }
    if rel.contains('\0') {
        return Err("path holds a NUL byte");
    }
    if rel.chars().any(char::is_control) {
        return Err("path holds a control character");
    }
    if rel.starts_with('/') {
        return Err("absolute path (kLLM lists paths relative to the sealed directory)");
    }
    if rel.contains('\\') {
        return Err("backslash in path (kLLM writes POSIX paths)");
    }
    for part in rel.split('/') {
        match part {
            "" => return Err("empty path part (`//` or a trailing `/`)"),
            "." => return Err("`.` path part"),
            ".." => return Err("`..` path part: it would leave the sealed directory"),
            ".cache" => return Err("`.cache` folder, which kLLM never lists"),
            _ => {}
        }
    }
    if rel.rsplit('/').next() == Some(FILE_NAME) {
        return Err("a manifest cannot list a manifest (kLLM leaves them out)");
    }
    Ok(())
}

fn parse_digest(s: &str) -> Option<[u8; 32]> {
    if s.len() != 64 || !s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')) {
        return None;
    }
    let mut out = [0u8; 32];
    hex::decode_to_slice(s, &mut out).ok()?;
    Some(out)
}

/// One listed file to check: its manifest path, where it is, the digest it must have.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileCheck {
    pub rel: String,
    pub path: PathBuf,
    pub want: [u8; 32],
}

#[derive(Debug)]
pub enum Problem {
    /// Missing, not a regular file, or a read failed.
    Unreadable(io::Error),
    /// Read whole, with another digest.
    Altered { got: [u8; 32] },
}

/// The first failed check of [`verify_all`].
#[derive(Debug)]
pub struct Mismatch {
    /// Index into the checks given.
    pub index: usize,
    pub rel: String,
    pub path: PathBuf,
    pub want: [u8; 32],
    pub problem: Problem,
}

impl Mismatch {
    pub fn to_error(&self) -> Error {
        match &self.problem {
            Problem::Unreadable(e) => Error::at(
                &self.path,
                format!(
                    "listed in the manifest as {:?} but cannot be read: {e}",
                    self.rel
                ),
            ),
            Problem::Altered { got } => Error::at(
                &self.path,
                format!(
                    "SHA-256 is {}, but the manifest lists {} for {:?}: the file was altered",
                    hex::encode(got),
                    hex::encode(self.want),
                    self.rel
                ),
            ),
        }
    }
}

impl From<Box<Mismatch>> for Error {
    fn from(m: Box<Mismatch>) -> Error {
        m.to_error()
    }
}

/// Hashes every file of `checks` on `threads` threads (0: one per core) and returns the
/// failure with the lowest index, the same one whatever the timing: once a check fails,
/// later ones are skipped, earlier ones still run. `progress(done, total)` is called with
/// bytes hashed and the total size of the files, from any thread.
pub fn verify_all(
    checks: &[FileCheck],
    threads: usize,
    progress: Option<&(dyn Fn(u64, u64) + Sync)>,
) -> std::result::Result<(), Box<Mismatch>> {
    let sizes: Vec<Option<u64>> = checks
        .iter()
        .map(|c| std::fs::metadata(&c.path).ok().map(|m| m.len()))
        .collect();
    let total: u64 = sizes.iter().flatten().sum();
    let done = AtomicU64::new(0);
    let first_bad = AtomicUsize::new(usize::MAX);
    let count = |n: u64| {
        let now = done.fetch_add(n, Ordering::Relaxed) + n;
        if let Some(p) = progress {
            p(now, total.max(now));
        }
    };
    let check_one = |(index, check): (usize, &FileCheck)| -> Option<(usize, Problem)> {
        if index > first_bad.load(Ordering::Relaxed) {
            return None;
        }
        let result = open_regular(&check.path).and_then(|f| sha256_file_counting(&f, &count));
        let problem = match result {
            Ok(got) if got == check.want => return None,
            Ok(got) => Problem::Altered { got },
            Err(e) => Problem::Unreadable(e),
        };
        first_bad.fetch_min(index, Ordering::Relaxed);
        Some((index, problem))
    };
    let run = || {
        checks
            .par_iter()
            .enumerate()
            .with_max_len(1)
            .filter_map(check_one)
            .min_by_key(|(index, _)| *index)
    };
    // A pool of its own, never rayon's global one: a check before the daemon forks would
    // leave the daemon a global pool without threads (see `sealed::verify_now`).
    let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build();
    let found = match &pool {
        Ok(pool) => pool.install(run),
        Err(_) => checks
            .iter()
            .enumerate()
            .filter_map(check_one)
            .min_by_key(|(index, _)| *index),
    };
    match found {
        None => Ok(()),
        Some((index, problem)) => {
            let c = &checks[index];
            Err(Box::new(Mismatch {
                index,
                rel: c.rel.clone(),
                path: c.path.clone(),
                want: c.want,
                problem,
            }))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::digest::{sha256_file, READ_CHUNK};
    use std::fs::File;
    use std::io::Write;

    fn fixture_dir() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/manifest/sealed")
    }

    fn parse(text: &str) -> Result<Manifest> {
        Manifest::parse(Path::new("/m/kllm-manifest.json"), text.as_bytes())
    }

    const D: &str = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";

    fn doc(files: &str) -> String {
        format!(r#"{{"format": "kllm-catalog", "version": 1, "files": {files}}}"#)
    }

    fn refused(text: &str, needle: &str) {
        let e = parse(text).expect_err(text).to_string();
        assert!(e.starts_with("/m/kllm-manifest.json: "), "{e}");
        assert!(e.contains(needle), "{e:?} lacks {needle:?}");
    }

    #[test]
    fn reads_the_manifest_kllm_wrote_and_the_directory_matches_it() {
        let dir = fixture_dir();
        let m = Manifest::load(&dir.join(FILE_NAME)).unwrap();
        assert_eq!(m.len(), 9);
        assert_eq!(m.name(), Some("tiny-zimage-client"));
        assert_eq!(m.fingerprint(), Some("4171-a935-cc49-8505"));
        assert_eq!(m.kllm_version(), Some("0.1.0"));
        let paths: Vec<&str> = m.files().map(|(p, _)| p).collect();
        assert!(paths.contains(&"transformer/diffusion_pytorch_model.safetensors"));
        assert!(paths.contains(&"trusted.kllm"));
        assert!(!paths.contains(&FILE_NAME));
        assert!(m.unlisted(&dir).unwrap().is_empty());
        for (rel, want) in m.files() {
            let f = File::open(dir.join(rel)).unwrap();
            assert_eq!(&sha256_file(&f).unwrap(), want, "{rel}");
        }
        verify_all(&m.checks(&dir), 2, None).unwrap();
        let bytes = std::fs::read(dir.join(FILE_NAME)).unwrap();
        assert_eq!(m.sha256_hex(), hex::encode(Sha256::digest(&bytes)));
        m.check_pin(&m.sha256_hex().to_uppercase()).unwrap();
        let e = m.check_pin(D).unwrap_err().to_string();
        assert!(e.contains("not the pinned"), "{e}");
        assert!(m.check_pin("abc").is_err());
    }

    #[test]
    fn accepts_a_minimal_document_and_ignores_unknown_members() {
        let m = parse(&format!(
            r#"{{"format": "kllm-catalog", "version": 1, "later": [1, 2], "files": {{"a/b.safetensors": "{D}"}}}}"#
        ))
        .unwrap();
        assert_eq!(
            m.digest("a/b.safetensors").map(hex::encode).as_deref(),
            Some(D)
        );
        assert_eq!(m.digest("b.safetensors"), None);
        assert_eq!(m.fingerprint(), None);
    }

    #[test]
    fn refuses_what_kllm_would_never_write() {
        refused("not json", "not a kLLM manifest");
        refused("[1]", "not a kLLM manifest");
        refused(r#"{"version": 1, "files": {}}"#, "no \"format\"");
        refused(
            r#"{"format": "kllm-key", "version": 1}"#,
            "not \"kllm-catalog\"",
        );
        refused(
            r#"{"format": "kllm-catalog", "files": {}}"#,
            "no \"version\"",
        );
        refused(
            r#"{"format": "kllm-catalog", "version": 2}"#,
            "version 2 is not supported",
        );
        refused(
            r#"{"format": "kllm-catalog", "version": "1"}"#,
            "not supported",
        );
        refused(
            r#"{"format": "kllm-catalog", "version": 1}"#,
            "no \"files\"",
        );
        refused(&doc("{}"), "guards nothing");
        refused(&doc("[]"), "not a kLLM manifest");
        refused(&doc(r#"{"a": 5}"#), "not to a SHA-256 hex string");
        refused(
            &doc(&format!(r#"{{"/etc/passwd": "{D}"}}"#)),
            "absolute path",
        );
        refused(&doc(&format!(r#"{{"a/../../x": "{D}"}}"#)), "`..`");
        refused(&doc(&format!(r#"{{"a//b": "{D}"}}"#)), "empty path part");
        refused(&doc(&format!(r#"{{"a/": "{D}"}}"#)), "empty path part");
        refused(&doc(&format!(r#"{{"": "{D}"}}"#)), "empty path");
        refused(&doc(&format!(r#"{{"./a": "{D}"}}"#)), "`.` path part");
        refused(&doc(&format!(r#"{{"a\u0000b": "{D}"}}"#)), "NUL");
        refused(&doc(&format!(r#"{{"a\nb": "{D}"}}"#)), "control character");
        refused(&doc(&format!(r#"{{"a\\b": "{D}"}}"#)), "backslash");
        refused(&doc(&format!(r#"{{".cache/x": "{D}"}}"#)), ".cache");
        refused(
            &doc(&format!(r#"{{"sub/kllm-manifest.json": "{D}"}}"#)),
            "cannot list a manifest",
        );
        refused(
            &doc(&format!(r#"{{"a": "{}"}}"#, &D[1..])),
            "not 64 lowercase hex",
        );
        refused(
            &doc(&format!(r#"{{"a": "{}"}}"#, D.to_uppercase())),
            "not 64 lowercase hex",
        );
        refused(
            &doc(&format!(r#"{{"a": "{}g"}}"#, &D[1..])),
            "not 64 lowercase hex",
        );
        refused(
            &doc(&format!(r#"{{"a": "{D}", "a": "{D}"}}"#)),
            "lists \"a\" twice",
        );
        refused(
            &format!(
                r#"{{"format": "kllm-catalog", "format": "kllm-catalog", "version": 1, "files": {{"a": "{D}"}}}}"#
            ),
            "duplicate field `format`",
        );
        refused(
            &doc(&format!(r#"{{"a": "{D}", "a/b": "{D}"}}"#)),
            "as a file and as the folder",
        );
        refused(
            &doc(&format!(r#"{{"a": "{D}", "a-x": "{D}", "a/b/c": "{D}"}}"#)),
            "folder of \"a/b/c\"",
        );
        let long = "x".repeat(4097);
        refused(&doc(&format!(r#"{{"{long}": "{D}"}}"#)), "longer than 4096");
    }

    #[test]
    fn load_names_the_file_and_bounds_its_size() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join(FILE_NAME);
        let e = Manifest::load(&path).unwrap_err().to_string();
        assert!(e.starts_with(&path.display().to_string()), "{e}");
        let f = File::create(&path).unwrap();
        f.set_len(MAX_BYTES + 1).unwrap();
        let e = Manifest::load(&path).unwrap_err().to_string();
        assert!(e.contains("larger than any kLLM manifest"), "{e}");
        let e = Manifest::load(tmp.path()).unwrap_err().to_string();
        assert!(e.contains("not a regular file"), "{e}");
        let fifo = tmp.path().join("fifo");
        mkfifo(&fifo);
        let e = Manifest::load(&fifo).unwrap_err().to_string();
        assert!(e.contains("not a regular file"), "{e}");
    }

    fn mkfifo(path: &Path) {
        let c = std::ffi::CString::new(path.to_str().unwrap()).unwrap();
        // SAFETY: a valid C string.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    }

    fn write_dir(files: &[(&str, &[u8])]) -> (tempfile::TempDir, Vec<FileCheck>) {
        let tmp = tempfile::tempdir().unwrap();
        let mut checks = Vec::new();
        for (rel, data) in files {
            let p = tmp.path().join(rel);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            File::create(&p).unwrap().write_all(data).unwrap();
            checks.push(FileCheck {
                rel: rel.to_string(),
                path: p,
                want: Sha256::digest(data).into(),
            });
        }
        (tmp, checks)
    }

    #[test]
    fn verify_all_finds_the_first_mismatch_whatever_the_threads() {
        let big = vec![3u8; READ_CHUNK + 100];
        let (tmp, checks) = write_dir(&[
            ("a", b"one"),
            ("b/c", &big),
            ("d", b"three"),
            ("e", b"four"),
            ("f", b"five"),
        ]);
        let seen = AtomicU64::new(0);
        verify_all(
            &checks,
            3,
            Some(&|done, total| {
                assert!(done <= total);
                seen.fetch_max(done, Ordering::Relaxed);
            }),
        )
        .unwrap();
        assert_eq!(
            seen.load(Ordering::Relaxed),
            (3 + big.len() + 5 + 4 + 4) as u64
        );

        std::fs::write(tmp.path().join("f"), b"FIVE").unwrap();
        std::fs::write(tmp.path().join("d"), b"THREE").unwrap();
        std::fs::remove_file(tmp.path().join("e")).unwrap();
        for threads in [1, 2, 4] {
            let m = verify_all(&checks, threads, None).unwrap_err();
            assert_eq!((m.index, m.rel.as_str()), (2, "d"), "threads {threads}");
            let Problem::Altered { got } = m.problem else {
                panic!("{m:?}")
            };
            assert_eq!(got, <[u8; 32]>::from(Sha256::digest(b"THREE")));
            let e = Error::from(m).to_string();
            assert!(
                e.contains("the file was altered") && e.contains("/d: "),
                "{e}"
            );
        }
        mkfifo(&tmp.path().join("e"));
        let m = verify_all(&checks[3..], 2, None).unwrap_err();
        assert_eq!(m.rel, "e");
        assert!(
            m.to_error().to_string().contains("not a regular file"),
            "{m:?}"
        );
        std::fs::remove_file(tmp.path().join("e")).unwrap();
        let m = verify_all(&checks[3..], 2, None).unwrap_err();
        assert_eq!(m.rel, "e");
        assert!(matches!(m.problem, Problem::Unreadable(_)), "{m:?}");
        assert!(m.to_error().to_string().contains("cannot be read"));
    }

    #[test]
    fn unlisted_files_are_found_as_kllm_would_count_them() {
        let (tmp, checks) = write_dir(&[("a", b"1"), ("sub/b", b"2")]);
        let files: Vec<String> = checks
            .iter()
            .map(|c| format!("\"{}\": \"{}\"", c.rel, hex::encode(c.want)))
            .collect();
        let m = parse(&doc(&format!("{{{}}}", files.join(",")))).unwrap();
        assert!(m.unlisted(tmp.path()).unwrap().is_empty());
        std::fs::write(tmp.path().join(FILE_NAME), b"{}").unwrap();
        std::fs::create_dir_all(tmp.path().join(".cache/x")).unwrap();
        std::fs::write(tmp.path().join(".cache/x/y"), b"").unwrap();
        std::fs::write(tmp.path().join("sub/.cache"), b"").unwrap();
        std::fs::write(tmp.path().join("sub/extra"), b"").unwrap();
        std::os::unix::fs::symlink("a", tmp.path().join("link")).unwrap();
        std::os::unix::fs::symlink("sub", tmp.path().join("dirlink")).unwrap();
        assert_eq!(m.unlisted(tmp.path()).unwrap(), ["link", "sub/extra"]);
    }
}
