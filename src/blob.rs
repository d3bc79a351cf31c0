//! `trusted.kllm`: the chunked AES-256-GCM container holding the secret files.

use std::collections::BTreeMap;
use std::path::Path;

use aes_gcm::aead::{Aead, KeyInit, Payload};
use aes_gcm::{Aes256Gcm, Nonce};
use safetensors::{Dtype, SafeTensors};
use serde_json::Value;
use zeroize::Zeroizing;

use crate::key::ModelKey;
use crate::{Error, Result};

pub const MAGIC: &[u8; 10] = b"KLLMBLOB1\n";
pub const FILE_NAME: &str = "trusted.kllm";
const TAG: u64 = 16;
/// kLLM writes 64 MiB chunks; anything larger is refused before memory is committed.
pub const MAX_CHUNK: u64 = 64 << 20;
/// The header is four short fields; a long one is hostile or broken.
const MAX_HEADER: u32 = 64 << 10;
const FILE_PREFIX: &str = "file/";

/// Secret files by path relative to the model root, plaintext kept only in memory.
pub type SecretFiles = BTreeMap<String, Zeroizing<Vec<u8>>>;

/// The parsed header of a blob, before any decryption.
#[derive(Debug, Clone)]
pub struct Header {
    pub chunk: u64,
    pub chunks: u64,
    pub fingerprint: String,
    pub salt: Vec<u8>,
}

fn aad(header: &[u8], index: u64, last: bool) -> Vec<u8> {
    let mut out = Vec::with_capacity(header.len() + 9);
    out.extend_from_slice(header);
    out.extend_from_slice(&index.to_le_bytes());
    out.push(last as u8);
    out
}

fn nonce(index: u64) -> [u8; 12] {
    let mut n = [0u8; 12];
    n[4..].copy_from_slice(&index.to_le_bytes());
    n
}

/// An error about the blob: `<model dir>: trusted.kllm <problem>`.
fn bad(path: &Path, msg: impl std::fmt::Display) -> Error {
    let dir = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    Error::at(dir, format!("{FILE_NAME} {msg}"))
}

fn cipher(key: &ModelKey, salt: &[u8]) -> Aes256Gcm {
    let sub = key.derive(&format!("l1/trusted-blob/{}", hex::encode(salt)));
    Aes256Gcm::new_from_slice(sub.bytes()).expect("32-byte key")
}

/// Split `data` into header bytes, parsed header, and chunk bytes; checks sizes only.
pub fn parse_header<'a>(path: &Path, data: &'a [u8]) -> Result<(&'a [u8], Header, &'a [u8])> {
    if data.len() < MAGIC.len() + 4 || &data[..MAGIC.len()] != MAGIC {
        return Err(bad(path, "is not a kLLM trusted blob (bad magic)"));
    }
    let hlen = u32::from_le_bytes(data[10..14].try_into().expect("4 bytes"));
    if hlen > MAX_HEADER || 14 + hlen as usize > data.len() {
        return Err(bad(path, format!("has an impossible header length {hlen}")));
    }
    let header_bytes = &data[14..14 + hlen as usize];
    let doc: Value = serde_json::from_slice(header_bytes)
        .map_err(|e| bad(path, format!("has a header that is not JSON ({e})")))?;
    let field = |name: &str| {
        doc.get(name)
            .ok_or_else(|| bad(path, format!("has no {name} in its header")))
    };
    let chunk = field("chunk")?
        .as_u64()
        .filter(|c| (1..=MAX_CHUNK).contains(c))
        .ok_or_else(|| bad(path, format!("has a chunk size outside 1..={MAX_CHUNK}")))?;
    let chunks = field("chunks")?
        .as_u64()
        .filter(|c| *c >= 1)
        .ok_or_else(|| bad(path, "has a chunk count that is not a positive integer"))?;
    let fingerprint = field("fingerprint")?
        .as_str()
        .ok_or_else(|| bad(path, "has a fingerprint that is not a string"))?
        .to_string();
    let salt = field("salt")?
        .as_str()
        .and_then(|s| hex::decode(s).ok())
        .filter(|s| s.len() == 16)
        .ok_or_else(|| bad(path, "has a salt that is not 16 bytes of hex"))?;
    let body = &data[14 + hlen as usize..];
    let full = chunk + TAG;
    let body_len = body.len() as u64;
    let min = (chunks - 1)
        .checked_mul(full)
        .and_then(|v| v.checked_add(TAG));
    let max = chunks.checked_mul(full);
    match (min, max) {
        (Some(min), _) if body_len < min => {
            return Err(bad(
                path,
                format!(
                    "is truncated: {chunks} chunks declared, {body_len} bytes of chunks present"
                ),
            ))
        }
        (_, Some(max)) if body_len > max => {
            return Err(bad(path, "has trailing data after its last chunk"))
        }
        (None, _) => return Err(bad(path, "has an impossible chunk count")),
        _ => {}
    }
    Ok((
        header_bytes,
        Header {
            chunk,
            chunks,
            fingerprint,
            salt,
        },
        body,
    ))
}

