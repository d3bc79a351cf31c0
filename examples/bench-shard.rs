//! Sealed test models for `scripts/bench`, written fast and in bounded memory.
//!
//!   bench-shard shard OUT [--mib 1024] [--lock v2|v1] [--dtype bf16[,f16,f32,f8]]
//!                         [--tensor-mib 64] [--threads 2]
//!       OUT/sealed/    a sealed model (config.json with the seal and lock flag, trusted.kllm,
//!                      model.safetensors: one locked shard of --mib MiB)
//!       OUT/plain/     the same files as the mount shows them: model.safetensors here is
//!                      byte for byte what kllm-mount serves for the sealed one (same header
//!                      length, `kllm.lock` removed), so every system reads the same bytes
//!       OUT/kllm.key   the open key file
//!     Tensors take the listed dtypes in turn (`f32,f8` gives a shard mixing F32 and
//!     F8_E4M3 tensors), --tensor-mib MiB each. The data is pseudo-random weights with
//!     realistic exponents, generated and locked in 16 MiB chunks on --threads threads.
//!
//!   bench-shard shards OUT --count N [--min-mib 1] [--max-mib 16] [--tensors 64]
//!                          [--lock v2] [--sparse]
//!       OUT/sealed/ with N BF16 shards (model-0000i-of-0000N.safetensors) whose sizes grow
//!       geometrically from --min-mib to --max-mib, --tensors tensors each, and OUT/kllm.key.
//!       With --sparse the tensor data is a hole (all-zero bytes, which are valid locked
//!       codes): headers are real, the data costs no disk. For the mount-ready test, which
//!       needs only headers.
//!
//!   bench-shard decode SHARD [--rounds 3]
//!       The decode alone, a floor for any read that decodes: SHARD (made by `shard`, under
//!       this tool's fixed key) read into memory and touched first, untimed; then its data
//!       unlocked in place in 8 MiB chunks on all cores, as a fill unlocks, with no I/O, no
//!       FUSE and no fresh pages. Prints one JSON line: the best and the median seconds.
//!       The result is checked against the plain twin (`../plain/` beside `sealed/`) if any.
//!
//! The key is fixed (the same every run), so data sets are reproducible.

use std::fs::{self, File};
use std::io::{BufWriter, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::time::Instant;

use clap::{Parser, Subcommand};
use kllm_mount::key::ModelKey;
use kllm_mount::lock::{tensor_id, Codec, TensorLock, Version};
use kllm_mount::shard::Shard;
use kllm_mount::testseal;
use safetensors::Dtype;
use serde_json::{json, Value};

const CHUNK: usize = 16 << 20;
const KEY: [u8; 32] = *b"kllm-mount bench key, not secret";

#[derive(Parser)]
#[command(name = "bench-shard", about = "sealed test models for scripts/bench")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// One large locked shard: OUT/sealed, OUT/plain (the unlocked view's bytes), OUT/kllm.key.
    Shard {
        out: PathBuf,
        #[arg(long, default_value_t = 1024)]
        mib: u64,
        #[arg(long, default_value = "v2")]
        lock: String,
        /// Comma-separated: bf16, f16, f32, f8 (F8_E4M3), taken in turn by the tensors.
        #[arg(long, default_value = "bf16")]
        dtype: String,
        #[arg(long, default_value_t = 64)]
        tensor_mib: u64,
        #[arg(long, default_value_t = 2)]
        threads: usize,
    },
    /// N BF16 shards of growing sizes (OUT/sealed, OUT/kllm.key), for the mount-ready test.
    Shards {
        out: PathBuf,
        #[arg(long)]
        count: usize,
        #[arg(long, default_value_t = 1.0)]
        min_mib: f64,
        #[arg(long, default_value_t = 16.0)]
        max_mib: f64,
        #[arg(long, default_value_t = 64)]
        tensors: usize,
        #[arg(long, default_value = "v2")]
        lock: String,
        #[arg(long)]
        sparse: bool,
        #[arg(long, default_value_t = 2)]
        threads: usize,
    },
    /// The decode alone of a sealed shard made by `shard`, in memory on all cores (JSON).
    Decode {
        shard: PathBuf,
        #[arg(long, default_value_t = 3)]
        rounds: usize,
    },
}

