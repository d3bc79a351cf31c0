//! Bad input is refused at mount time with a message naming the file and the problem.

use std::fs;
use std::path::{Path, PathBuf};

use kllm_mount::blob;
use kllm_mount::key::ModelKey;
use kllm_mount::lock::Version;
use kllm_mount::sealed::{self, Options, Seal};
use kllm_mount::testseal;
use serde_json::json;

const KEY: [u8; 32] = [42; 32];

fn sealed_sample(lock: Option<Version>) -> (tempfile::TempDir, PathBuf) {
    let tmp = tempfile::tempdir().unwrap();
    testseal::write_sample_model(&tmp.path().join("plain"), 16, 1).unwrap();
    let dst = tmp.path().join("sealed");
    testseal::seal_dir(
        &tmp.path().join("plain"),
        &dst,
        &ModelKey::new(KEY),
        lock,
        [9; 16],
    )
    .unwrap();
    (tmp, dst)
}

fn mount_error(dir: &Path) -> String {
    let key = ModelKey::new(KEY);
    let result = sealed::open(dir, &key, &"test", &Options::default());
    match result {
        Ok(_) => panic!("{} mounted; it must be refused", dir.display()),
        Err(e) => e.to_string(),
    }
}

fn assert_refused(dir: &Path, file: &str, words: &[&str]) {
    let err = mount_error(dir);
    assert!(err.contains(file), "error {err:?} does not name {file}");
    for w in words {
        assert!(err.contains(w), "error {err:?} lacks {w:?}");
    }
}

fn edit_json(path: &Path, f: impl FnOnce(&mut serde_json::Value)) {
    let mut doc: serde_json::Value =
        serde_json::from_str(&fs::read_to_string(path).unwrap()).unwrap();
    f(&mut doc);
    fs::write(path, serde_json::to_string_pretty(&doc).unwrap()).unwrap();
}

#[test]
fn the_sample_mounts() {
    let (_t, dir) = sealed_sample(Some(Version::V2));
    let key = ModelKey::new(KEY);
    let view = sealed::open(&dir, &key, &"test", &Options::default()).unwrap();
    assert!(view.resolve("tokenizer.json").is_some());
    assert!(view.resolve("trusted.kllm").is_none());
}

#[test]
fn wrong_key_names_both_fingerprints() {
    let (_t, dir) = sealed_sample(Some(Version::V2));
    let other = ModelKey::new([1; 32]);
    let Err(err) = sealed::open(&dir, &other, &"k", &Options::default()) else {
        panic!("a key of another model opened the sealed directory");
    };
    let err = err.to_string();
    assert!(
        err.contains(&other.fingerprint()) && err.contains(&ModelKey::new(KEY).fingerprint()),
        "{err}"
    );
}

#[test]
fn schemes_and_lock_versions() {
    let (_t, dir) = sealed_sample(Some(Version::V2));
    edit_json(&dir.join("config.json"), |d| {
        d["kllm"]["lock"] = json!("v3")
    });
    assert_refused(&dir, "config.json", &["v3"]);
    edit_json(&dir.join("config.json"), |d| {
        d["kllm"]["lock"] = json!("v2");
        d["kllm"]["scheme"] = json!("d1-v1");
    });
    assert_refused(&dir, "config.json", &["d1-v1", "kllm demo"]);
    edit_json(&dir.join("config.json"), |d| {
        d.as_object_mut()
            .unwrap()
            .remove("kllm")
            .map(|_| ())
            .unwrap()
    });
    assert_refused(&dir, "sealed", &["not a sealed"]);
}

fn replace_blob(dir: &Path, f: impl FnOnce(Vec<u8>) -> Vec<u8>) {
    let p = dir.join(blob::FILE_NAME);
    let data = fs::read(&p).unwrap();
    fs::write(&p, f(data)).unwrap();
}

