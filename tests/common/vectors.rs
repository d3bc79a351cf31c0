//! The sealed cases and their expected views, and comparisons.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde_json::Value;

pub fn vectors_dir() -> PathBuf {
    let here = Path::new(env!("CARGO_MANIFEST_DIR"));
    let dir = std::env::var_os("KLLM_VECTORS")
        .map(PathBuf::from)
        .unwrap_or_else(|| here.join("../shared/vectors"));
    assert!(
        dir.is_dir(),
        "test vectors not found at {} (set KLLM_VECTORS)",
        dir.display()
    );
    dir
}

pub struct Case {
    pub name: String,
    pub dir: PathBuf,
    pub expect: Value,
}

impl Case {
    pub fn ok(&self) -> bool {
        self.expect["ok"].as_bool().unwrap_or(false)
    }
    pub fn sealed(&self) -> PathBuf {
        self.dir.join("sealed")
    }
    pub fn view(&self) -> PathBuf {
        self.dir.join("view")
    }
    /// The key file to pass with --key, and the passphrase it needs.
    pub fn key_file(&self) -> (PathBuf, Option<String>) {
        let pass = self.dir.join("passphrase.txt");
        if pass.is_file() {
            let p = std::fs::read_to_string(pass)
                .unwrap()
                .trim_end_matches('\n')
                .to_string();
            (self.dir.join("key.json"), Some(p))
        } else {
            (self.dir.join("kllm.key"), None)
        }
    }
}

pub fn cases() -> Vec<Case> {
    let mut out: Vec<Case> = std::fs::read_dir(vectors_dir())
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.path().join("expect.json").is_file())
        .map(|e| Case {
            name: e.file_name().to_string_lossy().into_owned(),
            dir: e.path(),
            expect: serde_json::from_str(
                &std::fs::read_to_string(e.path().join("expect.json")).unwrap(),
            )
            .unwrap(),
        })
        .collect();
    out.sort_by(|a, b| a.name.cmp(&b.name));
    assert!(out.len() >= 10, "expected the ten shared vectors");
    out
}

/// Every regular file under `root`, by relative path.
pub fn tree(root: &Path) -> BTreeMap<String, PathBuf> {
    fn go(root: &Path, dir: &Path, out: &mut BTreeMap<String, PathBuf>) {
        for e in std::fs::read_dir(dir).unwrap() {
            let e = e.unwrap();
            let p = e.path();
            if p.is_dir() {
                go(root, &p, out);
            } else {
                out.insert(
                    p.strip_prefix(root).unwrap().to_string_lossy().into_owned(),
                    p,
                );
            }
        }
    }
    let mut out = BTreeMap::new();
    go(root, root, &mut out);
    out
}

/// Compare a file of the view with the expected one: JSON as parsed JSON, safetensors with
/// the header as parsed JSON and the rest byte for byte, anything else byte for byte.
pub fn assert_same_file(rel: &str, got: &[u8], want: &[u8]) {
    if rel.ends_with(".json") {
        let g: Value =
            serde_json::from_slice(got).unwrap_or_else(|e| panic!("{rel}: view is not JSON: {e}"));
        let w: Value = serde_json::from_slice(want).unwrap();
        assert_eq!(g, w, "{rel}: JSON differs");
    } else if rel.ends_with(".safetensors") {
        assert_eq!(got.len(), want.len(), "{rel}: size differs");
        let n = u64::from_le_bytes(want[..8].try_into().unwrap()) as usize;
        assert_eq!(&got[..8], &want[..8], "{rel}: header length differs");
        let g: Value = serde_json::from_slice(&got[8..8 + n])
            .unwrap_or_else(|e| panic!("{rel}: header not JSON: {e}"));
        let w: Value = serde_json::from_slice(&want[8..8 + n]).unwrap();
        assert_eq!(g, w, "{rel}: header differs");
        if let Some(i) = (8 + n..want.len()).find(|&i| got[i] != want[i]) {
            panic!("{rel}: data differs first at byte {i} (of {})", want.len());
        }
    } else {
        assert!(got == want, "{rel}: bytes differ");
    }
}