fn die(msg: String) -> ! {
    eprintln!("bench-shard: {msg}");
    std::process::exit(1)
}

trait OrDie<T> {
    fn or_die(self, what: &dyn std::fmt::Display) -> T;
}

impl<T, E: std::fmt::Display> OrDie<T> for std::result::Result<T, E> {
    fn or_die(self, what: &dyn std::fmt::Display) -> T {
        self.unwrap_or_else(|e| die(format!("{what}: {e}")))
    }
}

/// A float dtype the generator can fill.
#[derive(Clone, Copy)]
struct Kind {
    dtype: Dtype,
    name: &'static str,
}

fn kind(s: &str) -> Kind {
    let dtype = match s {
        "bf16" => Dtype::BF16,
        "f16" => Dtype::F16,
        "f32" => Dtype::F32,
        "f8" | "fp8" | "f8_e4m3" => Dtype::F8_E4M3,
        o => die(format!("--dtype {o}: use bf16, f16, f32 or f8")),
    };
    Kind {
        dtype,
        name: match dtype {
            Dtype::BF16 => "bf16",
            Dtype::F16 => "f16",
            Dtype::F32 => "f32",
            _ => "f8",
        },
    }
}

impl Kind {
    fn unit(self) -> usize {
        match self.dtype {
            Dtype::F32 => 4,
            Dtype::BF16 | Dtype::F16 => 2,
            _ => 1,
        }
    }

    /// Largest magnitude the generator writes (planted at unit 0 of every tensor, so the
    /// domain is known without scanning).
    fn max_code(self) -> Vec<u8> {
        match self.dtype {
            Dtype::BF16 => 0x3FFFu16.to_le_bytes().to_vec(),
            Dtype::F16 => 0x3FFFu16.to_le_bytes().to_vec(),
            Dtype::F32 => 0x3FFF_FFFFu32.to_le_bytes().to_vec(),
            _ => vec![0x7E],
        }
    }

    fn domain(self) -> u64 {
        Codec::float(self.dtype)
            .unwrap()
            .domain_of(&self.max_code())
            .unwrap()
    }

    /// Fill `buf` (a whole number of units) with weights of magnitude at most `max_code`.
    fn fill(self, seed: u64, buf: &mut [u8]) {
        let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0xD1B5_4A32_D192_ED03;
        let mut next = || {
            s = s.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = s;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^ (z >> 31)
        };
        for c in buf.chunks_mut(8) {
            let r = next();
            let v: u64 = match self.dtype {
                // sign | exponent 2^-7..2^0 | mantissa, four per word
                Dtype::BF16 => map16(r, |x| {
                    (x & 0x8000) | (0x78 + (x >> 7 & 7)) << 7 | (x & 0x7F)
                }),
                // sign | exponent 2^-7..2^0 | mantissa
                Dtype::F16 => map16(r, |x| {
                    (x & 0x8000) | (0x08 + (x >> 10 & 7)) << 10 | (x & 0x3FF)
                }),
                Dtype::F32 => {
                    let f =
                        |x: u64| (x & 0x8000_0000) | (0x78 + (x >> 23 & 7)) << 23 | (x & 0x7F_FFFF);
                    f(r & 0xFFFF_FFFF) | f(r >> 32) << 32
                }
                _ => {
                    let mut v = r;
                    for k in 0..8 {
                        if (r >> (8 * k)) & 0x7F == 0x7F {
                            v &= !(1u64 << (8 * k)); // 0x7F (NaN magnitude) -> 0x7E
                        }
                    }
                    v
                }
            };
            c.copy_from_slice(&v.to_le_bytes()[..c.len()]);
        }
    }
}

