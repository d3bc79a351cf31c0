//! Codes of 16 bits or fewer unlocked as their key stream is made, on AVX-512: the stream
//! never leaves the registers. Lock v2's (BF16, F16, I16 tables, FP8 floats, E8M0 scales, FP4
//! pairs) as their ChaCha20 blocks are made; lock v1's floats (BF16, F16, FP8) as their
//! AES-256-CTR blocks are made by VAES (`super::vaes::Blocks512`).
//!
//! Why: these are most of a checkpoint's bytes, and each plain byte takes two (16-bit codes),
//! four (8-bit) or eight (FP4 pairs) bytes of key stream. The general path writes the stream
//! to a buffer (the cipher's last step there is a 16 x 16 transpose of 32-bit words), then
//! reads it back and unlocks. Here the 16 blocks' words stay one state word per vector (lane
//! `b` holds word `i` of block `b`, as OpenSSL's 16-block path keeps them), each word becomes
//! its offset in place, and only the offsets, two, four or eight to a 32-bit lane, are
//! transposed into the codes' order: an 8 x 16, 4 x 16 or 2 x 16 transpose instead of
//! 16 x 16, and no stream in memory. (32-bit codes would need the whole 16 x 16 transpose of
//! their offsets, and keep the general path.)
//!
//! AES-256-CTR makes its blocks in the stream's order, four to a vector, so a vector of words is
//! the offsets of 16 consecutive codes: they are only packed to the codes' width (v1's group is
//! 64 codes, 16 blocks).
//!
//! The arithmetic is `arith`'s: code `j` of the tensor takes stream word `j` (for ChaCha20
//! word `j % 16` of block `j / 16`, for AES word `j % 4` of block `j / 4`),
//! `off = (word * span) >> 32`, `plain = (index - off) mod span`. The tests compare every byte
//! with the general path at any position and domain, for both versions.

use std::arch::x86_64::*;

use zeroize::Zeroize;

use super::lanes::{Fp4Pair, Kind, SignMagnitude, Unsigned};

/// Codes per group of lock v2: 16 ChaCha20 blocks of 16 words, one word a code.
const GROUP_CODES: usize = 256;
/// How far ahead of a group its kernel asks for the codes (bytes). A group's chain of cipher
/// rounds fills the core's window, leaving one or two loads in flight: codes in memory rather
/// than in the cache (a chunk unlocked in place after a read from the disk) would be waited for
/// line by line (docs/PERFORMANCE-LOG.md, "Lock v1's key stream"; 1-8 KiB measured alike).
const PREFETCH_AHEAD: usize = 2048;
/// Codes per group of lock v1: 16 AES blocks of 4 words.
const AES_GROUP_CODES: usize = 64;

/// The key stream a kernel makes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Cipher {
    /// Lock v2.
    ChaCha20,
    /// Lock v1 (floats only: `Codes::Float16` and `Codes::Float8`).
    Aes256Ctr,
}

impl Cipher {
    /// Whether this CPU runs the kernels of this cipher, asked once.
    pub(super) fn available(self) -> bool {
        static AVX512: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        let avx512 = *AVX512.get_or_init(|| {
            std::arch::is_x86_feature_detected!("avx512f")
                && std::arch::is_x86_feature_detected!("avx512bw")
        });
        match self {
            Cipher::ChaCha20 => avx512,
            Cipher::Aes256Ctr => super::vaes::Width::Bits512.available(),
        }
    }
}

/// A kernel: the codes it unlocks under the stream it makes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Kernel {
    pub(super) cipher: Cipher,
    pub(super) codes: Codes,
}

impl Kernel {
    /// Bytes of a unit: a code, or a byte of two FP4 codes.
    pub(super) fn unit_bytes(self) -> usize {
        self.codes.unit_bytes()
    }

