//! Key streams: AES-256-CTR for lock v1, ChaCha20 for lock v2. Both seek to any byte, so
//! any range of a tensor decodes on its own.
//!
//! Each cipher has two implementations, and `chosen` picks one per process for the CPU.
//! ChaCha20: the `chacha20` crate where the CPU has AVX-512 (its AVX-512 backend, 7.2-7.5
//! GB/s on one core where we measured it), and elsewhere AWS-LC's assembly (already linked
//! for TLS), which keeps 8 blocks in flight on AVX2 where the crate keeps 4: 2.08 against
//! 3.2 GB/s on one core of an AVX2-only EPYC (`cargo bench --bench decode`). AES-256-CTR:
//! our VAES kernel (`super::vaes`) on the widest vectors the CPU has VAES for, 16 GB/s on
//! one core of an AVX-512 EPYC; elsewhere AWS-LC's wherever it is linked, whose AES-NI code ran at
//! 7.5-8.2 GB/s there against 4.6-5.5 for the `aes` crate 0.8 (the crate's 0.9 VAES backend
//! reached 10.7 only when built for that CPU alone, and 4.4-5.9 as a portable build). The
//! key stream sets the pace of a decode (2-4 bytes of it per plain byte), so this is most
//! of the decode's speed.

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
        Version::V1 => AesCtr::chosen().fill(key, pos, ks),
        Version::V2 => ChaCha::chosen().fill(key, pos, ks),
    }
}

/// An implementation of AES-256-CTR as lock v1 keys it (a 128-bit big-endian counter from
/// 0, so byte `pos` of the stream is byte `pos % 16` of block `pos / 16`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AesCtr {
    /// The RustCrypto `aes` and `ctr` crates (AES-NI picked at run time).
    Crate,
    /// AWS-LC's `AES_ctr128_encrypt` (AES-NI 8 blocks at a time, vector-permute AES, or
    /// plain code, picked at run time).
    #[cfg(feature = "aws-lc")]
    AwsLc,
    /// Our VAES kernel on 256-bit vectors (`super::vaes`), where the CPU has AVX2 and VAES.
    #[cfg(target_arch = "x86_64")]
    Vaes256,
    /// Our VAES kernel on 512-bit vectors, where the CPU has AVX-512 and VAES.
    #[cfg(target_arch = "x86_64")]
    Vaes512,
}

impl AesCtr {
    /// The fastest implementation this CPU runs, decided once: VAES on the widest vectors
    /// it has, else AWS-LC's wherever it is linked.
    pub fn chosen() -> AesCtr {
        static CHOSEN: OnceLock<AesCtr> = OnceLock::new();
        *CHOSEN.get_or_init(|| {
            let all = AesCtr::available();
            *all.last().expect("the crate's is always there")
        })
    }

    /// The implementations this CPU runs, slowest first.
    pub fn available() -> Vec<AesCtr> {
        let mut all = vec![AesCtr::Crate];
        #[cfg(feature = "aws-lc")]
        all.push(AesCtr::AwsLc);
        #[cfg(target_arch = "x86_64")]
        {
            use super::vaes::Width;
            if Width::Bits256.available() {
                all.push(AesCtr::Vaes256);
            }
            if Width::Bits512.available() {
                all.push(AesCtr::Vaes512);
            }
        }
        all
    }

