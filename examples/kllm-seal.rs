//! The project's own test sealer (not kLLM): makes sealed checkpoints for tests, benchmarks
//! and the quick start.
//!
//!   kllm-seal keygen KEYFILE
//!   kllm-seal sample OUT [--lock v1|v2|none] [--hidden N] [--layers N]
//!   kllm-seal seal SRC DST --key KEYFILE [--lock v1|v2|none]
//!   kllm-seal lock DIR --key KEYFILE --lock v1|v2

use std::path::{Path, PathBuf};

use clap::{Parser, Subcommand};
use kllm_mount::key::{self, ModelKey};
use kllm_mount::lock::Version;
use kllm_mount::testseal;
use zeroize::Zeroizing;

#[derive(Parser)]
#[command(
    name = "kllm-seal",
    about = "kllm-mount's test sealer (lock v1/v2, trusted.kllm)"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Write a new random key as an open key file.
    Keygen { file: PathBuf },
    /// Write OUT/plain (a tiny checkpoint), OUT/kllm.key and OUT/sealed.
    Sample {
        out: PathBuf,
        #[arg(long, default_value = "v2")]
        lock: String,
        #[arg(long, default_value_t = 64)]
        hidden: usize,
        #[arg(long, default_value_t = 2)]
        layers: usize,
    },
    /// Seal a plain checkpoint.
    Seal {
        src: PathBuf,
        dst: PathBuf,
        #[arg(long)]
        key: PathBuf,
        #[arg(long, default_value = "v2")]
        lock: String,
    },
    /// Lock the shards of a sealed, unlocked directory in place.
    Lock {
        dir: PathBuf,
        #[arg(long)]
        key: PathBuf,
        #[arg(long)]
        lock: String,
    },
}

fn version(s: &str) -> Option<Version> {
    match s {
        "none" => None,
        v => Some(
            Version::parse(v).unwrap_or_else(|| die(&format!("--lock {v}: use v1, v2 or none"))),
        ),
    }
}

fn die(msg: &str) -> ! {
    eprintln!("kllm-seal: {msg}");
    std::process::exit(1)
}

fn random_bytes<const N: usize>() -> [u8; N] {
    let mut out = [0u8; N];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut out))
        .unwrap_or_else(|e| die(&format!("/dev/urandom: {e}")));
    out
}

fn load_key(path: &Path) -> ModelKey {
    let text =
        std::fs::read_to_string(path).unwrap_or_else(|e| die(&format!("{}: {e}", path.display())));
    key::parse_key_file(path, &text, || key::passphrase_from_env_or_prompt(path))
        .unwrap_or_else(|e| die(&e.to_string()))
}

fn write_key(path: &Path, k: &ModelKey) {
    let text = Zeroizing::new(testseal::open_key_file(k));
    std::fs::write(path, text.as_bytes())
        .unwrap_or_else(|e| die(&format!("{}: {e}", path.display())));
}

fn main() {
    let result = match Cli::parse().cmd {
        Cmd::Keygen { file } => {
            let k = ModelKey::new(random_bytes());
            write_key(&file, &k);
            println!("{}", k.fingerprint());
            Ok(())
        }
        Cmd::Sample {
            out,
            lock,
            hidden,
            layers,
        } => {
            let k = ModelKey::new(random_bytes());
            std::fs::create_dir_all(&out)
                .unwrap_or_else(|e| die(&format!("{}: {e}", out.display())));
            write_key(&out.join("kllm.key"), &k);
            testseal::write_sample_model(&out.join("plain"), hidden, layers).and_then(|_| {
                testseal::seal_dir(
                    &out.join("plain"),
                    &out.join("sealed"),
                    &k,
                    version(&lock),
                    random_bytes(),
                )
            })
        }
        Cmd::Seal {
            src,
            dst,
            key,
            lock,
        } => testseal::seal_dir(&src, &dst, &load_key(&key), version(&lock), random_bytes()),
        Cmd::Lock { dir, key, lock } => match version(&lock) {
            Some(v) => testseal::lock_dir(&dir, &load_key(&key), v),
            None => die("lock needs --lock v1 or v2"),
        },
    };
    if let Err(e) = result {
        die(&e.to_string());
    }
}
