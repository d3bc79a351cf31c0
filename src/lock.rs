//! Locked tensors: format-preserving shifts of value codes by a per-tensor key stream.
//!
//! Every value is read as an unsigned code below `span` and shifted modulo `span`; the
//! shift (offset) of value `j` comes from position `j` of the tensor's own key stream,
//! AES-256-CTR for lock v1 and ChaCha20 for lock v2. Both seek to any block, so any range of
//! a tensor decodes on its own.

use aes::cipher::{KeyIvInit, StreamCipher, StreamCipherSeek};

use safetensors::Dtype;

use crate::key::{ModelKey, Secret};

type Aes256Ctr = ctr::Ctr128BE<aes::Aes256>;

/// Codes processed per batch: the offsets of a batch fit in L1/L2.
const BATCH: usize = 4096;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Version {
    V1,
    V2,
}

impl Version {
    pub fn parse(s: &str) -> Option<Version> {
        match s {
            "v1" => Some(Version::V1),
            "v2" => Some(Version::V2),
            _ => None,
        }
    }

    pub fn label(self) -> &'static str {
        match self {
            Version::V1 => "v1",
            Version::V2 => "v2",
        }
    }
}

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

    /// Bytes of one unit: a value, or a byte of two FP4 codes.
    pub fn unit_bytes(self) -> usize {
        match self {
            Codec::Float { bits, .. } => bits as usize / 8,
            Codec::E8m0 | Codec::Fp4x2 => 1,
            Codec::Index { bytes } => bytes,
        }
    }

    fn codes_per_unit(self) -> u64 {
        if self == Codec::Fp4x2 {
            2
        } else {
            1
        }
    }

    fn signed(self) -> bool {
        matches!(self, Codec::Float { .. } | Codec::Fp4x2)
    }

    /// Whether `m` is a domain this codec can have: for floats, every code up to some
    /// binary exponent (`m` a multiple of `2^mantissa`) or all finite codes.
    pub fn valid_domain(self, m: u64) -> bool {
        let float_ok = |mantissa: u32, top: u64| {
            let unit = 1u64 << mantissa;
            m >= unit && m <= top + 1 && (m % unit == 0 || m == top + 1)
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

fn sign_extend(raw: u64, bytes: usize) -> i64 {
    let shift = 64 - 8 * bytes as u32;
    ((raw << shift) as i64) >> shift
}

/// A value outside the locked domain: the data is not what was locked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OutOfDomain {
    /// Index of the offending unit from the start of the tensor.
    pub unit: u64,
}

/// Everything needed to lock or unlock any range of one tensor.
#[derive(Debug, Clone)]
pub struct TensorLock {
    pub version: Version,
    pub codec: Codec,
    pub m: u64,
    span: u64,
    /// v1 F32 and v2 spans above 2^31 take 64 bits of stream per code.
    wide: bool,
    stream_key: Secret,
}

/// The id a tensor's key stream is derived from: its name, scoped by the shard's directory.
pub fn tensor_id(shard_dir: &str, name: &str) -> String {
    if shard_dir.is_empty() {
        name.to_string()
    } else {
        format!("{shard_dir}/{name}")
    }
}

impl TensorLock {
    /// `m` must already satisfy `codec.valid_domain(m)`.
    pub fn new(
        key: &ModelKey,
        version: Version,
        codec: Codec,
        m: u64,
        tensor_id: &str,
    ) -> TensorLock {
        debug_assert!(codec.valid_domain(m));
        let span = if codec.signed() { 2 * m } else { m };
        let wide = match version {
            Version::V1 => matches!(codec, Codec::Float { bits: 32, .. }),
            Version::V2 => span > 1 << 31,
        };
        let stream_key = key.derive(&format!("lock/{}/{tensor_id}", version.label()));
        TensorLock {
            version,
            codec,
            m,
            span,
            wide,
            stream_key,
        }
    }

    /// Key stream bytes for codes `[first_code, ...)` into `ks` (`width` bytes a code).
    fn keystream(&self, first_code: u64, ks: &mut [u8]) {
        let pos = first_code * self.stream_width() as u64;
        match self.version {
            Version::V1 => {
                // cipher 0.4 has no write_keystream: XOR into zeros.
                ks.fill(0);
                let mut c = Aes256Ctr::new(self.stream_key.bytes().into(), &[0u8; 16].into());
                c.seek(pos);
                c.apply_keystream(ks);
            }
            Version::V2 => {
                use chacha20::cipher::{KeyIvInit as _, StreamCipher as _, StreamCipherSeek as _};
                let mut c =
                    chacha20::ChaCha20::new(self.stream_key.bytes().into(), &[0u8; 12].into());
                c.seek(pos);
                c.write_keystream(ks);
            }
        }
    }

    fn stream_width(&self) -> usize {
        if self.wide {
            8
        } else {
            4
        }
    }

    /// Unlock whole units in place: `buf` holds units `[first_unit, ...)` of the tensor.
    pub fn decode(&self, first_unit: u64, buf: &mut [u8]) -> Result<(), OutOfDomain> {
        self.shift(first_unit, buf, false)
    }

    /// Lock whole units in place (the test sealer's side).
    pub fn encode(&self, first_unit: u64, buf: &mut [u8]) -> Result<(), OutOfDomain> {
        self.shift(first_unit, buf, true)
    }

    /// The largest tensor a stream can cover: ChaCha20's 32-bit block counter (256 GiB of
    /// stream); AES-CTR's 128-bit counter has no practical limit.
    pub fn max_units(&self) -> u64 {
        let per_code = if self.wide { 8 } else { 4 };
        match self.version {
            Version::V1 => u64::MAX / 16,
            Version::V2 => (64u64 << 32) / per_code / self.codec.codes_per_unit(),
        }
    }

    fn shift(&self, first_unit: u64, buf: &mut [u8], lock: bool) -> Result<(), OutOfDomain> {
        let ub = self.codec.unit_bytes();
        assert_eq!(buf.len() % ub, 0, "whole units only");
        let cpu = self.codec.codes_per_unit() as usize;
        let width = self.stream_width();
        let units_per_batch = BATCH / cpu;
        KEYSTREAM.with(|cell| {
            let mut ks = cell.borrow_mut();
            for (b, part) in buf.chunks_mut(units_per_batch * ub).enumerate() {
                let unit0 = first_unit + (b * units_per_batch) as u64;
                let n_codes = part.len() / ub * cpu;
                ks.resize(n_codes * width, 0);
                let ks = &mut ks[..n_codes * width];
                self.keystream(unit0 * cpu as u64, ks);
                let k = Kernel {
                    m: self.m,
                    span: self.span,
                };
                let bad = match (self.codec, self.wide, lock) {
                    (Codec::Float { bits: 8, .. }, false, false) => {
                        k.float::<1, false, false>(part, ks)
                    }
                    (Codec::Float { bits: 8, .. }, true, false) => {
                        k.float::<1, true, false>(part, ks)
                    }
                    (Codec::Float { bits: 8, .. }, false, true) => {
                        k.float::<1, false, true>(part, ks)
                    }
                    (Codec::Float { bits: 8, .. }, true, true) => {
                        k.float::<1, true, true>(part, ks)
                    }
                    (Codec::Float { bits: 16, .. }, false, false) => {
                        k.float::<2, false, false>(part, ks)
                    }
                    (Codec::Float { bits: 16, .. }, true, false) => {
                        k.float::<2, true, false>(part, ks)
                    }
                    (Codec::Float { bits: 16, .. }, false, true) => {
                        k.float::<2, false, true>(part, ks)
                    }
                    (Codec::Float { bits: 16, .. }, true, true) => {
                        k.float::<2, true, true>(part, ks)
                    }
                    (Codec::Float { .. }, false, false) => k.float::<4, false, false>(part, ks),
                    (Codec::Float { .. }, true, false) => k.float::<4, true, false>(part, ks),
                    (Codec::Float { .. }, false, true) => k.float::<4, false, true>(part, ks),
                    (Codec::Float { .. }, true, true) => k.float::<4, true, true>(part, ks),
                    (Codec::E8m0, w, l) => k.index::<1>(part, ks, w, l),
                    (Codec::Index { bytes: 2 }, w, l) => k.index::<2>(part, ks, w, l),
                    (Codec::Index { bytes: 4 }, w, l) => k.index::<4>(part, ks, w, l),
                    (Codec::Index { .. }, w, l) => k.index::<8>(part, ks, w, l),
                    (Codec::Fp4x2, _, l) => k.fp4(part, ks, l),
                };
                if let Some(i) = bad {
                    return Err(OutOfDomain {
                        unit: unit0 + i as u64,
                    });
                }
            }
            Ok(())
        })
    }
}

thread_local! {
    /// One batch of key stream per thread, reused across calls.
    static KEYSTREAM: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// One sign-magnitude float kernel for a concrete value type `$v` and stream word `$w`,
/// written with plain integer loads so the loop vectorizes.
macro_rules! float_lanes {
    ($k:expr, $part:expr, $ks:expr, $v:ty, u32, $lock:expr) => {{
        // Narrow streams: every quantity fits 32 bits, so the loop maps onto 32-bit lanes
        // (the stream word times span is a 32x32->64 multiply).
        const VB: usize = std::mem::size_of::<$v>();
        let shift = 8 * VB as u32 - 1;
        let mag_mask: u32 = (1u32 << shift) - 1;
        let (m, span) = ($k.m as u32, $k.span as u32);
        for (v, w) in $part.chunks_exact_mut(VB).zip($ks.chunks_exact(4)) {
            let code = <$v>::from_le_bytes(v.try_into().expect("value")) as u32;
            let word = u32::from_le_bytes(w.try_into().expect("word"));
            let off = if VB <= 2 {
                // Spans of 8- and 16-bit codes are at most 2^16, so the product splits
                // into two 32-bit ones: a full 8-lane multiply instead of a 4-lane one.
                split_mul_high(word, span)
            } else {
                ((word as u64 * span as u64) >> 32) as u32
            };
            let idx = (code & mag_mask) + (code >> shift) * m;
            let p = if $lock {
                let t = idx as u64 + off as u64;
                (if t >= span as u64 { t - span as u64 } else { t }) as u32
            } else {
                let (d, borrow) = idx.overflowing_sub(off);
                d.wrapping_add(span * borrow as u32)
            };
            let high = (p >= m) as u32;
            let res = p - m * high | high << shift;
            v.copy_from_slice(&(res as $v).to_le_bytes());
        }
    }};
    ($k:expr, $part:expr, $ks:expr, $v:ty, u64, $lock:expr) => {{
        const VB: usize = std::mem::size_of::<$v>();
        let shift = 8 * VB as u64 - 1;
        let mag_mask: u64 = (1u64 << shift) - 1;
        let (m, span) = ($k.m, $k.span);
        for (v, w) in $part.chunks_exact_mut(VB).zip($ks.chunks_exact(8)) {
            let code = <$v>::from_le_bytes(v.try_into().expect("value")) as u64;
            let word = u64::from_le_bytes(w.try_into().expect("word"));
            let off = (word & 0x7FFF_FFFF_FFFF_FFFF) % span;
            let idx = (code & mag_mask) + (code >> shift) * m;
            let t = if $lock { idx + off } else { idx + span - off };
            let p = if t >= span { t - span } else { t };
            let high = (p >= m) as u64;
            let res = p - m * high | high << shift;
            v.copy_from_slice(&(res as $v).to_le_bytes());
        }
    }};
}

/// The narrow-stream kernels, compiled twice: for the baseline target and with AVX2, picked
/// at run time. With AVX2 the 32-bit lanes become 8-wide vectors.
macro_rules! narrow_kernels {
    ($body:ident: $($plain:ident, $avx2:ident, $avx512:ident, $v:ty;)*) => {$(
        fn $plain<const LOCK: bool>(k: &Kernel, part: &mut [u8], ks: &[u8]) {
            $body!(k, part, ks, $v, u32, LOCK)
        }

        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = "avx2")]
        fn $avx2<const LOCK: bool>(k: &Kernel, part: &mut [u8], ks: &[u8]) {
            $body!(k, part, ks, $v, u32, LOCK)
        }

        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
        fn $avx512<const LOCK: bool>(k: &Kernel, part: &mut [u8], ks: &[u8]) {
            $body!(k, part, ks, $v, u32, LOCK)
        }
    )*};
}

