//! How a tensor's values are read as codes, and which domains `m` each kind allows.

use safetensors::Dtype;

/// How the codes of a tensor are read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Codec {
    /// Sign-magnitude floats: `code = mag + sign * m`, `span = 2m`.
    Float { bits: u32, mantissa: u32, top: u64 },
    /// F8_E8M0 scales: the byte is the code, `span = m`.
    E8m0,
    /// Non-negative integer tables (I16, I32, I64): the value is the code, `span = m`.
    Index { bytes: usize },
    /// Two FP4 (E2M1) codes per byte, low nibble first, each a 4-bit float code.
    Fp4x2,
}

const FP4: (u32, u32, u64) = (4, 1, 7);

impl Codec {
    /// The codec of a v1 entry, or of a v2 `float` entry.
    pub fn float(dtype: Dtype) -> Option<Codec> {
        let (bits, mantissa, top) = match dtype {
            Dtype::BF16 => (16, 7, 0x7F7F),
            Dtype::F16 => (16, 10, 0x7BFF),
            Dtype::F32 => (32, 23, 0x7F7F_FFFF),
            Dtype::F8_E4M3 => (8, 3, 0x7E),
            Dtype::F8_E5M2 => (8, 2, 0x7B),
            _ => return None,
        };
        Some(Codec::Float {
            bits,
            mantissa,
            top,
        })
    }

    /// The codec a v2 entry names, if it can apply to `dtype`.
    pub fn v2(format: &str, dtype: Dtype) -> Option<Codec> {
        match (format, dtype) {
            ("float", d) => Codec::float(d),
            ("e8m0", Dtype::F8_E8M0) => Some(Codec::E8m0),
            ("index", Dtype::I16) => Some(Codec::Index { bytes: 2 }),
            ("index", Dtype::I32) => Some(Codec::Index { bytes: 4 }),
            ("index", Dtype::I64) => Some(Codec::Index { bytes: 8 }),
            ("e2m1x2", Dtype::I8 | Dtype::U8) => Some(Codec::Fp4x2),
            _ => None,
        }
    }

    /// The format name a v2 entry gives this codec.
    pub fn format_name(self) -> &'static str {
        match self {
            Codec::Float { .. } => "float",
            Codec::E8m0 => "e8m0",
            Codec::Index { .. } => "index",
            Codec::Fp4x2 => "e2m1x2",
        }
    }

    /// Bytes of one unit: a value, or a byte of two FP4 codes.
    pub fn unit_bytes(self) -> usize {
        match self {
            Codec::Float { bits, .. } => bits as usize / 8,
            Codec::E8m0 | Codec::Fp4x2 => 1,
            Codec::Index { bytes } => bytes,
        }
    }

    pub(super) fn codes_per_unit(self) -> u64 {
        if self == Codec::Fp4x2 {
            2
        } else {
            1
        }
    }

    /// Whether codes carry a sign bit, which doubles the span.
    pub(super) fn signed(self) -> bool {
        matches!(self, Codec::Float { .. } | Codec::Fp4x2)
    }

    /// Whether `m` is a domain this codec can have: for floats, every code up to some
    /// binary exponent (`m` a multiple of `2^mantissa`) or all finite codes.
    pub fn valid_domain(self, m: u64) -> bool {
        let float_ok = |mantissa: u32, top: u64| {
            let unit = 1u64 << mantissa;
            m >= unit && m <= top + 1 && (m.is_multiple_of(unit) || m == top + 1)
        };
        match self {
            Codec::Float { mantissa, top, .. } => float_ok(mantissa, top),
            Codec::Fp4x2 => float_ok(FP4.1, FP4.2),
            Codec::E8m0 => (1..=255).contains(&m),
            Codec::Index { bytes } => m >= 1 && m <= (1u64 << 31).min(1u64 << (bytes * 8 - 1)),
        }
    }

    /// The domain kLLM records for plain data (the test sealer's side).
    pub fn domain_of(self, plain: &[u8]) -> Option<u64> {
        let float = |largest: u64, mantissa: u32, top: u64| {
            (largest <= top).then(|| (((largest >> mantissa) + 1) << mantissa).min(top + 1))
        };
        match self {
            Codec::Float {
                bits,
                mantissa,
                top,
            } => {
                let largest = units(plain, bits as usize / 8)
                    .map(|c| c & ((1u64 << (bits - 1)) - 1))
                    .max()
                    .unwrap_or(0);
                float(largest, mantissa, top)
            }
            Codec::Fp4x2 => {
                let largest = plain
                    .iter()
                    .flat_map(|b| [b & 7, (b >> 4) & 7])
                    .max()
                    .unwrap_or(0);
                float(largest as u64, FP4.1, FP4.2)
            }
            Codec::E8m0 => {
                let largest = *plain.iter().max().unwrap_or(&0);
                (largest != 0xFF).then_some(largest as u64 + 1)
            }
            Codec::Index { bytes } => {
                let mut largest = 0i64;
                for c in units(plain, bytes) {
                    let v = sign_extend(c, bytes);
                    if !(0..1 << 31).contains(&v) {
                        return None;
                    }
                    largest = largest.max(v);
                }
                Some(largest as u64 + 1)
            }
        }
    }
}

fn units(data: &[u8], width: usize) -> impl Iterator<Item = u64> + '_ {
    data.chunks_exact(width).map(move |c| {
        let mut b = [0u8; 8];
        b[..width].copy_from_slice(c);
        u64::from_le_bytes(b)
    })
}

pub(super) fn sign_extend(raw: u64, bytes: usize) -> i64 {
    let shift = 64 - 8 * bytes as u32;
    ((raw << shift) as i64) >> shift
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn domains() {
        let bf16 = Codec::float(Dtype::BF16).unwrap();
        assert!(bf16.valid_domain(128));
        assert!(bf16.valid_domain(0x7F80));
        assert!(!bf16.valid_domain(0x7F81));
        assert!(!bf16.valid_domain(100));
        assert!(!bf16.valid_domain(0));
        let e4m3 = Codec::float(Dtype::F8_E4M3).unwrap();
        assert!(e4m3.valid_domain(0x7F));
        assert!(!e4m3.valid_domain(0x80));
        assert!(Codec::Fp4x2.valid_domain(8));
        assert!(!Codec::Fp4x2.valid_domain(3));
        assert!(Codec::E8m0.valid_domain(255));
        assert!(!Codec::E8m0.valid_domain(256));
        assert!(!Codec::Index { bytes: 2 }.valid_domain(40000));
        assert!(Codec::v2("index", Dtype::F32).is_none());
        assert!(Codec::v2("e2m1x2", Dtype::U8).is_some());
    }

    #[test]
    fn bf16_domain_as_kllm() {
        // 1.0 in BF16 is 0x3F80: exponent field 0x7F, so m = (0x3F80 >> 7 + 1) << 7 = 0x4000.
        let c = Codec::float(Dtype::BF16).unwrap();
        assert_eq!(c.domain_of(&[0x80, 0x3F, 0x80, 0xBF]), Some(0x4000));
        assert_eq!(c.domain_of(&[0x80, 0x7F]), None); // inf
    }

    #[test]
    fn sign_extension_of_on_disk_integers() {
        assert_eq!(sign_extend(0xFFFF, 2), -1);
        assert_eq!(sign_extend(0x7FFF, 2), 0x7FFF);
        assert_eq!(sign_extend(0x8000_0000, 4), -(1 << 31));
        assert_eq!(sign_extend(u64::MAX, 8), -1);
        assert_eq!(sign_extend(0x80, 1), -128);
    }
}
