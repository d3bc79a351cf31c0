//! Model keys: the 32-byte secret, its HKDF sub-keys and fingerprint, and kLLM key files
//! (open, or sealed under a passphrase with scrypt + AES-256-GCM).

use std::fmt;
use std::path::{Path, PathBuf};

use aes_gcm::aead::{Aead, KeyInit, Payload};
use aes_gcm::{Aes256Gcm, Nonce};
use base64::engine::general_purpose::STANDARD as B64;
use base64::Engine;
use hkdf::Hkdf;
use serde_json::Value;
use sha2::Sha256;
use zeroize::{Zeroize, Zeroizing};

use crate::pyjson;
use crate::{Error, Result};

pub const KEY_BYTES: usize = 32;
const HKDF_SALT: &[u8] = b"kllm/v1";
const FORMAT: &str = "kllm-key";
/// The environment variable kLLM hands engines the raw key in.
pub const KEY_ENV: &str = "KLLM_MODEL_KEY";
pub const PASSPHRASE_ENV: &str = "KLLM_PASSPHRASE";
/// A catalog model ships its key next to its weights.
pub const SHIPPED_KEY: &str = "kllm.key";

/// A 32-byte secret, wiped from memory when dropped and never printed.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(Zeroizing<[u8; KEY_BYTES]>);

impl Secret {
    pub fn new(bytes: [u8; KEY_BYTES]) -> Self {
        Secret(Zeroizing::new(bytes))
    }

    pub fn bytes(&self) -> &[u8; KEY_BYTES] {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(..)")
    }
}

/// The model key every sub-key is derived from.
#[derive(Clone)]
pub struct ModelKey {
    secret: Secret,
}

impl fmt::Debug for ModelKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ModelKey({})", self.fingerprint())
    }
}

impl ModelKey {
    pub fn new(secret: [u8; KEY_BYTES]) -> Self {
        ModelKey {
            secret: Secret::new(secret),
        }
    }

    pub fn from_slice(bytes: &[u8]) -> Result<Self> {
        let arr: [u8; KEY_BYTES] = bytes.try_into().map_err(|_| {
            Error::new(format!(
                "a model key is {KEY_BYTES} bytes, not {}",
                bytes.len()
            ))
        })?;
        Ok(ModelKey::new(arr))
    }

    /// The key as 64 hex digits, as `KLLM_MODEL_KEY` holds it.
    pub fn from_hex(text: &str) -> Result<Self> {
        let mut bytes = Zeroizing::new(
            hex::decode(text.trim()).map_err(|_| Error::new("not 64 hexadecimal digits"))?,
        );
        let key = ModelKey::from_slice(&bytes).map_err(|_| Error::new("not 64 hexadecimal digits"));
        bytes.zeroize();
        key
    }

    pub fn secret(&self) -> &Secret {
        &self.secret
    }

    /// HKDF-SHA256 of the key, salt `kllm/v1`, `label` as info.
    pub fn derive_into(&self, label: &str, out: &mut [u8]) {
        Hkdf::<Sha256>::new(Some(HKDF_SALT), self.secret.bytes())
            .expand(label.as_bytes(), out)
            .expect("HKDF output lengths used here are far below the limit");
    }

    /// A 32-byte sub-key.
    pub fn derive(&self, label: &str) -> Secret {
        let mut out = [0u8; KEY_BYTES];
        self.derive_into(label, &mut out);
        let secret = Secret::new(out);
        out.zeroize();
        secret
    }

    /// `3f9a-0c41-d27e-88b5`: 8 bytes of HKDF output; names the key, reveals nothing.
    pub fn fingerprint(&self) -> String {
        let mut raw = [0u8; 8];
        self.derive_into("fingerprint", &mut raw);
        let hexed = hex::encode(raw);
        hexed
            .as_bytes()
            .chunks(4)
            .map(|c| std::str::from_utf8(c).expect("hex is ASCII"))
            .collect::<Vec<_>>()
            .join("-")
    }
}

/// Where a key came from, for messages.
#[derive(Debug, Clone)]
pub enum KeySource {
    File(PathBuf),
    Env,
}

impl fmt::Display for KeySource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            KeySource::File(p) => write!(f, "{}", p.display()),
            KeySource::Env => write!(f, "${KEY_ENV}"),
        }
    }
}

/// Bounds on scrypt parameters a key file may ask for (kLLM writes n = 2^17, r = 8, p = 1):
/// a hostile file must not make us allocate gigabytes or spin for minutes.
const MAX_SCRYPT_LOG_N: u8 = 20;
const MAX_SCRYPT_R: u32 = 32;
const MAX_SCRYPT_P: u32 = 16;

