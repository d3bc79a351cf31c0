//! A small sealer of our own, for tests, benchmarks and the quick start: it locks shards
//! with v1 or v2 and packs secret files into `trusted.kllm` the way kLLM 0.1.0 does. It
//! applies no transform (the seal records `"transform": "none"`); the mount never needs one.

use std::fs;
use std::path::{Path, PathBuf};

use safetensors::tensor::Metadata;
use safetensors::Dtype;
use serde_json::{json, Value};

use crate::blob;
use crate::key::ModelKey;
use crate::lock::LOCK_META;
use crate::lock::{tensor_id, Codec, TensorLock, Version};
use crate::sealed::{is_lockable, LLM_META, PIPELINE_META};
use crate::{Error, Result};

/// Files kLLM keeps only inside `trusted.kllm`.
const SECRET_NAMES: [&str; 2] = ["tokenizer.json", "vocab.json"];
/// Component folders whose tokenizer files pipelines move into the blob.
const SECRET_DIRS: [&str; 3] = ["tokenizer", "processor", "text_encoder"];

/// One tensor of a shard being written.
#[derive(Debug, Clone)]
pub struct Tensor {
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    pub data: Vec<u8>,
}

/// Serialize a safetensors file: tensors in the given order, header padded to 8 bytes.
pub fn safetensors_bytes(tensors: &[Tensor], metadata: &serde_json::Map<String, Value>) -> Vec<u8> {
    let mut header = serde_json::Map::new();
    if !metadata.is_empty() {
        header.insert("__metadata__".into(), Value::Object(metadata.clone()));
    }
    let mut off = 0usize;
    for t in tensors {
        header.insert(
            t.name.clone(),
            json!({"dtype": format!("{:?}", t.dtype), "shape": t.shape, "data_offsets": [off, off + t.data.len()]}),
        );
        off += t.data.len();
    }
    let mut h = serde_json::to_vec(&header).expect("JSON");
    h.resize(h.len().div_ceil(8) * 8, b' ');
    let mut out = Vec::with_capacity(8 + h.len() + off);
    out.extend_from_slice(&(h.len() as u64).to_le_bytes());
    out.extend_from_slice(&h);
    for t in tensors {
        out.extend_from_slice(&t.data);
    }
    out
}

/// Parse a safetensors file into its metadata and tensors (in offset order).
pub fn read_safetensors(path: &Path) -> Result<(serde_json::Map<String, Value>, Vec<Tensor>)> {
    let bytes = fs::read(path).map_err(|e| Error::at(path, e))?;
    let (n, meta) = safetensors::SafeTensors::read_metadata(&bytes)
        .map_err(|e| Error::at(path, format!("{e:?}")))?;
    let meta: Metadata = meta;
    let data = &bytes[8 + n..];
    let mut tensors = Vec::new();
    for name in meta.offset_keys() {
        let info = meta.info(&name).expect("listed");
        let (s, e) = info.data_offsets;
        tensors.push(Tensor {
            name,
            dtype: info.dtype,
            shape: info.shape.clone(),
            data: data[s..e].to_vec(),
        });
    }
    let md = meta
        .metadata()
        .clone()
        .unwrap_or_default()
        .into_iter()
        .map(|(k, v)| (k, Value::String(v)))
        .collect::<std::collections::BTreeMap<_, _>>()
        .into_iter()
        .collect();
    Ok((md, tensors))
}

/// The v2 codec kLLM would choose for a tensor (`fp4` marks packed FP4 experts).
pub fn v2_codec(t: &Tensor, fp4: bool) -> Option<Codec> {
    if t.data.is_empty() {
        return None;
    }
    if fp4 && matches!(t.dtype, Dtype::I8 | Dtype::U8) {
        return Some(Codec::Fp4x2);
    }
    match t.dtype {
        Dtype::F8_E8M0 => Some(Codec::E8m0),
        Dtype::I16 | Dtype::I32 | Dtype::I64 => {
            Codec::v2("index", t.dtype).filter(|c| c.domain_of(&t.data).is_some())
        }
        d => Codec::float(d),
    }
}

