//! Integrity while serving: files checked against kLLM's manifest before their first byte
//! is served, in both serving modes, and the status socket's counters against what a test
//! read.

mod common;

use std::fs::{self, File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::process::Output;

use common::*;
use kllm_mount::manifest;
use kllm_mount::metrics::METRICS;
use serde_json::{json, Value};
use sha2::{Digest, Sha256};

const KEY: [u8; 32] = [0x3c; 32];
const EIO: i32 = libc::EIO;
const SHARD: &str = "model-00002-of-00002.safetensors";
const MODES: [&str; 2] = ["passthrough", "fuse"];

/// A sealed sample with a manifest in kLLM's layout, and its view.
fn fixture() -> Fixture {
    let f = Fixture::new(KEY, 256, 2);
    f.write_manifest(&f.sealed().join(manifest::FILE_NAME));
    f
}

/// Manifests and mounts of a fixture, as these tests make them.
trait Manifested {
    /// A manifest of the sealed directory as kLLM's catalog writes it; its digest.
    fn write_manifest(&self, to: &Path) -> String;
    fn args(&self, extra: &[&str]) -> Vec<String>;
    /// Mount in the background with a log in the mount's temporary directory; the daemon.
    fn mount(&self, m: &Mnt, extra: &[&str]) -> i32;
    fn try_mount(&self, m: &Mnt, extra: &[&str]) -> Output;
}

impl Manifested for Fixture {
    fn write_manifest(&self, to: &Path) -> String {
        let mut files = serde_json::Map::new();
        for (rel, path) in tree(&self.sealed()) {
            if rel != manifest::FILE_NAME {
                let digest = Sha256::digest(fs::read(path).unwrap());
                files.insert(rel, Value::from(hex::encode(digest)));
            }
        }
        let doc = json!({"format": "kllm-catalog", "version": 1, "name": "test", "kllm": "0.1.0", "files": files});
        let text = serde_json::to_string_pretty(&doc).unwrap();
        fs::write(to, &text).unwrap();
        hex::encode(Sha256::digest(text.as_bytes()))
    }

    fn args(&self, extra: &[&str]) -> Vec<String> {
        let mut a = vec!["--key".to_string(), self.s.key_file().display().to_string()];
        a.extend(extra.iter().map(|s| s.to_string()));
        a
    }

    fn mount(&self, m: &Mnt, extra: &[&str]) -> i32 {
        let mut c = m.cmd(&self.sealed());
        c.args(self.args(extra))
            .arg("--log-file")
            .arg(m.scratch().join("log"));
        m.mount(c)
    }

    fn try_mount(&self, m: &Mnt, extra: &[&str]) -> Output {
        let mut c = m.cmd(&self.sealed());
        c.args(self.args(extra));
        run(c)
    }
}

/// Flip one bit of `rel` in the sealed directory at `at` (from the end when negative),
/// keeping its times as they were, as a careful attacker would.
fn flip(sealed: &Path, rel: &str, at: i64) {
    let p = sealed.join(rel);
    let len = fs::metadata(&p).unwrap().len() as i64;
    let at = if at < 0 { len + at } else { at } as u64;
    let f = OpenOptions::new().read(true).write(true).open(&p).unwrap();
    let mut b = [0u8; 1];
    f.read_exact_at(&mut b, at).unwrap();
    b[0] ^= 0x01;
    f.write_all_at(&b, at).unwrap();
}

fn assert_reads_fail(m: &Mnt, rel: &str, label: &str) {
    let e = File::open(m.path(rel)).and_then(|f| {
        let mut b = vec![0u8; 64];
        f.read_at(&mut b, 0)
    });
    assert_eq!(
        errno_of(e, &format!("{label}: {rel}")),
        EIO,
        "{label}: {rel}"
    );
}

#[test]
fn untouched_files_are_verified_and_served_in_each_mode() {
    let s = fixture();
    for mode in MODES {
        let m = Mnt::new();
        s.mount(&m, &["--mode", mode]);
        assert!(
            !m.path(manifest::FILE_NAME).exists(),
            "the manifest is shown"
        );
        for (rel, want) in &s.view {
            assert!(&fs::read(m.path(rel)).unwrap() == want, "{mode}: {rel}");
        }
        let st = status(&m);
        assert_eq!(st["mode"], mode, "{st}");
        assert_eq!(st["failed_files"], 0, "{st}");
        // Every file read: the shards on first use, the rest at mount.
        assert_eq!(st["verified_files"], s.view.len() as u64, "{st}");
    }
}

/// `--verify mount` hashes before the daemon forks. Shards large enough that a read decodes
/// on all cores are then served in both modes: the hash must not leave the daemon a thread
/// pool without threads (a hang on the first such read until this was fixed).
#[test]
fn after_verify_mount_large_shards_are_served_in_each_mode() {
    let s = Fixture::new(KEY, 1024, 2);
    s.write_manifest(&s.sealed().join(manifest::FILE_NAME));
    let largest = s.view.values().map(|v| v.len()).max().unwrap();
    assert!(largest >= 4 << 20, "largest file {largest} bytes");
    for mode in MODES {
        let m = Mnt::new();
        s.mount(&m, &["--mode", mode, "--verify", "mount"]);
        let (tx, rx) = std::sync::mpsc::channel();
        let (files, root) = (s.view.clone(), m.mp.clone());
        std::thread::spawn(move || {
            for (rel, want) in &files {
                let _ = tx.send((rel.clone(), &fs::read(root.join(rel)).unwrap() == want));
            }
        });
        for _ in 0..s.view.len() {
            let (rel, same) = rx
                .recv_timeout(std::time::Duration::from_secs(120))
                .unwrap_or_else(|_| panic!("{mode}: a read did not return in 120 s"));
            assert!(same, "{mode}: {rel}");
        }
    }
}

#[test]
fn the_real_kllm_manifest_guards_its_model() {
    let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    let key = fixtures.join("pipe_zimage_client/kllm.key");
    let view = fixtures.join("pipe_zimage_client/view");
    let m = Mnt::new();
    let sealed = m.scratch().join("sealed");
    copy_tree(&fixtures.join("manifest/sealed"), &sealed);
    let mount = |m: &Mnt| {
        let mut c = m.cmd(&sealed);
        c.arg("--key").arg(&key).args(["--verify", "mount"]);
        run(c)
    };
    let out = mount(&m);
    assert!(out.status.success(), "{}", stderr_of(&out));
    m.daemon();
    for (rel, path) in tree(&view) {
        assert!(
            fs::read(m.path(&rel)).unwrap() == fs::read(path).unwrap(),
            "{rel}"
        );
    }
    assert!(fusermount_u(&m.mp, false));
    wait_for(5, "unmounted", || !is_mounted(&m.mp));
    // One bit of a weight changed after sealing: the mount is refused and says which.
    flip(
        &sealed,
        "transformer/diffusion_pytorch_model.safetensors",
        -3,
    );
    let out = mount(&m);
    let err = stderr_of(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("transformer/diffusion_pytorch_model.safetensors")
            && err.contains("does not match kllm-manifest.json"),
        "{err}"
    );
    assert!(!is_mounted(&m.mp));
}

/// Where to flip a bit of a file, from the sample's bytes (from the end when negative).
type Where = dyn Fn(&Fixture) -> i64;

/// Each region of a sealed model altered after sealing, in each mode: the file fails with
/// EIO (never other bytes), the others still read, the log names it, status counts it,
/// and `--verify mount` refuses naming it.
#[test]
fn altered_files_fail_with_eio_in_each_mode() {
    let header = |s: &Fixture| {
        // Inside the shard's JSON header, where the change still parses: "pt" -> "qt".
        let b = fs::read(s.sealed().join(SHARD)).unwrap();
        let n = u64::from_le_bytes(b[..8].try_into().unwrap()) as usize;
        let text = std::str::from_utf8(&b[8..8 + n]).unwrap();
        8 + text.find("\"format\":\"pt\"").unwrap() as i64 + 10
    };
    let cases: Vec<(&str, &str, Box<Where>)> = vec![
        ("header", SHARD, Box::new(header)),
        ("locked data", SHARD, Box::new(|_| -3)),
        ("verbatim file", "tokenizer_config.json", Box::new(|_| 3)),
        ("the config", "config.json", Box::new(|_| 5)),
    ];
    for (region, rel, at) in cases {
        let s = fixture();
        flip(&s.sealed(), rel, at(&s));
        for mode in MODES {
            let label = format!("{region}, --mode {mode}");
            let m = Mnt::new();
            s.mount(&m, &["--mode", mode]);
            assert_reads_fail(&m, rel, &label);
            for (other, want) in s.view.iter().filter(|(r, _)| r.as_str() != rel) {
                let got = fs::read(m.path(other));
                assert!(
                    got.as_deref().ok() == Some(&want[..]),
                    "{label}: {other}: {got:?}"
                );
            }
            let log = fs::read_to_string(m.scratch().join("log")).unwrap();
            assert!(
                log.lines()
                    .any(|l| l.contains(rel) && l.contains("does not match")),
                "{label}: the log does not name {rel}"
            );
            let st = status(&m);
            assert_eq!(st["failed_files"], 1, "{label}: {st}");
            assert!(count(&st, "read_errors") >= 1, "{label}: {st}");
        }
        let m = Mnt::new();
        let out = s.try_mount(&m, &["--verify", "mount"]);
        let err = stderr_of(&out);
        assert_eq!(out.status.code(), Some(1), "{region}: {err}");
        assert!(
            err.contains(rel) && err.contains("--verify mount"),
            "{region}: {err}"
        );
        assert!(!is_mounted(&m.mp));
        // Without the check the altered bytes are what the mount shows.
        let m = Mnt::new();
        s.mount(&m, &["--verify", "off"]);
        assert!(File::open(m.path(rel)).is_ok(), "{region}: --verify off");
    }
}

#[test]
fn an_altered_blob_is_refused_at_mount() {
    let s = fixture();
    flip(&s.sealed(), "trusted.kllm", -40);
    let m = Mnt::new();
    let out = s.try_mount(&m, &[]);
    let err = stderr_of(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("trusted.kllm"), "{err}");
    assert!(!is_mounted(&m.mp));
}

#[test]
fn missing_extra_and_pinned_manifests() {
    // A listed file that is missing: refused at mount, naming it.
    let s = fixture();
    fs::remove_file(s.sealed().join("tokenizer_config.json")).unwrap();
    let m = Mnt::new();
    let out = s.try_mount(&m, &[]);
    let err = stderr_of(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("tokenizer_config.json") && err.contains("missing"),
        "{err}"
    );

    // A file the manifest does not list is not shown.
    let s = fixture();
    fs::write(s.sealed().join("extra.py"), b"print('not sealed')").unwrap();
    let m = Mnt::new();
    s.mount(&m, &[]);
    assert!(!m.path("extra.py").exists(), "an unlisted file is shown");
    assert!(fs::read(m.path(SHARD)).unwrap() == s.bytes(SHARD));
    drop(m);

    // Pinned: the right value mounts, another is refused, a pin without a manifest too.
    let s = fixture();
    let outside = s.s.root().join("catalog.json");
    let pin = s.write_manifest(&outside);
    fs::remove_file(s.sealed().join(manifest::FILE_NAME)).unwrap();
    let m = Mnt::new();
    s.mount(
        &m,
        &[
            "--manifest",
            outside.to_str().unwrap(),
            "--manifest-sha256",
            &pin,
        ],
    );
    assert!(fs::read(m.path(SHARD)).unwrap() == s.bytes(SHARD));
    drop(m);
    let wrong = "0".repeat(64);
    let m = Mnt::new();
    let out = s.try_mount(
        &m,
        &[
            "--manifest",
            outside.to_str().unwrap(),
            "--manifest-sha256",
            &wrong,
        ],
    );
    let err = stderr_of(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("catalog.json"), "{err}");
    let out = s.try_mount(&m, &["--manifest-sha256", &pin]);
    assert_eq!(out.status.code(), Some(1), "{}", stderr_of(&out));
}

/// A shard not in the page cache is checked by the fill that reads it from the disk (the
/// digest fed chunk by chunk), as one in the page cache is by the check's own reads: served
/// untouched, refused altered.
#[test]
fn a_shard_read_from_the_disk_is_checked_as_it_is_read() {
    let s = fixture();
    for altered in [false, true] {
        if altered {
            flip(&s.sealed(), SHARD, -7);
        }
        let f = File::open(s.sealed().join(SHARD)).unwrap();
        f.sync_all().unwrap();
        drop_page_cache(&f);
        let m = Mnt::new();
        s.mount(&m, &["--mode", "passthrough"]);
        let label = if altered { "altered" } else { "untouched" };
        if altered {
            assert_reads_fail(&m, SHARD, label);
        } else {
            assert!(
                fs::read(m.path(SHARD)).unwrap() == s.bytes(SHARD),
                "{label}"
            );
        }
        let st = status(&m);
        assert_eq!(st["failed_files"], altered as u64, "{label}: {st}");
    }
}

#[test]
fn a_verified_file_rewritten_later_fails() {
    let s = fixture();
    let m = Mnt::new();
    s.mount(&m, &["--mode", "fuse", "--cache-size", "0"]);
    let f = open_direct(&m.path("tokenizer_config.json"));
    let want = s.bytes("tokenizer_config.json");
    assert_eq!(pread(&f, 0, want.len()).unwrap(), want);
    // Same bytes, same size, rewritten: the change time moves.
    fs::write(s.sealed().join("tokenizer_config.json"), want).unwrap();
    assert_eq!(errno_of(pread(&f, 0, want.len()), "rewritten"), EIO);
}

/// Through FUSE the files are checked right after mounting, then the shards decoded into
/// the kernel's page cache (fetch ahead), so their reads reach the daemon no more; a shard
/// that fails its check is never decoded ahead.
#[test]
fn through_fuse_files_are_checked_ahead_of_their_opens() {
    let s = fixture();
    let is_shard = |rel: &str| rel.ends_with(".safetensors");
    let shards: u64 = s
        .view
        .iter()
        .filter(|(rel, _)| is_shard(rel))
        .map(|(_, v)| v.len() as u64)
        .sum();
    let m = Mnt::new();
    s.mount(&m, &["--mode", "fuse"]);
    wait_for(20, "every file checked with none opened", || {
        let st = status(&m);
        assert_eq!(st["opens"], 0, "{st}");
        st["verified_files"] == s.view.len() as u64
    });
    wait_for(20, "the shards decoded ahead", || {
        counter(&m, "bytes_stored_ahead") == shards
    });
    let served = counter(&m, "bytes_served");
    for (rel, want) in &s.view {
        assert!(&fs::read(m.path(rel)).unwrap() == want, "{rel}");
    }
    let others: u64 = s
        .view
        .iter()
        .filter(|(rel, _)| !is_shard(rel))
        .map(|(_, v)| v.len() as u64)
        .sum();
    // Only the other files through the daemon, but for shard pages proactive reclaim took.
    let served = counter(&m, "bytes_served") - served;
    assert!(
        served >= others && served - others <= reclaim_allowance(shards),
        "{served} bytes through the daemon, where the other files are {others}"
    );
    assert_eq!(status(&m)["verified_files"], s.view.len() as u64);
    drop(m);

    // Turned off with decode ahead: a shard is checked on its first open only.
    let m = Mnt::new();
    s.mount(&m, &["--mode", "fuse", "--no-decode-ahead"]);
    std::thread::sleep(std::time::Duration::from_millis(500));
    let st = status(&m);
    let shards = 2;
    assert!(
        count(&st, "verified_files") <= s.view.len() as u64 - shards,
        "{st}"
    );
    drop(m);

    // A shard altered after sealing is found with nothing opened, and its opens fail.
    flip(&s.sealed(), SHARD, -7);
    let m = Mnt::new();
    s.mount(&m, &["--mode", "fuse"]);
    wait_for(20, "the altered shard found with none opened", || {
        let st = status(&m);
        assert_eq!(st["opens"], 0, "{st}");
        st["failed_files"] == 1
    });
    let other = "model-00001-of-00002.safetensors";
    wait_for(20, "the good shard decoded ahead", || {
        counter(&m, "bytes_stored_ahead") == s.view[other].len() as u64
    });
    assert_eq!(
        counter(&m, "bytes_fetched_ahead"),
        fs::metadata(s.sealed().join(other)).unwrap().len(),
        "only the good shard fetched ahead"
    );
    assert_reads_fail(&m, SHARD, "checked ahead");
    assert!(fs::read(m.path(other)).unwrap() == s.bytes(other));
}

/// Through FUSE under a manifest, check ahead hashes the files other than shards first
/// (what engines open first), then each shard, each decoded ahead only after its own check
/// and without waiting for the other shards' checks.
#[test]
fn through_fuse_each_shard_is_decoded_ahead_right_after_its_check() {
    let s = fixture();
    let is_shard = |rel: &str| rel.ends_with(".safetensors");
    let shards: Vec<&String> = s.view.keys().filter(|rel| is_shard(rel)).collect();
    let stored: u64 = shards.iter().map(|rel| s.view[*rel].len() as u64).sum();
    let m = Mnt::new();
    let log = m.scratch().join("log");
    let mut c = m.cmd(&s.sealed());
    c.args(s.args(&["--mode", "fuse"]))
        .arg("--log-file")
        .arg(&log)
        .env("RUST_LOG", "kllm_mount=debug");
    m.mount(c);
    wait_for(20, "the shards decoded ahead", || {
        counter(&m, "bytes_stored_ahead") == stored
    });
    let lines = fs::read_to_string(&log).unwrap();
    let lines: Vec<&str> = lines.lines().collect();
    let at = |needle: &str| {
        lines
            .iter()
            .position(|l| l.contains(needle))
            .unwrap_or_else(|| panic!("no '{needle}' in the log:\n{}", lines.join("\n")))
    };
    // The files read at mount (the metadata file, the blob) have their verdicts already.
    let checked: Vec<bool> = lines
        .iter()
        .filter(|l| l.contains("check ahead: ") && l.ends_with(" checked"))
        .map(|l| is_shard(l.trim_end_matches(" checked")))
        .collect();
    assert!(
        checked.iter().position(|&shard| shard) == Some(checked.len() - shards.len())
            && checked.len() > shards.len(),
        "the other files first, then the shards: {checked:?}"
    );
    for rel in &shards {
        let checked = at(&format!("check ahead: {rel} checked"));
        assert!(
            checked < at(&format!("fetch ahead: {rel} begins")),
            "{rel} fetched ahead before its check"
        );
        assert!(
            checked < at(&format!("store ahead: {rel} stored")),
            "{rel} decoded ahead before its check"
        );
    }
    assert!(
        at(&format!("fetch ahead: {} begins", shards[0]))
            < at(&format!(
                "check ahead: {} checked",
                shards[shards.len() - 1]
            )),
        "the first shard waited for the last one's check"
    );
}

#[test]
fn status_counts_what_was_read() {
    let s = fixture();
    let m = Mnt::new();
    // No check ahead, so the shard is checked on its first open (counted below).
    s.mount(
        &m,
        &["--mode", "fuse", "--cache-size", "0", "--no-decode-ahead"],
    );
    let st = status(&m);
    let counters = METRICS.iter().map(|m| m.field);
    for field in ["mode", "sealed", "mounted_at"].into_iter().chain(counters) {
        assert!(st.get(field).is_some(), "no {field} in {st}");
    }
    assert_eq!(st["bytes_served"], 0);
    let st0 = st.clone();
    assert_eq!(
        st["mounted_at"],
        fs::canonicalize(&m.mp).unwrap().to_str().unwrap()
    );
    let want = s.bytes(SHARD);
    let f = File::open(m.path(SHARD)).unwrap();
    let mut got = vec![0u8; want.len()];
    f.read_exact_at(&mut got, 0).unwrap();
    assert!(got == want);
    let st = status(&m);
    assert_eq!(st["files_open"], 1, "{st}");
    assert_eq!(st["bytes_served"], want.len() as u64, "{st}");
    assert!(
        count(&st, "bytes_decoded") >= want.len() as u64 - 4096,
        "{st}"
    );
    // The shard on its first open; the files read at mount were checked then.
    let at_mount = count(&st0, "verified_files");
    assert_eq!(st["verified_files"], at_mount + 1, "{st}");
    drop(f);
    wait_for(5, "no file open", || status(&m)["files_open"] == 0);
}

#[test]
fn status_of_a_mount_point_without_a_daemon_is_an_error() {
    let m = Mnt::new();
    let out = run({
        let mut c = std::process::Command::new(env!("CARGO_BIN_EXE_kllm-mount"));
        c.arg("--status").arg(&m.mp);
        c
    });
    let err = stderr_of(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.starts_with("kllm-mount: "), "{err}");
}
