//! Property tests of the kernel-free core: random tensors, dtypes, formats, versions and
//! byte ranges. Locking then unlocking is the identity, and decoding any range (by a read, or
//! from the sealed bytes left in place) equals the same slice of the whole decoded file.

use kllm_mount::key::ModelKey;
use kllm_mount::lock::{Codec, Version};
use kllm_mount::testseal::{lock_tensors, safetensors_bytes, MemoryShard, Tensor};
use proptest::prelude::*;
use safetensors::Dtype;

const DTYPES: [Dtype; 11] = [
    Dtype::BF16,
    Dtype::F16,
    Dtype::F32,
    Dtype::F8_E4M3,
    Dtype::F8_E5M2,
    Dtype::F8_E8M0,
    Dtype::I16,
    Dtype::I32,
    Dtype::I64,
    Dtype::U8,
    Dtype::I8,
];

/// Plain values of `dtype` that kLLM can lock, from random bits: floats capped below a
/// random magnitude (so domains vary), scales without NaN, non-negative indices.
fn plain_values(dtype: Dtype, count: usize, bits: &[u8], cap: u64) -> Vec<u8> {
    let width = dtype.bitsize() / 8;
    let mut out = Vec::with_capacity(count * width);
    for i in 0..count {
        let mut raw = [0u8; 8];
        for (k, r) in raw.iter_mut().enumerate().take(width) {
            *r = bits[(i * width + k) % bits.len()].wrapping_add((i * 31 + k * 7) as u8);
        }
        let v = u64::from_le_bytes(raw);
        let fixed = match Codec::float(dtype) {
            Some(Codec::Float { bits: b, top, .. }) => {
                let sign = v & (1 << (b - 1));
                let mag = v & ((1 << (b - 1)) - 1);
                sign | (mag % (top.min(cap.max(1)) + 1))
            }
            _ => match dtype {
                Dtype::F8_E8M0 => v % 255,
                Dtype::I16 => v % (cap.clamp(1, 0x7FFF)),
                Dtype::I32 | Dtype::I64 => v % cap.clamp(1, 1 << 31),
                _ => v,
            },
        };
        out.extend_from_slice(&fixed.to_le_bytes()[..width]);
    }
    out
}

#[derive(Debug, Clone)]
struct Case {
    version: Version,
    tensors: Vec<Tensor>,
    fp4: bool,
    ranges: Vec<(u64, usize)>,
    key: [u8; 32],
}

fn case() -> impl Strategy<Value = Case> {
    let tensor = (
        0..DTYPES.len(),
        0usize..300,
        proptest::collection::vec(any::<u8>(), 1..64),
        any::<u64>(),
        0usize..3,
    );
    (
        prop_oneof![Just(Version::V1), Just(Version::V2)],
        proptest::collection::vec(tensor, 1..6),
        any::<bool>(),
        proptest::collection::vec((any::<u64>(), 0usize..5000), 1..20),
        any::<[u8; 32]>(),
    )
        .prop_map(|(version, specs, fp4, ranges, key)| {
            let mut tensors = Vec::new();
            for (i, (d, count, bits, cap, pad)) in specs.into_iter().enumerate() {
                let dtype = DTYPES[d];
                tensors.push(Tensor {
                    name: format!("t{i}.weight"),
                    dtype,
                    shape: vec![count],
                    data: plain_values(dtype, count, &bits, cap >> (cap % 60)),
                });
                // Odd-sized U8 tensors put the next tensor at an odd offset.
                tensors.push(Tensor {
                    name: format!("t{i}.pad"),
                    dtype: Dtype::U8,
                    shape: vec![pad * 3],
                    data: vec![0x5A; pad * 3],
                });
            }
            Case {
                version,
                tensors,
                fp4,
                ranges,
                key,
            }
        })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]

    #[test]
    fn lock_unlock_identity_and_ranges(c in case()) {
        let key = ModelKey::new(c.key);
        let plain_file = safetensors_bytes(&c.tensors, &Default::default());
        let mut locked = c.tensors.clone();
        let fp4 = |name: &str| c.fp4 && name.ends_with(".weight");
        let m = MemoryShard::seal(&mut locked, &key, c.version, "comp", &fp4).unwrap();
        let (sealed, shard) = (&m.sealed, &m.shard);
        prop_assert_eq!(shard.is_locked(), m.doc.is_some());
        let n = shard.data_start as usize - 8;
        let raw = |at: u64, buf: &mut [u8]| m.raw(at, buf);
        // The whole view: data identical to the plain tensors (lock then unlock = identity).
        let mut whole = vec![0u8; sealed.len()];
        shard.read(0, &mut whole, &raw).unwrap();
        let plain_n = u64::from_le_bytes(plain_file[..8].try_into().unwrap()) as usize;
        prop_assert_eq!(&whole[8 + n..], &plain_file[8 + plain_n..]);
        // No "locking changed the bytes" here: a value keeps its code with probability
        // 1/domain, and a tensor of zeros has a domain of one. The vectors and fixtures
        // hold sealed data apart from their views.
        // Any range equals the same slice of the whole.
        for (off, len) in c.ranges {
            let off = off % (sealed.len() as u64 + 1);
            let len = len.min(sealed.len() - off as usize);
            let mut part = vec![0u8; len];
            shard.read(off, &mut part, &raw).unwrap();
            prop_assert_eq!(&part[..], &whole[off as usize..off as usize + len]);
            // And from the sealed bytes in place, left as they are (a mapping of them).
            let from = &sealed[off as usize..off as usize + len];
            let mut out = vec![0xA5u8; len];
            shard.decode_from(off, from, &mut out, &raw).unwrap();
            prop_assert_eq!(&out[..], &whole[off as usize..off as usize + len]);
        }
    }
}