/// Lock the tensors of one shard in memory; returns the `kllm.lock` document, or `None`
/// when nothing was lockable. `fp4` says which I8/U8 tensors hold packed FP4.
pub fn lock_tensors(
    tensors: &mut [Tensor],
    key: &ModelKey,
    version: Version,
    shard_dir: &str,
    fp4: &dyn Fn(&str) -> bool,
) -> Result<Option<String>> {
    let mut entries = Vec::new();
    for t in tensors.iter_mut() {
        let codec = match version {
            Version::V1 => Codec::float(t.dtype).filter(|_| !t.data.is_empty()),
            Version::V2 => v2_codec(t, fp4(&t.name)),
        };
        let Some(codec) = codec else { continue };
        let m = codec.domain_of(&t.data).ok_or_else(|| {
            Error::new(format!(
                "{}: cannot lock a tensor holding inf, NaN or negative indices",
                t.name
            ))
        })?;
        let lock = TensorLock::new(key, version, codec, m, &tensor_id(shard_dir, &t.name));
        lock.encode(0, &mut t.data)
            .map_err(|e| Error::new(format!("{}: value {} outside its domain", t.name, e.unit)))?;
        entries.push((t.name.clone(), m, codec));
    }
    if entries.is_empty() {
        return Ok(None);
    }
    Ok(Some(crate::lock::document::render(version, &entries)))
}

/// A shard sealed in memory, as the core reads it: the file's bytes and the shard parsed
/// from its header.
pub struct MemoryShard {
    pub sealed: Vec<u8>,
    pub shard: crate::shard::Shard,
    /// The lock document in its metadata; `None` when nothing was lockable.
    pub doc: Option<String>,
}

impl MemoryShard {
    /// Lock `tensors` in place ([`lock_tensors`], ids scoped by `shard_dir`) and write them
    /// as a safetensors file whose metadata carries the lock document (none when nothing was
    /// lockable).
    pub fn seal(
        tensors: &mut [Tensor],
        key: &ModelKey,
        version: Version,
        shard_dir: &str,
        fp4: &dyn Fn(&str) -> bool,
    ) -> Result<MemoryShard> {
        let mut meta = serde_json::Map::new();
        let doc = lock_tensors(tensors, key, version, shard_dir, fp4)?;
        if let Some(doc) = &doc {
            meta.insert(LOCK_META.into(), Value::String(doc.clone()));
        }
        let sealed = safetensors_bytes(tensors, &meta);
        let n = u64::from_le_bytes(sealed[..8].try_into().expect("8 bytes")) as usize;
        let shard = crate::shard::Shard::from_header(
            Path::new("memory.safetensors"),
            &sealed[8..8 + n],
            sealed.len() as u64,
            shard_dir,
            key,
        )?;
        Ok(MemoryShard { sealed, shard, doc })
    }

    /// Reads of the sealed bytes, for [`crate::shard::Shard::read`].
    pub fn raw(&self, at: u64, buf: &mut [u8]) -> std::io::Result<()> {
        buf.copy_from_slice(&self.sealed[at as usize..at as usize + buf.len()]);
        Ok(())
    }
}

/// Lock one shard file in place.
pub fn lock_file(
    path: &Path,
    rel: &Path,
    key: &ModelKey,
    version: Version,
    fp4_experts: bool,
) -> Result<()> {
    let (mut meta, mut tensors) = read_safetensors(path)?;
    if meta.contains_key(LOCK_META) {
        return Err(Error::at(path, "is already locked"));
    }
    let dir = rel
        .parent()
        .map(|p| p.to_string_lossy().into_owned())
        .unwrap_or_default();
    let fp4 = |name: &str| fp4_experts && name.contains(".experts.");
    if let Some(doc) = lock_tensors(&mut tensors, key, version, &dir, &fp4)? {
        meta.insert(LOCK_META.into(), Value::String(doc));
        if !meta.contains_key("format") {
            meta.insert("format".into(), json!("pt"));
        }
        fs::write(path, safetensors_bytes(&tensors, &meta)).map_err(|e| Error::at(path, e))?;
    }
    Ok(())
}

fn files_under(root: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in fs::read_dir(&d).into_iter().flatten().flatten() {
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
            } else {
                out.push(p.strip_prefix(root).expect("under root").to_path_buf());
            }
        }
    }
    out.sort();
    out
}

fn meta_file(dir: &Path) -> (PathBuf, bool) {
    let p = dir.join(PIPELINE_META);
    if p.is_file() {
        (p, true)
    } else {
        (dir.join(LLM_META), false)
    }
}

fn write_json(path: &Path, doc: &Value) -> Result<()> {
    fs::write(path, serde_json::to_string_pretty(doc).expect("JSON"))
        .map_err(|e| Error::at(path, e))
}

