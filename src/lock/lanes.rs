//! The kernels: one loop over the codes of a batch, generic over the kind of code and the
//! lane width, compiled once per instruction set. A tensor picks its kernel once, when its
//! lock is made, so a batch runs one indirect call and no dispatch.

use super::arith::{shift_mod, Lane};
use super::codec::{sign_extend, Codec};

/// A tensor's domain as the kernels see it: codes below `span`, of which `m` per sign.
#[derive(Debug, Clone, Copy)]
pub(super) struct Domain {
    pub m: u64,
    pub span: u64,
}

/// One batch: checks every unit of `part` against the domain before changing any, then
/// shifts each code by the offset its word of `ks` gives. Returns the first unit outside the
/// domain. Unsafe to call only because it may be built for an instruction set the CPU lacks:
/// [`Isa::best`] picks one it has.
pub(super) type BatchFn = unsafe fn(Domain, &mut [u8], &[u8]) -> Option<usize>;

/// How codes sit in their units, and how a code maps onto an index below the span.
pub(super) trait Kind {
    const UNIT_BYTES: usize;
    /// Codes a unit holds, low bits first, each with its own stream word.
    const CODES_PER_UNIT: usize;
    const CODE_BITS: u32;
    /// `span <= 2^16`, so narrow offsets take the split multiply.
    const SMALL_SPAN: bool;

    /// The first unit with a code outside the domain.
    fn first_outside(part: &[u8], m: u64) -> Option<usize>;
    fn index<L: Lane>(code: L, m: L) -> L;
    fn code<L: Lane>(index: L, m: L) -> L;
}

/// Sign-magnitude floats of `W` bytes: `index = magnitude + sign * m`.
pub(super) struct SignMagnitude<const W: usize>;

/// Unsigned codes of `W` bytes (E8M0 scales, index tables): the value is the index.
pub(super) struct Unsigned<const W: usize>;

/// Two 4-bit sign-magnitude codes a byte (FP4 E2M1), low nibble first.
pub(super) struct Fp4Pair;

#[inline(always)]
fn sign_magnitude_index<L: Lane>(code: L, m: L, bits: u32) -> L {
    let shift = bits - 1;
    let magnitude = code & ((L::ONE << shift) - L::ONE);
    magnitude + (code >> shift) * m
}

#[inline(always)]
fn sign_magnitude_code<L: Lane>(index: L, m: L, bits: u32) -> L {
    let high = L::from_bool(index >= m);
    (index - m * high) | (high << (bits - 1))
}

impl<const W: usize> Kind for SignMagnitude<W> {
    const UNIT_BYTES: usize = W;
    const CODES_PER_UNIT: usize = 1;
    const CODE_BITS: u32 = 8 * W as u32;
    const SMALL_SPAN: bool = W <= 2;

    #[inline(always)]
    fn first_outside(part: &[u8], m: u64) -> Option<usize> {
        if max_code::<W>(part, true) < m {
            return None;
        }
        let mask = (1u64 << (8 * W - 1)) - 1;
        part.chunks_exact(W)
            .position(|v| u64::load(v, W) & mask >= m)
    }

    #[inline(always)]
    fn index<L: Lane>(code: L, m: L) -> L {
        sign_magnitude_index(code, m, Self::CODE_BITS)
    }

    #[inline(always)]
    fn code<L: Lane>(index: L, m: L) -> L {
        sign_magnitude_code(index, m, Self::CODE_BITS)
    }
}

/// The largest code of `W` bytes, read unsigned, its top bit dropped when `magnitude`: a
/// reduction without an early exit, so it vectorizes (the domain check runs on every decoded
/// value).
#[inline(always)]
fn max_code<const W: usize>(part: &[u8], magnitude: bool) -> u64 {
    macro_rules! fold {
        ($t:ty) => {{
            let mask = if magnitude { <$t>::MAX >> 1 } else { <$t>::MAX };
            part.chunks_exact(W)
                .map(|v| <$t>::from_le_bytes(v.try_into().expect("one value")) & mask)
                .fold(0, <$t>::max) as u64
        }};
    }
    match W {
        1 => fold!(u8),
        2 => fold!(u16),
        4 => fold!(u32),
        _ => fold!(u64),
    }
}

