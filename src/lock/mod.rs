//! Locked tensors: format-preserving shifts of value codes by a per-tensor key stream.
//!
//! Every value is read as an unsigned code below `span` and shifted modulo `span`; the
//! shift (offset) of value `j` comes from position `j` of the tensor's own key stream,
//! AES-256-CTR for lock v1 and ChaCha20 for lock v2. Both seek to any block, so any range of
//! a tensor decodes on its own.
//!
//! - [`document`]: the `kllm.lock` document a locked shard carries, and which codec each
//!   entry gets;
//! - `codec`: how values are read as codes, and the domains each kind allows;
//! - [`stream`]: the key streams;
//! - `arith`: offsets and modular shifts;
//! - `lanes`: the kernels, one generic loop per kind of code and instruction set;
//! - `fused`: codes of 16 bits or fewer on AVX-512, unlocked as their key stream is made
//!   (lock v2's ChaCha20 blocks, lock v1's AES blocks by VAES), the stream never written out
//!   (the general path, `stream` into a buffer and then `lanes`, takes every other tensor and
//!   the codes around a call's whole groups).

mod arith;
mod codec;
pub mod document;
#[cfg(target_arch = "x86_64")]
mod fused;
mod lanes;
pub mod stream;
#[cfg(target_arch = "x86_64")]
mod vaes;

pub use codec::Codec;
pub use document::{LockEntry, LOCK_META};

use crate::key::{ModelKey, Secret};
use lanes::{BatchFn, Domain, Isa};

/// Codes processed per batch: the offsets of a batch fit in L1/L2.
const BATCH: usize = 4096;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Version {
    V1,
    V2,
}

impl Version {
    /// Every lock version this build reads: a new one is added here and in [`document`].
    pub const ALL: [Version; 2] = [Version::V1, Version::V2];

    pub fn parse(s: &str) -> Option<Version> {
        Version::ALL.into_iter().find(|v| v.label() == s)
    }

    /// The versions for messages: `v1 and v2`.
    pub fn supported_text() -> String {
        let labels: Vec<&str> = Version::ALL.iter().map(|v| v.label()).collect();
        match labels.split_last() {
            Some((last, rest)) if !rest.is_empty() => format!("{} and {last}", rest.join(", ")),
            _ => labels.concat(),
        }
    }

    pub fn label(self) -> &'static str {
        match self {
            Version::V1 => "v1",
            Version::V2 => "v2",
        }
    }
}

/// A value outside the locked domain: the data is not what was locked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OutOfDomain {
    /// Index of the offending unit from the start of the tensor.
    pub unit: u64,
}

/// Everything needed to unlock (and, with the sealer, lock) any range of one tensor.
#[derive(Debug, Clone)]
pub struct TensorLock {
    pub version: Version,
    pub codec: Codec,
    pub m: u64,
    span: u64,
    /// v1 F32 and v2 spans above 2^31 take 64 bits of stream per code.
    wide: bool,
    stream_key: Secret,
    /// Chosen once for this codec, stream width and CPU.
    decode_kernel: BatchFn,
    #[cfg(feature = "seal")]
    encode_kernel: BatchFn,
    /// Codes of 16 bits or fewer on an AVX-512 CPU (lock v1's with VAES too): unlocked as their
    /// stream is made (`fused`), but for a head and tail of less than a group.
    #[cfg(target_arch = "x86_64")]
    fused: Option<fused::Kernel>,
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
        let isa = Isa::best();
        TensorLock {
            version,
            codec,
            m,
            span,
            wide,
            stream_key,
            decode_kernel: isa.select::<false>(codec, span, wide),
            #[cfg(feature = "seal")]
            encode_kernel: isa.select::<true>(codec, span, wide),
            #[cfg(target_arch = "x86_64")]
            fused: fused_kernel(version, codec, span),
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
        #[cfg(target_arch = "x86_64")]
        if let Some(kernel) = self.fused {
            return self.decode_fused(kernel, first_unit, None, buf);
        }
        self.shift(self.decode_kernel, first_unit, buf)
    }

    /// Unlock whole units from `sealed` (units `[first_unit, ...)` of the tensor, left as they
    /// are) into `out`, as many bytes. A fused kernel reads each code once, where an unlock in
    /// place needs the codes copied into `out` first.
    pub fn decode_from(
        &self,
        first_unit: u64,
        sealed: &[u8],
        out: &mut [u8],
    ) -> Result<(), OutOfDomain> {
        assert_eq!(sealed.len(), out.len(), "as many bytes written as read");
        #[cfg(target_arch = "x86_64")]
        if let Some(kernel) = self.fused {
            return self.decode_fused(kernel, first_unit, Some(sealed), out);
        }
        out.copy_from_slice(sealed);
        self.shift(self.decode_kernel, first_unit, out)
    }

