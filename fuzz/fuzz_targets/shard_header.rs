//! Safetensors shards (`kllm_mount::shard`): the header, `kllm.lock` (v1 and v2), the
//! unlocked header, and decoding of any byte range over a fake file. The input is a whole
//! shard file. Must never panic; reads may fail, but a range that reads must equal the same
//! bytes of a whole-file read, and bytes outside locked tensors must be the file's own.
#![no_main]

use std::io;
use std::path::Path;

use kllm_mount::key::ModelKey;
use kllm_mount::shard::{Shard, MAX_HEADER};
use libfuzzer_sys::fuzz_target;

/// The key of ../shared/vectors/llm_v2, so its shards decode to their view.
const KEY: &str = "72976d4fa6588bf1db3b53b24f04035cce1a8622ea01e9c836a40766d4015e97";

fn key() -> &'static ModelKey {
    static K: std::sync::OnceLock<ModelKey> = std::sync::OnceLock::new();
    K.get_or_init(|| ModelKey::from_hex(KEY).unwrap())
}

/// splitmix64, seeded from the input, for the ranges read.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: u64) -> u64 {
        if n == 0 {
            0
        } else {
            self.next() % n
        }
    }
}

fn seed_of(data: &[u8]) -> u64 {
    // FNV-1a over the last 64 bytes and the length.
    let mut h = 0xcbf2_9ce4_8422_2325u64 ^ data.len() as u64;
    for b in &data[data.len().saturating_sub(64)..] {
        h = (h ^ *b as u64).wrapping_mul(0x100_0000_01b3);
    }
    h
}

fuzz_target!(|data: &[u8]| {
    if data.len() < 8 {
        return;
    }
    let n = u64::from_le_bytes(data[..8].try_into().unwrap());
    // What Shard::open checks before from_header.
    if n > MAX_HEADER || 8 + n > data.len() as u64 {
        return;
    }
    let header = &data[8..8 + n as usize];
    let file_len = data.len() as u64;
    for dir in ["", "transformer"] {
        let Ok(shard) =
            Shard::from_header(Path::new("fuzz.safetensors"), header, file_len, dir, key())
        else {
            continue;
        };
        check(&shard, data);
    }
});

fn check(shard: &Shard, data: &[u8]) {
    let file_len = data.len() as u64;
    assert_eq!(shard.file_len, file_len);
    assert_eq!(shard.view_header.len() as u64, shard.data_start);
    assert_eq!(&shard.view_header[..8], &data[..8], "length prefix kept");
    // The unlocked header is JSON padded with spaces.
    let text = std::str::from_utf8(&shard.view_header[8..]).expect("view header is UTF-8");
    serde_json::from_str::<serde_json::Value>(text.trim_end()).expect("view header is JSON");
    let mut prev_end = shard.data_start;
    for t in &shard.locked {
        assert!(
            t.start >= prev_end && t.start <= t.end && t.end <= file_len,
            "{t:?}"
        );
        prev_end = t.end;
    }
    let raw = |at: u64, buf: &mut [u8]| -> io::Result<()> {
        let end = at
            .checked_add(buf.len() as u64)
            .filter(|e| *e <= file_len)
            .ok_or_else(|| io::Error::from(io::ErrorKind::UnexpectedEof))?;
        buf.copy_from_slice(&data[at as usize..end as usize]);
        Ok(())
    };
    let mut whole = vec![0u8; data.len()];
    let whole_ok = shard.read(0, &mut whole, &raw).is_ok();
    if whole_ok {
        assert_eq!(&whole[..shard.data_start as usize], &shard.view_header[..]);
        // Outside locked tensors the view is the file.
        let spans = shard.locked.iter().map(|t| (t.start, t.end));
        let mut pos = shard.data_start;
        for (start, end) in spans.chain(std::iter::once((file_len, file_len))) {
            assert_eq!(
                &whole[pos as usize..start as usize],
                &data[pos as usize..start as usize]
            );
            pos = end.max(pos);
        }
    }
    let mut rng = Rng(seed_of(data));
    for _ in 0..16 {
        let off = rng.below(file_len);
        let len = match rng.below(4) {
            0 => rng.below(9),
            1 => rng.below(64),
            _ => rng.below(file_len - off + 1),
        }
        .min(file_len - off) as usize;
        let mut out = vec![0u8; len];
        match shard.read(off, &mut out, &raw) {
            Ok(()) => {
                if whole_ok {
                    assert_eq!(
                        out,
                        whole[off as usize..off as usize + len],
                        "[{off}, +{len})"
                    );
                }
            }
            Err(e) => {
                assert!(
                    !whole_ok,
                    "[{off}, +{len}) fails ({e}) but the whole file reads"
                );
            }
        }
    }
}