fn set_lock_flag(dir: &Path, version: Option<Version>) -> Result<()> {
    let (path, pipeline) = meta_file(dir);
    let mut doc: Value =
        serde_json::from_str(&fs::read_to_string(&path).map_err(|e| Error::at(&path, e))?)
            .map_err(|e| Error::at(&path, e))?;
    let meta = if pipeline { &mut doc } else { &mut doc["kllm"] };
    let obj = meta
        .as_object_mut()
        .ok_or_else(|| Error::at(&path, "no seal metadata"))?;
    match version {
        Some(v) => obj.insert("lock".into(), json!(v.label())),
        None => obj.shift_remove("lock"),
    };
    write_json(&path, &doc)
}

fn fp4_experts(dir: &Path) -> bool {
    fs::read_to_string(dir.join(LLM_META))
        .ok()
        .and_then(|t| serde_json::from_str::<Value>(&t).ok())
        .is_some_and(|c| c["expert_dtype"] == "fp4")
}

/// Lock every lockable shard of a sealed, unlocked directory in place (as kLLM's
/// `lock_dir`), and set the lock flag.
pub fn lock_dir(dir: &Path, key: &ModelKey, version: Version) -> Result<()> {
    let fp4 = fp4_experts(dir);
    for rel in files_under(dir) {
        if is_lockable(&rel) {
            lock_file(&dir.join(&rel), &rel, key, version, fp4)?;
        }
    }
    set_lock_flag(dir, Some(version))
}

/// Seal a plain checkpoint `src` into `dst`: secret files into `trusted.kllm`, seal
/// metadata into `config.json` (or `kllm.json` for pipelines), shards locked with `lock`.
pub fn seal_dir(
    src: &Path,
    dst: &Path,
    key: &ModelKey,
    lock: Option<Version>,
    salt: [u8; 16],
) -> Result<()> {
    let pipeline = src.join("model_index.json").is_file();
    let mut secrets = Vec::new();
    for rel in files_under(src) {
        let name = rel.file_name().and_then(|n| n.to_str()).unwrap_or("");
        let parent = rel.parent().and_then(|p| p.to_str()).unwrap_or("");
        let secret = SECRET_NAMES.contains(&name)
            && (parent.is_empty() || (pipeline && SECRET_DIRS.contains(&parent)));
        let from = src.join(&rel);
        if secret {
            let data = fs::read(&from).map_err(|e| Error::at(&from, e))?;
            secrets.push((rel.to_string_lossy().into_owned(), data));
            continue;
        }
        let to = dst.join(&rel);
        fs::create_dir_all(to.parent().expect("has a parent")).map_err(|e| Error::at(&to, e))?;
        fs::copy(&from, &to).map_err(|e| Error::at(&from, e))?;
    }
    let seal = json!({
        "scheme": "l1",
        "transform": "none",
        "fingerprint": key.fingerprint(),
    });
    if pipeline {
        let mut doc = seal;
        doc["architecture"] = json!("Pipeline");
        write_json(&dst.join(PIPELINE_META), &doc)?;
    } else {
        let path = dst.join(LLM_META);
        let mut cfg: Value = match fs::read_to_string(&path) {
            Ok(t) => serde_json::from_str(&t).map_err(|e| Error::at(&path, e))?,
            Err(_) => json!({}),
        };
        cfg["kllm"] = seal;
        write_json(&path, &cfg)?;
    }
    let payload = secrets_payload(&secrets);
    let blob_path = dst.join(blob::FILE_NAME);
    fs::write(&blob_path, blob::seal(&payload, key, salt, blob::MAX_CHUNK))
        .map_err(|e| Error::at(&blob_path, e))?;
    if let Some(v) = lock {
        lock_dir(dst, key, v)?;
    }
    Ok(())
}

/// The payload `trusted.kllm` seals: each secret file (its path in the model, its bytes) as
/// a `U8` tensor named `file/<path>`; with none, one empty `_empty` tensor, as kLLM writes.
pub fn secrets_payload<S: AsRef<str>>(files: &[(S, Vec<u8>)]) -> Vec<u8> {
    let tensors: Vec<Tensor> = if files.is_empty() {
        vec![Tensor {
            name: "_empty".into(),
            dtype: Dtype::F32,
            shape: vec![0],
            data: vec![],
        }]
    } else {
        files
            .iter()
            .map(|(path, data)| Tensor {
                name: format!("file/{}", path.as_ref()),
                dtype: Dtype::U8,
                shape: vec![data.len()],
                data: data.clone(),
            })
            .collect()
    };
    safetensors_bytes(&tensors, &serde_json::Map::new())
}