    /// [`TensorLock::decode`] by the general path whatever the codec and CPU: the key stream
    /// made into a buffer a batch at a time, then applied (the decode benchmark compares it
    /// with the fused kernel).
    pub fn decode_through_stream_buffer(
        &self,
        first_unit: u64,
        buf: &mut [u8],
    ) -> Result<(), OutOfDomain> {
        self.shift(self.decode_kernel, first_unit, buf)
    }

    /// [`TensorLock::decode`] (`sealed` none: `buf` holds the codes) or
    /// [`TensorLock::decode_from`] by whole groups of the fused kernel, the codes before the
    /// first group and after the last by the general path.
    #[cfg(target_arch = "x86_64")]
    fn decode_fused(
        &self,
        kernel: fused::Kernel,
        first_unit: u64,
        sealed: Option<&[u8]>,
        buf: &mut [u8],
    ) -> Result<(), OutOfDomain> {
        let unit = kernel.unit_bytes();
        assert_eq!(buf.len() % unit, 0, "whole units only");
        let units = (buf.len() / unit) as u64;
        let group = kernel.group_units();
        let head = ((group - first_unit % group) % group).min(units);
        let groups = (units - head) / group * group;
        let (head_end, middle_end) = (head as usize * unit, (head + groups) as usize * unit);
        let (head_bytes, rest) = buf.split_at_mut(head_end);
        let (middle, tail) = rest.split_at_mut(middle_end - head_end);
        if let Some(sealed) = sealed {
            head_bytes.copy_from_slice(&sealed[..head_end]);
            tail.copy_from_slice(&sealed[middle_end..]);
        }
        self.shift(self.decode_kernel, first_unit, head_bytes)?;
        let start = first_unit + head;
        if groups > 0 {
            let places = match sealed {
                Some(sealed) => fused::Places::from_to(&sealed[head_end..middle_end], middle),
                None => fused::Places::in_place(middle),
            };
            // SAFETY: `fused` is set only where `Cipher::available` found the kernel's
            // instructions, for codes whose domain and span the kernel takes; `start` is a
            // multiple of the group and `middle` whole groups.
            let outside = unsafe {
                fused::unlock_groups(kernel, self.stream_key.bytes(), start, self.m, places)
            };
            if let Some(i) = outside {
                return Err(OutOfDomain {
                    unit: start + i as u64,
                });
            }
        }
        self.shift(self.decode_kernel, start + groups, tail)
    }

    /// Lock whole units in place (the test sealer's side).
    #[cfg(feature = "seal")]
    pub fn encode(&self, first_unit: u64, buf: &mut [u8]) -> Result<(), OutOfDomain> {
        self.shift(self.encode_kernel, first_unit, buf)
    }

    /// The largest tensor a stream can cover: ChaCha20's 32-bit block counter (256 GiB of
    /// stream); AES-CTR's 128-bit counter has no practical limit.
    pub fn max_units(&self) -> u64 {
        let per_code = self.stream_width() as u64;
        match self.version {
            Version::V1 => u64::MAX / 16,
            Version::V2 => (64u64 << 32) / per_code / self.codec.codes_per_unit(),
        }
    }

    fn shift(&self, kernel: BatchFn, first_unit: u64, buf: &mut [u8]) -> Result<(), OutOfDomain> {
        let ub = self.codec.unit_bytes();
        assert_eq!(buf.len() % ub, 0, "whole units only");
        let cpu = self.codec.codes_per_unit() as usize;
        let width = self.stream_width();
        let units_per_batch = BATCH / cpu;
        let domain = Domain {
            m: self.m,
            span: self.span,
        };
        KEYSTREAM.with(|cell| {
            let mut ks = cell.borrow_mut();
            let mut unit0 = first_unit;
            let mut rest = buf;
            while !rest.is_empty() {
                // Batches end on multiples of the batch in the tensor, so that every batch
                // but a call's first starts its stream on a cipher block: a stream that
                // starts mid-block costs a single-block pass per batch (a quarter of the
                // decode for BF16, `cargo bench --bench decode`).
                let to_boundary = units_per_batch - (unit0 % units_per_batch as u64) as usize;
                let units = to_boundary.min(rest.len() / ub);
                let (part, tail) = std::mem::take(&mut rest).split_at_mut(units * ub);
                rest = tail;
                let n_codes = units * cpu;
                ks.resize(n_codes * width, 0);
                let ks = &mut ks[..n_codes * width];
                let first_code = unit0 * cpu as u64;
                stream::fill(
                    self.version,
                    &self.stream_key,
                    first_code * width as u64,
                    ks,
                );
                // SAFETY: `kernel` was built for an instruction set `Isa::best` found on
                // this CPU.
                if let Some(i) = unsafe { kernel(domain, part, ks) } {
                    return Err(OutOfDomain {
                        unit: unit0 + i as u64,
                    });
                }
                unit0 += units as u64;
            }
            Ok(())
        })
    }
}

