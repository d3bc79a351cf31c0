//! kLLM key files (`kllm_mount::key::parse_key_file`): open and passphrase-sealed JSON,
//! with a fixed passphrase. Must never panic; a key it returns must match its fingerprint
//! and never show up in `Debug` output.
#![no_main]

use std::path::Path;

use libfuzzer_sys::fuzz_target;
use serde_json::Value;
use zeroize::Zeroizing;

/// The passphrase of the seed `fuzz/seeds/key_file/passphrase-n16.json`.
const PASSPHRASE: &str = "fuzz";

/// scrypt at kLLM's n = 2^17 costs ~0.3 s an input; the parser allows up to 2^20. Inputs
/// that would run scrypt with more than this much work (n * r * p) are skipped: the parse
/// and the bounds checks before scrypt are what is fuzzed, not scrypt.
const MAX_SCRYPT_WORK: u64 = 1 << 13;

fn too_costly(text: &str) -> bool {
    let Ok(Value::Object(doc)) = serde_json::from_str::<Value>(text) else {
        return false;
    };
    let Some(kdf) = doc.get("kdf") else {
        return false;
    };
    let n = kdf.get("n").and_then(Value::as_u64).unwrap_or(0);
    let r = kdf.get("r").and_then(Value::as_u64).unwrap_or(0);
    let p = kdf.get("p").and_then(Value::as_u64).unwrap_or(0);
    // Those the parser refuses before scrypt are cheap; keep them.
    let in_bounds = n.is_power_of_two()
        && (2..=1 << 20).contains(&n)
        && (1..=32).contains(&r)
        && (1..=16).contains(&p);
    in_bounds && n.saturating_mul(r).saturating_mul(p) > MAX_SCRYPT_WORK
}

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if too_costly(text) {
        return;
    }
    let path = Path::new("fuzz.key");
    let _ = kllm_mount::key::needs_passphrase(path, text);
    let result =
        kllm_mount::key::parse_key_file(path, text, || Ok(Zeroizing::new(PASSPHRASE.to_string())));
    match result {
        Ok(key) => {
            let fp = key.fingerprint();
            assert_eq!(fp.len(), 19, "fingerprint {fp:?}");
            let shown = format!("{key:?}");
            let hexed = hex_of(key.secret().bytes());
            assert!(!shown.contains(&hexed), "Debug shows the key");
            assert!(!format!("{:?}", key.secret()).contains(&hexed));
            // An open key file's recorded fingerprint was checked.
            if let Ok(Value::Object(doc)) = serde_json::from_str::<Value>(text) {
                if let Some(rec) = doc.get("fingerprint").and_then(Value::as_str) {
                    assert_eq!(rec, fp, "accepted a key whose fingerprint differs");
                }
            }
        }
        Err(e) => {
            // Errors name the file and never carry key material.
            assert!(e.message().starts_with("fuzz.key"), "{e}");
        }
    }
});

fn hex_of(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}