fn map16(r: u64, f: impl Fn(u64) -> u64) -> u64 {
    (0..4).fold(0, |acc, k| acc | f(r >> (16 * k) & 0xFFFF) << (16 * k))
}

struct Planned {
    name: String,
    kind: Kind,
    bytes: u64,
    lock: TensorLock,
}

/// The safetensors header (length prefix included) of `tensors` with a `kllm.lock`.
fn header(tensors: &[Planned], version: Version, shape_cols: u64) -> Vec<u8> {
    let mut entries = serde_json::Map::new();
    for t in tensors {
        let m = t.kind.domain();
        entries.insert(
            t.name.clone(),
            match version {
                Version::V1 => json!(m),
                Version::V2 => json!([m, "float"]),
            },
        );
    }
    let doc = match version {
        Version::V1 => Value::Object(entries),
        Version::V2 => json!({"version": "v2", "tensors": entries}),
    };
    let mut h = serde_json::Map::new();
    h.insert(
        "__metadata__".into(),
        json!({"format": "pt", "kllm.lock": kllm_mount::pyjson::dumps_sorted(&doc)}),
    );
    let mut off = 0u64;
    for t in tensors {
        let units = t.bytes / t.kind.unit() as u64;
        let shape = if units.is_multiple_of(shape_cols) {
            json!([units / shape_cols, shape_cols])
        } else {
            json!([units])
        };
        h.insert(
            t.name.clone(),
            json!({"dtype": format!("{:?}", t.kind.dtype), "shape": shape, "data_offsets": [off, off + t.bytes]}),
        );
        off += t.bytes;
    }
    let mut text = serde_json::to_vec(&h).expect("JSON");
    text.resize(text.len().div_ceil(8) * 8, b' ');
    let mut out = (text.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&text);
    out
}

fn plan(
    key: &ModelKey,
    version: Version,
    names_kinds_bytes: Vec<(String, Kind, u64)>,
) -> Vec<Planned> {
    names_kinds_bytes
        .into_iter()
        .map(|(name, kind, bytes)| {
            let codec = Codec::float(kind.dtype).unwrap();
            let lock = TensorLock::new(key, version, codec, kind.domain(), &tensor_id("", &name));
            Planned {
                name,
                kind,
                bytes,
                lock,
            }
        })
        .collect()
}

/// Write the tensors' data: plain to `plain` (if any), locked to `sealed`, in order.
fn write_data(
    tensors: &[Planned],
    plain: Option<&mut dyn Write>,
    sealed: &mut dyn Write,
    threads: usize,
    seed: u64,
) {
    let mut plain = plain;
    for (ti, t) in tensors.iter().enumerate() {
        let ub = t.kind.unit() as u64;
        let chunks: Vec<(u64, u64)> = (0..t.bytes)
            .step_by(CHUNK)
            .map(|s| (s, (s + CHUNK as u64).min(t.bytes)))
            .collect();
        for group in chunks.chunks(threads.max(1)) {
            let done: Vec<(Vec<u8>, Vec<u8>)> = std::thread::scope(|sc| {
                let hs: Vec<_> = group
                    .iter()
                    .map(|&(s, e)| {
                        sc.spawn(move || {
                            let mut p = vec![0u8; (e - s) as usize];
                            t.kind
                                .fill(seed ^ ((ti as u64) << 32) ^ (s / CHUNK as u64), &mut p);
                            if s == 0 {
                                let mc = t.kind.max_code();
                                p[..mc.len()].copy_from_slice(&mc);
                            }
                            let mut l = p.clone();
                            t.lock
                                .encode(s / ub, &mut l)
                                .expect("generated data is in its domain");
                            (p, l)
                        })
                    })
                    .collect();
                hs.into_iter().map(|h| h.join().expect("worker")).collect()
            });
            for (p, l) in done {
                if let Some(w) = plain.as_deref_mut() {
                    w.write_all(&p).or_die(&"write plain");
                }
                sealed.write_all(&l).or_die(&"write sealed");
            }
        }
    }
}

