//! The pure arithmetic of a lock: how a key-stream word becomes an offset below `span`, and
//! how an index moves by that offset modulo `span`. Every kernel goes through these, so the
//! lane loops differ only in how codes are read and written.

/// The integer type a kernel computes in: 16-bit lanes for codes of at most 16 bits with a
/// span below 2^16, 32-bit lanes for other narrow streams (4 bytes of stream a code, spans up
/// to 2^31), 64-bit for wide ones (8 bytes a code).
pub(super) trait Lane:
    Copy
    + Ord
    + std::ops::Add<Output = Self>
    + std::ops::Sub<Output = Self>
    + std::ops::Mul<Output = Self>
    + std::ops::BitAnd<Output = Self>
    + std::ops::BitOr<Output = Self>
    + std::ops::Shl<u32, Output = Self>
    + std::ops::Shr<u32, Output = Self>
{
    /// Bytes of key stream one code consumes.
    const WORD_BYTES: usize;
    /// The span as [`Lane::offset`] takes it, prepared once per batch.
    type Span: Copy;
    const ONE: Self;

    /// `x` cut to the lane; callers pass values the lane holds (`m`, `span`, checked codes).
    fn from_u64(x: u64) -> Self;
    fn from_bool(b: bool) -> Self;

    /// A little-endian unsigned value of `width` bytes (1, 2, 4 or 8; at most 2 in 16-bit
    /// lanes), cut to the lane.
    fn load(bytes: &[u8], width: usize) -> Self;
    /// The low `width` bytes of `self`, little-endian, zero-extended when `width` is wider.
    fn store(self, bytes: &mut [u8], width: usize);

    /// `span` as [`Lane::offset`] takes it (with its reciprocal, for wide lanes).
    fn span(span: u64) -> Self::Span;
    /// The offset a code's stream word (at the start of `word`) gives, below `span`.
    /// `small_span`: `span <= 2^16`, known when the kernel is built.
    fn offset(word: &[u8], span: Self::Span, small_span: bool) -> Self;

    fn overflowing_sub(self, rhs: Self) -> (Self, bool);
    fn overflowing_add(self, rhs: Self) -> (Self, bool);
    fn wrapping_add(self, rhs: Self) -> Self;
    fn wrapping_sub(self, rhs: Self) -> Self;
}

/// The methods every lane type has as a plain integer: conversions in, and the overflowing
/// and wrapping arithmetic of the same name.
macro_rules! plain_integer_ops {
    ($t:ty) => {
        #[inline(always)]
        fn from_u64(x: u64) -> $t {
            x as $t
        }

        #[inline(always)]
        fn from_bool(b: bool) -> $t {
            b as $t
        }

        #[inline(always)]
        fn overflowing_sub(self, rhs: $t) -> ($t, bool) {
            <$t>::overflowing_sub(self, rhs)
        }

        #[inline(always)]
        fn overflowing_add(self, rhs: $t) -> ($t, bool) {
            <$t>::overflowing_add(self, rhs)
        }

        #[inline(always)]
        fn wrapping_add(self, rhs: $t) -> $t {
            <$t>::wrapping_add(self, rhs)
        }

        #[inline(always)]
        fn wrapping_sub(self, rhs: $t) -> $t {
            <$t>::wrapping_sub(self, rhs)
        }
    };
}

/// 16-bit lanes for codes and spans below 2^16 (BF16, F16, 8-bit and 4-bit codes, I16
/// tables): twice the codes per vector of 32-bit lanes. The stream word is still 32 bits,
/// taken as two halves.
impl Lane for u16 {
    const WORD_BYTES: usize = 4;
    type Span = u16;
    const ONE: u16 = 1;

    plain_integer_ops!(u16);

    #[inline(always)]
    fn load(bytes: &[u8], width: usize) -> u16 {
        debug_assert!(width <= 2, "16-bit lanes hold codes of at most 2 bytes");
        match width {
            1 => bytes[0] as u16,
            _ => u16::from_le_bytes(bytes[..2].try_into().expect("2 bytes")),
        }
    }