    /// Units a group takes: the kernel's step, and the alignment in the tensor its first
    /// unit needs.
    pub(super) fn group_units(self) -> u64 {
        let codes = match self.cipher {
            Cipher::ChaCha20 => GROUP_CODES,
            Cipher::Aes256Ctr => AES_GROUP_CODES,
        } as u64;
        match self.codes {
            Codes::Fp4Pairs => codes / 2,
            _ => codes,
        }
    }
}

/// The codes the kernel unlocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Codes {
    /// 16-bit sign-magnitude floats (BF16, F16): `span = 2m < 2^16`.
    Float16,
    /// Unsigned 16-bit values (I16 index tables): `span = m <= 2^15`.
    Unsigned16,
    /// 8-bit sign-magnitude floats (F8_E4M3, F8_E5M2): `span = 2m`.
    Float8,
    /// Unsigned bytes (E8M0 scales): `span = m`, at most 256.
    Unsigned8,
    /// Two 4-bit sign-magnitude floats a byte (FP4 E2M1), low nibble first: `span = 2m`.
    Fp4Pairs,
}

impl Codes {
    /// Bytes of a unit: a code, or a byte of two FP4 codes.
    pub(super) fn unit_bytes(self) -> usize {
        match self {
            Codes::Float16 | Codes::Unsigned16 => 2,
            Codes::Float8 | Codes::Unsigned8 | Codes::Fp4Pairs => 1,
        }
    }
}

/// Where a kernel reads its codes and writes their plain values: the same bytes (in place), or
/// sealed bytes left as they are (a mapping of the sealed file's page cache) and as many bytes
/// to write, so the codes are read once, by the kernel, not copied out first.
#[derive(Clone, Copy)]
pub(super) struct Places<'a> {
    src: *const u8,
    dst: *mut u8,
    len: usize,
    _borrows: std::marker::PhantomData<&'a mut [u8]>,
}

impl<'a> Places<'a> {
    pub(super) fn in_place(data: &'a mut [u8]) -> Places<'a> {
        Places {
            src: data.as_ptr(),
            dst: data.as_mut_ptr(),
            len: data.len(),
            _borrows: std::marker::PhantomData,
        }
    }

    pub(super) fn from_to(src: &'a [u8], dst: &'a mut [u8]) -> Places<'a> {
        assert_eq!(src.len(), dst.len(), "as many bytes written as read");
        Places {
            src: src.as_ptr(),
            dst: dst.as_mut_ptr(),
            len: dst.len(),
            _borrows: std::marker::PhantomData,
        }
    }

    pub(super) fn len(&self) -> usize {
        self.len
    }
}

/// Unlocks `places`, whole groups of one tensor's codes (`kernel`), the first of them unit
/// `first_unit` (a multiple of [`Kernel::group_units`]), under the stream key `key` and domain
/// `m` (`span` as the codes set it). Returns the first unit outside the domain, counted from
/// the start; the groups before it are unlocked, the rest not written (a caller drops the
/// bytes on an error).
///
/// # Safety
/// The CPU must run the kernel's cipher ([`Cipher::available`]).
#[target_feature(enable = "avx512f,avx512bw")]
pub(super) unsafe fn unlock_groups(
    kernel: Kernel,
    key: &[u8; 32],
    first_unit: u64,
    m: u64,
    data: Places<'_>,
) -> Option<usize> {
    let group_units = kernel.group_units();
    debug_assert_eq!(first_unit % group_units, 0);
    debug_assert_eq!(data.len() % (group_units as usize * kernel.unit_bytes()), 0);
    match kernel.cipher {
        Cipher::ChaCha20 => unlock_chacha(kernel.codes, key, first_unit / group_units, m, data),
        // SAFETY: the caller checked that the CPU has VAES and AES-NI too.
        Cipher::Aes256Ctr => unsafe { unlock_aes(kernel.codes, key, first_unit, m, data) },
    }
}

