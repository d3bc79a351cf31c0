//! `manifest::Manifest::parse`, the catalog manifest a mount may be told to trust: any
//! input either is refused with an error naming the file, or yields only plain relative
//! paths and well-formed digests that say what the document says.
#![no_main]

use std::path::Path;

use kllm_mount::manifest::{Manifest, FORMAT};
use libfuzzer_sys::fuzz_target;
use serde_json::Value;
use sha2::{Digest, Sha256};

const NAME: &str = "/fuzz/kllm-manifest.json";

fuzz_target!(|data: &[u8]| {
    let m = match Manifest::parse(Path::new(NAME), data) {
        Ok(m) => m,
        Err(e) => {
            assert!(e.to_string().starts_with(NAME), "error without the file: {e}");
            return;
        }
    };
    assert!(!m.is_empty());
    assert_eq!(m.sha256(), <[u8; 32]>::from(Sha256::digest(data)));
    m.check_pin(&m.sha256_hex()).expect("own digest pins");
    for (rel, digest) in m.files() {
        assert!(!rel.is_empty() && !rel.starts_with('/'), "{rel:?}");
        assert!(
            rel.split('/').all(|p| !matches!(p, "" | "." | ".." | ".cache")),
            "{rel:?}"
        );
        assert!(!rel.chars().any(|c| c.is_control() || c == '\\'), "{rel:?}");
        assert_eq!(m.digest(rel).as_ref(), Some(digest));
    }
    // What serde_json reads as a plain document must agree with what was accepted.
    // (A document with serde_json's private RawValue marker as a key is not a `Value`.)
    if let Ok(Value::Object(doc)) = serde_json::from_slice::<Value>(data) {
        assert_eq!(doc.get("format").and_then(Value::as_str), Some(FORMAT));
        assert_eq!(doc.get("version").and_then(Value::as_u64), Some(1));
        let files = doc["files"].as_object().expect("files is an object");
        assert_eq!(files.len(), m.len(), "a duplicate key was accepted");
        for (rel, digest) in m.files() {
            assert_eq!(files[rel].as_str(), Some(hex::encode(digest).as_str()));
        }
    }
    // Written back canonically, it reads back the same.
    let files: serde_json::Map<String, Value> = m
        .files()
        .map(|(k, v)| (k.to_owned(), Value::from(hex::encode(v))))
        .collect();
    let again = serde_json::json!({"format": FORMAT, "version": 1, "files": files});
    let back = Manifest::parse(Path::new(NAME), again.to_string().as_bytes())
        .expect("a canonical rewrite parses");
    assert!(back.files().eq(m.files()));
});