#[test]
fn tensor_ids_are_scoped_by_folder() {
    let key = ModelKey::new([3; 32]);
    let t = Tensor {
        name: "w".into(),
        dtype: Dtype::BF16,
        shape: vec![64],
        data: plain_values(Dtype::BF16, 64, &[1, 2, 3], 0x3F80),
    };
    let (mut a, mut b) = (vec![t.clone()], vec![t]);
    lock_tensors(&mut a, &key, Version::V2, "", &|_| false).unwrap();
    lock_tensors(&mut b, &key, Version::V2, "transformer", &|_| false).unwrap();
    assert_ne!(a[0].data, b[0].data);
}

#[test]
fn large_reads_decoded_on_several_threads_equal_the_plain_bytes() {
    // Reads of 256 KiB and more are split across threads at arbitrary byte boundaries,
    // cutting values; an odd offset puts the cut inside values of every tensor.
    let key = ModelKey::new([9; 32]);
    let mut tensors = vec![
        Tensor {
            name: "pad".into(),
            dtype: Dtype::U8,
            shape: vec![3],
            data: vec![1, 2, 3],
        },
        Tensor {
            name: "w".into(),
            dtype: Dtype::BF16,
            shape: vec![700_001],
            data: plain_values(Dtype::BF16, 700_001, &[7, 1, 9, 200], 0x3F80),
        },
        Tensor {
            name: "f".into(),
            dtype: Dtype::F32,
            shape: vec![100_003],
            data: plain_values(Dtype::F32, 100_003, &[5, 3, 250], 0x4000_0000),
        },
    ];
    let plain = safetensors_bytes(&tensors, &Default::default());
    let m = MemoryShard::seal(&mut tensors, &key, Version::V2, "", &|_| false).unwrap();
    assert!(m.doc.is_some());
    let (sealed, shard) = (&m.sealed, &m.shard);
    let n = shard.data_start as usize - 8;
    let pn = u64::from_le_bytes(plain[..8].try_into().unwrap()) as usize;
    let raw = |at: u64, buf: &mut [u8]| m.raw(at, buf);
    let mut whole = vec![0u8; sealed.len() - 8 - n];
    shard.read(8 + n as u64, &mut whole, &raw).unwrap();
    assert!(whole == plain[8 + pn..], "whole data differs");
    for (a, len) in [
        (8 + n + 1, 1 << 20),
        (8 + n + 5, 333_333),
        (8 + n + 1_000_001, 500_000),
    ] {
        let len = len.min(sealed.len() - a);
        let mut part = vec![0u8; len];
        shard.read(a as u64, &mut part, &raw).unwrap();
        let d = a - 8 - n;
        assert!(part == whole[d..d + len], "range at {a} (+{len}) differs");
        let mut out = vec![0u8; len];
        shard
            .decode_from(a as u64, &sealed[a..a + len], &mut out, &raw)
            .unwrap();
        assert!(
            out == whole[d..d + len],
            "decode_from at {a} (+{len}) differs"
        );
    }
}