/// A blob of several chunks, for chunk-level tampering.
fn multi_chunk_blob(dir: &Path, files: &[(&str, Vec<u8>)]) -> (usize, usize) {
    let payload = testseal::secrets_payload(files);
    let sealed = blob::seal(&payload, &ModelKey::new(KEY), [5; 16], 256);
    let hlen = u32::from_le_bytes(sealed[10..14].try_into().unwrap()) as usize;
    fs::write(dir.join(blob::FILE_NAME), &sealed).unwrap();
    (14 + hlen, 256 + 16)
}

#[test]
fn trusted_blob_tampering() {
    let (_t, dir) = sealed_sample(Some(Version::V2));
    let good = fs::read(dir.join(blob::FILE_NAME)).unwrap();
    let restore = |d: &Path| fs::write(d.join(blob::FILE_NAME), &good).unwrap();

    replace_blob(&dir, |mut b| {
        b[0] = b'X';
        b
    });
    assert_refused(&dir, "trusted.kllm", &["magic"]);
    restore(&dir);
    // An altered header (a salt digit) fails authentication.
    replace_blob(&dir, |mut b| {
        let i = b.windows(6).position(|w| w == b"\"salt\"").unwrap() + 10;
        b[i] = if b[i] == b'0' { b'1' } else { b'0' };
        b
    });
    assert_refused(&dir, "trusted.kllm", &["authentication"]);
    restore(&dir);
    replace_blob(&dir, |mut b| {
        let n = b.len();
        b[n - 3] ^= 0x40;
        b
    });
    assert_refused(&dir, "trusted.kllm", &["authentication"]);
    restore(&dir);

    let big: Vec<u8> = (0..1000u32).map(|i| (i * 7) as u8).collect();
    let (start, chunk) = multi_chunk_blob(&dir, &[("tokenizer.json", big.clone())]);
    assert!(Seal::read(&dir).is_ok());
    let full = fs::read(dir.join(blob::FILE_NAME)).unwrap();
    // A dropped middle chunk.
    let mut dropped = full[..start + chunk].to_vec();
    dropped.extend_from_slice(&full[start + 2 * chunk..]);
    fs::write(dir.join(blob::FILE_NAME), &dropped).unwrap();
    assert_refused(&dir, "trusted.kllm", &[]);
    // Two chunks swapped.
    let mut swapped = full[..start].to_vec();
    swapped.extend_from_slice(&full[start + chunk..start + 2 * chunk]);
    swapped.extend_from_slice(&full[start..start + chunk]);
    swapped.extend_from_slice(&full[start + 2 * chunk..]);
    fs::write(dir.join(blob::FILE_NAME), &swapped).unwrap();
    assert_refused(&dir, "trusted.kllm", &["authentication"]);
    // The last chunk cut off.
    let last = start + ((full.len() - start) / chunk) * chunk;
    fs::write(dir.join(blob::FILE_NAME), &full[..last.min(full.len() - 1)]).unwrap();
    assert_refused(&dir, "trusted.kllm", &[]);

    for bad in ["../escape.json", "/etc/passwd", "a//b.json"] {
        multi_chunk_blob(&dir, &[(bad, vec![1, 2, 3])]);
        assert_refused(&dir, "trusted.kllm", &[bad]);
    }
    multi_chunk_blob(&dir, &[("tokenizer/tokenizer.json", vec![1, 2, 3])]);
    let key = ModelKey::new(KEY);
    let view = sealed::open(&dir, &key, &"test", &Options::default()).unwrap();
    assert_eq!(
        view.read_path("tokenizer/tokenizer.json", 0, 10)
            .unwrap()
            .to_vec(),
        vec![1u8, 2, 3]
    );
}

fn shard_path(dir: &Path) -> PathBuf {
    dir.join("model-00002-of-00002.safetensors")
}

fn rewrite_header(dir: &Path, f: impl FnOnce(&mut serde_json::Map<String, serde_json::Value>)) {
    let p = shard_path(dir);
    let bytes = fs::read(&p).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let mut h: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    f(&mut h);
    let mut text = serde_json::to_vec(&h).unwrap();
    text.resize(text.len().max(n), b' ');
    let mut out = (text.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&text);
    out.extend_from_slice(&bytes[8 + n..]);
    fs::write(&p, out).unwrap();
}