/// [`unlock_groups`] under ChaCha20, from group `group` of the tensor.
#[target_feature(enable = "avx512f,avx512bw")]
fn unlock_chacha(
    codes: Codes,
    key: &[u8; 32],
    group: u64,
    m: u64,
    data: Places<'_>,
) -> Option<usize> {
    let mut key_words = [0i32; 8];
    for (w, b) in key_words.iter_mut().zip(key.chunks_exact(4)) {
        *w = i32::from_le_bytes(b.try_into().expect("4 bytes"));
    }
    let mut key_vectors: [__m512i; 8] = std::array::from_fn(|i| _mm512_set1_epi32(key_words[i]));
    key_words.zeroize();
    // Units of a group start on a group of 16 blocks of the stream.
    let mut stream = ChaChaStream {
        key: &key_vectors,
        block: group * 16,
    };
    let outside = match codes {
        Codes::Float16 => {
            debug_assert!(2 * m < 1 << 16);
            unlock_16::<true, 8>(m as u16, data, |span| stream.offsets_16(span))
        }
        Codes::Unsigned16 => {
            debug_assert!(m <= 1 << 15);
            unlock_16::<false, 8>(m as u16, data, |span| stream.offsets_16(span))
        }
        Codes::Float8 => {
            debug_assert!(2 * m <= 1 << 8);
            unlock_8::<true, 4>(m as u16, data, |span| stream.offsets_8(span))
        }
        Codes::Unsigned8 => {
            debug_assert!(m <= 1 << 8);
            unlock_8::<false, 4>(m as u16, data, |span| stream.offsets_8(span))
        }
        Codes::Fp4Pairs => {
            debug_assert!(m <= 8);
            unlock_fp4(stream, m as u8, data)
        }
    };
    key_vectors.zeroize();
    outside
}

/// [`unlock_groups`] under AES-256-CTR: lock v1's floats.
///
/// # Safety
/// The CPU must have VAES and AES-NI ([`Cipher::available`]).
#[target_feature(enable = "avx512f,avx512bw,vaes,aes")]
unsafe fn unlock_aes(
    codes: Codes,
    key: &[u8; 32],
    first_unit: u64,
    m: u64,
    data: Places<'_>,
) -> Option<usize> {
    // Code `j` takes bytes `4j .. 4j + 4` of the stream: block `j / 4`.
    let mut blocks = super::vaes::Blocks512::new(key, first_unit / 4);
    match codes {
        Codes::Float16 => {
            debug_assert!(2 * m < 1 << 16);
            unlock_16::<true, 2>(m as u16, data, |span| aes_offsets_16(&mut blocks, span))
        }
        Codes::Float8 => {
            debug_assert!(2 * m <= 1 << 8);
            unlock_8::<true, 1>(m as u16, data, |span| aes_offsets_8(&mut blocks, span))
        }
        Codes::Unsigned16 | Codes::Unsigned8 | Codes::Fp4Pairs => {
            unreachable!("lock v1 locks floats only")
        }
    }
}

/// The offsets of the next 64 codes, 16-bit, 32 a vector in the codes' order.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,vaes,aes")]
fn aes_offsets_16(blocks: &mut super::vaes::Blocks512, span: __m512i) -> [__m512i; 2] {
    let off = blocks.next_16().map(|words| offsets(words, span));
    // A pack works within each 128-bit lane: lane q holds codes 4q .. 4q + 4 of the first
    // vector, then of the second; the 64-bit permute puts the first's four before the
    // second's.
    let order = _mm512_setr_epi64(0, 2, 4, 6, 1, 3, 5, 7);
    let packed = |a, b| _mm512_permutexvar_epi64(order, _mm512_packus_epi32(a, b));
    [packed(off[0], off[1]), packed(off[2], off[3])]
}

/// The offsets of the next 64 codes, 8-bit, in the codes' order.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,vaes,aes")]
fn aes_offsets_8(blocks: &mut super::vaes::Blocks512, span: __m512i) -> [__m512i; 1] {
    let off = blocks.next_16().map(|words| offsets(words, span));
    // After two packs, 32-bit word 4q + v of the result holds codes 4q .. 4q + 4 of vector v.
    let bytes = _mm512_packus_epi16(
        _mm512_packus_epi32(off[0], off[1]),
        _mm512_packus_epi32(off[2], off[3]),
    );
    let order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    [_mm512_permutexvar_epi32(order, bytes)]
}