/// The fused kernel for this tensor on this CPU, if any: narrow streams (one word a code) of
/// codes of 16 bits or fewer. 32-bit codes keep the general path: a fused kernel for them
/// (lock v2), with its 16 x 16 transpose of offsets, ran at 2.3 GB/s where the general path
/// runs at 3.5 (`cargo bench --bench decode`, F32 and I32); lock v1's F32 take 64-bit words.
#[cfg(target_arch = "x86_64")]
fn fused_kernel(version: Version, codec: Codec, span: u64) -> Option<fused::Kernel> {
    use fused::{Cipher, Codes};
    let cipher = match version {
        Version::V1 => Cipher::Aes256Ctr,
        Version::V2 => Cipher::ChaCha20,
    };
    if !cipher.available() {
        return None;
    }
    let codes = match (cipher, codec) {
        (_, Codec::Float { bits: 16, .. }) if span < 1 << 16 => Codes::Float16,
        (_, Codec::Float { bits: 8, .. }) => Codes::Float8,
        (Cipher::ChaCha20, Codec::Index { bytes: 2 }) => Codes::Unsigned16,
        (Cipher::ChaCha20, Codec::E8m0) => Codes::Unsigned8,
        (Cipher::ChaCha20, Codec::Fp4x2) => Codes::Fp4Pairs,
        _ => return None,
    };
    Some(fused::Kernel { cipher, codes })
}

