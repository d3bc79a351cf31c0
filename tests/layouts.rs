//! Checkpoints of unusual shape, through the mount: a header of 100k tensors, folders 64
//! deep, and odd file names (spaces, new lines, Unicode, names that are not UTF-8).
//!
//! They mount the binary in temporary directories (root, /dev/fuse and fusermount3, as the
//! CI machine has), through FUSE (`--mode fuse`: they hold the daemon's own read path to
//! account); a guard unmounts and ends the daemon even when a test panics.

mod common;

use std::collections::BTreeMap;
use std::ffi::OsStr;
use std::fs;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use kllm_mount::lock::Version;
use kllm_mount::testseal::{self, safetensors_bytes, Tensor};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use safetensors::Dtype;

use common::*;

const KEY: [u8; 32] = [0x6b; 32];

// ---------------------------------------------------------------------------------------
// 100k tensors, deep folders, odd names
// ---------------------------------------------------------------------------------------

#[test]
fn header_with_100k_tensors() {
    const N: usize = 100_000;
    let tensors: Vec<Tensor> = (0..N)
        .map(|i| Tensor {
            name: format!("model.layers.{}.experts.{}.w", i / 1000, i % 1000),
            dtype: Dtype::BF16,
            shape: vec![4],
            data: testseal::sample_bf16(i as u64, 4),
        })
        .collect();
    let mut md = serde_json::Map::new();
    md.insert("format".into(), "pt".into());
    let t0 = Instant::now();
    let s = Sample::new(KEY, 16, 1, Some(Version::V2), |plain| {
        fs::write(
            plain.join("huge.safetensors"),
            safetensors_bytes(&tensors, &md),
        )
        .unwrap();
    });
    let sealed_in = t0.elapsed();
    let bytes = fs::read(s.sealed().join("huge.safetensors")).unwrap();
    let header_len = data_start(&bytes) - 8;
    assert!(String::from_utf8_lossy(&bytes[..header_len + 8]).contains("kllm.lock"));

    let t = Instant::now();
    let view = s.open_view().unwrap();
    let built_in = t.elapsed();
    let plain = fs::read(s.plain().join("huge.safetensors")).unwrap();
    let ino = view.resolve("huge.safetensors").unwrap();
    let got = view.read(ino, 0, bytes.len()).unwrap().to_vec();
    assert_eq!(got[data_start(&got)..], plain[data_start(&plain)..]);

    let t = Instant::now();
    let m = s.mount_fuse(&[]);
    let mounted_in = t.elapsed();
    let t = Instant::now();
    let through = read_direct(&m.path("huge.safetensors")).unwrap();
    let read_in = t.elapsed();
    assert!(through == got, "read through the mount differs");
    let mut rng = StdRng::seed_from_u64(100);
    let f = open_direct(&m.path("huge.safetensors"));
    for _ in 0..200 {
        let off = rng.gen_range(0..got.len() as u64);
        let len = rng.gen_range(1..=600);
        let end = (off as usize + len).min(got.len());
        assert_eq!(
            pread(&f, off, len).unwrap(),
            got[off as usize..end],
            "[{off}, +{len})"
        );
    }
    eprintln!(
        "100k tensors: header {header_len} bytes, file {} bytes; sealed in {sealed_in:?}, view built in {built_in:?}, \
         mounted (binary) in {mounted_in:?}, whole file read through the mount in {read_in:?}",
        bytes.len()
    );
    assert!(
        mounted_in < Duration::from_secs(60),
        "mount took {mounted_in:?}"
    );
    m.assert_alive("after the reads");
}