    #[inline(always)]
    fn store(self, bytes: &mut [u8], width: usize) {
        debug_assert!(width <= 2, "16-bit lanes hold codes of at most 2 bytes");
        match width {
            1 => bytes[0] = self as u8,
            _ => bytes[..2].copy_from_slice(&self.to_le_bytes()),
        }
    }

    #[inline(always)]
    fn span(span: u64) -> u16 {
        debug_assert!(span < 1 << 16);
        span as u16
    }

    #[inline(always)]
    fn offset(word: &[u8], span: u16, _small_span: bool) -> u16 {
        let low = u16::from_le_bytes(word[..2].try_into().expect("2 bytes"));
        let high = u16::from_le_bytes(word[2..4].try_into().expect("2 bytes"));
        half_word_offset(low, high, span)
    }
}

impl Lane for u32 {
    const WORD_BYTES: usize = 4;
    type Span = u32;
    const ONE: u32 = 1;

    plain_integer_ops!(u32);

    #[inline(always)]
    fn load(bytes: &[u8], width: usize) -> u32 {
        match width {
            1 => bytes[0] as u32,
            2 => u16::from_le_bytes(bytes[..2].try_into().expect("2 bytes")) as u32,
            4 => u32::from_le_bytes(bytes[..4].try_into().expect("4 bytes")),
            _ => u64::from_le_bytes(bytes[..8].try_into().expect("8 bytes")) as u32,
        }
    }

    #[inline(always)]
    fn store(self, bytes: &mut [u8], width: usize) {
        match width {
            1 => bytes[0] = self as u8,
            2 => bytes[..2].copy_from_slice(&(self as u16).to_le_bytes()),
            4 => bytes[..4].copy_from_slice(&self.to_le_bytes()),
            _ => bytes[..8].copy_from_slice(&(self as u64).to_le_bytes()),
        }
    }

    #[inline(always)]
    fn span(span: u64) -> u32 {
        span as u32
    }

    #[inline(always)]
    fn offset(word: &[u8], span: u32, small_span: bool) -> u32 {
        let word = u32::load(word, 4);
        if small_span {
            narrow_offset::<true>(word, span)
        } else {
            narrow_offset::<false>(word, span)
        }
    }
}

impl Lane for u64 {
    const WORD_BYTES: usize = 8;
    type Span = WideSpan;
    const ONE: u64 = 1;

    plain_integer_ops!(u64);

    #[inline(always)]
    fn load(bytes: &[u8], width: usize) -> u64 {
        let mut raw = [0u8; 8];
        raw[..width].copy_from_slice(&bytes[..width]);
        u64::from_le_bytes(raw)
    }

    #[inline(always)]
    fn store(self, bytes: &mut [u8], width: usize) {
        bytes[..width].copy_from_slice(&self.to_le_bytes()[..width]);
    }

    #[inline(always)]
    fn span(span: u64) -> WideSpan {
        WideSpan::new(span)
    }

    #[inline(always)]
    fn offset(word: &[u8], span: WideSpan, _small_span: bool) -> u64 {
        wide_offset(u64::load(word, 8), span)
    }
}

/// A 32-bit stream word scaled onto `[0, span)`: `(word * span) >> 32`.
#[inline(always)]
pub(super) fn narrow_offset<const SMALL_SPAN: bool>(word: u32, span: u32) -> u32 {
    if SMALL_SPAN {
        // The 32x32->64 multiply is a 4-lane vector op; two 32-bit ones are 8-lane.
        split_mul_high(word, span)
    } else {
        ((word as u64 * span as u64) >> 32) as u32
    }
}

/// A wide span with its reciprocal: a 64-bit `%` by a divisor known only at run time is a
/// hardware divide per code, which made wide streams run at a third of their key stream's
/// speed (`cargo bench --bench decode`, "F32 (wide span)").
#[derive(Debug, Clone, Copy)]
pub(super) struct WideSpan(strength_reduce::StrengthReducedU64);

