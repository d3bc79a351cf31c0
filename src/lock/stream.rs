//! Key streams: AES-256-CTR for lock v1, ChaCha20 for lock v2. Both seek to any byte, so
//! any range of a tensor decodes on its own.
//!
//! ChaCha20 has two implementations, and [`ChaCha::chosen`] picks one per process for the
//! CPU: the `chacha20` crate where the CPU has AVX-512 (its AVX-512 backend, 7.2-7.5 GB/s on
//! one core where we measured it), and elsewhere AWS-LC's assembly (already linked for TLS),
//! which keeps 8 blocks in flight on AVX2 where the crate keeps 4: 2.08 against 3.2 GB/s on
//! one core of an AVX2-only EPYC (`cargo bench --bench decode`). The key stream sets the
//! pace of a lock-v2 decode, so this is most of the decode's speed on such machines.

use std::sync::OnceLock;

use aes::cipher::{KeyIvInit, StreamCipher, StreamCipherSeek};
#[cfg(feature = "aws-lc")]
use zeroize::Zeroize;

use super::Version;
use crate::key::Secret;

type Aes256Ctr = ctr::Ctr128BE<aes::Aes256>;

/// Bytes `[pos, pos + ks.len())` of the tensor's key stream into `ks`.
pub(super) fn fill(version: Version, key: &Secret, pos: u64, ks: &mut [u8]) {
    let key: &[u8; 32] = key.bytes();
    match version {
        Version::V1 => aes_ctr(key, pos, ks),
        Version::V2 => ChaCha::chosen().fill(key, pos, ks),
    }
}

/// Bytes `[pos, pos + ks.len())` of the AES-256-CTR stream keyed by `key` (lock v1: a
/// 128-bit big-endian counter from 0) into `ks`.
pub fn aes_ctr(key: &[u8; 32], pos: u64, ks: &mut [u8]) {
    // cipher 0.4 has no write_keystream: the stream XORed onto zeros, read from `ZEROS`
    // rather than written into `ks` first (one pass over the batch fewer).
    let mut c = Aes256Ctr::new(key.into(), &[0u8; 16].into());
    c.seek(pos);
    for piece in ks.chunks_mut(ZEROS_LEN) {
        c.apply_keystream_b2b(&ZEROS[..piece.len()], piece)
            .expect("input and output of one length");
    }
}

/// An implementation of ChaCha20 (RFC 8439: 32-bit block counter from 0, zero nonce).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChaCha {
    /// The RustCrypto `chacha20` crate (AVX-512, AVX2 or SSE2, picked at run time).
    Crate,
    /// AWS-LC's `CRYPTO_chacha_20` (AVX2 8 blocks at a time, SSSE3, or plain code).
    #[cfg(feature = "aws-lc")]
    AwsLc,
}

impl ChaCha {
    /// The faster implementation on this CPU, decided once.
    pub fn chosen() -> ChaCha {
        static CHOSEN: OnceLock<ChaCha> = OnceLock::new();
        *CHOSEN.get_or_init(|| {
            #[cfg(feature = "aws-lc")]
            if !has_avx512() {
                return ChaCha::AwsLc;
            }
            ChaCha::Crate
        })
    }

    pub fn label(self) -> &'static str {
        match self {
            ChaCha::Crate => "chacha20 crate",
            #[cfg(feature = "aws-lc")]
            ChaCha::AwsLc => "AWS-LC",
        }
    }

    /// Bytes `[pos, pos + ks.len())` of the stream keyed by `key` into `ks`.
    pub fn fill(self, key: &[u8; 32], pos: u64, ks: &mut [u8]) {
        match self {
            ChaCha::Crate => {
                use chacha20::cipher::{KeyIvInit as _, StreamCipher as _, StreamCipherSeek as _};
                let mut c = chacha20::ChaCha20::new(key.into(), &[0u8; 12].into());
                c.seek(pos);
                c.write_keystream(ks);
            }
            #[cfg(feature = "aws-lc")]
            ChaCha::AwsLc => aws_lc_chacha(key, pos, ks),
        }
    }
}

#[cfg(feature = "aws-lc")]
fn has_avx512() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512vl")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