/// The key stream of one tensor from a block on, 16 blocks (256 words) a step.
struct ChaChaStream<'a> {
    key: &'a [__m512i; 8],
    block: u64,
}

impl ChaChaStream<'_> {
    /// The next 16 blocks' words, vector `i` lane `b` word `i` of block `b`: the word of
    /// code `16b + i` of the step.
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn next_words(&mut self) -> [__m512i; 16] {
        let lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        // The shard's validation keeps every stream within the 32-bit block counter.
        let counter = _mm512_add_epi32(_mm512_set1_epi32(self.block as u32 as i32), lanes);
        self.block += 16;
        chacha20_words(self.key, counter)
    }

    /// The offsets of the next 256 codes, 16-bit, 32 a vector in the codes' order.
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn offsets_16(&mut self, span: __m512i) -> [__m512i; 8] {
        let words = self.next_words();
        let off = |i: usize| offsets(words[i], span);
        // Lane b of pair p: the offsets of codes 16b + 2p and 16b + 2p + 1, as they sit in
        // memory.
        transpose_pairs(std::array::from_fn(|p| {
            _mm512_or_si512(off(2 * p), _mm512_slli_epi32::<16>(off(2 * p + 1)))
        }))
    }

    /// The offsets of the next 256 codes, 8-bit, 64 a vector in the codes' order.
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn offsets_8(&mut self, span: __m512i) -> [__m512i; 4] {
        let words = self.next_words();
        let off = |i: usize| offsets(words[i], span);
        // Lane b of quad p: the offsets of codes 16b + 4p .. 16b + 4p + 4, as they sit in
        // memory.
        transpose_quads(std::array::from_fn(|p| {
            let low = _mm512_or_si512(off(4 * p), _mm512_slli_epi32::<8>(off(4 * p + 1)));
            let high = _mm512_or_si512(
                _mm512_slli_epi32::<16>(off(4 * p + 2)),
                _mm512_slli_epi32::<24>(off(4 * p + 3)),
            );
            _mm512_or_si512(low, high)
        }))
    }
}

/// The loop of every kernel, over groups of `N` vectors of `data`: the group's offsets in the
/// codes' order (`next_offsets`, the stream's next step), every code of the group checked
/// against the domain before any is written (`outside` of its vectors: one comparison a group;
/// `first_outside` names the unit), then each vector unlocked into its place (`unlock` of its
/// codes and offsets). Returns the first unit outside the domain, counted from the start.
#[inline]
#[target_feature(enable = "avx512f,avx512bw")]
fn each_group<const N: usize>(
    data: Places<'_>,
    units_per_group: usize,
    mut next_offsets: impl FnMut() -> [__m512i; N],
    outside: impl Fn(&[__m512i; N]) -> bool,
    first_outside: impl Fn(&[u8]) -> Option<usize>,
    unlock: impl Fn(__m512i, __m512i) -> __m512i,
) -> Option<usize> {
    let group_bytes = 64 * N;
    let end = data.src.wrapping_add(data.len);
    for g in 0..data.len / group_bytes {
        // SAFETY: group `g` lies within both places, which hold `data.len` bytes each.
        let (src, dst) = unsafe { (data.src.add(g * group_bytes), data.dst.add(g * group_bytes)) };
        for k in 0..N {
            let ahead = src.wrapping_add(PREFETCH_AHEAD + 64 * k);
            if ahead < end {
                _mm_prefetch::<_MM_HINT_T0>(ahead as *const i8);
            }
        }
        let offsets = next_offsets();
        let codes: [__m512i; N] = std::array::from_fn(|k| {
            // SAFETY: the group holds `64 * N` bytes; unaligned access.
            unsafe { _mm512_loadu_si512(src.add(64 * k) as *const __m512i) }
        });
        if outside(&codes) {
            // SAFETY: the group's codes, not yet written (in place, the same bytes).
            let group = unsafe { std::slice::from_raw_parts(src, group_bytes) };
            // The group holds a code outside the domain, so `first_outside` finds it.
            return Some(g * units_per_group + first_outside(group).unwrap_or(0));
        }
        for (k, (code, off)) in codes.into_iter().zip(offsets).enumerate() {
            // SAFETY: as the loads.
            unsafe { _mm512_storeu_si512(dst.add(64 * k) as *mut __m512i, unlock(code, off)) };
        }
    }
    None
}

