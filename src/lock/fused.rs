//! Lock v2's 16-bit floats (BF16, F16) unlocked as their ChaCha20 blocks are made, on
//! AVX-512: the key stream never leaves the registers.
//!
//! Why: these are most of a checkpoint's bytes, and each plain byte takes two bytes of key
//! stream. The general path writes the stream to a buffer (the cipher's last step there is a
//! 16 x 16 transpose of 32-bit words), then reads it back, splits each word into 16-bit
//! halves and unlocks. Here the 16 blocks' words stay one state word per vector (lane `b`
//! holds word `i` of block `b`, as OpenSSL's 16-block path keeps them), each word becomes its
//! 16-bit offset in place, and only the offsets, two to a 32-bit lane, are transposed into
//! the codes' order: an 8 x 16 transpose instead of 16 x 16, and no stream in memory.
//!
//! The arithmetic is `arith`'s: code `j` of the tensor takes stream word `j` (word `j % 16` of
//! block `j / 16`), `off = (word * span) >> 32`, `plain = (index - off) mod span`. The tests
//! compare every byte with the general path at any position and domain.

use std::arch::x86_64::*;

use zeroize::Zeroize;

/// Codes per group: 16 blocks of 16 words, one word a code.
pub(super) const GROUP_CODES: u64 = 256;
const GROUP_BYTES: usize = 2 * GROUP_CODES as usize;

/// Whether this CPU runs the kernel.
pub(super) fn available() -> bool {
    std::arch::is_x86_feature_detected!("avx512f")
        && std::arch::is_x86_feature_detected!("avx512bw")
}

/// Unlocks `data`, whole groups of 16-bit sign-magnitude codes of one tensor, the first of
/// them code `first_code` (a multiple of [`GROUP_CODES`]), under the ChaCha20 key `key`,
/// domain `m` and `span = 2m < 2^16`. Returns the first code outside the domain, counted
/// from the start of `data`; the groups before it are unlocked, the rest left as they were
/// (a caller drops the bytes on an error).
///
/// # Safety
/// The CPU must have AVX-512 F and BW ([`available`]).
#[target_feature(enable = "avx512f,avx512bw")]
pub(super) unsafe fn unlock_groups(
    key: &[u8; 32],
    first_code: u64,
    m: u16,
    span: u16,
    data: &mut [u8],
) -> Option<usize> {
    debug_assert_eq!(first_code % GROUP_CODES, 0);
    debug_assert_eq!(data.len() % GROUP_BYTES, 0);
    debug_assert!(u32::from(m) * 2 == u32::from(span));
    let mut key_words = [0i32; 8];
    for (w, b) in key_words.iter_mut().zip(key.chunks_exact(4)) {
        *w = i32::from_le_bytes(b.try_into().expect("4 bytes"));
    }
    let mut key_vectors: [__m512i; 8] = std::array::from_fn(|i| _mm512_set1_epi32(key_words[i]));
    key_words.zeroize();
    let outside = unlock_with(&key_vectors, first_code, m, span, data);
    key_vectors.zeroize();
    outside
}

