//! Facts of sealed shards the tests look for, and a small shard to seal.

use std::fs;
use std::path::Path;

use kllm_mount::testseal::{self, safetensors_bytes, Tensor};
use safetensors::Dtype;

use super::vectors::tree;

/// Where a safetensors file's data starts.
pub fn data_start(bytes: &[u8]) -> usize {
    8 + u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize
}

/// The locked shards of a sealed directory, by relative path, largest first.
pub fn locked_shards(sealed: &Path) -> Vec<String> {
    let mut out: Vec<(u64, String)> = tree(sealed)
        .into_iter()
        .filter(|(rel, p)| {
            rel.ends_with(".safetensors")
                && fs::read(p)
                    .map(|b| String::from_utf8_lossy(&b[..data_start(&b)]).contains("kllm.lock"))
                    .unwrap_or(false)
        })
        .map(|(rel, p)| (fs::metadata(p).unwrap().len(), rel))
        .collect();
    out.sort_by(|a, b| b.cmp(a));
    out.into_iter().map(|(_, r)| r).collect()
}

/// A plain shard of two small bf16 tensors, to place anywhere in a sample.
pub fn small_shard(seed: u64) -> Vec<u8> {
    let tensors = [
        Tensor {
            name: "a.weight".into(),
            dtype: Dtype::BF16,
            shape: vec![32, 16],
            data: testseal::sample_bf16(seed, 512),
        },
        Tensor {
            name: "b.weight".into(),
            dtype: Dtype::BF16,
            shape: vec![300],
            data: testseal::sample_bf16(seed + 1, 300),
        },
    ];
    let mut md = serde_json::Map::new();
    md.insert("format".into(), "pt".into());
    safetensors_bytes(&tensors, &md)
}