impl<const W: usize> Kind for Unsigned<W> {
    const UNIT_BYTES: usize = W;
    const CODES_PER_UNIT: usize = 1;
    const CODE_BITS: u32 = 8 * W as u32;
    const SMALL_SPAN: bool = W <= 2;

    #[inline(always)]
    fn first_outside(part: &[u8], m: u64) -> Option<usize> {
        // Negative integers read as unsigned are at least 2^(8W-1) >= m, so they fail the
        // unsigned maximum just as their sign-extended codes fail below.
        debug_assert!(W == 1 || m <= 1 << (8 * W - 1));
        if max_code::<W>(part, false) < m {
            return None;
        }
        part.chunks_exact(W).position(|v| {
            if W == 1 {
                v[0] as u64 >= m
            } else {
                // Integers are signed on disk: a negative value sign-extends to a huge code.
                sign_extend(u64::load(v, W), W) as u64 >= m
            }
        })
    }

    #[inline(always)]
    fn index<L: Lane>(code: L, _m: L) -> L {
        code
    }

    #[inline(always)]
    fn code<L: Lane>(index: L, _m: L) -> L {
        index
    }
}

impl Kind for Fp4Pair {
    const UNIT_BYTES: usize = 1;
    const CODES_PER_UNIT: usize = 2;
    const CODE_BITS: u32 = 4;
    const SMALL_SPAN: bool = true;

    #[inline(always)]
    fn first_outside(part: &[u8], m: u64) -> Option<usize> {
        let largest = part
            .iter()
            .map(|&b| (b & 7).max((b >> 4) & 7))
            .fold(0, u8::max);
        if (largest as u64) < m {
            return None;
        }
        part.iter()
            .position(|&b| (b & 7) as u64 >= m || ((b >> 4) & 7) as u64 >= m)
    }

    #[inline(always)]
    fn index<L: Lane>(code: L, m: L) -> L {
        sign_magnitude_index(code, m, Self::CODE_BITS)
    }

    #[inline(always)]
    fn code<L: Lane>(index: L, m: L) -> L {
        sign_magnitude_code(index, m, Self::CODE_BITS)
    }
}

/// The loop every kernel is: plain integer loads and selects, so it vectorizes.
#[inline(always)]
fn shift_codes<K: Kind, L: Lane, const LOCK: bool>(d: Domain, part: &mut [u8], ks: &[u8]) {
    let (m, span) = (L::from_u64(d.m), L::from_u64(d.span));
    let modulus = L::span(d.span);
    let code_mask = L::from_u64((1u64 << K::CODE_BITS.min(63)) - 1);
    let words = ks.chunks_exact(K::CODES_PER_UNIT * L::WORD_BYTES);
    for (unit, word) in part.chunks_exact_mut(K::UNIT_BYTES).zip(words) {
        let raw = L::load(unit, K::UNIT_BYTES);
        let mut out = L::from_u64(0);
        for c in 0..K::CODES_PER_UNIT {
            let at = c as u32 * K::CODE_BITS;
            let code = if K::CODES_PER_UNIT == 1 {
                raw
            } else {
                (raw >> at) & code_mask
            };
            let off = L::offset(&word[c * L::WORD_BYTES..], modulus, K::SMALL_SPAN);
            let p = shift_mod::<L, LOCK>(K::index(code, m), off, span);
            out = out | (K::code(p, m) << at);
        }
        out.store(unit, K::UNIT_BYTES);
    }
}

#[inline(always)]
fn batch<K: Kind, L: Lane, const LOCK: bool>(
    d: Domain,
    part: &mut [u8],
    ks: &[u8],
) -> Option<usize> {
    if let Some(i) = K::first_outside(part, d.m) {
        return Some(i);
    }
    shift_codes::<K, L, LOCK>(d, part, ks);
    None
}