#[inline]
#[target_feature(enable = "avx512f,avx512bw")]
fn unlock_with(
    key_vectors: &[__m512i; 8],
    first_code: u64,
    m: u16,
    span: u16,
    data: &mut [u8],
) -> Option<usize> {
    let lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    let m_v = _mm512_set1_epi16(m as i16);
    let span_v = _mm512_set1_epi16(span as i16);
    let magnitude = _mm512_set1_epi16(0x7FFF);
    let to_negative = _mm512_set1_epi16(0x8000u16.wrapping_sub(m) as i16);
    let span_words = _mm512_set1_epi32(i32::from(span));
    let mut block = first_code / 16;
    for (g, group) in data.chunks_exact_mut(GROUP_BYTES).enumerate() {
        // The shard's validation keeps every stream within the 32-bit block counter.
        let counter = _mm512_add_epi32(_mm512_set1_epi32(block as u32 as i32), lanes);
        let words = chacha20_words(key_vectors, counter);
        let offsets = transpose_offsets(std::array::from_fn(|p| {
            pair_offsets(words[2 * p], words[2 * p + 1], span_words)
        }));
        // Every code of the group checked before any changes: one comparison a group.
        let mut largest = _mm512_setzero_si512();
        for codes in group.chunks_exact(64) {
            // SAFETY: `codes` holds the 64 bytes read; unaligned access.
            let code = unsafe { _mm512_loadu_si512(codes.as_ptr() as *const __m512i) };
            largest = _mm512_max_epu16(largest, _mm512_and_si512(code, magnitude));
        }
        if _mm512_cmpge_epu16_mask(largest, m_v) != 0 {
            // The largest magnitude is one of the group's, so `position` finds it.
            let first = group
                .chunks_exact(2)
                .position(|v| u16::from_le_bytes([v[0], v[1]]) & 0x7FFF >= m)
                .unwrap_or(0);
            return Some(g * GROUP_CODES as usize + first);
        }
        for (off, codes) in offsets.into_iter().zip(group.chunks_exact_mut(64)) {
            let at = codes.as_mut_ptr() as *mut __m512i;
            // SAFETY: `codes` holds the 64 bytes read and written; unaligned access.
            let code = unsafe { _mm512_loadu_si512(at) };
            let mag = _mm512_and_si512(code, magnitude);
            let sign_m = _mm512_and_si512(_mm512_srai_epi16::<15>(code), m_v);
            let index = _mm512_add_epi16(mag, sign_m);
            let diff = _mm512_sub_epi16(index, off);
            let borrow = _mm512_cmplt_epu16_mask(index, off);
            let plain = _mm512_mask_add_epi16(diff, borrow, diff, span_v);
            let high = _mm512_cmpge_epu16_mask(plain, m_v);
            let out = _mm512_mask_add_epi16(plain, high, plain, to_negative);
            // SAFETY: as the load.
            unsafe { _mm512_storeu_si512(at, out) };
        }
        block += 16;
    }
    None
}

const CONSTANTS: [i32; 4] = [0x6170_7865, 0x3320_646e, 0x7962_2d32, 0x6b20_6574];

/// Words 0..16 of the 16 blocks whose counters `counter` holds (nonce zero), lane `b` of
/// vector `i` word `i` of block `b`.
#[inline]
#[target_feature(enable = "avx512f")]
fn chacha20_words(key: &[__m512i; 8], counter: __m512i) -> [__m512i; 16] {
    let zero = _mm512_setzero_si512();
    let input: [__m512i; 16] = [
        _mm512_set1_epi32(CONSTANTS[0]),
        _mm512_set1_epi32(CONSTANTS[1]),
        _mm512_set1_epi32(CONSTANTS[2]),
        _mm512_set1_epi32(CONSTANTS[3]),
        key[0],
        key[1],
        key[2],
        key[3],
        key[4],
        key[5],
        key[6],
        key[7],
        counter,
        zero,
        zero,
        zero,
    ];
    let mut x = input;
    macro_rules! quarter {
        ($a:expr, $b:expr, $c:expr, $d:expr) => {
            x[$a] = _mm512_add_epi32(x[$a], x[$b]);
            x[$d] = _mm512_rol_epi32::<16>(_mm512_xor_si512(x[$d], x[$a]));
            x[$c] = _mm512_add_epi32(x[$c], x[$d]);
            x[$b] = _mm512_rol_epi32::<12>(_mm512_xor_si512(x[$b], x[$c]));
            x[$a] = _mm512_add_epi32(x[$a], x[$b]);
            x[$d] = _mm512_rol_epi32::<8>(_mm512_xor_si512(x[$d], x[$a]));
            x[$c] = _mm512_add_epi32(x[$c], x[$d]);
            x[$b] = _mm512_rol_epi32::<7>(_mm512_xor_si512(x[$b], x[$c]));
        };
    }
    for _ in 0..10 {
        quarter!(0, 4, 8, 12);
        quarter!(1, 5, 9, 13);
        quarter!(2, 6, 10, 14);
        quarter!(3, 7, 11, 15);
        quarter!(0, 5, 10, 15);
        quarter!(1, 6, 11, 12);
        quarter!(2, 7, 8, 13);
        quarter!(3, 4, 9, 14);
    }
    std::array::from_fn(|i| _mm512_add_epi32(x[i], input[i]))
}