    pub fn label(self) -> &'static str {
        match self {
            AesCtr::Crate => "aes crate",
            #[cfg(feature = "aws-lc")]
            AesCtr::AwsLc => "AWS-LC",
            #[cfg(target_arch = "x86_64")]
            AesCtr::Vaes256 => "VAES on AVX2, ours",
            #[cfg(target_arch = "x86_64")]
            AesCtr::Vaes512 => "VAES on AVX-512, ours",
        }
    }

    /// Bytes `[pos, pos + ks.len())` of the stream keyed by `key` into `ks`.
    pub fn fill(self, key: &[u8; 32], pos: u64, ks: &mut [u8]) {
        match self {
            AesCtr::Crate => {
                // cipher 0.4 has no write_keystream: the stream XORed onto zeros, read from
                // `ZEROS` rather than written into `ks` first (one pass over the batch fewer).
                let mut c = Aes256Ctr::new(key.into(), &[0u8; 16].into());
                c.seek(pos);
                for piece in ks.chunks_mut(ZEROS_LEN) {
                    c.apply_keystream_b2b(&ZEROS[..piece.len()], piece)
                        .expect("input and output of one length");
                }
            }
            #[cfg(feature = "aws-lc")]
            AesCtr::AwsLc => aws_lc_aes_ctr(key, pos, ks),
            #[cfg(target_arch = "x86_64")]
            AesCtr::Vaes256 => super::vaes::fill(super::vaes::Width::Bits256, key, pos, ks),
            #[cfg(target_arch = "x86_64")]
            AesCtr::Vaes512 => super::vaes::fill(super::vaes::Width::Bits512, key, pos, ks),
        }
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
fn aws_lc_aes_ctr(key: &[u8; 32], pos: u64, ks: &mut [u8]) {
    const AES_BLOCK: usize = 16;
    let mut schedule = aws_lc_sys::AES_KEY {
        rd_key: [0; 60],
        rounds: 0,
    };
    // SAFETY: the key holds 32 bytes (256 bits), and `schedule` is an `AES_KEY` the
    // function writes.
    let set = unsafe { aws_lc_sys::AES_set_encrypt_key(key.as_ptr(), 256, &mut schedule) };
    assert_eq!(set, 0, "AES_set_encrypt_key refused a 256-bit key");
    let mut counter = u128::from(pos / AES_BLOCK as u64).to_be_bytes();
    let mut ecount = [0u8; AES_BLOCK];
    let mut num: std::os::raw::c_uint = 0;
    // Each call XORs the stream from `counter` onto zeros and advances it; every call but
    // the last covers whole blocks, so each starts on a block (`num` 0).
    let ctr = |out: &mut [u8]| {
        debug_assert!(out.len() <= ZEROS_LEN);
        // SAFETY: `out` and `ZEROS` hold at least `out.len()` bytes; the schedule, the
        // 16-byte counter, the 16-byte block buffer and `num` are the function's to read
        // and write.
        unsafe {
            aws_lc_sys::AES_ctr128_encrypt(
                ZEROS.as_ptr(),
                out.as_mut_ptr(),
                out.len(),
                &schedule,
                counter.as_mut_ptr(),
                ecount.as_mut_ptr(),
                &mut num,
            )
        }
    };
    let skip = (pos % AES_BLOCK as u64) as usize;
    from_block_start::<AES_BLOCK>(skip, ks, ctr);
    ecount.zeroize();
    schedule.rd_key.zeroize();
}

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
    from_block_start::<BLOCK>(skip, ks, |out| {
        chacha(out, block);
        block += out.len().div_ceil(BLOCK) as u64;
    });
}

/// Fills `ks` with a stream that begins `skip` bytes into a block of `B` bytes, where
/// `next` writes the stream onward from a block boundary, one call after another (at most
/// `ZEROS_LEN` bytes a call, every call but the last whole blocks): a start mid-block takes
/// its whole block into a buffer and keeps the tail.
#[cfg(feature = "aws-lc")]
fn from_block_start<const B: usize>(skip: usize, ks: &mut [u8], mut next: impl FnMut(&mut [u8])) {
    let mut rest = ks;
    if skip != 0 {
        let mut first = [0u8; B];
        next(&mut first);
        let n = (B - skip).min(rest.len());
        rest[..n].copy_from_slice(&first[skip..skip + n]);
        first.zeroize();
        rest = &mut rest[n..];
    }
    for piece in rest.chunks_mut(ZEROS_LEN) {
        next(piece);
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

    /// Any position and length, across block, group and zero-buffer boundaries and the
    /// 32-bit counter's carry, gives the same AES-256-CTR stream from every implementation
    /// this CPU runs (the crate's stream is the one its own test vectors check).
    #[test]
    fn every_aes_implementation_agrees_at_any_position() {
        let all = AesCtr::available();
        eprintln!("AES-256-CTR against the crate: {:?}", &all[1..]);
        let mut rng = crate::testkit::SplitMix(12);
        let key: [u8; 32] = std::array::from_fn(|i| i as u8 * 5 + 1);
        for round in 0..400 {
            let pos = match round % 4 {
                0 => rng.below(1 << 20),
                1 => rng.below(4096) * 16,
                2 => (1u64 << 32) * 16 - 70_000 + rng.below(140_000),
                _ => rng.below(1 << 40),
            };
            let len = match round % 4 {
                0 => rng.below(40) as usize,
                1 => rng.below(600) as usize,
                2 => rng.below(40_000) as usize,
                _ => ZEROS_LEN + rng.below(300) as usize,
            };
            let mut a = vec![0u8; len];
            AesCtr::Crate.fill(&key, pos, &mut a);
            for &imp in &all[1..] {
                let mut b = vec![0xAAu8; len];
                imp.fill(&key, pos, &mut b);
                assert!(a == b, "pos {pos} len {len}: {} differs", imp.label());
            }
        }
    }

    /// The stream's first block is AES-256 of the all-zero counter block: under the zero
    /// key, dc95c078... (the known answer for a zero key and a zero block).
    #[test]
    fn every_aes_implementation_gives_the_known_first_block() {
        let expected = hex::decode("dc95c078a2408989ad48a21492842087").expect("hex");
        for imp in AesCtr::available() {
            let mut ks = [0u8; 16];
            imp.fill(&[0u8; 32], 0, &mut ks);
            assert_eq!(ks.to_vec(), expected, "{}", imp.label());
        }
    }
}