#[cfg(feature = "aws-lc")]
const BLOCK: usize = 64;
/// AES-CTR and AWS-LC only XOR their stream into an input: this many zeros serve as the
/// input of any call (a batch's stream is at most 32 KiB).
const ZEROS_LEN: usize = 64 << 10;
static ZEROS: [u8; ZEROS_LEN] = [0; ZEROS_LEN];

#[cfg(feature = "aws-lc")]
fn aws_lc_chacha(key: &[u8; 32], pos: u64, ks: &mut [u8]) {
    const NONCE: [u8; 12] = [0; 12];
    let chacha = |out: &mut [u8], block: u64| {
        // The shard's validation keeps every tensor's stream within the 32-bit block
        // counter (`TensorLock::max_units`), so `block` fits.
        debug_assert!(block + (out.len() / BLOCK) as u64 <= 1 << 32);
        debug_assert!(out.len() <= ZEROS_LEN);
        // SAFETY: `out` and `ZEROS` hold at least `out.len()` bytes, the key 32 and the
        // nonce 12, as the function reads them; it writes only `out`.
        unsafe {
            aws_lc_sys::CRYPTO_chacha_20(
                out.as_mut_ptr(),
                ZEROS.as_ptr(),
                out.len(),
                key.as_ptr(),
                NONCE.as_ptr(),
                block as u32,
            )
        }
    };
    let mut block = pos / BLOCK as u64;
    let skip = (pos % BLOCK as u64) as usize;
    let mut rest = ks;
    if skip != 0 {
        let mut first = [0u8; BLOCK];
        chacha(&mut first, block);
        let n = (BLOCK - skip).min(rest.len());
        rest[..n].copy_from_slice(&first[skip..skip + n]);
        first.zeroize();
        rest = &mut rest[n..];
        block += 1;
    }
    for piece in rest.chunks_mut(ZEROS_LEN) {
        chacha(piece, block);
        block += (ZEROS_LEN / BLOCK) as u64;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// RFC 8439 appendix A.1, test vector 3: the key all zero but its last byte 1, the
    /// nonce zero (as lock v2's), block 1.
    #[test]
    fn both_implementations_give_the_rfc_8439_stream() {
        let mut key = [0u8; 32];
        key[31] = 1;
        let expected = hex::decode(
            "3aeb5224ecf849929b9d828db1ced4dd832025e8018b8160b82284f3c949aa5a\
             8eca00bbb4a73bdad192b5c42f73f2fd4e273644c8b36125a64addeb006c13a0",
        )
        .expect("hex");
        #[cfg(feature = "aws-lc")]
        let all = [ChaCha::Crate, ChaCha::AwsLc];
        #[cfg(not(feature = "aws-lc"))]
        let all = [ChaCha::Crate];
        for imp in all {
            let mut ks = [0u8; 64];
            imp.fill(&key, 64, &mut ks);
            assert_eq!(ks.to_vec(), expected, "{}", imp.label());
        }
    }

    /// Any position and length, across block and zero-buffer boundaries, gives the same
    /// bytes from both implementations.
    #[cfg(feature = "aws-lc")]
    #[test]
    fn both_implementations_agree_at_any_position() {
        let mut rng = crate::testkit::SplitMix(11);
        let key: [u8; 32] = std::array::from_fn(|i| i as u8 * 7 + 3);
        for round in 0..200 {
            let pos = match round % 4 {
                0 => rng.below(1 << 20),
                1 => rng.below(4096) * 64,
                2 => (1u64 << 32) * 64 - 70_000 + rng.below(1000),
                _ => rng.below(1 << 38),
            };
            let len = match round % 3 {
                0 => rng.below(130) as usize,
                1 => rng.below(40_000) as usize,
                _ => ZEROS_LEN + rng.below(3 * BLOCK as u64) as usize,
            };
            let len = len.min(((1u64 << 32) * 64 - pos) as usize);
            let mut a = vec![0u8; len];
            let mut b = vec![0xAAu8; len];
            ChaCha::Crate.fill(&key, pos, &mut a);
            ChaCha::AwsLc.fill(&key, pos, &mut b);
            assert!(a == b, "pos {pos} len {len}: the two streams differ");
        }
    }
}