narrow_kernels! { float_lanes:
    narrow_u8, narrow_u8_avx2, narrow_u8_avx512, u8;
    narrow_u16, narrow_u16_avx2, narrow_u16_avx512, u16;
    narrow_u32, narrow_u32_avx2, narrow_u32_avx512, u32;
}

/// Unsigned codes (E8M0 scales, index tables), already checked to be below `m` (the span),
/// so they fit 32-bit lanes whatever their width on disk.
macro_rules! unsigned_lanes {
    ($k:expr, $part:expr, $ks:expr, $v:ty, u32, $lock:expr) => {{
        const VB: usize = std::mem::size_of::<$v>();
        let span = $k.span as u32;
        for (v, w) in $part.chunks_exact_mut(VB).zip($ks.chunks_exact(4)) {
            let x = <$v>::from_le_bytes(v.try_into().expect("value")) as u32;
            let word = u32::from_le_bytes(w.try_into().expect("word"));
            let off = if VB <= 2 {
                split_mul_high(word, span)
            } else {
                ((word as u64 * span as u64) >> 32) as u32
            };
            let p = if $lock {
                // Both below span <= 2^31: the sum fits.
                let t = x + off;
                if t >= span {
                    t - span
                } else {
                    t
                }
            } else {
                let (d, borrow) = x.overflowing_sub(off);
                d.wrapping_add(span * borrow as u32)
            };
            v.copy_from_slice(&(p as $v).to_le_bytes());
        }
    }};
}