/// Decrypt and authenticate a whole blob. The fingerprint is checked before anything is
/// decrypted.
pub fn open(path: &Path, data: &[u8], key: &ModelKey) -> Result<Zeroizing<Vec<u8>>> {
    let (header_bytes, header, body) = parse_header(path, data)?;
    let ours = key.fingerprint();
    if header.fingerprint != ours {
        return Err(bad(
            path,
            format!(
                "was sealed with key fingerprint {}, but the key given has fingerprint {ours}",
                header.fingerprint
            ),
        ));
    }
    let aead = cipher(key, &header.salt);
    let full = (header.chunk + TAG) as usize;
    let mut out = Zeroizing::new(Vec::with_capacity(body.len()));
    for i in 0..header.chunks {
        let last = i == header.chunks - 1;
        let start = i as usize * full;
        let end = if last { body.len() } else { start + full };
        let plain = Zeroizing::new(
            aead.decrypt(
                Nonce::from_slice(&nonce(i)),
                Payload {
                    msg: &body[start..end],
                    aad: &aad(header_bytes, i, last),
                },
            )
            .map_err(|_| {
                bad(
                    path,
                    format!(
                        "is corrupted or was modified (chunk {i} of {} failed authentication)",
                        header.chunks
                    ),
                )
            })?,
        );
        if !last && plain.len() as u64 != header.chunk {
            return Err(bad(path, format!("has a short chunk {i}")));
        }
        out.extend_from_slice(&plain);
    }
    Ok(out)
}

/// The secret files of a decrypted payload (a safetensors archive of `file/<path>` tensors).
pub fn secret_files(path: &Path, payload: &[u8]) -> Result<SecretFiles> {
    let archive = SafeTensors::deserialize(payload)
        .map_err(|e| bad(path, format!("holds no safetensors archive ({e})")))?;
    let mut out = SecretFiles::new();
    for (name, view) in archive.iter() {
        let Some(rel) = name.strip_prefix(FILE_PREFIX) else {
            continue;
        };
        check_relative(rel)
            .map_err(|e| bad(path, format!("names secret file {rel:?}, which {e}")))?;
        if view.dtype() != Dtype::U8 {
            return Err(bad(
                path,
                format!(
                    "secret file {rel:?} is stored as {:?}, not U8",
                    view.dtype()
                ),
            ));
        }
        out.insert(rel.to_string(), Zeroizing::new(view.data().to_vec()));
    }
    Ok(out)
}

/// A secret file's path must stay inside the model directory.
pub fn check_relative(rel: &str) -> std::result::Result<(), &'static str> {
    if rel.is_empty() || rel.starts_with('/') {
        return Err("is not a relative path");
    }
    for part in rel.split('/') {
        match part {
            "" => return Err("has an empty path component"),
            "." | ".." => return Err("leaves the model directory"),
            p if p.contains('\0') || p.contains('\\') => return Err("has a forbidden character"),
            _ => {}
        }
    }
    Ok(())
}

/// Read, authenticate and unpack `trusted.kllm`.
pub fn read(path: &Path, key: &ModelKey) -> Result<SecretFiles> {
    let data = read_bytes(path)?;
    let payload = open(path, &data, key)?;
    secret_files(path, &payload)
}