/// A kLLM key file without a passphrase.
pub fn open_key_file(key: &ModelKey) -> String {
    use base64::Engine;
    let doc = json!({
        "cipher": {"name": "none"},
        "fingerprint": key.fingerprint(),
        "format": "kllm-key",
        "secret": base64::engine::general_purpose::STANDARD.encode(key.secret().bytes()),
        "version": 1,
    });
    serde_json::to_string_pretty(&doc).expect("JSON") + "\n"
}

/// Deterministic pseudo-random bytes (splitmix64), so samples need no RNG crate.
pub fn pseudo_random(seed: u64, n: usize) -> Vec<u8> {
    let mut s = seed;
    let mut out = Vec::with_capacity(n + 8);
    while out.len() < n {
        s = s.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = s;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        out.extend_from_slice(&(z ^ (z >> 31)).to_le_bytes());
    }
    out.truncate(n);
    out
}

/// Plain BF16 weights of moderate magnitude (no inf or NaN): random mantissas, exponents
/// near 1.0.
pub fn sample_bf16(seed: u64, count: usize) -> Vec<u8> {
    pseudo_random(seed, count * 2)
        .chunks_exact(2)
        .flat_map(|c| {
            let r = u16::from_le_bytes([c[0], c[1]]);
            let sign = r & 0x8000;
            let exp = 0x78 + (r >> 7 & 0x7); // 2^-7 .. 2^0
            (sign | exp << 7 | (r & 0x7F)).to_le_bytes()
        })
        .collect()
}

/// A tiny plain checkpoint (Qwen3-shaped config, two BF16 shards, a tokenizer) in `dir`.
pub fn write_sample_model(dir: &Path, hidden: usize, layers: usize) -> Result<()> {
    fs::create_dir_all(dir).map_err(|e| Error::at(dir, e))?;
    let vocab = 256usize;
    let config = json!({
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": hidden,
        "intermediate_size": hidden * 2,
        "num_hidden_layers": layers,
        "vocab_size": vocab,
        "torch_dtype": "bfloat16",
        "tie_word_embeddings": false,
    });
    write_json(&dir.join("config.json"), &config)?;
    let mut shards = vec![vec![Tensor {
        name: "model.embed_tokens.weight".into(),
        dtype: Dtype::BF16,
        shape: vec![vocab, hidden],
        data: sample_bf16(1, vocab * hidden),
    }]];
    let mut last = Vec::new();
    for l in 0..layers {
        for (i, (name, rows)) in [("self_attn.q_proj", hidden), ("mlp.up_proj", hidden * 2)]
            .into_iter()
            .enumerate()
        {
            last.push(Tensor {
                name: format!("model.layers.{l}.{name}.weight"),
                dtype: Dtype::BF16,
                shape: vec![rows, hidden],
                data: sample_bf16(100 + (l * 2 + i) as u64, rows * hidden),
            });
        }
    }
    last.push(Tensor {
        name: "lm_head.weight".into(),
        dtype: Dtype::BF16,
        shape: vec![vocab, hidden],
        data: sample_bf16(2, vocab * hidden),
    });
    shards.push(last);
    let total = shards.len();
    let mut weight_map = serde_json::Map::new();
    for (i, tensors) in shards.iter().enumerate() {
        let name = format!("model-{:05}-of-{:05}.safetensors", i + 1, total);
        let mut md = serde_json::Map::new();
        md.insert("format".into(), json!("pt"));
        fs::write(dir.join(&name), safetensors_bytes(tensors, &md))
            .map_err(|e| Error::at(dir, e))?;
        for t in tensors {
            weight_map.insert(t.name.clone(), json!(name));
        }
    }
    write_json(
        &dir.join("model.safetensors.index.json"),
        &json!({"metadata": {}, "weight_map": weight_map}),
    )?;
    let tokens: serde_json::Map<String, Value> =
        (0..vocab).map(|i| (format!("t{i}"), json!(i))).collect();
    write_json(&dir.join("vocab.json"), &Value::Object(tokens.clone()))?;
    write_json(
        &dir.join("tokenizer.json"),
        &json!({"version": "1.0", "model": {"type": "BPE", "vocab": tokens, "merges": []}}),
    )?;
    fs::write(
        dir.join("tokenizer_config.json"),
        "{\"model_max_length\": 512}",
    )
    .map_err(|e| Error::at(dir, e))?;
    Ok(())
}