fn batch_baseline<K: Kind, L: Lane, const LOCK: bool>(
    d: Domain,
    part: &mut [u8],
    ks: &[u8],
) -> Option<usize> {
    batch::<K, L, LOCK>(d, part, ks)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn batch_avx2<K: Kind, L: Lane, const LOCK: bool>(
    d: Domain,
    part: &mut [u8],
    ks: &[u8],
) -> Option<usize> {
    batch::<K, L, LOCK>(d, part, ks)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
fn batch_avx512<K: Kind, L: Lane, const LOCK: bool>(
    d: Domain,
    part: &mut [u8],
    ks: &[u8],
) -> Option<usize> {
    batch::<K, L, LOCK>(d, part, ks)
}

/// The instruction sets the kernels are built for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Isa {
    Baseline,
    #[cfg(target_arch = "x86_64")]
    Avx2,
    #[cfg(target_arch = "x86_64")]
    Avx512,
}

impl Isa {
    /// The widest this CPU runs.
    pub(super) fn best() -> Isa {
        *Isa::available().last().expect("the baseline always runs")
    }

    /// Every one this CPU runs, narrowest first.
    pub(super) fn available() -> Vec<Isa> {
        #[allow(unused_mut)]
        let mut isas = vec![Isa::Baseline];
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx2") {
                isas.push(Isa::Avx2);
            }
            if std::arch::is_x86_feature_detected!("avx512f")
                && std::arch::is_x86_feature_detected!("avx512bw")
                && std::arch::is_x86_feature_detected!("avx512vl")
            {
                isas.push(Isa::Avx512);
            }
        }
        isas
    }

    fn kernel<K: Kind, L: Lane, const LOCK: bool>(self) -> BatchFn {
        match self {
            Isa::Baseline => batch_baseline::<K, L, LOCK>,
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => batch_avx2::<K, L, LOCK>,
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => batch_avx512::<K, L, LOCK>,
        }
    }

    /// The kernel for a codec: `wide` streams give 8 bytes a code and need 64-bit lanes;
    /// codes of 16 bits or fewer with a span below 2^16 take 16-bit lanes.
    pub(super) fn select<const LOCK: bool>(self, codec: Codec, span: u64, wide: bool) -> BatchFn {
        match codec {
            Codec::Float { bits: 8, .. } => self.by_lanes::<SignMagnitude<1>, LOCK>(span, wide),
            Codec::Float { bits: 16, .. } => self.by_lanes::<SignMagnitude<2>, LOCK>(span, wide),
            Codec::Float { .. } => self.by_lanes::<SignMagnitude<4>, LOCK>(span, wide),
            Codec::E8m0 => self.by_lanes::<Unsigned<1>, LOCK>(span, wide),
            Codec::Index { bytes: 2 } => self.by_lanes::<Unsigned<2>, LOCK>(span, wide),
            Codec::Index { bytes: 4 } => self.by_lanes::<Unsigned<4>, LOCK>(span, wide),
            // Checked codes are below 2^31, so 8-byte integers fit 32-bit lanes too.
            Codec::Index { .. } => self.by_lanes::<Unsigned<8>, LOCK>(span, wide),
            // FP4 spans are at most 16: never wide.
            Codec::Fp4x2 => self.by_lanes::<Fp4Pair, LOCK>(span, wide),
        }
    }

    fn by_lanes<K: Kind, const LOCK: bool>(self, span: u64, wide: bool) -> BatchFn {
        if wide {
            self.kernel::<K, u64, LOCK>()
        } else if K::CODE_BITS <= 16 && span < 1 << 16 {
            // Wider codes stay in 32-bit lanes whatever their span: a lane holds the whole
            // code as read (a sign-magnitude code's sign bit is its top bit).
            self.kernel::<K, u16, LOCK>()
        } else {
            self.kernel::<K, u32, LOCK>()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn xorshift(seed: &mut u64) -> u64 {
        *seed ^= *seed << 13;
        *seed ^= *seed >> 7;
        *seed ^= *seed << 17;
        *seed
    }

    /// The 64-bit scalar arithmetic the lanes replace, written out once per code.
    fn scalar(codec: Codec, d: Domain, wide: bool, lock: bool, part: &mut [u8], ks: &[u8]) {
        let (m, span) = (d.m, d.span);
        let (unit, codes, bits, signed) = match codec {
            Codec::Float { bits, .. } => (bits as usize / 8, 1, bits, true),
            Codec::E8m0 => (1, 1, 8, false),
            Codec::Index { bytes } => (bytes, 1, 8 * bytes as u32, false),
            Codec::Fp4x2 => (1, 2, 4, true),
        };
        let sw = if wide { 8 } else { 4 };
        for (i, v) in part.chunks_exact_mut(unit).enumerate() {
            let mut raw = [0u8; 8];
            raw[..unit].copy_from_slice(v);
            let raw = u64::from_le_bytes(raw);
            let mut out = 0u64;
            for h in 0..codes {
                let code = (raw >> (h as u32 * bits)) & ((1u128 << bits) - 1) as u64;
                let sign = 1u64 << (bits - 1);
                let idx = if signed && code & sign != 0 {
                    (code - sign) + m
                } else {
                    code
                };
                let w = &ks[(i * codes + h) * sw..][..sw];
                let off = if wide {
                    (u64::from_le_bytes(w.try_into().unwrap()) << 1 >> 1) % span
                } else {
                    (u32::from_le_bytes(w.try_into().unwrap()) as u64 * span) >> 32
                };
                let p = if lock {
                    (idx + off) % span
                } else {
                    (idx + span - off) % span
                };
                let c = if signed && p >= m { p - m + sign } else { p };
                out |= c << (h as u32 * bits);
            }
            v.copy_from_slice(&out.to_le_bytes()[..unit]);
        }
    }

    /// Random codes inside the domain (each at the top of it every few rounds).
    fn codes_in_domain(codec: Codec, d: Domain, n: usize, top: bool, seed: &mut u64) -> Vec<u8> {
        let (unit, codes, bits, signed) = match codec {
            Codec::Float { bits, .. } => (bits as usize / 8, 1, bits, true),
            Codec::E8m0 => (1, 1, 8, false),
            Codec::Index { bytes } => (bytes, 1, 8 * bytes as u32, false),
            Codec::Fp4x2 => (1, 2, 4, true),
        };
        let mut data = vec![0u8; n * unit];
        for v in data.chunks_exact_mut(unit) {
            let mut raw = 0u64;
            for h in 0..codes {
                let idx = if top {
                    d.span - 1
                } else {
                    xorshift(seed) % d.span
                };
                let c = if signed && idx >= d.m {
                    idx - d.m + (1 << (bits - 1))
                } else {
                    idx
                };
                raw |= c << (h as u32 * bits);
            }
            v.copy_from_slice(&raw.to_le_bytes()[..unit]);
        }
        data
    }

    fn random_domain(codec: Codec, wide: bool, seed: &mut u64) -> u64 {
        let mut r = |n: u64| xorshift(seed) % n;
        match codec {
            Codec::Float { bits: 8, .. } => 1 + r(0x7F),
            // Up to BF16's largest domain, 0x7F80 (span 0xFF00, the widest in 16-bit lanes).
            Codec::Float { bits: 16, .. } => 1 + r(0x7F80),
            Codec::Float { .. } if wide => 1 + r(1 << 31),
            // Narrow F32 spans stay at most 2^31.
            Codec::Float { .. } => 1 + r(1 << 30),
            Codec::E8m0 => 1 + r(255),
            Codec::Index { bytes: 2 } => 1 + r(1 << 15),
            Codec::Index { .. } => 1 + r(1 << 31),
            Codec::Fp4x2 => [1u64, 2, 4, 6, 8][r(5) as usize],
        }
    }

    const CODECS: [Codec; 8] = [
        Codec::Float {
            bits: 8,
            mantissa: 3,
            top: 0x7E,
        },
        Codec::Float {
            bits: 16,
            mantissa: 7,
            top: 0x7F7F,
        },
        Codec::Float {
            bits: 32,
            mantissa: 23,
            top: 0x7F7F_FFFF,
        },
        Codec::E8m0,
        Codec::Index { bytes: 2 },
        Codec::Index { bytes: 4 },
        Codec::Index { bytes: 8 },
        Codec::Fp4x2,
    ];

    /// Every kernel, on every instruction set this CPU has, in both directions and both
    /// stream widths, against the scalar arithmetic.
    #[test]
    fn lane_kernels_equal_the_scalar_arithmetic() {
        let isas = Isa::available();
        let mut seed = 0x1234_5678_9ABC_DEF1u64;
        for round in 0..150 {
            // Odd lengths leave a tail past any vector width.
            let n = 1 + (xorshift(&mut seed) % 700) as usize;
            let mut ks = vec![0u8; n * 16];
            ks.iter_mut().for_each(|b| *b = xorshift(&mut seed) as u8);
            for codec in CODECS {
                for wide in [false, true] {
                    if wide && codec == Codec::Fp4x2 {
                        continue;
                    }
                    let m = random_domain(codec, wide, &mut seed);
                    let span = if matches!(codec, Codec::Float { .. } | Codec::Fp4x2) {
                        2 * m
                    } else {
                        m
                    };
                    let d = Domain { m, span };
                    let plain = codes_in_domain(codec, d, n, round % 7 == 0, &mut seed);
                    for lock in [false, true] {
                        let mut want = plain.clone();
                        scalar(codec, d, wide, lock, &mut want, &ks);
                        for &isa in &isas {
                            let kernel = if lock {
                                isa.select::<true>(codec, span, wide)
                            } else {
                                isa.select::<false>(codec, span, wide)
                            };
                            let mut got = plain.clone();
                            // SAFETY: `isa` is one this CPU runs.
                            let bad = unsafe { kernel(d, &mut got, &ks) };
                            assert_eq!(bad, None);
                            assert_eq!(
                                got, want,
                                "{codec:?} {isa:?} m={m:#x} wide={wide} lock={lock}"
                            );
                        }
                    }
                }
            }
        }
    }

    /// A code outside the domain is reported at its unit, and nothing is changed.
    #[test]
    fn kernels_refuse_codes_outside_the_domain() {
        let ks = vec![0x5Au8; 64 * 16];
        for &isa in &Isa::available() {
            for (codec, m, bad_unit) in [
                (CODECS[1], 0x100u64, [0x00u8, 0x01]),
                (CODECS[1], 0x100, [0x00, 0x81]),
                (CODECS[0], 0x10, [0x90, 0x90]),
                (Codec::E8m0, 0x10, [0x10, 0x10]),
                (Codec::Index { bytes: 2 }, 0x100, [0xFF, 0xFF]),
                (Codec::Fp4x2, 2, [0x20, 0x20]),
                (Codec::Fp4x2, 2, [0x02, 0x02]),
            ] {
                let signed = matches!(codec, Codec::Float { .. } | Codec::Fp4x2);
                let d = Domain {
                    m,
                    span: if signed { 2 * m } else { m },
                };
                let unit = codec.unit_bytes();
                let mut data = vec![0u8; 40 * unit];
                data[29 * unit..30 * unit].copy_from_slice(&bad_unit[..unit]);
                let before = data.clone();
                let kernel = isa.select::<false>(codec, d.span, false);
                // SAFETY: `isa` is one this CPU runs.
                let bad = unsafe { kernel(d, &mut data, &ks) };
                assert_eq!(bad, Some(29), "{codec:?} {isa:?} {bad_unit:?}");
                assert_eq!(data, before);
            }
        }
    }
}