narrow_kernels! { unsigned_lanes:
    unsigned_u8, unsigned_u8_avx2, unsigned_u8_avx512, u8;
    unsigned_u16, unsigned_u16_avx2, unsigned_u16_avx512, u16;
    unsigned_u32, unsigned_u32_avx2, unsigned_u32_avx512, u32;
}

/// Two 4-bit sign-magnitude codes a byte, low nibble first, each with its own stream word.
macro_rules! fp4_lanes {
    ($k:expr, $part:expr, $ks:expr, $v:ty, u32, $lock:expr) => {{
        let (m, span) = ($k.m as u32, $k.span as u32);
        for (v, w) in $part.iter_mut().zip($ks.chunks_exact(8)) {
            let mut res = 0u32;
            for half in 0..2 {
                let code = (*v as u32 >> (4 * half)) & 0xF;
                let word = u32::from_le_bytes(w[4 * half..4 * half + 4].try_into().expect("word"));
                let off = split_mul_high(word, span);
                let idx = (code & 7) + (code >> 3) * m;
                let p = if $lock {
                    let t = idx + off;
                    if t >= span {
                        t - span
                    } else {
                        t
                    }
                } else {
                    let (d, borrow) = idx.overflowing_sub(off);
                    d.wrapping_add(span * borrow as u32)
                };
                let high = (p >= m) as u32;
                res |= (p - m * high | high << 3) << (4 * half);
            }
            *v = res as u8;
        }
    }};
}