thread_local! {
    /// One batch of key stream per thread, reused across calls.
    static KEYSTREAM: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The fused kernels give the general path's bytes for every kind of code they take, under
    /// both lock versions, at any start, length and domain, and name the same first unit
    /// outside the domain.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn fused_kernel_equals_the_general_path() {
        use fused::{Cipher, Codes};
        use safetensors::Dtype;
        let key = ModelKey::new([9; 32]);
        let mut rng = crate::testkit::SplitMix(21);
        let float = |d| Codec::float(d).expect("float codec");
        let floats = [
            (float(Dtype::BF16), Codes::Float16),
            (float(Dtype::F16), Codes::Float16),
            (float(Dtype::F8_E4M3), Codes::Float8),
            (float(Dtype::F8_E5M2), Codes::Float8),
        ];
        let v2_only = [
            (Codec::Index { bytes: 2 }, Codes::Unsigned16),
            (Codec::E8m0, Codes::Unsigned8),
            (Codec::Fp4x2, Codes::Fp4Pairs),
        ];
        let cases = floats
            .iter()
            .chain(&v2_only)
            .map(|&(codec, codes)| (Version::V2, Cipher::ChaCha20, codec, codes))
            .chain(
                floats
                    .iter()
                    .map(|&(codec, codes)| (Version::V1, Cipher::Aes256Ctr, codec, codes)),
            );
        for (version, cipher, codec, codes) in cases {
            if !cipher.available() {
                eprintln!("{cipher:?}: the CPU lacks the fused kernel's instructions");
                continue;
            }
            let kernel = fused::Kernel { cipher, codes };
            let unit = kernel.unit_bytes();
            // Per code: its bits, the sign bit (floats) and the largest domain.
            let (bits, sign, limit) = match codec {
                Codec::Float { bits, top, .. } => (bits, 1u64 << (bits - 1), top + 1),
                Codec::Fp4x2 => (4, 8, 8),
                Codec::E8m0 => (8, 0, 255),
                Codec::Index { bytes } => (8 * bytes as u32, 0, 1u64 << (8 * bytes - 1).min(31)),
            };
            // Codes of a unit's width run below this: the sign bit, or every bit.
            let widest = if sign != 0 {
                sign
            } else {
                1u64 << bits.min(31)
            };
            for round in 0..80 {
                let m = match round % 4 {
                    0 => limit,
                    1 => 1 + rng.below(limit),
                    2 => match codec {
                        Codec::Float { mantissa, .. } => {
                            (1 + rng.below(limit >> mantissa)) << mantissa
                        }
                        _ => 1 + rng.below(8).min(limit - 1),
                    },
                    _ => 1 + rng.below(limit),
                };
                if !codec.valid_domain(m) {
                    continue;
                }
                let lock = TensorLock::new(&key, version, codec, m, "layers.0.w");
                assert_eq!(lock.fused, Some(kernel), "{codec:?} m {m:#x}");
                let first = match round % 3 {
                    0 => rng.below(4) * 256,
                    1 => rng.below(1 << 20),
                    _ => (1u64 << 36) / 4 / codec.codes_per_unit() - 5000 + rng.below(1000),
                };
                let units = rng.below(3000) as usize;
                // A code of `magnitude` at least `above` and below `below`, any sign.
                let code = |rng: &mut crate::testkit::SplitMix, above: u64, below: u64| {
                    let magnitude = above + rng.below(below - above);
                    magnitude
                        | if sign != 0 && rng.below(2) == 1 {
                            sign
                        } else {
                            0
                        }
                };
                let per_unit = codec.codes_per_unit() as u32;
                let unit_of = |rng: &mut crate::testkit::SplitMix, bad: bool| {
                    let bad_code = rng.below(u64::from(per_unit));
                    (0..per_unit).fold(0u64, |acc, c| {
                        let v = if bad && u64::from(c) == bad_code {
                            code(rng, m, widest)
                        } else {
                            code(rng, 0, m)
                        };
                        acc | v << (c * bits)
                    })
                };
                let mut sealed = vec![0u8; unit * units];
                for v in sealed.chunks_exact_mut(unit) {
                    v.copy_from_slice(&unit_of(&mut rng, false).to_le_bytes()[..unit]);
                }
                let mut general = sealed.clone();
                lock.decode_through_stream_buffer(first, &mut general)
                    .expect("in the domain");
                let mut fused = sealed.clone();
                lock.decode(first, &mut fused).expect("in the domain");
                assert!(
                    fused == general,
                    "{version:?} {codec:?} m {m:#x} from {first}: bytes differ"
                );
                // From sealed bytes left as they are into a buffer of other bytes.
                let mut out = vec![0xA5u8; sealed.len()];
                let kept = sealed.clone();
                lock.decode_from(first, &sealed, &mut out)
                    .expect("in the domain");
                assert!(
                    out == general && sealed == kept,
                    "{version:?} {codec:?} m {m:#x} from {first}: decode_from differs"
                );
                if units > 0 && m < widest {
                    let bad = rng.below(units as u64) as usize;
                    let v = unit_of(&mut rng, true);
                    sealed[unit * bad..unit * (bad + 1)].copy_from_slice(&v.to_le_bytes()[..unit]);
                    let err = lock
                        .decode(first, &mut sealed.clone())
                        .expect_err("outside");
                    assert_eq!(
                        err.unit,
                        first + bad as u64,
                        "{version:?} {codec:?} m {m:#x}"
                    );
                    let err = lock
                        .decode_from(first, &sealed, &mut vec![0; sealed.len()])
                        .expect_err("outside");
                    assert_eq!(err.unit, first + bad as u64, "decode_from {codec:?}");
                }
            }
        }
    }

    /// Any split of a tensor into decode calls gives the bytes of one call over all of it:
    /// the batches (which end on multiples of the batch in the tensor) and the stream
    /// positions do not depend on where a call starts.
    #[test]
    fn decoding_in_pieces_equals_decoding_whole() {
        let key = ModelKey::new([7; 32]);
        let bf16 = Codec::float(safetensors::Dtype::BF16).expect("BF16 codec");
        let f32 = Codec::float(safetensors::Dtype::F32).expect("F32 codec");
        // Narrow and wide streams, a power-of-two span and one that is not.
        let cases = [
            (Version::V2, bf16, 0x3F80, 2),
            (Version::V1, bf16, 0x4000, 2),
            (Version::V1, f32, 0x4000_0000, 4),
            (Version::V2, f32, 0x4300_0000, 4),
        ];
        let mut rng = crate::testkit::SplitMix(7);
        for (version, codec, m, ub) in cases {
            let lock = TensorLock::new(&key, version, codec, m, "t.weight");
            let units = 3 * BATCH + 17;
            let mut sealed = vec![0u8; units * ub];
            for v in sealed.chunks_exact_mut(ub) {
                let code = rng.below(m) | (rng.below(2) << (8 * ub - 1));
                v.copy_from_slice(&code.to_le_bytes()[..ub]);
            }
            let mut whole = sealed.clone();
            lock.decode(0, &mut whole).expect("in the domain");
            for _ in 0..20 {
                let mut pieces = sealed.clone();
                let mut at = 0;
                while at < units {
                    let n = (1 + rng.below(BATCH as u64 + 100) as usize).min(units - at);
                    let piece = &mut pieces[at * ub..(at + n) * ub];
                    lock.decode(at as u64, piece).expect("in the domain");
                    at += n;
                }
                assert!(pieces == whole, "{version:?} {codec:?}: pieces differ");
            }
        }
    }
}
