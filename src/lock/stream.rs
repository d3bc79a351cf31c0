//! Key streams: AES-256-CTR for lock v1, ChaCha20 for lock v2. Both seek to any byte, so
//! any range of a tensor decodes on its own.

use aes::cipher::{KeyIvInit, StreamCipher, StreamCipherSeek};

use super::Version;
use crate::key::Secret;

type Aes256Ctr = ctr::Ctr128BE<aes::Aes256>;

/// Bytes `[pos, pos + ks.len())` of the tensor's key stream into `ks`.
pub(super) fn fill(version: Version, key: &Secret, pos: u64, ks: &mut [u8]) {
    match version {
        Version::V1 => {
            // cipher 0.4 has no write_keystream: XOR into zeros.
            ks.fill(0);
            let mut c = Aes256Ctr::new(key.bytes().into(), &[0u8; 16].into());
            c.seek(pos);
            c.apply_keystream(ks);
        }
        Version::V2 => {
            use chacha20::cipher::{KeyIvInit as _, StreamCipher as _, StreamCipherSeek as _};
            let mut c = chacha20::ChaCha20::new(key.bytes().into(), &[0u8; 12].into());
            c.seek(pos);
            c.write_keystream(ks);
        }
    }
}