narrow_kernels! { fp4_lanes:
    fp4_plain, fp4_avx2, fp4_avx512, u8;
}

/// Whether the AVX-512 builds of the kernels may run (checked once; the macro caches it).
#[cfg(target_arch = "x86_64")]
fn has_avx512() -> bool {
    std::arch::is_x86_feature_detected!("avx512f")
        && std::arch::is_x86_feature_detected!("avx512bw")
        && std::arch::is_x86_feature_detected!("avx512vl")
}

/// `(word * span) >> 32` for `span <= 2^16`, in 32-bit arithmetic: exact, because
/// `floor((hi * 2^16 * span + lo * span) / 2^32) = (hi * span + (lo * span >> 16)) >> 16`
/// and neither sum can overflow 32 bits.
#[inline(always)]
fn split_mul_high(word: u32, span: u32) -> u32 {
    debug_assert!(span <= 1 << 16);
    ((word >> 16) * span + (((word & 0xFFFF) * span) >> 16)) >> 16
}

/// The largest magnitude among sign-magnitude values: a reduction without an early exit,
/// so it vectorizes (the domain check runs on every decoded value).
macro_rules! max_magnitude {
    ($($plain:ident, $avx2:ident, $v:ty;)*) => {$(
        fn $plain(part: &[u8]) -> u64 {
            max_magnitude!(@body part, $v)
        }

        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = "avx2")]
        fn $avx2(part: &[u8]) -> u64 {
            max_magnitude!(@body part, $v)
        }
    )*};
    (@body $part:expr, $v:ty) => {{
        const VB: usize = std::mem::size_of::<$v>();
        let mask: $v = <$v>::MAX >> 1;
        $part
            .chunks_exact(VB)
            .map(|v| <$v>::from_le_bytes(v.try_into().expect("value")) & mask)
            .fold(0, <$v>::max) as u64
    }};
}

