//! `trusted.kllm` (`kllm_mount::blob`): the header and chunk arithmetic, authentication,
//! the safetensors payload of secret files, and seal/open round trips at any chunk size.
//! Must never panic or allocate without bound.
#![no_main]

use std::path::Path;

use kllm_mount::blob;
use kllm_mount::key::ModelKey;
use libfuzzer_sys::fuzz_target;

/// The keys of ../shared/vectors (public test keys), so seeds taken from the vectors pass
/// the fingerprint check and reach decryption.
const VECTOR_KEYS: [&str; 10] = [
    "09a194a2c27033aebe947a1d5d510ab3ddcb7348379429b15d2e8c3425ebfff9",
    "2c413084ac58397ce193ad645379f9dc84df77a6ba628f6ddd55ea4d7b4e2e24",
    "5311b7bc25a031a63a8e2c53d993c5c73c27d50b27d832134cc317b3e86fcdc0",
    "609842dbf7c6321c73c84391d89132c4e60a06b5be488690626fb58cbca38113",
    "6fd1ef387a3699362a93f9439878e89ab9b3ca983abbe8b1be83eb11a495d701",
    "72976d4fa6588bf1db3b53b24f04035cce1a8622ea01e9c836a40766d4015e97",
    "90d5d843d52c3ecea93c3d0b89163135d9db778a635e6296201a51117f478bb2",
    "95c8c1aefd888ea6808ab096b77edafe9eeeed6a8acb4b3bc075d566d41caec3",
    "f2a3c1ba86eb64fd938851a823013e0e6c050fdad614b072675f131272827347",
    "f2e4f36b861e229cfc6a6e987341eb02f325ec3134cc948922dc95f0c5495e52",
];

fn keys() -> &'static [(String, ModelKey)] {
    static KEYS: std::sync::OnceLock<Vec<(String, ModelKey)>> = std::sync::OnceLock::new();
    KEYS.get_or_init(|| {
        VECTOR_KEYS
            .iter()
            .map(|h| {
                let k = ModelKey::from_hex(h).unwrap();
                (k.fingerprint(), k)
            })
            .collect()
    })
}

fuzz_target!(|data: &[u8]| {
    let path = Path::new("trusted.kllm");
    // 1. As a blob: the key whose fingerprint the header names, else the first.
    let key = match blob::parse_header(path, data) {
        Ok((_, h, _)) => {
            assert!(h.chunk >= 1 && h.chunk <= blob::MAX_CHUNK);
            keys()
                .iter()
                .find(|(fp, _)| *fp == h.fingerprint)
                .map_or(&keys()[0].1, |(_, k)| k)
        }
        Err(_) => &keys()[0].1,
    };
    if let Ok(payload) = blob::open(path, data, key) {
        // Memory stays within the file's size.
        assert!(payload.len() <= data.len());
        if let Ok(files) = blob::secret_files(path, &payload) {
            for rel in files.keys() {
                assert!(blob::check_relative(rel).is_ok());
            }
        }
    }
    // 2. As a decrypted payload: a safetensors archive of `file/<path>` tensors.
    if let Ok(files) = blob::secret_files(path, data) {
        for (rel, bytes) in &files {
            assert!(blob::check_relative(rel).is_ok(), "{rel:?} accepted");
            assert!(bytes.len() <= data.len());
        }
    }
    // 3. As a payload sealed and opened again, at a chunk size from the first byte, so
    //    every chunk count and a full or short last chunk are met.
    let payload = &data[..data.len().min(256)];
    let chunk = 1 + data.first().map_or(0, |b| *b as u64) % 64;
    let (_, k) = &keys()[data.len() % keys().len()];
    let sealed = blob::seal(payload, k, [7; 16], chunk);
    let opened = blob::open(path, &sealed, k).expect("a fresh seal opens");
    assert_eq!(&opened[..], payload, "seal/open round trip");
    // A truncated or extended seal never opens.
    if !sealed.is_empty() {
        let cut = data.len() % sealed.len();
        if cut > 0 {
            assert!(
                blob::open(path, &sealed[..cut], k).is_err(),
                "truncated at {cut} opens"
            );
        }
        let mut longer = sealed.clone();
        longer.push(data.len() as u8);
        assert!(blob::open(path, &longer, k).is_err(), "extended blob opens");
    }
});