fn set_lock_doc(dir: &Path, doc: serde_json::Value) {
    rewrite_header(dir, |h| {
        h["__metadata__"]["kllm.lock"] = json!(doc.to_string());
    });
}

#[test]
fn shard_header_problems() {
    let name = "model-00002-of-00002.safetensors";
    let fresh = || sealed_sample(Some(Version::V2));

    let (_t, dir) = fresh();
    set_lock_doc(&dir, json!({"version": "v7", "tensors": {}}));
    assert_refused(&dir, name, &["v7"]);

    let (_t, dir) = fresh();
    set_lock_doc(
        &dir,
        json!({"version": "v2", "tensors": {"no.such.tensor": [128, "float"]}}),
    );
    assert_refused(&dir, name, &["no.such.tensor", "lacks"]);

    let (_t, dir) = fresh();
    set_lock_doc(
        &dir,
        json!({"version": "v2", "tensors": {"lm_head.weight": [100, "float"]}}),
    );
    assert_refused(&dir, name, &["domain 100", "impossible"]);

    let (_t, dir) = fresh();
    set_lock_doc(
        &dir,
        json!({"version": "v2", "tensors": {"lm_head.weight": [128, "e8m0"]}}),
    );
    assert_refused(&dir, name, &["lm_head.weight", "e8m0"]);

    let (_t, dir) = fresh();
    set_lock_doc(&dir, json!({"lm_head.weight": 0x7F80}));
    assert!(
        Seal::read(&dir).is_ok(),
        "a v1 document with a valid domain is accepted at mount"
    );

    // Malformed JSON header.
    let (_t, dir) = fresh();
    let p = shard_path(&dir);
    let mut bytes = fs::read(&p).unwrap();
    bytes[8] = b'[';
    fs::write(&p, &bytes).unwrap();
    assert_refused(&dir, name, &["malformed"]);

    // Oversized header.
    let (_t, dir) = fresh();
    let mut bytes = fs::read(shard_path(&dir)).unwrap();
    bytes[..8].copy_from_slice(&(200_000_000u64).to_le_bytes());
    fs::write(shard_path(&dir), &bytes).unwrap();
    assert_refused(&dir, name, &["oversized"]);

    // Data running past the end.
    let (_t, dir) = fresh();
    let bytes = fs::read(shard_path(&dir)).unwrap();
    fs::write(shard_path(&dir), &bytes[..bytes.len() - 1]).unwrap();
    assert_refused(&dir, name, &["past the end"]);

    // A header that claims more bytes than the file has.
    let (_t, dir) = fresh();
    fs::write(shard_path(&dir), [0xff, 0xff, 0, 0, 0, 0, 0, 0, b'{']).unwrap();
    assert_refused(&dir, name, &["past the end"]);

    // Locked shards in a directory without the lock flag.
    let (_t, dir) = fresh();
    edit_json(&dir.join("config.json"), |d| {
        d["kllm"]
            .as_object_mut()
            .unwrap()
            .remove("lock")
            .map(|_| ())
            .unwrap()
    });
    assert_refused(&dir, ".safetensors", &["lock flag"]);
}

#[test]
fn no_lock_directories_are_served_verbatim() {
    let (t, dir) = sealed_sample(None);
    let key = ModelKey::new(KEY);
    let view = sealed::open(&dir, &key, &"test", &Options::default()).unwrap();
    let plain = fs::read(t.path().join("plain/model-00001-of-00002.safetensors")).unwrap();
    let got = view
        .read_path("model-00001-of-00002.safetensors", 0, plain.len())
        .unwrap();
    assert!(*got == plain);
    let cfg: serde_json::Value =
        serde_json::from_slice(&view.read_path("config.json", 0, 1 << 20).unwrap()).unwrap();
    assert_eq!(cfg["kllm"]["scheme"], "l1");
}