/// The offsets of two stream words per lane (`even` word `2p`, `odd` word `2p + 1` of each
/// block) as the two 16-bit halves of one 32-bit lane: codes `16b + 2p` and `16b + 2p + 1`,
/// in the order they sit in memory.
#[inline]
#[target_feature(enable = "avx512f")]
fn pair_offsets(even: __m512i, odd: __m512i, span: __m512i) -> __m512i {
    _mm512_or_si512(
        offsets(even, span),
        _mm512_slli_epi32::<16>(offsets(odd, span)),
    )
}

/// `(word * span) >> 32` of each 32-bit word (below 2^16, as `span` is), by 32 x 32-bit
/// products of the even words and of the odd ones. 16-bit products of the words' halves
/// need a carry fixed by a mask: the decode ran at 2.13 GB/s with them, 2.49 with these.
#[inline]
#[target_feature(enable = "avx512f")]
fn offsets(word: __m512i, span: __m512i) -> __m512i {
    let even = _mm512_mul_epu32(word, span);
    let odd = _mm512_mul_epu32(_mm512_srli_epi64::<32>(word), span);
    _mm512_mask_blend_epi32(0xAAAA, _mm512_srli_epi64::<32>(even), odd)
}

/// From `pairs[p]` (lane `b`: the offsets of codes `16b + 2p`, `16b + 2p + 1`) to the offsets
/// of codes `32k .. 32k + 32` in vector `k`, as the codes sit in memory.
#[inline]
#[target_feature(enable = "avx512f")]
fn transpose_offsets(pairs: [__m512i; 8]) -> [__m512i; 8] {
    let p = pairs;
    // Within each 128-bit lane (blocks 4q .. 4q + 4): t[2r] and t[2r + 1] interleave pairs
    // 2r and 2r + 1.
    let t = [
        _mm512_unpacklo_epi32(p[0], p[1]),
        _mm512_unpackhi_epi32(p[0], p[1]),
        _mm512_unpacklo_epi32(p[2], p[3]),
        _mm512_unpackhi_epi32(p[2], p[3]),
        _mm512_unpacklo_epi32(p[4], p[5]),
        _mm512_unpackhi_epi32(p[4], p[5]),
        _mm512_unpacklo_epi32(p[6], p[7]),
        _mm512_unpackhi_epi32(p[6], p[7]),
    ];
    // u[r] (r < 4): pairs 0..4 of block 4q + r in lane q; u[4 + r]: pairs 4..8.
    let u = [
        _mm512_unpacklo_epi64(t[0], t[2]),
        _mm512_unpackhi_epi64(t[0], t[2]),
        _mm512_unpacklo_epi64(t[1], t[3]),
        _mm512_unpackhi_epi64(t[1], t[3]),
        _mm512_unpacklo_epi64(t[4], t[6]),
        _mm512_unpackhi_epi64(t[4], t[6]),
        _mm512_unpacklo_epi64(t[5], t[7]),
        _mm512_unpackhi_epi64(t[5], t[7]),
    ];
    // Vector k = 2q + s holds blocks 4q + 2s and 4q + 2s + 1: lanes q of u[2s], u[4 + 2s],
    // u[2s + 1], u[5 + 2s]. A 4 x 4 transpose of 128-bit lanes for each s.
    let lanes4 = |a: __m512i, b: __m512i, c: __m512i, d: __m512i| -> [__m512i; 4] {
        // ab: lanes a0 a1 b0 b1 / a2 a3 b2 b3; then pick lanes across.
        let ab_lo = _mm512_shuffle_i32x4::<0b01_00_01_00>(a, b);
        let ab_hi = _mm512_shuffle_i32x4::<0b11_10_11_10>(a, b);
        let cd_lo = _mm512_shuffle_i32x4::<0b01_00_01_00>(c, d);
        let cd_hi = _mm512_shuffle_i32x4::<0b11_10_11_10>(c, d);
        [
            _mm512_shuffle_i32x4::<0b10_00_10_00>(ab_lo, cd_lo),
            _mm512_shuffle_i32x4::<0b11_01_11_01>(ab_lo, cd_lo),
            _mm512_shuffle_i32x4::<0b10_00_10_00>(ab_hi, cd_hi),
            _mm512_shuffle_i32x4::<0b11_01_11_01>(ab_hi, cd_hi),
        ]
    };
    let even = lanes4(u[0], u[4], u[1], u[5]);
    let odd = lanes4(u[2], u[6], u[3], u[7]);
    [
        even[0], odd[0], even[1], odd[1], even[2], odd[2], even[3], odd[3],
    ]
}