impl WideSpan {
    pub(super) fn new(span: u64) -> WideSpan {
        WideSpan(strength_reduce::StrengthReducedU64::new(span))
    }
}

/// A 64-bit stream word, its top bit dropped, reduced modulo `span` (kLLM's wide form).
#[inline(always)]
pub(super) fn wide_offset(word: u64, span: WideSpan) -> u64 {
    (word & 0x7FFF_FFFF_FFFF_FFFF) % span.0
}

/// `(word * span) >> 32` for `span <= 2^16`, in 32-bit arithmetic: exact, because
/// `floor((hi * 2^16 * span + lo * span) / 2^32) = (hi * span + (lo * span >> 16)) >> 16`
/// and neither sum can overflow 32 bits.
#[inline(always)]
pub(super) fn split_mul_high(word: u32, span: u32) -> u32 {
    debug_assert!(span <= 1 << 16);
    ((word >> 16) * span + (((word & 0xFFFF) * span) >> 16)) >> 16
}

/// [`split_mul_high`] in 16-bit halves, for 16-bit lanes: `(word * span) >> 32` with `word =
/// high << 16 | low` and `span < 2^16`. Each step is a 16x16 multiply (low or high half of
/// the product), which is one 32-lane vector op.
#[inline(always)]
pub(super) fn half_word_offset(low: u16, high: u16, span: u16) -> u16 {
    let mul_high = |a: u16, b: u16| ((a as u32 * b as u32) >> 16) as u16;
    // high * span + ((low * span) >> 16), then >> 16: the sum's top half is the high half of
    // `high * span` plus the carry out of its low half.
    let top = mul_high(high, span);
    let bottom = high.wrapping_mul(span);
    let sum = bottom.wrapping_add(mul_high(low, span));
    top + (sum < bottom) as u16
}