max_magnitude! {
    max_mag_u8, max_mag_u8_avx2, u8;
    max_mag_u16, max_mag_u16_avx2, u16;
    max_mag_u32, max_mag_u32_avx2, u32;
}

macro_rules! with_avx2 {
    ($plain:ident, $avx2:ident, $($arg:expr),*) => {{
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx2") {
                // SAFETY: the CPU was just found to support AVX2.
                unsafe { $avx2($($arg),*) }
            } else {
                $plain($($arg),*)
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        $plain($($arg),*)
    }};
}

macro_rules! narrow {
    ($k:expr, $part:expr, $ks:expr, $plain:ident, $avx2:ident, $avx512:ident, $lock:expr) => {{
        #[cfg(target_arch = "x86_64")]
        {
            if has_avx512() {
                // SAFETY: the CPU was just found to support these AVX-512 subsets.
                unsafe { $avx512::<$lock>($k, $part, $ks) }
            } else if std::arch::is_x86_feature_detected!("avx2") {
                // SAFETY: the CPU was just found to support AVX2.
                unsafe { $avx2::<$lock>($k, $part, $ks) }
            } else {
                $plain::<$lock>($k, $part, $ks)
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        $plain::<$lock>($k, $part, $ks)
    }};
}

/// The per-value arithmetic, monomorphized by value width, stream width and direction so
/// the inner loops have no branches the compiler cannot turn into selects.
struct Kernel {
    m: u64,
    span: u64,
}

impl Kernel {
    #[inline(always)]
    fn offset<const WIDE: bool>(&self, ks: &[u8], i: usize) -> u64 {
        let sw = if WIDE { 8 } else { 4 };
        self.offset_of::<WIDE>(&ks[sw * i..sw * i + sw])
    }

    /// The offset a code's stream word gives: `word` is 4 bytes, or 8 when `WIDE`.
    #[inline(always)]
    fn offset_of<const WIDE: bool>(&self, word: &[u8]) -> u64 {
        if WIDE {
            let w = u64::from_le_bytes(word.try_into().expect("8 bytes"));
            (w & 0x7FFF_FFFF_FFFF_FFFF) % self.span
        } else {
            let w = u32::from_le_bytes(word.try_into().expect("4 bytes")) as u64;
            (w * self.span) >> 32
        }
    }

    /// `(idx ± off) mod span`, both below `span`.
    #[inline(always)]
    fn apply<const LOCK: bool>(&self, idx: u64, off: u64) -> u64 {
        let t = if LOCK {
            idx + off
        } else {
            idx + self.span - off
        };
        if t >= self.span {
            t - self.span
        } else {
            t
        }
    }

    #[inline(always)]
    fn load<const W: usize>(v: &[u8]) -> u64 {
        let mut raw = [0u8; 8];
        raw[..W].copy_from_slice(&v[..W]);
        u64::from_le_bytes(raw)
    }

    /// Sign-magnitude values of `W` bytes. Returns the first value outside the domain,
    /// checked before anything is changed.
    fn float<const W: usize, const WIDE: bool, const LOCK: bool>(
        &self,
        part: &mut [u8],
        ks: &[u8],
    ) -> Option<usize> {
        let sign_bit = 1u64 << (8 * W - 1);
        let m = self.m;
        let largest = match W {
            1 => with_avx2!(max_mag_u8, max_mag_u8_avx2, part),
            2 => with_avx2!(max_mag_u16, max_mag_u16_avx2, part),
            _ => with_avx2!(max_mag_u32, max_mag_u32_avx2, part),
        };
        if largest >= m {
            return part
                .chunks_exact(W)
                .position(|v| Self::load::<W>(v) & (sign_bit - 1) >= m);
        }
        match (W, WIDE) {
            (1, false) => narrow!(
                self,
                part,
                ks,
                narrow_u8,
                narrow_u8_avx2,
                narrow_u8_avx512,
                LOCK
            ),
            (2, false) => narrow!(
                self,
                part,
                ks,
                narrow_u16,
                narrow_u16_avx2,
                narrow_u16_avx512,
                LOCK
            ),
            (4, false) => narrow!(
                self,
                part,
                ks,
                narrow_u32,
                narrow_u32_avx2,
                narrow_u32_avx512,
                LOCK
            ),
            (1, true) => float_lanes!(self, part, ks, u8, u64, LOCK),
            (2, true) => float_lanes!(self, part, ks, u16, u64, LOCK),
            _ => float_lanes!(self, part, ks, u32, u64, LOCK),
        }
        None
    }

    /// Unsigned codes: E8M0 bytes and non-negative little-endian integers of `W` bytes.
    fn index<const W: usize>(
        &self,
        part: &mut [u8],
        ks: &[u8],
        wide: bool,
        lock: bool,
    ) -> Option<usize> {
        let m = self.m;
        let code = |v: &[u8]| {
            let raw = Self::load::<W>(v);
            // Integers are signed on disk: a negative value sign-extends to a huge code.
            sign_extend(raw, W) as u64
        };
        let unsigned = |v: &[u8]| if W == 1 { v[0] as u64 } else { code(v) };
        if let Some(i) = part.chunks_exact(W).position(|v| unsigned(v) >= m) {
            return Some(i);
        }
        if !wide {
            match (W, lock) {
                (1, false) => narrow!(
                    self,
                    part,
                    ks,
                    unsigned_u8,
                    unsigned_u8_avx2,
                    unsigned_u8_avx512,
                    false
                ),
                (1, true) => narrow!(
                    self,
                    part,
                    ks,
                    unsigned_u8,
                    unsigned_u8_avx2,
                    unsigned_u8_avx512,
                    true
                ),
                (2, false) => narrow!(
                    self,
                    part,
                    ks,
                    unsigned_u16,
                    unsigned_u16_avx2,
                    unsigned_u16_avx512,
                    false
                ),
                (2, true) => narrow!(
                    self,
                    part,
                    ks,
                    unsigned_u16,
                    unsigned_u16_avx2,
                    unsigned_u16_avx512,
                    true
                ),
                (4, false) => narrow!(
                    self,
                    part,
                    ks,
                    unsigned_u32,
                    unsigned_u32_avx2,
                    unsigned_u32_avx512,
                    false
                ),
                (4, true) => narrow!(
                    self,
                    part,
                    ks,
                    unsigned_u32,
                    unsigned_u32_avx2,
                    unsigned_u32_avx512,
                    true
                ),
                _ => self.index_wide_or_long::<W>(part, ks, wide, lock),
            }
            return None;
        }
        self.index_wide_or_long::<W>(part, ks, wide, lock);
        None
    }

    /// Unsigned codes the 32-bit lanes do not cover: 8-byte integers, or 64-bit stream words.
    fn index_wide_or_long<const W: usize>(
        &self,
        part: &mut [u8],
        ks: &[u8],
        wide: bool,
        lock: bool,
    ) {
        let code = |v: &[u8]| sign_extend(Self::load::<W>(v), W) as u64;
        let unsigned = |v: &[u8]| if W == 1 { v[0] as u64 } else { code(v) };
        for (i, v) in part.chunks_exact_mut(W).enumerate() {
            let off = if wide {
                self.offset::<true>(ks, i)
            } else {
                self.offset::<false>(ks, i)
            };
            let x = unsigned(v);
            let p = if lock {
                self.apply::<true>(x, off)
            } else {
                self.apply::<false>(x, off)
            };
            v.copy_from_slice(&p.to_le_bytes()[..W]);
        }
    }

    /// Two 4-bit sign-magnitude codes a byte, low nibble first (code `2j` and `2j + 1`).
    fn fp4(&self, part: &mut [u8], ks: &[u8], lock: bool) -> Option<usize> {
        let m = self.m;
        let largest = part
            .iter()
            .map(|&b| (b & 7).max((b >> 4) & 7))
            .fold(0, u8::max);
        if largest as u64 >= m {
            return part
                .iter()
                .position(|&b| (b & 7) as u64 >= m || ((b >> 4) & 7) as u64 >= m);
        }
        if lock {
            narrow!(self, part, ks, fp4_plain, fp4_avx2, fp4_avx512, true)
        } else {
            narrow!(self, part, ks, fp4_plain, fp4_avx2, fp4_avx512, false)
        }
        None
    }
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

    fn xorshift(seed: &mut u64) -> u64 {
        *seed ^= *seed << 13;
        *seed ^= *seed >> 7;
        *seed ^= *seed << 17;
        *seed
    }

    /// The 32-bit lane kernels against the 64-bit scalar arithmetic they replace.
    #[test]
    fn lane_kernels_equal_the_scalar_arithmetic() {
        let mut seed = 0x1234_5678_9ABC_DEF1u64;
        for round in 0..300 {
            let n = 1 + (xorshift(&mut seed) % 700) as usize;
            let mut ks = vec![0u8; n * 8];
            ks.iter_mut().for_each(|b| *b = xorshift(&mut seed) as u8);
            for lock in [false, true] {
                // Unsigned codes of 1, 2 and 4 bytes.
                for w in [1usize, 2, 4] {
                    let max_m = match w {
                        1 => 255,
                        2 => 1 << 15,
                        _ => 1 << 31,
                    };
                    let m = 1 + xorshift(&mut seed) % max_m;
                    let k = Kernel { m, span: m };
                    let mut data = vec![0u8; n * w];
                    for v in data.chunks_exact_mut(w) {
                        let x = if round % 7 == 0 {
                            m - 1
                        } else {
                            xorshift(&mut seed) % m
                        };
                        v.copy_from_slice(&x.to_le_bytes()[..w]);
                    }
                    let mut want = data.clone();
                    match w {
                        1 => k.index_wide_or_long::<1>(&mut want, &ks, false, lock),
                        2 => k.index_wide_or_long::<2>(&mut want, &ks, false, lock),
                        _ => k.index_wide_or_long::<4>(&mut want, &ks, false, lock),
                    }
                    let got = match w {
                        1 => k.index::<1>(&mut data, &ks, false, lock),
                        2 => k.index::<2>(&mut data, &ks, false, lock),
                        _ => k.index::<4>(&mut data, &ks, false, lock),
                    };
                    assert_eq!(got, None);
                    assert_eq!(data, want, "index w={w} m={m:#x} lock={lock}");
                }
                // FP4 pairs against the per-nibble scalar formula.
                let m = [2u64, 4, 6, 8][(xorshift(&mut seed) % 4) as usize];
                let k = Kernel { m, span: 2 * m };
                let mut data: Vec<u8> = (0..n)
                    .map(|_| {
                        let lo = xorshift(&mut seed) % (2 * m);
                        let hi = xorshift(&mut seed) % (2 * m);
                        let nib = |c: u64| if c >= m { (c - m) | 8 } else { c } as u8;
                        nib(lo) | nib(hi) << 4
                    })
                    .collect();
                let want: Vec<u8> = data
                    .iter()
                    .enumerate()
                    .map(|(i, &b)| {
                        let mut res = 0u8;
                        for h in 0..2 {
                            let code = ((b >> (4 * h)) & 0xF) as u64;
                            let idx = (code & 7) + if code & 8 != 0 { m } else { 0 };
                            let off = k.offset::<false>(&ks, 2 * i + h);
                            let p = if lock {
                                k.apply::<true>(idx, off)
                            } else {
                                k.apply::<false>(idx, off)
                            };
                            let nib = if p >= m { (p - m) | 8 } else { p };
                            res |= (nib as u8) << (4 * h);
                        }
                        res
                    })
                    .collect();
                assert_eq!(k.fp4(&mut data, &ks, lock), None);
                assert_eq!(data, want, "fp4 m={m} lock={lock}");
            }
        }
    }

    #[test]
    fn split_multiply_is_exact() {
        let mut x = 0x9E37_79B9_7F4A_7C15u64;
        let spans = [
            1u32, 2, 0xFE, 0x100, 0x8000, 0xF800, 0xFF00, 0xFFFF, 0x10000,
        ];
        for i in 0..200_000u32 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let word = match i {
                0 => 0,
                1 => u32::MAX,
                _ => x as u32,
            };
            for &span in &spans {
                let exact = ((word as u64 * span as u64) >> 32) as u32;
                assert_eq!(split_mul_high(word, span), exact, "{word:#x} * {span:#x}");
            }
        }
    }

    #[test]
    fn bf16_domain_as_kllm() {
        // 1.0 in BF16 is 0x3F80: exponent field 0x7F, so m = (0x3F80 >> 7 + 1) << 7 = 0x4000.
        let c = Codec::float(Dtype::BF16).unwrap();
        assert_eq!(c.domain_of(&[0x80, 0x3F, 0x80, 0xBF]), Some(0x4000));
        assert_eq!(c.domain_of(&[0x80, 0x7F]), None); // inf
    }
}
