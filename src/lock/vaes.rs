//! Lock v1's AES-256-CTR stream with VAES: 16 blocks in flight, four to an instruction on
//! 512-bit vectors (AVX-512 CPUs), two on 256-bit ones (AVX2 CPUs with VAES, such as Zen 3).
//!
//! Why our own: the stream is most of a v1 decode (2-4 bytes of it per plain byte), and no
//! well-kept library makes it at the CPU's pace in a portable build. AWS-LC and OpenSSL run
//! CTR on 128-bit AES-NI (7.5-8.2 GB/s on one core of an AVX-512 EPYC); the `aes` crate
//! 0.9's VAES backend is fast only when the whole build targets the CPU. This is the same
//! instruction sequence those use, picked at run time: 16 GB/s there on 512-bit vectors,
//! 8.7-11.3 on 256-bit ones (that CPU splits them). What we write is the counter layout
//! (lock v1: a 128-bit big-endian counter from 0) and the AES-256 key expansion with
//! `AESKEYGENASSIST` (Intel's AES-NI white paper); the tests compare every byte with the
//! `aes` crate's stream at any position and length.

use std::arch::x86_64::*;

use zeroize::Zeroize;

const BLOCK: usize = 16;
/// Blocks made per step: four 512-bit vectors of four, or eight 256-bit ones of two.
const GROUP_BLOCKS: usize = 16;
const GROUP: usize = GROUP_BLOCKS * BLOCK;
const ROUNDS: usize = 14;

/// The vectors a kernel runs VAES on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Width {
    /// 512 bits: AVX-512 F and BW.
    Bits512,
    /// 256 bits: AVX2.
    Bits256,
}

impl Width {
    /// Whether this CPU runs the kernel of this width (and AES-NI, for the key expansion).
    pub fn available(self) -> bool {
        let vaes = std::arch::is_x86_feature_detected!("vaes")
            && std::arch::is_x86_feature_detected!("aes");
        vaes && match self {
            Width::Bits512 => {
                std::arch::is_x86_feature_detected!("avx512f")
                    && std::arch::is_x86_feature_detected!("avx512bw")
            }
            Width::Bits256 => std::arch::is_x86_feature_detected!("avx2"),
        }
    }
}

/// Bytes `[pos, pos + ks.len())` of the AES-256-CTR stream keyed by `key` into `ks`, by the
/// kernel of `width`.
///
/// # Panics
/// If the CPU lacks the instructions (`width.available()` is false).
pub fn fill(width: Width, key: &[u8; 32], pos: u64, ks: &mut [u8]) {
    assert!(
        width.available(),
        "AES-256-CTR by VAES ({width:?}) on a CPU without it"
    );
    let mut schedule = [0u8; (ROUNDS + 1) * BLOCK];
    // SAFETY: `available` checked every feature the functions enable.
    unsafe { expand_key(key, &mut schedule) };
    // SAFETY: as above; `out` is whole groups.
    let groups = |counter: u64, out: &mut [u8]| unsafe {
        match width {
            Width::Bits512 => groups_512(&schedule, counter, out),
            Width::Bits256 => groups_256(&schedule, counter, out),
        }
    };
    let mut counter = pos / BLOCK as u64;
    let skip = (pos % BLOCK as u64) as usize;
    let mut rest = ks;
    let mut spare = [0u8; GROUP];
    // A start mid-block, and a tail short of a group, take a whole group into `spare`.
    let mut partial = |rest: &mut [u8], counter: &mut u64, from: usize| -> usize {
        groups(*counter, &mut spare);
        let n = (GROUP - from).min(rest.len());
        rest[..n].copy_from_slice(&spare[from..from + n]);
        *counter += GROUP_BLOCKS as u64;
        n
    };
    if skip != 0 {
        let n = partial(rest, &mut counter, skip);
        rest = &mut rest[n..];
    }
    let whole = rest.len() / GROUP * GROUP;
    let (body, tail) = rest.split_at_mut(whole);
    groups(counter, body);
    counter += (whole / BLOCK) as u64;
    if !tail.is_empty() {
        partial(tail, &mut counter, 0);
    }
    spare.zeroize();
    schedule.zeroize();
}