/// `(idx ± off) mod span` for `idx, off < span`, written with selects rather than branches so
/// the lane loops vectorize. In 32- and 64-bit lanes the sum cannot overflow (narrow spans are
/// at most 2^31, wide ones come from values of at most 63 magnitude bits); in 16-bit lanes it
/// can, and its carry means it passed the span.
#[inline(always)]
pub(super) fn shift_mod<L: Lane, const LOCK: bool>(idx: L, off: L, span: L) -> L {
    if LOCK {
        // The sum carries out only in 16-bit lanes (spans up to 2^16 - 1).
        let (t, carry) = idx.overflowing_add(off);
        if carry || t >= span {
            t.wrapping_sub(span)
        } else {
            t
        }
    } else {
        let (d, borrow) = idx.overflowing_sub(off);
        d.wrapping_add(span * L::from_bool(borrow))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn xorshift(x: &mut u64) -> u64 {
        *x ^= *x << 13;
        *x ^= *x >> 7;
        *x ^= *x << 17;
        *x
    }

    #[test]
    fn split_multiply_is_exact() {
        let mut x = 0x9E37_79B9_7F4A_7C15u64;
        let spans = [
            1u32, 2, 0xFE, 0x100, 0x8000, 0xF800, 0xFF00, 0xFFFF, 0x10000,
        ];
        for i in 0..200_000u32 {
            let word = match i {
                0 => 0,
                1 => u32::MAX,
                _ => xorshift(&mut x) as u32,
            };
            for &span in &spans {
                let exact = ((word as u64 * span as u64) >> 32) as u32;
                assert_eq!(split_mul_high(word, span), exact, "{word:#x} * {span:#x}");
                if span < 1 << 16 {
                    let halves = half_word_offset(word as u16, (word >> 16) as u16, span as u16);
                    assert_eq!(halves as u32, exact, "{word:#x} * {span:#x} in halves");
                }
            }
        }
    }

    #[test]
    fn offsets_stay_below_the_span() {
        assert_eq!(narrow_offset::<false>(0, 1 << 31), 0);
        assert_eq!(narrow_offset::<false>(u32::MAX, 1 << 31), (1 << 31) - 1);
        assert_eq!(narrow_offset::<true>(u32::MAX, 0x10000), 0xFFFF);
        assert_eq!(narrow_offset::<true>(0x8000_0000, 10), 5);
        // The wide form ignores the top bit of the word.
        assert_eq!(wide_offset(u64::MAX, WideSpan::new(1 << 40)), (1 << 40) - 1);
        assert_eq!(wide_offset(1 << 63, WideSpan::new(7)), 0);
        assert_eq!(wide_offset((1 << 63) | 20, WideSpan::new(7)), 6);
        let mut x = 0x0123_4567_89AB_CDEFu64;
        for _ in 0..10_000 {
            let span = 1 + xorshift(&mut x) % (1 << 31);
            assert!((narrow_offset::<false>(xorshift(&mut x) as u32, span as u32) as u64) < span);
            let span = 1 + xorshift(&mut x) % (1 << (1 + xorshift(&mut x) % 63));
            let word = xorshift(&mut x);
            let off = wide_offset(word, WideSpan::new(span));
            assert_eq!(
                off,
                (word & (u64::MAX >> 1)) % span,
                "{word:#x} mod {span:#x}"
            );
        }
    }

    #[test]
    fn the_lanes_read_the_same_stream_words() {
        let word = [0xEF, 0xBE, 0xAD, 0xDE, 0x78, 0x56, 0x34, 0x92];
        assert_eq!(u32::offset(&word, 1 << 16, false), 0xDEAD);
        assert_eq!(u32::offset(&word, 1 << 16, true), 0xDEAD);
        assert_eq!(u16::offset(&word, 0xFFFF, true), 0xDEAC);
        assert_eq!(
            u64::offset(&word, WideSpan::new(1 << 32), false),
            0x1234_5678_DEAD_BEEF & 0xFFFF_FFFF
        );
    }

    #[test]
    fn shifts_wrap_modulo_the_span() {
        assert_eq!(shift_mod::<u32, true>(5, 3, 7), 1);
        assert_eq!(shift_mod::<u32, false>(1, 3, 7), 5);
        assert_eq!(shift_mod::<u32, false>(3, 3, 7), 0);
        assert_eq!(shift_mod::<u32, true>(0, 0, 1), 0);
        let top = 1u32 << 31;
        assert_eq!(shift_mod::<u32, true>(top - 1, top - 1, top), top - 2);
        assert_eq!(shift_mod::<u32, false>(0, top - 1, top), 1);
        // 16-bit lanes: the sum of two codes below the widest span carries out of the lane.
        let widest = 0xFF00u16;
        assert_eq!(
            shift_mod::<u16, true>(widest - 1, widest - 1, widest),
            widest - 2
        );
        assert_eq!(shift_mod::<u16, true>(widest - 1, 1, widest), 0);
        assert_eq!(shift_mod::<u16, false>(0, widest - 1, widest), 1);
        let big = 1u64 << 62;
        assert_eq!(shift_mod::<u64, true>(big - 1, big - 2, big), big - 3);
        assert_eq!(shift_mod::<u64, false>(0, 1, big), big - 1);
        // Exhaustive on small spans: unlocking undoes locking, and both stay below the span.
        for span in 1u32..=40 {
            for idx in 0..span {
                for off in 0..span {
                    let locked = shift_mod::<u32, true>(idx, off, span);
                    assert!(locked < span);
                    assert_eq!(locked, (idx + off) % span);
                    assert_eq!(shift_mod::<u32, false>(locked, off, span), idx);
                    assert_eq!(
                        shift_mod::<u64, false>(locked as u64, off as u64, span as u64),
                        idx as u64
                    );
                    let (idx16, off16, span16) = (idx as u16, off as u16, span as u16);
                    assert_eq!(shift_mod::<u16, true>(idx16, off16, span16), locked as u16);
                    assert_eq!(shift_mod::<u16, false>(locked as u16, off16, span16), idx16);
                }
            }
        }
    }
}