/// Whether a key file needs a passphrase (so the caller knows to ask for one).
pub fn needs_passphrase(path: &Path, text: &str) -> Result<bool> {
    let doc = parse_doc(path, text)?;
    Ok(cipher_name(path, &doc)? != "none")
}

fn parse_doc(path: &Path, text: &str) -> Result<serde_json::Map<String, Value>> {
    let doc: Value = serde_json::from_str(text)
        .map_err(|e| Error::at(path, format!("not a kLLM key file ({e})")))?;
    let Value::Object(doc) = doc else {
        return Err(Error::at(path, "not a kLLM key file (not a JSON object)"));
    };
    if doc.get("format").and_then(Value::as_str) != Some(FORMAT)
        || doc.get("version").and_then(Value::as_i64) != Some(1)
    {
        return Err(Error::at(path, "not a kLLM v1 key file (format/version)"));
    }
    Ok(doc)
}

fn cipher_name<'a>(path: &Path, doc: &'a serde_json::Map<String, Value>) -> Result<&'a str> {
    doc.get("cipher")
        .and_then(|c| c.get("name"))
        .and_then(Value::as_str)
        .ok_or_else(|| Error::at(path, "key file has no cipher name"))
}

fn b64_field(path: &Path, v: Option<&Value>, what: &str) -> Result<Zeroizing<Vec<u8>>> {
    let s = v
        .and_then(Value::as_str)
        .ok_or_else(|| Error::at(path, format!("key file has no {what}")))?;
    B64.decode(s)
        .map(Zeroizing::new)
        .map_err(|_| Error::at(path, format!("key file's {what} is not base64")))
}

/// Read a key file. `passphrase` is asked for only when the file is sealed with one.
pub fn parse_key_file(
    path: &Path,
    text: &str,
    passphrase: impl FnOnce() -> Result<Zeroizing<String>>,
) -> Result<ModelKey> {
    let doc = parse_doc(path, text)?;
    match cipher_name(path, &doc)? {
        "none" => open_key(path, &doc),
        "aes-256-gcm" => passphrase_key(path, text, doc, passphrase),
        other => Err(Error::at(
            path,
            format!("unknown key file cipher {other:?}"),
        )),
    }
}

/// A key file without a passphrase: the secret in the open, checked by its fingerprint.
fn open_key(path: &Path, doc: &serde_json::Map<String, Value>) -> Result<ModelKey> {
    let secret = b64_field(path, doc.get("secret"), "secret")?;
    let key = ModelKey::from_slice(&secret).map_err(|e| Error::at(path, e))?;
    let recorded = doc.get("fingerprint").and_then(Value::as_str);
    if recorded != Some(key.fingerprint().as_str()) {
        return Err(Error::at(
            path,
            "was modified: its fingerprint does not match the key it holds",
        ));
    }
    Ok(key)
}

/// A key file sealed under a passphrase: scrypt derives the key that opens the secret
/// with AES-256-GCM, the rest of the document as associated data.
fn passphrase_key(
    path: &Path,
    text: &str,
    doc: serde_json::Map<String, Value>,
    passphrase: impl FnOnce() -> Result<Zeroizing<String>>,
) -> Result<ModelKey> {
    let ciphertext = b64_field(path, doc.get("ciphertext"), "ciphertext")?;
    let kdf = doc
        .get("kdf")
        .ok_or_else(|| Error::at(path, "key file has no kdf"))?;
    let params = scrypt_params(path, kdf)?;
    let salt = b64_field(path, kdf.get("salt"), "scrypt salt")?;
    let nonce = b64_field(
        path,
        doc.get("cipher").and_then(|c| c.get("nonce")),
        "nonce",
    )?;
    if nonce.len() != 12 {
        return Err(Error::at(path, "key file's nonce is not 12 bytes"));
    }
    // From the text, not `doc`: a `Value` holds an integer beyond 64 bits as a float, which
    // Python, which wrote the associated data, keeps exact.
    let aad = pyjson::dumps_sorted_text_without(text, "ciphertext")
        .ok_or_else(|| Error::at(path, "not a kLLM key file (not a JSON object)"))?;
    let phrase = passphrase()?;
    let mut kek = Zeroizing::new([0u8; KEY_BYTES]);
    scrypt::scrypt(phrase.as_bytes(), &salt, &params, kek.as_mut())
        .map_err(|e| Error::at(path, format!("scrypt failed ({e})")))?;
    let cipher = Aes256Gcm::new_from_slice(kek.as_ref()).expect("32-byte key");
    let plain = Zeroizing::new(
        cipher
            .decrypt(
                Nonce::from_slice(&nonce),
                Payload {
                    msg: &ciphertext,
                    aad: aad.as_bytes(),
                },
            )
            .map_err(|_| Error::at(path, "wrong passphrase (or the key file was modified)"))?,
    );
    let key = ModelKey::from_slice(&plain).map_err(|e| Error::at(path, e))?;
    if let Some(recorded) = doc.get("fingerprint").and_then(Value::as_str) {
        if recorded != key.fingerprint() {
            return Err(Error::at(
                path,
                "was modified: its fingerprint does not match the key",
            ));
        }
    }
    Ok(key)
}