/// AES-256's 15 round keys from `key` into `schedule`, in the byte order `AESENC` takes.
#[target_feature(enable = "aes,sse2")]
unsafe fn expand_key(key: &[u8; 32], schedule: &mut [u8; (ROUNDS + 1) * BLOCK]) {
    // The previous round key of the same parity, each 32-bit word XORed with all the
    // words below it, then with `t` (the assist's output broadcast).
    #[inline(always)]
    unsafe fn next(prev: __m128i, t: __m128i) -> __m128i {
        let mut a = prev;
        a = _mm_xor_si128(a, _mm_slli_si128(a, 4));
        a = _mm_xor_si128(a, _mm_slli_si128(a, 8));
        _mm_xor_si128(a, t)
    }
    let mut rk = [_mm_setzero_si128(); ROUNDS + 1];
    rk[0] = _mm_loadu_si128(key.as_ptr().cast());
    rk[1] = _mm_loadu_si128(key.as_ptr().add(BLOCK).cast());
    // Even round keys take RotWord(SubWord) of the last word with the round constant;
    // odd ones SubWord alone.
    macro_rules! even {
        ($i:expr, $rcon:expr) => {
            let t = _mm_shuffle_epi32(_mm_aeskeygenassist_si128(rk[$i - 1], $rcon), 0xff);
            rk[$i] = next(rk[$i - 2], t);
        };
    }
    macro_rules! odd {
        ($i:expr) => {
            let t = _mm_shuffle_epi32(_mm_aeskeygenassist_si128(rk[$i - 1], 0), 0xaa);
            rk[$i] = next(rk[$i - 2], t);
        };
    }
    even!(2, 0x01);
    odd!(3);
    even!(4, 0x02);
    odd!(5);
    even!(6, 0x04);
    odd!(7);
    even!(8, 0x08);
    odd!(9);
    even!(10, 0x10);
    odd!(11);
    even!(12, 0x20);
    odd!(13);
    even!(14, 0x40);
    for (i, k) in rk.iter().enumerate() {
        _mm_storeu_si128(schedule.as_mut_ptr().add(i * BLOCK).cast(), *k);
    }
}

/// The stream from block `counter` on into `out`, whole groups of 16 blocks, on 512-bit
/// vectors.
#[target_feature(enable = "avx512f,avx512bw,vaes,aes")]
unsafe fn groups_512(schedule: &[u8; (ROUNDS + 1) * BLOCK], counter: u64, out: &mut [u8]) {
    debug_assert_eq!(out.len() % GROUP, 0);
    debug_assert!(counter.checked_add((out.len() / BLOCK) as u64).is_some());
    let mut blocks = Blocks512::from_schedule(schedule, counter);
    for group in out.chunks_exact_mut(GROUP) {
        for (j, v) in blocks.next_16().into_iter().enumerate() {
            _mm512_storeu_si512(group.as_mut_ptr().add(j * 4 * BLOCK).cast(), v);
        }
    }
}

/// AES-256-CTR blocks in lock v1's counter layout, made 16 at a time in four 512-bit vectors
/// that hold the stream's bytes in order: the stream for [`fill`], and for the fused kernel
/// (`super::fused`), which unlocks codes with it in registers.
pub(super) struct Blocks512 {
    round_keys: [__m512i; ROUNDS + 1],
    /// Four counters, one a 128-bit lane, as (low 64 bits, high 64 bits = 0) in little-endian
    /// order: a tensor's stream is at most 2^64 bytes, so its blocks number at most 2^60 and
    /// the low half never carries.
    counters: __m512i,
}

impl Blocks512 {
    /// The stream keyed by `key` from block `counter` on.
    #[target_feature(enable = "avx512f,avx512bw,vaes,aes")]
    pub(super) fn new(key: &[u8; 32], counter: u64) -> Blocks512 {
        let mut schedule = [0u8; (ROUNDS + 1) * BLOCK];
        // SAFETY: this function's features include AES-NI and SSE2.
        unsafe { expand_key(key, &mut schedule) };
        let blocks = Blocks512::from_schedule(&schedule, counter);
        schedule.zeroize();
        blocks
    }