/// OUT/plain with small files, sealed into OUT/sealed (lock flag set), and OUT/kllm.key.
fn small_model(out: &Path, key: &ModelKey, version: Version) -> (PathBuf, PathBuf) {
    let plain = out.join("plain");
    let sealed = out.join("sealed");
    for d in [&plain, &sealed] {
        if d.exists() {
            fs::remove_dir_all(d).or_die(&d.display());
        }
    }
    fs::create_dir_all(&plain).or_die(&plain.display());
    let cfg = json!({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "torch_dtype": "bfloat16"});
    fs::write(
        plain.join("config.json"),
        serde_json::to_string_pretty(&cfg).unwrap(),
    )
    .or_die(&"config.json");
    fs::write(
        plain.join("tokenizer.json"),
        r#"{"version": "1.0", "model": {"type": "BPE", "vocab": {"a": 0, "b": 1}, "merges": []}}"#,
    )
    .or_die(&"tokenizer.json");
    testseal::seal_dir(&plain, &sealed, key, Some(version), [7u8; 16]).or_die(&"seal");
    fs::write(out.join("kllm.key"), testseal::open_key_file(key)).or_die(&"kllm.key");
    (plain, sealed)
}

fn version(s: &str) -> Version {
    Version::parse(s).unwrap_or_else(|| die(format!("--lock {s}: use v1 or v2")))
}

/// `bench-shard decode`: see the module's docs.
fn decode_alone(path: &Path, key: &ModelKey, rounds: usize) {
    let file = File::open(path).or_die(&path.display());
    let shard = Shard::open(path, &file, "", key).or_die(&path.display());
    let sealed = fs::read(path).or_die(&path.display());
    let raw = |at: u64, buf: &mut [u8]| std::os::unix::fs::FileExt::read_exact_at(&file, buf, at);
    let chunk = kllm_mount::fill::CHUNK as usize;
    let mut buf = sealed.clone();
    let mut times = Vec::new();
    for _ in 0..rounds.max(1) {
        buf.copy_from_slice(&sealed);
        let t = Instant::now();
        for (i, c) in buf.chunks_mut(chunk).enumerate() {
            shard
                .unlock_in_place((i * chunk) as u64, c, &raw)
                .or_die(&"unlock");
        }
        times.push(t.elapsed().as_secs_f64());
    }
    let plain = path
        .parent()
        .and_then(Path::parent)
        .zip(path.file_name())
        .map(|(out, name)| out.join("plain").join(name));
    if let Some(plain) = plain.filter(|p| p.exists()) {
        if fs::read(&plain).or_die(&plain.display()) != buf {
            die(format!("the decode differs from {}", plain.display()));
        }
    }
    times.sort_by(|a, b| a.total_cmp(b));
    println!(
        "{}",
        json!({"bytes": buf.len(), "threads": rayon::current_num_threads(),
               "best_s": times[0], "median_s": times[times.len() / 2]})
    );
}

