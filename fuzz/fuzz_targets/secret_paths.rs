//! Path handling of secret files: `blob::check_relative` on arbitrary names, then a real
//! `sealed::build` of a small sealed directory whose `trusted.kllm` holds files of those
//! names (collisions with files and folders on disk, with each other, nesting). Must never
//! panic; an accepted name must stay inside the model directory and read back as its bytes.
//!
//! Input: names separated by 0xFF bytes (never part of UTF-8).
#![no_main]

use std::path::{Component, Path, PathBuf};

use kllm_mount::blob;
use kllm_mount::key::ModelKey;
use kllm_mount::sealed::{self, Options};
use kllm_mount::testseal::{safetensors_bytes, Tensor};
use kllm_mount::view::Kind;
use libfuzzer_sys::fuzz_target;

struct Fixture {
    _dir: tempfile::TempDir,
    root: PathBuf,
    key: ModelKey,
}

/// A sealed directory (no lock) with a file and a folder for names to collide with. Lives
/// in /dev/shm when it can: every input rewrites its trusted.kllm.
fn fixture() -> &'static Fixture {
    static F: std::sync::OnceLock<Fixture> = std::sync::OnceLock::new();
    F.get_or_init(|| {
        let dir = tempfile::Builder::new()
            .prefix("kllm-fuzz-secret-paths.")
            .tempdir_in(if Path::new("/dev/shm").is_dir() { "/dev/shm" } else { "/tmp" })
            .unwrap();
        let root = dir.path().join("sealed");
        let key = ModelKey::new([5; 32]);
        std::fs::create_dir_all(root.join("sub/deeper")).unwrap();
        std::fs::write(
            root.join("config.json"),
            format!(
                "{{\n  \"model_type\": \"x\",\n  \"kllm\": {{\"scheme\": \"l1\", \"fingerprint\": \"{}\"}}\n}}\n",
                key.fingerprint()
            ),
        )
        .unwrap();
        std::fs::write(root.join("README.md"), b"readme").unwrap();
        std::fs::write(root.join("sub/file.txt"), b"sub file").unwrap();
        Fixture { _dir: dir, root, key }
    })
}

fn stays_inside(rel: &str) -> bool {
    let p = Path::new(rel);
    p.components().all(|c| matches!(c, Component::Normal(_))) && p.components().count() >= 1
}

/// Whether two entries would need the same path as a file and as a folder.
fn conflicts(names: &[&str]) -> bool {
    const DISK_DIRS: [&str; 2] = ["sub", "sub/deeper"];
    const DISK_FILES: [&str; 3] = ["config.json", "README.md", "sub/file.txt"];
    let files: Vec<&str> = names.iter().copied().chain(DISK_FILES).collect();
    names.iter().any(|n| {
        DISK_DIRS.contains(n)
            || files
                .iter()
                .any(|f| n.len() > f.len() && n.starts_with(f) && n.as_bytes()[f.len()] == b'/')
            || names
                .iter()
                .any(|m| m.len() > n.len() && m.starts_with(n) && m.as_bytes()[n.len()] == b'/')
    })
}

fuzz_target!(|data: &[u8]| {
    let names: Vec<&str> = data
        .split(|&b| b == 0xFF)
        .filter_map(|n| std::str::from_utf8(n).ok())
        .take(32)
        .collect();
    for name in &names {
        if blob::check_relative(name).is_ok() {
            assert!(stays_inside(name), "check_relative accepts {name:?}");
            assert!(!name.contains('\0') && !name.contains('\\'), "{name:?}");
        }
    }
    let f = fixture();
    // The archive: every name (accepted or not, deduplicated), bytes that name it.
    let mut tensors = Vec::new();
    let mut seen = std::collections::BTreeSet::new();
    for (i, name) in names.iter().enumerate() {
        if !seen.insert(*name) {
            continue;
        }
        let data = format!("{i}:{name}").into_bytes();
        tensors.push(Tensor {
            name: format!("file/{name}"),
            dtype: safetensors::Dtype::U8,
            shape: vec![data.len()],
            data,
        });
    }
    let payload = safetensors_bytes(&tensors, &serde_json::Map::new());
    std::fs::write(
        f.root.join(blob::FILE_NAME),
        blob::seal(&payload, &f.key, [3; 16], 1 << 16),
    )
    .unwrap();
    let all_ok = names.iter().all(|n| blob::check_relative(n).is_ok());
    match sealed::open(&f.root, &f.key, &"fuzz", &Options::default()) {
        Ok(view) => {
            assert!(all_ok, "a build with a refused name succeeded: {names:?}");
            // The first occurrence of each name is the one in the archive.
            for (i, name) in names.iter().enumerate() {
                if names[..i].contains(name) {
                    continue;
                }
                let want = format!("{i}:{name}").into_bytes();
                let ino = view
                    .resolve(name)
                    .unwrap_or_else(|| panic!("{name:?} missing from the view"));
                assert_eq!(view.node(ino).unwrap().attr.kind, Kind::File, "{name:?}");
                let got = view.read(ino, 0, 1 << 20).unwrap().to_vec();
                assert_eq!(got, want, "{name:?} reads other bytes");
            }
            // The blob and the key stay hidden whatever the archive holds, unless the
            // archive itself names them (or a folder of that name).
            for hidden in [blob::FILE_NAME, "kllm.key"] {
                let named = names.iter().any(|n| {
                    *n == hidden || n.strip_prefix(hidden).is_some_and(|r| r.starts_with('/'))
                });
                if !named {
                    assert!(view.resolve(hidden).is_none(), "{hidden} shown");
                }
            }
        }
        Err(e) => {
            assert!(
                !all_ok || conflicts(&names),
                "names that fit together were refused: {names:?}: {e}"
            );
        }
    }
});