    #[target_feature(enable = "avx512f,avx512bw,vaes,aes")]
    fn from_schedule(schedule: &[u8; (ROUNDS + 1) * BLOCK], counter: u64) -> Blocks512 {
        let round_keys = std::array::from_fn(|i| {
            // SAFETY: round key `i` lies within the schedule; unaligned load.
            let key = unsafe { _mm_loadu_si128(schedule.as_ptr().add(i * BLOCK).cast()) };
            _mm512_broadcast_i32x4(key)
        });
        let c = counter as i64;
        Blocks512 {
            round_keys,
            counters: _mm512_setr_epi64(
                c,
                0,
                c.wrapping_add(1),
                0,
                c.wrapping_add(2),
                0,
                c.wrapping_add(3),
                0,
            ),
        }
    }

    /// The next 16 blocks: vector `j` holds blocks `4j .. 4j + 4` of the step.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,vaes,aes")]
    pub(super) fn next_16(&mut self) -> [__m512i; 4] {
        // Reversing a lane's 16 bytes makes the big-endian block of its counter.
        let reverse = _mm512_broadcast_i32x4(_mm_setr_epi8(
            15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0,
        ));
        let four = _mm512_setr_epi64(4, 0, 4, 0, 4, 0, 4, 0);
        let k = &self.round_keys;
        let mut b = [_mm512_setzero_si512(); 4];
        for v in b.iter_mut() {
            *v = _mm512_xor_si512(_mm512_shuffle_epi8(self.counters, reverse), k[0]);
            self.counters = _mm512_add_epi64(self.counters, four);
        }
        for rk in &k[1..ROUNDS] {
            for v in b.iter_mut() {
                *v = _mm512_aesenc_epi128(*v, *rk);
            }
        }
        b.map(|v| _mm512_aesenclast_epi128(v, k[ROUNDS]))
    }
}

impl Drop for Blocks512 {
    fn drop(&mut self) {
        self.round_keys.zeroize();
    }
}

/// The same on 256-bit vectors.
#[target_feature(enable = "avx2,vaes,aes")]
unsafe fn groups_256(schedule: &[u8; (ROUNDS + 1) * BLOCK], counter: u64, out: &mut [u8]) {
    debug_assert_eq!(out.len() % GROUP, 0);
    debug_assert!(counter.checked_add((out.len() / BLOCK) as u64).is_some());
    let mut k = [_mm256_setzero_si256(); ROUNDS + 1];
    for (i, rk) in k.iter_mut().enumerate() {
        *rk = _mm256_broadcastsi128_si256(_mm_loadu_si128(schedule.as_ptr().add(i * BLOCK).cast()));
    }
    let reverse = _mm256_setr_epi8(
        15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 15, 14, 13, 12, 11, 10, 9, 8, 7, 6,
        5, 4, 3, 2, 1, 0,
    );
    let c = counter as i64;
    let mut lanes = _mm256_setr_epi64x(c, 0, c.wrapping_add(1), 0);
    let two = _mm256_setr_epi64x(2, 0, 2, 0);
    for group in out.chunks_exact_mut(GROUP) {
        let mut b = [_mm256_setzero_si256(); 8];
        for v in b.iter_mut() {
            *v = _mm256_xor_si256(_mm256_shuffle_epi8(lanes, reverse), k[0]);
            lanes = _mm256_add_epi64(lanes, two);
        }
        for rk in &k[1..ROUNDS] {
            for v in b.iter_mut() {
                *v = _mm256_aesenc_epi128(*v, *rk);
            }
        }
        for (j, v) in b.iter().enumerate() {
            let last = _mm256_aesenclast_epi128(*v, k[ROUNDS]);
            _mm256_storeu_si256(group.as_mut_ptr().add(j * 2 * BLOCK).cast(), last);
        }
    }
}