/// The key file's scrypt parameters, bounded so a hostile file cannot ask for unbounded
/// memory or time.
fn scrypt_params(path: &Path, kdf: &Value) -> Result<scrypt::Params> {
    if kdf.get("name").and_then(Value::as_str) != Some("scrypt") {
        return Err(Error::at(path, "key file's kdf is not scrypt"));
    }
    let num = |name: &str| {
        kdf.get(name)
            .and_then(Value::as_u64)
            .ok_or_else(|| Error::at(path, format!("key file's scrypt has no {name}")))
    };
    let (n, r, p) = (num("n")?, num("r")?, num("p")?);
    if !n.is_power_of_two() || n < 2 {
        return Err(Error::at(
            path,
            format!("scrypt n = {n} is not a power of two"),
        ));
    }
    let log_n = n.trailing_zeros() as u8;
    if log_n > MAX_SCRYPT_LOG_N
        || r == 0
        || r > MAX_SCRYPT_R as u64
        || p == 0
        || p > MAX_SCRYPT_P as u64
    {
        return Err(Error::at(
            path,
            format!("scrypt parameters n={n} r={r} p={p} are out of bounds"),
        ));
    }
    scrypt::Params::new(log_n, r as u32, p as u32, KEY_BYTES)
        .map_err(|e| Error::at(path, format!("bad scrypt parameters ({e})")))
}

/// Where to look for the key, in order, when `--key` is not given.
pub fn default_key_files(sealed: &Path) -> Vec<PathBuf> {
    let mut out = vec![sealed.join(SHIPPED_KEY)];
    if let Some(home) = std::env::var_os("HOME") {
        out.push(PathBuf::from(home).join(".kllm/keys/default.key"));
    }
    out
}

/// The passphrase from `KLLM_PASSPHRASE`, else a prompt on the terminal.
pub fn passphrase_from_env_or_prompt(path: &Path) -> Result<Zeroizing<String>> {
    if let Ok(p) = std::env::var(PASSPHRASE_ENV) {
        return Ok(Zeroizing::new(p));
    }
    rpassword::prompt_password(format!("Passphrase for {}: ", path.display()))
        .map(Zeroizing::new)
        .map_err(|e| {
            Error::at(
                path,
                format!("needs a passphrase: set {PASSPHRASE_ENV} or run on a terminal ({e})"),
            )
        })
}

/// The key for a mount: `--key FILE`, else `KLLM_MODEL_KEY`, else `<SEALED>/kllm.key`, else
/// `~/.kllm/keys/default.key`.
pub fn resolve(
    explicit: Option<&Path>,
    sealed: &Path,
    passphrase: &dyn Fn(&Path) -> Result<Zeroizing<String>>,
) -> Result<(ModelKey, KeySource)> {
    let shipped = sealed.join(SHIPPED_KEY);
    let read_shipped = || -> Result<Option<Zeroizing<String>>> {
        if !shipped.is_file() {
            return Ok(None);
        }
        read_key_text(&shipped).map(Some)
    };
    resolve_with_shipped(explicit, sealed, &read_shipped, passphrase)
}

fn read_key_text(path: &Path) -> Result<Zeroizing<String>> {
    std::fs::read_to_string(path)
        .map(Zeroizing::new)
        .map_err(|e| Error::at(path, format!("cannot read key file ({e})")))
}

