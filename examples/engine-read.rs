//! Read a mounted checkpoint the way an engine does, and check it against the plain one:
//! every shard memory-mapped and parsed with the `safetensors` crate (the core of
//! `safe_open`), every tensor compared, the tokenizer and config read from the mount.
//!
//!   engine-read MOUNT PLAIN

use std::collections::BTreeMap;
use std::fs::File;
use std::path::Path;
use std::time::Instant;

use safetensors::SafeTensors;

fn die(msg: String) -> ! {
    eprintln!("engine-read: FAIL: {msg}");
    std::process::exit(1)
}

fn tensors(path: &Path) -> (memmap2::Mmap, usize) {
    let file = File::open(path).unwrap_or_else(|e| die(format!("{}: {e}", path.display())));
    // SAFETY: the mapped files are not modified while mapped (the mount is read-only).
    let map = unsafe { memmap2::Mmap::map(&file) }
        .unwrap_or_else(|e| die(format!("{}: mmap: {e}", path.display())));
    let n = SafeTensors::deserialize(&map)
        .unwrap_or_else(|e| die(format!("{}: not a safetensors file: {e:?}", path.display())))
        .len();
    (map, n)
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.len() != 3 {
        die("usage: engine-read MOUNT PLAIN".into());
    }
    let (mount, plain) = (Path::new(&args[1]), Path::new(&args[2]));
    let start = Instant::now();
    let (mut shards, mut count, mut bytes) = (0, 0, 0u64);
    let mut names: Vec<_> = std::fs::read_dir(plain)
        .unwrap_or_else(|e| die(format!("{}: {e}", plain.display())))
        .flatten()
        .map(|e| e.file_name())
        .filter(|n| n.to_string_lossy().ends_with(".safetensors"))
        .collect();
    names.sort();
    for name in names {
        let (got_map, _) = tensors(&mount.join(&name));
        let (want_map, _) = tensors(&plain.join(&name));
        let got = SafeTensors::deserialize(&got_map).expect("checked");
        let want = SafeTensors::deserialize(&want_map).expect("checked");
        let g: BTreeMap<_, _> = got.tensors().into_iter().collect();
        let w: BTreeMap<_, _> = want.tensors().into_iter().collect();
        if g.keys().ne(w.keys()) {
            die(format!("{}: tensor names differ", name.to_string_lossy()));
        }
        for (t, view) in &w {
            let other = &g[t];
            if other.dtype() != view.dtype()
                || other.shape() != view.shape()
                || other.data() != view.data()
            {
                die(format!(
                    "{}: tensor {t} differs from the plain checkpoint",
                    name.to_string_lossy()
                ));
            }
            count += 1;
            bytes += view.data().len() as u64;
        }
        shards += 1;
    }
    for f in ["tokenizer.json", "vocab.json"] {
        if plain.join(f).exists()
            && std::fs::read(mount.join(f)).ok() != std::fs::read(plain.join(f)).ok()
        {
            die(format!("{f} differs from the plain checkpoint"));
        }
    }
    let cfg: serde_json::Value =
        serde_json::from_slice(&std::fs::read(mount.join("config.json")).unwrap_or_default())
            .unwrap_or_else(|e| die(format!("config.json: {e}")));
    if cfg["kllm"].get("lock").is_some() {
        die("config.json still carries the lock flag".into());
    }
    for hidden in ["trusted.kllm", "kllm.key"] {
        if mount.join(hidden).exists() {
            die(format!("{hidden} is visible in the mount"));
        }
    }
    println!(
        "engine-read: OK: {shards} shards, {count} tensors, {bytes} bytes equal to the plain checkpoint; tokenizer and config from the mount ({:.0} ms)",
        start.elapsed().as_secs_f64() * 1e3
    );
}