/// Compare the data region of every safetensors file of `plain` with the view's, and every
/// other file byte for byte (config.json and the secret files aside).
fn assert_view_matches_plain(plain: &Path, m: &Mounted, view: &BTreeMap<String, Vec<u8>>) {
    for (rel, path) in tree(plain) {
        // Names that are not UTF-8 are checked by the caller (tree() shows them lossily).
        if rel.contains('\u{FFFD}') {
            continue;
        }
        if rel == "config.json" || rel.ends_with("tokenizer.json") || rel.ends_with("vocab.json") {
            continue;
        }
        let want = fs::read(&path).unwrap();
        let got = read_direct(&m.path(&rel)).unwrap_or_else(|e| panic!("{rel:?}: {e}"));
        assert!(
            got == view[&rel],
            "{rel:?}: mount and in-process view differ"
        );
        if rel.ends_with(".safetensors") {
            assert!(
                got[data_start(&got)..] == want[data_start(&want)..],
                "{rel:?}: decoded tensors differ from the plain ones"
            );
        } else {
            assert!(got == want, "{rel:?}: differs");
        }
    }
}

#[test]
fn deep_folders() {
    const DEPTH: usize = 64;
    let rel_dir: PathBuf = (0..DEPTH).map(|i| format!("d{i:02}")).collect();
    let s = Sample::new(KEY, 16, 1, Some(Version::V2), |plain| {
        let dir = plain.join(&rel_dir);
        fs::create_dir_all(&dir).unwrap();
        fs::write(dir.join("model.safetensors"), small_shard(5)).unwrap();
        fs::write(dir.join("notes.txt"), b"at the bottom").unwrap();
        // Every level holds a file too.
        let mut d = plain.to_path_buf();
        for i in 0..DEPTH {
            d.push(format!("d{i:02}"));
            fs::write(d.join(format!("level-{i}.txt")), format!("level {i}")).unwrap();
        }
    });
    let deep = rel_dir.join("model.safetensors");
    assert!(locked_shards(&s.sealed()).contains(&deep.to_string_lossy().into_owned()));
    let view = s.view();
    let m = s.mount_fuse(&[]);
    assert_view_matches_plain(&s.plain(), &m, &view);
    assert_eq!(
        fs::read(m.path(&rel_dir.join("notes.txt").to_string_lossy())).unwrap(),
        b"at the bottom"
    );
}

#[test]
fn odd_names() {
    let names: Vec<&str> = vec![
        "with space.json",
        "  leading and trailing  ",
        "ünïcödé-ファイル-😀.txt",
        "new\nline.txt",
        "tab\there",
        "-starts-with-dash",
        "quote\"s and 'apostrophes'",
        "back\\slash",
        "#hash%percent&amp;",
        "...",
        ".hidden",
        "trusted.kllm.bak",
        "kllm.key.txt",
    ];
    let long = "L".repeat(255);
    let odd_dir = "dir with space/ü ñ/new\nline";
    let s = Sample::new(KEY, 16, 1, Some(Version::V2), |plain| {
        for (i, n) in names
            .iter()
            .chain(std::iter::once(&long.as_str()))
            .enumerate()
        {
            fs::write(plain.join(n), format!("file {i}: {n}")).unwrap();
        }
        let d = plain.join(odd_dir);
        fs::create_dir_all(&d).unwrap();
        fs::write(d.join("odd shard ü.safetensors"), small_shard(9)).unwrap();
        fs::write(d.join("x y.txt"), b"in an odd folder").unwrap();
        // Not UTF-8 at all (kLLM cannot seal such a name, but the mount must not choke).
        fs::write(
            plain.join(OsStr::from_bytes(b"latin1-\xe9t\xe9.txt")),
            b"latin-1 name",
        )
        .unwrap();
    });
    let shard = format!("{odd_dir}/odd shard ü.safetensors");
    assert!(
        locked_shards(&s.sealed()).contains(&shard),
        "{shard:?} was not locked"
    );
    let view = s.view();
    let m = s.mount_fuse(&[]);
    let top = listing(&m.mp);
    for n in names.iter().chain(std::iter::once(&long.as_str())) {
        assert!(top.contains(*n), "{n:?} not listed");
    }
    assert_view_matches_plain(&s.plain(), &m, &view);
    let latin = m.mp.join(OsStr::from_bytes(b"latin1-\xe9t\xe9.txt"));
    assert_eq!(fs::read(latin).unwrap(), b"latin-1 name");
}