/// [`resolve`] for a sealed directory that is not a local one (object storage): its
/// `kllm.key`, when it has one, comes from `shipped`.
pub fn resolve_with_shipped(
    explicit: Option<&Path>,
    sealed: &Path,
    shipped: &dyn Fn() -> Result<Option<Zeroizing<String>>>,
    passphrase: &dyn Fn(&Path) -> Result<Zeroizing<String>>,
) -> Result<(ModelKey, KeySource)> {
    let parse = |path: &Path, text: &str| parse_key_file(path, text, || passphrase(path));
    if let Some(path) = explicit {
        let text = read_key_text(path)?;
        return Ok((parse(path, &text)?, KeySource::File(path.to_path_buf())));
    }
    if let Ok(hexed) = std::env::var(KEY_ENV) {
        let hexed = Zeroizing::new(hexed);
        let key = ModelKey::from_hex(&hexed).map_err(|e| Error::new(format!("${KEY_ENV}: {e}")))?;
        return Ok((key, KeySource::Env));
    }
    let shipped_path = sealed.join(SHIPPED_KEY);
    if let Some(text) = shipped()? {
        return Ok((parse(&shipped_path, &text)?, KeySource::File(shipped_path)));
    }
    let candidates = default_key_files(sealed);
    for path in candidates.iter().skip(1) {
        if path.is_file() {
            let text = read_key_text(path)?;
            return Ok((parse(path, &text)?, KeySource::File(path.clone())));
        }
    }
    let tried: Vec<String> = candidates.iter().map(|p| p.display().to_string()).collect();
    Err(Error::new(format!(
        "no key: give --key FILE, set ${KEY_ENV}, or put a key file at {}",
        tried.join(" or ")
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fingerprint_of_known_key() {
        // shared/vectors/llm_v2/kllm.key
        let key = ModelKey::from_slice(
            &B64.decode("cpdtT6ZYi/HbO1OyTwQDXM4ahiLqAenINqQHZtQBXpc=")
                .unwrap(),
        )
        .unwrap();
        assert_eq!(key.fingerprint(), "c440-08b8-6b0f-7d0e");
        assert!(!format!("{key:?}").contains("cpdt"));
    }

    /// A passphrase key file whose authenticated part holds an integer beyond 64 bits opens:
    /// kLLM writes that part with Python's `json.dumps(sort_keys=True)`, which keeps the
    /// integer exact (finding F6). The associated data below is Python 3's output for the
    /// file less its `ciphertext`.
    #[test]
    fn a_passphrase_key_file_with_a_big_integer_opens() {
        let key = ModelKey::new([7u8; KEY_BYTES]);
        let (fp, salt, nonce) = (
            key.fingerprint(),
            B64.encode([1u8; 16]),
            B64.encode([2u8; 12]),
        );
        let big = "123450000000000000000768276196";
        let aad = format!(
            r#"{{"cipher": {{"name": "aes-256-gcm", "nonce": "{nonce}"}}, "extra": {big}, "fingerprint": "{fp}", "format": "kllm-key", "kdf": {{"n": 16, "name": "scrypt", "p": 1, "r": 8, "salt": "{salt}"}}, "version": 1}}"#
        );
        let mut kek = [0u8; KEY_BYTES];
        scrypt::scrypt(
            b"pw",
            &[1u8; 16],
            &scrypt::Params::new(4, 8, 1, KEY_BYTES).unwrap(),
            &mut kek,
        )
        .unwrap();
        let ct = Aes256Gcm::new_from_slice(&kek)
            .unwrap()
            .encrypt(
                Nonce::from_slice(&[2u8; 12]),
                Payload {
                    msg: &[7u8; KEY_BYTES],
                    aad: aad.as_bytes(),
                },
            )
            .unwrap();
        let text = format!(
            r#"{{"format": "kllm-key", "version": 1, "extra": {big}, "fingerprint": "{fp}",
               "kdf": {{"name": "scrypt", "n": 16, "r": 8, "p": 1, "salt": "{salt}"}},
               "cipher": {{"name": "aes-256-gcm", "nonce": "{nonce}"}},
               "ciphertext": "{}"}}"#,
            B64.encode(ct)
        );
        let phrase = || Ok(Zeroizing::new("pw".to_string()));
        let opened = parse_key_file(Path::new("k.json"), &text, phrase).unwrap();
        assert_eq!(opened.fingerprint(), fp);
        // The same file with the integer one off is another document: refused.
        let other = text.replace(big, "123450000000000000000768276197");
        let e = parse_key_file(Path::new("k.json"), &other, phrase).unwrap_err();
        assert!(e.to_string().contains("wrong passphrase"), "{e}");
    }

    #[test]
    fn hex_key_rejects_bad_input() {
        assert!(ModelKey::from_hex("zz").is_err());
        assert!(ModelKey::from_hex(&"ab".repeat(31)).is_err());
        assert!(ModelKey::from_hex(&"ab".repeat(32)).is_ok());
    }
}