/// 16-bit codes, `N` vectors of 32 a group, their offsets from `next_offsets` (given the span
/// in each 32-bit lane): sign-magnitude floats when `SIGNED` (`span = 2m`), else unsigned
/// values (`span = m`; a negative I16 reads as 2^15 or more, outside any domain).
#[inline]
#[target_feature(enable = "avx512f,avx512bw")]
fn unlock_16<const SIGNED: bool, const N: usize>(
    m: u16,
    data: Places<'_>,
    mut next_offsets: impl FnMut(__m512i) -> [__m512i; N],
) -> Option<usize> {
    let span = if SIGNED { 2 * m } else { m };
    let m_v = _mm512_set1_epi16(m as i16);
    let span_v = _mm512_set1_epi16(span as i16);
    let span_words = _mm512_set1_epi32(i32::from(span));
    let magnitude = _mm512_set1_epi16(if SIGNED { 0x7FFF } else { -1 });
    let to_negative = _mm512_set1_epi16(0x8000u16.wrapping_sub(m) as i16);
    each_group(
        data,
        32 * N,
        || next_offsets(span_words),
        |codes| {
            let largest = codes.iter().fold(_mm512_setzero_si512(), |largest, &code| {
                _mm512_max_epu16(largest, _mm512_and_si512(code, magnitude))
            });
            _mm512_cmpge_epu16_mask(largest, m_v) != 0
        },
        |group| match SIGNED {
            true => SignMagnitude::<2>::first_outside(group, m.into()),
            false => Unsigned::<2>::first_outside(group, m.into()),
        },
        |code, off| {
            let index = if SIGNED {
                let mag = _mm512_and_si512(code, magnitude);
                _mm512_add_epi16(mag, _mm512_and_si512(_mm512_srai_epi16::<15>(code), m_v))
            } else {
                code
            };
            let diff = _mm512_sub_epi16(index, off);
            let borrow = _mm512_cmplt_epu16_mask(index, off);
            let plain = _mm512_mask_add_epi16(diff, borrow, diff, span_v);
            if SIGNED {
                let high = _mm512_cmpge_epu16_mask(plain, m_v);
                _mm512_mask_add_epi16(plain, high, plain, to_negative)
            } else {
                plain
            }
        },
    )
}

/// The unlock of codes of at most 8 bits, one a byte: sign-magnitude ones when `sign` is
/// given (the byte's sign bit; `magnitude` the bits below it, `span = 2m`), else unsigned
/// (`span = m`; a span of 256 is 0 in a byte, and adding it changes nothing, as a shift
/// modulo 256 needs).
struct ByteCodes {
    sign: Option<__m512i>,
    magnitude: __m512i,
    m: __m512i,
    span: __m512i,
    to_negative: __m512i,
}

impl ByteCodes {
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw")]
    fn new(m: u8, sign_bit: Option<u8>) -> ByteCodes {
        let span = match sign_bit {
            Some(_) => 2 * u16::from(m),
            None => u16::from(m),
        };
        ByteCodes {
            sign: sign_bit.map(|b| _mm512_set1_epi8(b as i8)),
            magnitude: _mm512_set1_epi8(sign_bit.map_or(-1, |b| (b - 1) as i8)),
            m: _mm512_set1_epi8(m as i8),
            span: _mm512_set1_epi8(span as u8 as i8),
            to_negative: _mm512_set1_epi8(sign_bit.map_or(0, |b| b.wrapping_sub(m)) as i8),
        }
    }

