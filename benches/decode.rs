//! Decode-kernel throughput: `TensorLock::decode` per format and lock version, one thread,
//! next to the raw key-stream rate of the cipher each version uses.
//!
//!   cargo bench --bench decode [FILTER]
//!
//! Every case decodes a 1 MiB buffer (one block of the mount's cache) in place, over and over,
//! walking forward through the tensor's key stream as a sequential read does. GB/s are of
//! plain output (10^9 bytes per second), the median of 9 samples of ~60 ms. The "ceiling"
//! column is what the key stream written to a buffer would allow: a decode through the
//! buffer can never beat `keystream rate x plain bytes / stream bytes`, since every value
//! consumes 4 (or 8) bytes of stream. The fused kernel (`src/lock/fused.rs`, lock v2's
//! 16-bit floats on AVX-512) makes the stream in registers and never writes it, so it can
//! pass that ceiling; the case "stream through a buffer" shows the general path beside it.
//! A decode that re-uses its output as input stays in the domain (decode maps the domain
//! onto itself), so repeated passes over the same buffer are valid.
//!
//! Set KLLM_BENCH_SECS (default 0.06) to lengthen each sample.

use std::time::{Duration, Instant};

use kllm_mount::key::ModelKey;
use kllm_mount::lock::stream::{AesCtr, ChaCha};
use kllm_mount::lock::{Codec, TensorLock, Version};
use kllm_mount::testseal::{pseudo_random, sample_bf16};
use safetensors::Dtype;

/// One block of the mount's cache.
const BUF: usize = 1 << 20;
const SAMPLES: usize = 9;