/// The bytes of `trusted.kllm`, bounded before they are read.
pub fn read_bytes(path: &Path) -> Result<Vec<u8>> {
    let meta = std::fs::metadata(path).map_err(|e| bad(path, format!("cannot be read ({e})")))?;
    check_len(path, meta.len())?;
    std::fs::read(path).map_err(|e| bad(path, format!("cannot be read ({e})")))
}

/// [`read_bytes`] from a source's object; `path` names it in errors.
pub fn read_object(path: &Path, object: &dyn crate::source::Object) -> Result<Vec<u8>> {
    check_len(path, object.len())?;
    crate::source::read_all(object).map_err(|e| bad(path, format!("cannot be read ({e})")))
}

/// Bound memory before reading: the header's chunk size is checked in parse_header, and a
/// file far past 1 GiB holds no tokenizer.
fn check_len(path: &Path, len: u64) -> Result<()> {
    if len > 4 << 30 {
        return Err(bad(
            path,
            "is larger than 4 GiB; refusing to decrypt it into memory",
        ));
    }
    Ok(())
}

/// Seal `payload` as kLLM does (used by the test sealer).
#[cfg(feature = "seal")]
pub fn seal(payload: &[u8], key: &ModelKey, salt: [u8; 16], chunk: u64) -> Vec<u8> {
    let chunks = payload.len().div_ceil(chunk as usize).max(1) as u64;
    let header = crate::pyjson::dumps_sorted(&serde_json::json!({
        "salt": hex::encode(salt),
        "chunk": chunk,
        "chunks": chunks,
        "fingerprint": key.fingerprint(),
    }));
    let aead = cipher(key, &salt);
    let mut out = Vec::new();
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&(header.len() as u32).to_le_bytes());
    out.extend_from_slice(header.as_bytes());
    for i in 0..chunks {
        let last = i == chunks - 1;
        let start = (i * chunk) as usize;
        let end = (start + chunk as usize).min(payload.len());
        let sealed = aead
            .encrypt(
                Nonce::from_slice(&nonce(i)),
                Payload {
                    msg: &payload[start..end],
                    aad: &aad(header.as_bytes(), i, last),
                },
            )
            .expect("AES-GCM encryption does not fail");
        out.extend_from_slice(&sealed);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn relative_paths() {
        assert!(check_relative("tokenizer.json").is_ok());
        assert!(check_relative("tokenizer/vocab.json").is_ok());
        for bad in ["", "/etc/passwd", "../x", "a/../b", "a//b", "a/", "./a"] {
            assert!(check_relative(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn seal_then_open_multi_chunk() {
        let key = ModelKey::new([7; 32]);
        let payload: Vec<u8> = (0..1000u32).map(|i| i as u8).collect();
        let blob = seal(&payload, &key, [1; 16], 300);
        let p = Path::new("trusted.kllm");
        assert_eq!(&open(p, &blob, &key).unwrap()[..], &payload[..]);
        let mut flipped = blob.clone();
        let n = flipped.len();
        flipped[n - 20] ^= 1;
        assert!(open(p, &flipped, &key)
            .unwrap_err()
            .message()
            .contains("authentication"));
        // After a short last chunk, extra bytes join that chunk and fail its tag.
        let mut trailing = blob.clone();
        trailing.push(0);
        assert!(open(p, &trailing, &key).is_err());
        // After a full last chunk, they cannot belong to any chunk.
        let full = seal(&payload[..900], &key, [1; 16], 300);
        assert_eq!(&open(p, &full, &key).unwrap()[..], &payload[..900]);
        let mut trailing = full.clone();
        trailing.push(0);
        assert!(open(p, &trailing, &key)
            .unwrap_err()
            .message()
            .contains("trailing"));
        assert!(open(p, &blob[..blob.len() - 300], &key).is_err());
        let other = ModelKey::new([8; 32]);
        assert!(open(p, &blob, &other)
            .unwrap_err()
            .message()
            .contains(&other.fingerprint()));
    }
}
