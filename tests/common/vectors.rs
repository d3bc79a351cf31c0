//! The sealed cases and their expected views, and comparisons.

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::path::{Path, PathBuf};

use serde_json::Value;

/// The checked-in cases every clone has (tests/fixtures/README.md says how each was made).
pub fn fixtures_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

/// Kept for callers from before the fixtures were checked in: the default suite.
pub fn vectors_dir() -> PathBuf {
    fixtures_dir()
}

/// The fixture cases the tests name or rely on; a fixture set without one of them is broken.
pub const FIXTURE_CASES: [&str; 12] = [
    "bad_blob_flip",
    "bad_lock_version",
    "bad_unsealed",
    "bad_wrong_key",
    "kllm_v1",
    "kllm_v2",
    "llm_edge_v2",
    "llm_passphrase",
    "llm_v1",
    "llm_v2",
    "pipe_h3",
    "pipe_zimage_client",
];

/// An optional second suite in the same layout: `KLLM_VECTORS=DIR` (which must exist, since
/// someone asked for it), else `../shared/vectors` beside the clone when there is one. A clone
/// with nothing beside it runs the fixtures alone.
pub fn extra_vectors_dir() -> Option<PathBuf> {
    match std::env::var_os("KLLM_VECTORS") {
        Some(dir) if !dir.is_empty() => {
            let dir = PathBuf::from(dir);
            assert!(
                dir.is_dir(),
                "KLLM_VECTORS={} is not a directory",
                dir.display()
            );
            Some(dir)
        }
        _ => {
            let sibling = Path::new(env!("CARGO_MANIFEST_DIR")).join("../shared/vectors");
            sibling.is_dir().then_some(sibling)
        }
    }
}

/// The prefix of the names of extra-suite cases, so a failure says which suite it came from.
pub const EXTRA_PREFIX: &str = "extra:";

pub struct Case {
    pub name: String,
    pub dir: PathBuf,
    pub expect: Value,
}

impl Case {
    pub fn ok(&self) -> bool {
        self.expect["ok"].as_bool().unwrap_or(false)
    }
    /// A refused case: `checked` (the error, or the part of it to look in) holds every item
    /// of `expect.error_contains` (a string, or a list of alternatives); `err` is the whole
    /// error, for the failure message.
    pub fn assert_error_names(&self, checked: &str, err: &str) {
        for item in self.expect["error_contains"].as_array().unwrap() {
            let alts: Vec<&str> = match item {
                Value::String(s) => vec![s.as_str()],
                Value::Array(a) => a.iter().map(|v| v.as_str().unwrap()).collect(),
                _ => panic!("bad expect.json"),
            };
            assert!(
                alts.iter().any(|a| checked.contains(a)),
                "{}: error {err:?} lacks {alts:?}",
                self.name
            );
        }
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

    /// The key as 64 hex digits (`key.hex`), as `KLLM_MODEL_KEY` takes it.
    pub fn key_hex(&self) -> String {
        std::fs::read_to_string(self.dir.join("key.hex"))
            .unwrap()
            .trim()
            .to_string()
    }

    /// `--key FILE` and the environment the case needs to mount (its key inside the sealed
    /// folder, or in `KLLM_MODEL_KEY`, where its expect.json says so).
    pub fn key_setup(&self) -> (Vec<OsString>, Vec<(&'static str, String)>) {
        let (file, pass) = self.key_file();
        let mut env = Vec::new();
        if let Some(p) = pass {
            env.push(("KLLM_PASSPHRASE", p));
        }
        if self.expect["key_arg"] == Value::Bool(false) {
            if self.expect["key_env"] == Value::Bool(true) {
                env.push(("KLLM_MODEL_KEY", self.key_hex()));
            }
            return (Vec::new(), env);
        }
        (vec!["--key".into(), file.into_os_string()], env)
    }
}

fn read_cases(dir: &Path, prefix: &str) -> Vec<Case> {
    let mut out: Vec<Case> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .filter_map(|e| e.ok())
        .filter(|e| e.path().join("expect.json").is_file())
        .map(|e| {
            let expect = e.path().join("expect.json");
            Case {
                name: format!("{prefix}{}", e.file_name().to_string_lossy()),
                dir: e.path(),
                expect: serde_json::from_str(&std::fs::read_to_string(&expect).unwrap())
                    .unwrap_or_else(|err| panic!("{}: {err}", expect.display())),
            }
        })
        .collect();
    out.sort_by(|a, b| a.name.cmp(&b.name));
    out
}

/// The checked-in fixtures (named by their folder), then the extra suite when there is one
/// (named `extra:<folder>`).
pub fn cases() -> Vec<Case> {
    let mut out = fixture_cases();
    out.extend(extra_cases());
    out
}

pub fn fixture_cases() -> Vec<Case> {
    let out = read_cases(&fixtures_dir(), "");
    let names: Vec<&str> = out.iter().map(|c| c.name.as_str()).collect();
    for want in FIXTURE_CASES {
        assert!(
            names.contains(&want),
            "tests/fixtures lacks the case {want} (scripts/fixtures makes the kLLM ones)"
        );
    }
    out
}

/// The extra suite's cases; none when there is no extra suite. One that is present but holds
/// no case is an error: an empty directory would otherwise pass every test.
pub fn extra_cases() -> Vec<Case> {
    let Some(dir) = extra_vectors_dir() else {
        return Vec::new();
    };
    let out = read_cases(&dir, EXTRA_PREFIX);
    assert!(
        !out.is_empty(),
        "no cases (folders with expect.json) in {}",
        dir.display()
    );
    out
}

/// A fixture case by its folder name.
pub fn case(name: &str) -> Case {
    fixture_cases()
        .into_iter()
        .find(|c| c.name == name)
        .unwrap_or_else(|| panic!("no fixture case {name}"))
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