fn sample_secs() -> f64 {
    std::env::var("KLLM_BENCH_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0.06)
}

/// Median GB/s of `f`, which processes `bytes` per call.
/// One row per implementation of a key stream, 1 MiB per call, the decoder's marked;
/// returns the decoder's rate.
fn stream_rows<F: Fn(u64, &mut [u8])>(
    cipher: &str,
    buf: &mut [u8],
    imps: impl IntoIterator<Item = (&'static str, bool, F)>,
) -> f64 {
    let mut used_rate = 0.0;
    for (label, used, fill) in imps {
        let rate = measure(buf.len(), |i| fill((i % 1024) * buf.len() as u64, buf));
        let mark = if used {
            used_rate = rate;
            ", the decoder's here"
        } else {
            ""
        };
        println!("| {cipher}, {label}{mark}, 1 MiB per call | {rate:.2} |");
    }
    used_rate
}

fn measure(bytes: usize, mut f: impl FnMut(u64)) -> f64 {
    // Warm up, and size a sample to about `sample_secs`.
    let t = Instant::now();
    let mut calls = 0u64;
    while t.elapsed() < Duration::from_millis(30) || calls < 3 {
        f(calls);
        calls += 1;
    }
    let per_call = t.elapsed().as_secs_f64() / calls as f64;
    let reps = ((sample_secs() / per_call).ceil() as u64).max(1);
    let mut rates: Vec<f64> = (0..SAMPLES)
        .map(|_| {
            let t = Instant::now();
            for _ in 0..reps {
                f(calls);
                calls += 1;
            }
            (bytes as f64 * reps as f64) / t.elapsed().as_secs_f64() / 1e9
        })
        .collect();
    rates.sort_by(|a, b| a.partial_cmp(b).unwrap());
    rates[SAMPLES / 2]
}

fn words(seed: u64, n: usize) -> Vec<u32> {
    pseudo_random(seed, n * 4)
        .chunks_exact(4)
        .map(|c| u32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

/// Plain weights of a float format, exponents in a realistic window (no inf/NaN).
fn floats(dtype: Dtype, wide: bool, n_bytes: usize) -> Vec<u8> {
    match dtype {
        Dtype::BF16 => sample_bf16(7, n_bytes / 2),
        Dtype::F16 => words(8, n_bytes / 2)
            .into_iter()
            .flat_map(|r| {
                let sign = (r & 0x8000) as u16;
                let exp = 0x0A + ((r >> 10) % 6) as u16; // 2^-5 .. 2^0
                (sign | exp << 10 | (r as u16 & 0x3FF)).to_le_bytes()
            })
            .collect(),
        Dtype::F32 => words(9, n_bytes / 4)
            .into_iter()
            .flat_map(|r| {
                let sign = r & 0x8000_0000;
                // |x| < 2 keeps the span at 2^31 (narrow); up to 2^6 makes it wider (64-bit
                // offsets in v2).
                let exp = if wide {
                    0x78 + (r >> 23) % 14
                } else {
                    0x78 + (r >> 23) % 8
                };
                (sign | exp << 23 | (r & 0x7F_FFFF)).to_le_bytes()
            })
            .collect(),
        Dtype::F8_E4M3 => pseudo_random(10, n_bytes)
            .into_iter()
            .map(|b| (b & 0x80) | ((b & 0x7F) % 0x7F))
            .collect(),
        _ => unreachable!(),
    }
}

struct Case {
    label: &'static str,
    version: Version,
    codec: Codec,
    plain: Vec<u8>,
    /// The unit the buffer starts at: a fill chunk begins anywhere in a tensor.
    first_unit: u64,
    /// The general path even where a fused kernel serves the codec on this CPU.
    through_stream_buffer: bool,
}

fn cases() -> Vec<Case> {
    let float = |d| Codec::float(d).unwrap();
    let case = |label, version, codec, plain| Case {
        label,
        version,
        codec,
        plain,
        first_unit: 0,
        through_stream_buffer: false,
    };
    // The same data through the general path, beside a case the fused kernel serves.
    let through_buffer = |label, version, codec, plain| Case {
        through_stream_buffer: true,
        ..case(label, version, codec, plain)
    };
    let mut out = Vec::new();
    use Version::{V1, V2};
    out.push(case(
        "v2 float BF16",
        V2,
        float(Dtype::BF16),
        floats(Dtype::BF16, false, BUF),
    ));
    out.push(Case {
        first_unit: 1,
        ..case(
            "v2 float BF16, from unit 1",
            V2,
            float(Dtype::BF16),
            floats(Dtype::BF16, false, BUF),
        )
    });
    out.push(through_buffer(
        "v2 float BF16, stream through a buffer (no fused kernel)",
        V2,
        float(Dtype::BF16),
        floats(Dtype::BF16, false, BUF),
    ));
    out.push(case(
        "v2 float F16",
        V2,
        float(Dtype::F16),
        floats(Dtype::F16, false, BUF),
    ));
    out.push(case(
        "v2 float F32 (abs < 2)",
        V2,
        float(Dtype::F32),
        floats(Dtype::F32, false, BUF),
    ));
    out.push(case(
        "v2 float F32 (wide span)",
        V2,
        float(Dtype::F32),
        floats(Dtype::F32, true, BUF),
    ));
    out.push(case(
        "v2 float F8_E4M3",
        V2,
        float(Dtype::F8_E4M3),
        floats(Dtype::F8_E4M3, false, BUF),
    ));
    out.push(through_buffer(
        "v2 float F8_E4M3, stream through a buffer (no fused kernel)",
        V2,
        float(Dtype::F8_E4M3),
        floats(Dtype::F8_E4M3, false, BUF),
    ));
    out.push(case(
        "v2 e8m0 F8_E8M0",
        V2,
        Codec::E8m0,
        pseudo_random(11, BUF)
            .into_iter()
            .map(|b| 0x70 + b % 16)
            .collect(),
    ));
    out.push(case(
        "v2 index I32",
        V2,
        Codec::Index { bytes: 4 },
        words(12, BUF / 4)
            .into_iter()
            .flat_map(|r| (r % 151_936).to_le_bytes())
            .collect(),
    ));
    out.push(case(
        "v2 e2m1x2 U8 (FP4)",
        V2,
        Codec::Fp4x2,
        pseudo_random(13, BUF),
    ));
    out.push(through_buffer(
        "v2 e2m1x2 U8 (FP4), stream through a buffer (no fused kernel)",
        V2,
        Codec::Fp4x2,
        pseudo_random(13, BUF),
    ));
    out.push(case(
        "v1 BF16",
        V1,
        float(Dtype::BF16),
        floats(Dtype::BF16, false, BUF),
    ));
    out.push(through_buffer(
        "v1 BF16, stream through a buffer (no fused kernel)",
        V1,
        float(Dtype::BF16),
        floats(Dtype::BF16, false, BUF),
    ));
    out.push(case(
        "v1 F32",
        V1,
        float(Dtype::F32),
        floats(Dtype::F32, false, BUF),
    ));
    out.push(case(
        "v1 F8_E4M3",
        V1,
        float(Dtype::F8_E4M3),
        floats(Dtype::F8_E4M3, false, BUF),
    ));
    out.push(through_buffer(
        "v1 F8_E4M3, stream through a buffer (no fused kernel)",
        V1,
        float(Dtype::F8_E4M3),
        floats(Dtype::F8_E4M3, false, BUF),
    ));
    out
}

/// Key-stream bytes a unit consumes.
fn stream_per_unit(lock: &TensorLock, codec: Codec, m: u64) -> usize {
    let signed = matches!(codec, Codec::Float { .. } | Codec::Fp4x2);
    let span = if signed { 2 * m } else { m };
    let wide = match lock.version {
        Version::V1 => matches!(codec, Codec::Float { bits: 32, .. }),
        Version::V2 => span > 1 << 31,
    };
    let per_code = if wide { 8 } else { 4 };
    per_code * if codec == Codec::Fp4x2 { 2 } else { 1 }
}

fn main() {
    let filter: Option<String> = std::env::args().skip(1).find(|a| !a.starts_with('-'));
    let want = |label: &str| filter.as_deref().is_none_or(|f| label.contains(f));
    let key = ModelKey::new(*b"kllm-mount decode bench key 0001");
    let stream_key = [0x42u8; 32];

    println!(
        "decode kernel, one thread, {} KiB buffers (GB/s = 10^9 B/s)",
        BUF >> 10
    );
    println!();
    println!("| key stream | GB/s of stream |");
    println!("|---|---:|");
    let mut buf = vec![0u8; BUF];
    // Both implementations of each key stream (src/lock/stream.rs); the decoder uses
    // `chosen`.
    let chosen = ChaCha::chosen();
    let chacha = stream_rows(
        "ChaCha20 (lock v2)",
        &mut buf,
        [ChaCha::Crate, ChaCha::AwsLc].map(|imp| {
            let fill = move |pos, ks: &mut [u8]| imp.fill(&stream_key, pos, ks);
            (imp.label(), imp == chosen, fill)
        }),
    );
    let chosen_aes = AesCtr::chosen();
    let aes = stream_rows(
        "AES-256-CTR (lock v1)",
        &mut buf,
        AesCtr::available().into_iter().map(|imp| {
            let fill = move |pos, ks: &mut [u8]| imp.fill(&stream_key, pos, ks);
            (imp.label(), imp == chosen_aes, fill)
        }),
    );
    // A new cipher and a seek for every 4096 codes (16 KiB of stream), as a batched
    // decoder that keys per batch does.
    let batch = 4096 * 4;
    let chacha_b = measure(BUF, |i| {
        for (k, part) in buf.chunks_mut(batch).enumerate() {
            chosen.fill(
                &stream_key,
                (i % 1024) * BUF as u64 + (k * batch) as u64,
                part,
            );
        }
    });
    let aes_b = measure(BUF, |i| {
        for (k, part) in buf.chunks_mut(batch).enumerate() {
            chosen_aes.fill(
                &stream_key,
                (i % 1024) * BUF as u64 + (k * batch) as u64,
                part,
            );
        }
    });
    println!(
        "| ChaCha20, {}, new cipher + seek per 16 KiB | {chacha_b:.2} |",
        chosen.label()
    );
    println!(
        "| AES-256-CTR, {}, new cipher + seek per 16 KiB | {aes_b:.2} |",
        chosen_aes.label()
    );
    println!();
    println!("| case | domain m | stream B per plain B | decode GB/s | ceiling GB/s (stream through a buffer) | % of ceiling |");
    println!("|---|---:|---:|---:|---:|---:|");
    for case in cases() {
        if !want(case.label) {
            continue;
        }
        let m = case
            .codec
            .domain_of(&case.plain)
            .expect("plain data in domain");
        let lock = TensorLock::new(&key, case.version, case.codec, m, "bench.weight");
        let mut data = case.plain.clone();
        lock.encode(0, &mut data).expect("encodes");
        let ub = case.codec.unit_bytes();
        let units = (data.len() / ub) as u64;
        let rate = measure(data.len(), |i| {
            let first = (i % 1024) * units + case.first_unit;
            if case.through_stream_buffer {
                lock.decode_through_stream_buffer(first, &mut data)
            } else {
                lock.decode(first, &mut data)
            }
            .expect("decodes");
        });
        let ratio = stream_per_unit(&lock, case.codec, m) as f64 / ub as f64;
        let ks = match case.version {
            Version::V1 => aes,
            Version::V2 => chacha,
        };
        let ceiling = ks / ratio;
        println!(
            "| {} | {m:#x} | {ratio} | {rate:.3} | {ceiling:.2} | {:.0}% |",
            case.label,
            100.0 * rate / ceiling
        );
    }
}