fn main() {
    let key = ModelKey::new(KEY);
    let t0 = Instant::now();
    match Cli::parse().cmd {
        Cmd::Decode { shard, rounds } => decode_alone(&shard, &key, rounds),
        Cmd::Shard {
            out,
            mib,
            lock,
            dtype,
            tensor_mib,
            threads,
        } => {
            let version = version(&lock);
            let kinds: Vec<Kind> = dtype.split(',').map(|s| kind(s.trim())).collect();
            let (plain_dir, sealed_dir) = small_model(&out, &key, version);
            let total = mib << 20;
            let per = (tensor_mib.max(1) << 20).min(total);
            let mut list = Vec::new();
            let mut done = 0u64;
            let mut i = 0usize;
            while done < total {
                let k = kinds[i % kinds.len()];
                let bytes = per.min(total - done);
                list.push((format!("model.layers.{i}.mlp.{}.weight", k.name), k, bytes));
                done += bytes;
                i += 1;
            }
            let tensors = plan(&key, version, list);
            let sealed_header = header(&tensors, version, 1024);
            let file_len = sealed_header.len() as u64 + total;
            let sealed_path = sealed_dir.join("model.safetensors");
            let plain_path = plain_dir.join("model.safetensors");
            // The plain file starts with the header exactly as the mount shows it.
            let shard = Shard::from_header(&sealed_path, &sealed_header[8..], file_len, "", &key)
                .or_die(&"header");
            let mut s = BufWriter::with_capacity(
                4 << 20,
                File::create(&sealed_path).or_die(&sealed_path.display()),
            );
            let mut p = BufWriter::with_capacity(
                4 << 20,
                File::create(&plain_path).or_die(&plain_path.display()),
            );
            s.write_all(&sealed_header).or_die(&"write");
            p.write_all(&shard.view_header).or_die(&"write");
            write_data(&tensors, Some(&mut p), &mut s, threads, 1);
            s.flush().or_die(&"flush");
            p.flush().or_die(&"flush");
            eprintln!(
                "bench-shard: {} ({} tensors, {mib} MiB, lock {lock}, {dtype}) in {:.1} s",
                out.display(),
                tensors.len(),
                t0.elapsed().as_secs_f64()
            );
        }
        Cmd::Shards {
            out,
            count,
            min_mib,
            max_mib,
            tensors: n_tensors,
            lock,
            sparse,
            threads,
        } => {
            if count == 0 || n_tensors == 0 {
                die("--count and --tensors must be at least 1".into());
            }
            let version = version(&lock);
            let (plain_dir, sealed_dir) = small_model(&out, &key, version);
            fs::remove_dir_all(&plain_dir).or_die(&plain_dir.display());
            let bf16 = kind("bf16");
            let mut weight_map = serde_json::Map::new();
            for i in 0..count {
                let frac = if count == 1 {
                    1.0
                } else {
                    i as f64 / (count - 1) as f64
                };
                let mib = min_mib * (max_mib / min_mib).powf(frac);
                // Whole 4 KiB pages per tensor, at least one.
                let total = ((mib * (1 << 20) as f64) as u64 / 4096).max(n_tensors as u64);
                let list: Vec<_> = (0..n_tensors)
                    .map(|t| {
                        let pages = total / n_tensors as u64
                            + u64::from((t as u64) < total % n_tensors as u64);
                        (format!("model.layers.{i}.t{t}.weight"), bf16, pages * 4096)
                    })
                    .collect();
                let tensors = plan(&key, version, list);
                let name = format!("model-{:05}-of-{:05}.safetensors", i + 1, count);
                for t in &tensors {
                    weight_map.insert(t.name.clone(), json!(name));
                }
                let hdr = header(&tensors, version, 1024);
                let path = sealed_dir.join(&name);
                let mut f = File::create(&path).or_die(&path.display());
                f.write_all(&hdr).or_die(&"write");
                let data: u64 = tensors.iter().map(|t| t.bytes).sum();
                if sparse {
                    f.seek(SeekFrom::Start(hdr.len() as u64 + data))
                        .or_die(&"seek");
                    f.set_len(hdr.len() as u64 + data).or_die(&"set_len");
                } else {
                    let mut w = BufWriter::with_capacity(4 << 20, f);
                    write_data(&tensors, None, &mut w, threads, 2 + i as u64);
                    w.flush().or_die(&"flush");
                }
            }
            let index = json!({"metadata": {}, "weight_map": weight_map});
            fs::write(
                sealed_dir.join("model.safetensors.index.json"),
                serde_json::to_string_pretty(&index).unwrap(),
            )
            .or_die(&"index");
            eprintln!(
                "bench-shard: {} ({count} shards, {min_mib}..{max_mib} MiB, {n_tensors} tensors each{}) in {:.1} s",
                out.display(),
                if sparse { ", sparse" } else { "" },
                t0.elapsed().as_secs_f64()
            );
        }
    }
}