    #[inline]
    #[target_feature(enable = "avx512f,avx512bw")]
    fn unlock(&self, code: __m512i, off: __m512i) -> __m512i {
        let index = match self.sign {
            Some(sign) => {
                let mag = _mm512_and_si512(code, self.magnitude);
                _mm512_mask_add_epi8(mag, _mm512_test_epi8_mask(code, sign), mag, self.m)
            }
            None => code,
        };
        let diff = _mm512_sub_epi8(index, off);
        let borrow = _mm512_cmplt_epu8_mask(index, off);
        let plain = _mm512_mask_add_epi8(diff, borrow, diff, self.span);
        if self.sign.is_some() {
            let high = _mm512_cmpge_epu8_mask(plain, self.m);
            _mm512_mask_add_epi8(plain, high, plain, self.to_negative)
        } else {
            plain
        }
    }
}

/// 8-bit codes, `N` vectors of 64 a group, their offsets from `next_offsets`: sign-magnitude
/// floats when `SIGNED`, else unsigned values ([`ByteCodes`]).
#[inline]
#[target_feature(enable = "avx512f,avx512bw")]
fn unlock_8<const SIGNED: bool, const N: usize>(
    m: u16,
    data: Places<'_>,
    mut next_offsets: impl FnMut(__m512i) -> [__m512i; N],
) -> Option<usize> {
    let codes = ByteCodes::new(m as u8, SIGNED.then_some(0x80));
    let span = if SIGNED { 2 * m } else { m };
    let span_words = _mm512_set1_epi32(i32::from(span));
    let largest_allowed = _mm512_set1_epi8((m - 1) as u8 as i8);
    each_group(
        data,
        64 * N,
        || next_offsets(span_words),
        |group| {
            let largest = group.iter().fold(_mm512_setzero_si512(), |largest, &code| {
                _mm512_max_epu8(largest, _mm512_and_si512(code, codes.magnitude))
            });
            _mm512_cmpgt_epu8_mask(largest, largest_allowed) != 0
        },
        |group| match SIGNED {
            true => SignMagnitude::<1>::first_outside(group, m.into()),
            false => Unsigned::<1>::first_outside(group, m.into()),
        },
        |code, off| codes.unlock(code, off),
    )
}

/// FP4 pairs, 256 codes (128 bytes, 2 vectors) a group: each nibble a 4-bit sign-magnitude
/// code (`span = 2m <= 16`), the low nibble the earlier code, unlocked as a byte of its own.
#[inline]
#[target_feature(enable = "avx512f,avx512bw")]
fn unlock_fp4(mut stream: ChaChaStream<'_>, m: u8, data: Places<'_>) -> Option<usize> {
    let codes = ByteCodes::new(m, Some(0x08));
    let span_words = _mm512_set1_epi32(2 * i32::from(m));
    let nibble = _mm512_set1_epi8(0x0F);
    let largest_allowed = _mm512_set1_epi8(m as i8 - 1);
    let high_nibbles = |v: __m512i| _mm512_and_si512(_mm512_srli_epi16::<4>(v), nibble);
    each_group(
        data,
        GROUP_CODES / 2,
        || {
            let words = stream.next_words();
            let off = |i: usize| offsets(words[i], span_words);
            // Lane b of octet p: the offsets of codes 16b + 8p .. 16b + 8p + 8, a nibble
            // each, as the codes sit in memory.
            transpose_octets(std::array::from_fn(|p| {
                let mut packed = off(8 * p);
                for i in 1..8 {
                    packed = _mm512_or_si512(
                        packed,
                        _mm512_sllv_epi32(off(8 * p + i), _mm512_set1_epi32(4 * i as i32)),
                    );
                }
                packed
            }))
        },
        |group| {
            let largest = group.iter().fold(_mm512_setzero_si512(), |largest, &code| {
                let low = _mm512_and_si512(code, codes.magnitude);
                let high = _mm512_and_si512(high_nibbles(code), codes.magnitude);
                _mm512_max_epu8(largest, _mm512_max_epu8(low, high))
            });
            _mm512_cmpgt_epu8_mask(largest, largest_allowed) != 0
        },
        |group| Fp4Pair::first_outside(group, m.into()),
        |code, off| {
            let low = codes.unlock(
                _mm512_and_si512(code, nibble),
                _mm512_and_si512(off, nibble),
            );
            let high = codes.unlock(high_nibbles(code), high_nibbles(off));
            // Each byte of `high` is below 16: a 16-bit lane shifted left by 4 keeps it in
            // its byte.
            _mm512_or_si512(low, _mm512_slli_epi16::<4>(high))
        },
    )
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

/// From `pairs[p]` (lane `b`: the 16-bit offsets of codes `16b + 2p`, `16b + 2p + 1`) to the
/// offsets of codes `32k .. 32k + 32` in vector `k`, as the codes sit in memory.
#[inline]
#[target_feature(enable = "avx512f")]
fn transpose_pairs(pairs: [__m512i; 8]) -> [__m512i; 8] {
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
    let even = transpose_lanes(u[0], u[4], u[1], u[5]);
    let odd = transpose_lanes(u[2], u[6], u[3], u[7]);
    [
        even[0], odd[0], even[1], odd[1], even[2], odd[2], even[3], odd[3],
    ]
}

/// From `quads[p]` (lane `b`: the 8-bit offsets of codes `16b + 4p .. 16b + 4p + 4`) to the
/// offsets of codes `64k .. 64k + 64` in vector `k`, as the codes sit in memory.
#[inline]
#[target_feature(enable = "avx512f")]
fn transpose_quads(quads: [__m512i; 4]) -> [__m512i; 4] {
    let q = quads;
    let t = [
        _mm512_unpacklo_epi32(q[0], q[1]),
        _mm512_unpackhi_epi32(q[0], q[1]),
        _mm512_unpacklo_epi32(q[2], q[3]),
        _mm512_unpackhi_epi32(q[2], q[3]),
    ];
    // u[r]: quads 0..4 of block 4q + r in lane q; vector k is lane k of u[0..4].
    transpose_lanes(
        _mm512_unpacklo_epi64(t[0], t[2]),
        _mm512_unpackhi_epi64(t[0], t[2]),
        _mm512_unpacklo_epi64(t[1], t[3]),
        _mm512_unpackhi_epi64(t[1], t[3]),
    )
}

/// A 4 x 4 transpose of 128-bit lanes: vector `q` of the result holds lane `q` of `a`, `b`,
/// `c` and `d`, in that order.
#[inline]
#[target_feature(enable = "avx512f")]
fn transpose_lanes(a: __m512i, b: __m512i, c: __m512i, d: __m512i) -> [__m512i; 4] {
    // Lanes a0 a1 b0 b1, a2 a3 b2 b3, then the same of c and d.
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
}

/// From `octets[p]` (lane `b`: the 4-bit offsets of codes `16b + 8p .. 16b + 8p + 8`) to
/// the offsets of codes `128k .. 128k + 128` in vector `k`, as the codes sit in memory.
#[inline]
#[target_feature(enable = "avx512f")]
fn transpose_octets(octets: [__m512i; 2]) -> [__m512i; 2] {
    // Lane q: blocks 4q, 4q + 1 (low) and 4q + 2, 4q + 3 (high), octets 0 and 1 of each.
    let low = _mm512_unpacklo_epi32(octets[0], octets[1]);
    let high = _mm512_unpackhi_epi32(octets[0], octets[1]);
    let first = _mm512_shuffle_i32x4::<0b01_00_01_00>(low, high);
    let second = _mm512_shuffle_i32x4::<0b11_10_11_10>(low, high);
    [
        _mm512_shuffle_i32x4::<0b11_01_10_00>(first, first),
        _mm512_shuffle_i32x4::<0b11_01_10_00>(second, second),
    ]
}
