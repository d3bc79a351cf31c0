//! Secrets in the daemon: nothing plain reaches a disk, the key stays out of its argv and
//! environment, it writes no core file, its decoded bytes are locked in memory (with a
//! warning where locking is refused), and passphrase key files hash as Python's do.
//!
//! They mount the binary in temporary directories (root, /dev/fuse and fusermount3, as the
//! CI machine has), through FUSE (`--mode fuse`: they hold the daemon's own read path to
//! account); a guard unmounts and ends the daemon even when a test panics.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::ffi::OsStr;
use std::fs::{self, File};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kllm_mount::key::ModelKey;
use kllm_mount::lock::Version;

use common::*;

const KEY: [u8; 32] = [0x6b; 32];

fn key() -> ModelKey {
    ModelKey::new(KEY)
}

// ---------------------------------------------------------------------------------------
// Nothing plain reaches a disk
// ---------------------------------------------------------------------------------------

fn proc_io(pid: i32) -> BTreeMap<String, u64> {
    fs::read_to_string(format!("/proc/{pid}/io"))
        .unwrap()
        .lines()
        .filter_map(|l| {
            let (k, v) = l.split_once(':')?;
            Some((k.to_string(), v.trim().parse().ok()?))
        })
        .collect()
}

/// The daemon's descriptors: target and open flags.
fn fds(pid: i32) -> Vec<(String, i32)> {
    let Ok(dir) = fs::read_dir(format!("/proc/{pid}/fd")) else {
        return Vec::new();
    };
    dir.flatten()
        .filter_map(|e| {
            let target = fs::read_link(e.path()).ok()?;
            let info = fs::read_to_string(format!(
                "/proc/{pid}/fdinfo/{}",
                e.file_name().to_string_lossy()
            ))
            .ok()?;
            let flags = info
                .lines()
                .find_map(|l| l.strip_prefix("flags:"))
                .and_then(|f| i32::from_str_radix(f.trim(), 8).ok())?;
            Some((target.to_string_lossy().into_owned(), flags))
        })
        .collect()
}

/// A descriptor a FUSE daemon that writes nothing may hold.
fn allowed_fd(target: &str, flags: i32, sealed: &Path) -> Result<(), String> {
    let kernel = ["pipe:", "socket:", "anon_inode:"];
    if kernel.iter().any(|k| target.starts_with(k))
        || target == "/dev/fuse"
        || target == "/dev/null"
    {
        return Ok(());
    }
    let read_only = flags & libc::O_ACCMODE == libc::O_RDONLY;
    if Path::new(target).starts_with(sealed) && read_only {
        return Ok(());
    }
    // The kernel's own state (the memory guard reads /proc/meminfo and the cgroup's files),
    // which holds no storage: read-only, it cannot take a byte anywhere.
    if (target.starts_with("/proc/") || target.starts_with("/sys/")) && read_only {
        return Ok(());
    }
    Err(format!("{target} (flags {flags:o})"))
}

#[test]
fn nothing_plain_reaches_a_disk_during_a_full_read() {
    let s = Sample::new(KEY, 512, 4, Some(Version::V2), |_| {});
    let view = s.view();
    let m = s.mount_fuse(&["--cache-size", "64M"]);
    let pid = m.pid;
    let before = proc_io(pid);
    let seen = Arc::new(Mutex::new(BTreeSet::new()));
    let stop = Arc::new(AtomicBool::new(false));
    let watcher = {
        let (seen, stop) = (seen.clone(), stop.clone());
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                seen.lock().unwrap().extend(fds(pid));
                std::thread::sleep(Duration::from_millis(2));
            }
        })
    };
    let mut total = 0usize;
    for round in 0..3 {
        for (rel, want) in &view {
            let got = match round {
                0 => fs::read(m.path(rel)).unwrap(),
                1 => read_direct(&m.path(rel)).unwrap(),
                _ => mmap_read(&m.path(rel)),
            };
            assert!(got == *want, "round {round}: {rel} differs");
            total += got.len();
        }
    }
    stop.store(true, Ordering::Relaxed);
    watcher.join().unwrap();
    let after = proc_io(pid);
    let written = after["write_bytes"] - before["write_bytes"];
    eprintln!(
        "read {total} bytes through the mount; daemon write_bytes +{written}, wchar +{} (replies on /dev/fuse), \
         descriptors seen: {:?}",
        after["wchar"] - before["wchar"],
        seen.lock().unwrap()
    );
    assert_eq!(
        written, 0,
        "the daemon caused {written} bytes to be written to storage"
    );
    let bad: Vec<String> = seen
        .lock()
        .unwrap()
        .iter()
        .filter_map(|(t, f)| allowed_fd(t, *f, &s.sealed()).err())
        .collect();
    assert!(
        bad.is_empty(),
        "descriptors other than the sealed files and /proc, /sys read-only, /dev/fuse, pipes and sockets: {bad:?}"
    );
    // No writable file mappings either.
    let maps = fs::read_to_string(format!("/proc/{pid}/maps")).unwrap();
    for line in maps.lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        if f.len() >= 6 && f[5].starts_with('/') && f[1].starts_with("rw") && f[1].ends_with('s') {
            panic!("shared writable file mapping: {line}");
        }
    }
    m.assert_alive("after the full reads");
}

fn mmap_read(path: &Path) -> Vec<u8> {
    let f = File::open(path).unwrap();
    if f.metadata().unwrap().len() == 0 {
        return Vec::new();
    }
    // SAFETY: a private read-only mapping of a file held open while it is read.
    let map = unsafe { memmap2::MmapOptions::new().map_copy_read_only(&f) }
        .unwrap_or_else(|e| panic!("mmap {}: {e}", path.display()));
    map.to_vec()
}

// ---------------------------------------------------------------------------------------
// Key hygiene
// ---------------------------------------------------------------------------------------

fn b64(bytes: &[u8]) -> String {
    use base64::Engine;
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

/// Forms of the key worth searching for: raw, hex, base64.
fn key_forms() -> Vec<Vec<u8>> {
    vec![
        KEY.to_vec(),
        hex::encode(KEY).into_bytes(),
        b64(&KEY).into_bytes(),
    ]
}

fn contains(hay: &[u8], needle: &[u8]) -> bool {
    hay.windows(needle.len()).any(|w| w == needle)
}

#[test]
fn key_never_in_the_daemon_argv() {
    let s = Sample::small(KEY);
    let m = s.mount_fuse(&[]);
    let cmdline = fs::read(format!("/proc/{}/cmdline", m.pid)).unwrap();
    for form in key_forms() {
        assert!(
            !contains(&cmdline, &form),
            "the key is in the daemon's argv"
        );
    }
    // The command line takes no key value at all: only a file name.
    let help = Command::new(kllm_mount_bin())
        .arg("--help")
        .output()
        .unwrap();
    let help = String::from_utf8_lossy(&help.stdout);
    assert!(help.contains("--key <FILE>"), "{help}");
}

/// A passphrase key file of KEY at a cheap scrypt cost (n = 2^10).
fn passphrase_key_file(path: &Path, phrase: &str) {
    use aes_gcm::aead::{Aead, KeyInit, Payload};
    let salt = [0x51u8; 16];
    let nonce = [0x52u8; 12];
    let mut doc = serde_json::json!({
        "cipher": {"name": "aes-256-gcm", "nonce": b64(&nonce)},
        "fingerprint": key().fingerprint(),
        "format": "kllm-key",
        "kdf": {"n": 1024, "name": "scrypt", "p": 1, "r": 8, "salt": b64(&salt)},
        "version": 1,
    });
    let aad = kllm_mount::pyjson::dumps_sorted(&doc);
    let mut kek = [0u8; 32];
    scrypt::scrypt(
        phrase.as_bytes(),
        &salt,
        &scrypt::Params::new(10, 8, 1, 32).unwrap(),
        &mut kek,
    )
    .unwrap();
    let ct = aes_gcm::Aes256Gcm::new_from_slice(&kek)
        .unwrap()
        .encrypt(
            aes_gcm::Nonce::from_slice(&nonce),
            Payload {
                msg: &KEY,
                aad: aad.as_bytes(),
            },
        )
        .unwrap();
    doc["ciphertext"] = b64(&ct).into();
    fs::write(path, serde_json::to_string_pretty(&doc).unwrap()).unwrap();
}

/// The key and the passphrase are read from the environment, then scrubbed: not in
/// /proc/PID/environ of the daemon, not passed on to anything it starts.
#[test]
fn key_and_passphrase_not_left_in_the_daemon_environment() {
    let s = Sample::small(KEY);
    let hexed = hex::encode(KEY);
    let m = Mounted::fuse::<&OsStr>(&s.sealed(), &[], |c| {
        c.env("KLLM_MODEL_KEY", &hexed);
    });
    let env = fs::read(format!("/proc/{}/environ", m.pid)).unwrap();
    assert!(
        !contains(&env, b"KLLM_MODEL_KEY"),
        "KLLM_MODEL_KEY in the daemon's environment"
    );
    assert!(
        !contains(&env, hexed.as_bytes()),
        "the key in the daemon's environment"
    );
    drop(m);

    let phrase = "correct horse battery staple";
    let kf = s.root().join("pass.key");
    passphrase_key_file(&kf, phrase);
    let m = Mounted::fuse(&s.sealed(), &[OsStr::new("--key"), kf.as_os_str()], |c| {
        c.env("KLLM_PASSPHRASE", phrase);
    });
    let env = fs::read(format!("/proc/{}/environ", m.pid)).unwrap();
    assert!(
        !contains(&env, phrase.as_bytes()),
        "the passphrase in the daemon's environment"
    );
}

/// A crash of the daemon (SIGABRT; SIGSEGV sent from outside is swallowed by Rust's
/// stack-overflow handler) under an unlimited core size must leave no core file: the daemon
/// is not dumpable (PR_SET_DUMPABLE 0). Were a core written, it is searched for the key and
/// for decoded weights, for the message.
#[test]
fn daemon_is_not_dumpable_and_writes_no_core() {
    let pattern = fs::read_to_string("/proc/sys/kernel/core_pattern").unwrap_or_default();
    if pattern.starts_with('|') || pattern.trim().is_empty() {
        eprintln!(
            "skipped: core_pattern {pattern:?} pipes cores to a handler; cannot look at them"
        );
        return;
    }
    let s = Sample::new(KEY, 128, 2, Some(Version::V2), |_| {});
    let rel = locked_shards(&s.sealed())[0].clone();
    let want = s.view()[&rel].clone();
    let m = Mounted::fuse(
        &s.sealed(),
        &[OsStr::new("--key"), s.key_file().as_os_str()],
        |c| {
            // SAFETY: setrlimit in the child before exec; async-signal-safe.
            unsafe {
                c.pre_exec(|| {
                    let lim = libc::rlimit {
                        rlim_cur: libc::RLIM_INFINITY,
                        rlim_max: libc::RLIM_INFINITY,
                    };
                    libc::setrlimit(libc::RLIMIT_CORE, &lim);
                    Ok(())
                });
            }
        },
    );
    assert_eq!(read_direct(&m.path(&rel)).unwrap(), want);
    let cwd = fs::read_link(format!("/proc/{}/cwd", m.pid)).unwrap();
    kill(m.pid, libc::SIGABRT);
    assert!(
        wait_gone(m.pid, Duration::from_secs(20)).is_some(),
        "daemon survived SIGABRT"
    );
    std::thread::sleep(Duration::from_millis(200));
    let cores: Vec<PathBuf> = fs::read_dir(&cwd)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.file_name().unwrap().to_string_lossy().starts_with("core"))
        .collect();
    if let Some(core) = cores.first() {
        let bytes = fs::read(core).unwrap();
        let ds = data_start(&want);
        let sample = &want[ds + 1000..ds + 1064];
        let has_key = key_forms().iter().any(|f| contains(&bytes, f));
        let has_plain = contains(&bytes, sample);
        panic!(
            "the daemon wrote a core file {} ({} bytes; holds the key: {has_key}, decoded weights: {has_plain})",
            core.display(),
            bytes.len()
        );
    }
}

/// Decoded bytes live in locked pages (root may lock; a user under a small RLIMIT_MEMLOCK
/// gets a warning) marked MADV_DONTDUMP.
#[test]
fn decoded_buffers_are_locked_in_memory() {
    let s = Sample::new(KEY, 512, 4, Some(Version::V2), |_| {});
    let m = s.mount_fuse(&["--cache-size", "64M"]);
    for rel in locked_shards(&s.sealed()) {
        read_direct(&m.path(&rel)).unwrap();
    }
    let status = fs::read_to_string(format!("/proc/{}/status", m.pid)).unwrap();
    let vmlck: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmLck:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap();
    assert!(vmlck >= 1024, "VmLck {vmlck} kB after decoding several MiB");
    let smaps = fs::read_to_string(format!("/proc/{}/smaps", m.pid)).unwrap();
    assert!(
        smaps
            .lines()
            .any(|l| l.starts_with("VmFlags:") && l.contains(" dd")),
        "no mapping is excluded from core dumps (MADV_DONTDUMP)"
    );
}

/// Where locking is not allowed (no CAP_IPC_LOCK, RLIMIT_MEMLOCK of 64 KiB), the daemon
/// warns once and still serves every byte.
#[test]
fn memory_lock_refused_gives_a_warning_and_still_serves() {
    if Command::new("setpriv").arg("--help").output().is_err() {
        eprintln!("skipped: no setpriv");
        return;
    }
    let s = Sample::new(KEY, 256, 2, Some(Version::V2), |_| {});
    let view = s.view();
    let log = s.root().join("daemon.log");
    let key_file = s.key_file();
    let args: Vec<&OsStr> = vec![
        OsStr::new("--key"),
        key_file.as_os_str(),
        OsStr::new("--log-file"),
        log.as_os_str(),
    ];
    let m = Mounted::fuse(&s.sealed(), &args, |c| {
        // Re-run the same command line under setpriv without CAP_IPC_LOCK.
        let mut wrapped = Command::new("setpriv");
        wrapped
            .args(["--inh-caps=-ipc_lock", "--bounding-set=-ipc_lock", "--"])
            .arg(c.get_program())
            .args(c.get_args());
        for (k, v) in c.get_envs() {
            match v {
                Some(v) => wrapped.env(k, v),
                None => wrapped.env_remove(k),
            };
        }
        if let Some(d) = c.get_current_dir() {
            wrapped.current_dir(d);
        }
        wrapped
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        // SAFETY: setrlimit between fork and exec.
        unsafe {
            wrapped.pre_exec(|| {
                let lim = libc::rlimit {
                    rlim_cur: 64 << 10,
                    rlim_max: 64 << 10,
                };
                libc::setrlimit(libc::RLIMIT_MEMLOCK, &lim);
                Ok(())
            });
        }
        *c = wrapped;
    });
    for (rel, want) in &view {
        assert!(read_direct(&m.path(rel)).unwrap() == *want, "{rel}");
        // A read that cuts a block goes through the daemon's cache, whose pages it tries
        // to lock.
        if want.len() > 200 {
            let got = pread(&open_direct(&m.path(rel)), 100, 100).unwrap();
            assert!(got == want[100..200], "{rel} [100, 200)");
        }
    }
    let status = fs::read_to_string(format!("/proc/{}/status", m.pid)).unwrap();
    let caps = status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .map(|v| u64::from_str_radix(v.trim(), 16).unwrap())
        .unwrap();
    // CAP_IPC_LOCK is capability 14.
    assert_eq!(caps & (1 << 14), 0, "the daemon still has CAP_IPC_LOCK");
    let text = fs::read_to_string(&log).unwrap_or_default();
    let warnings = text.matches("cannot lock").count();
    assert_eq!(
        warnings, 1,
        "expected one warning about locking in {text:?}"
    );
}

// ---------------------------------------------------------------------------------------
// Passphrase key files as Python hashes them (finding F6, fixed)
// ---------------------------------------------------------------------------------------

/// Each text written back as Python 3 prints `json.dumps(json.loads(text), sort_keys=True)`
/// (`dumps_sorted_text`, as a passphrase key file's associated data is made); `dumps_sorted`
/// of the parsed `Value` gives the same wherever a `Value` holds the number exactly.
fn dumps_as_python(cases: &[(&str, &str)], value_exact: bool) {
    for (text, python) in cases {
        let dumped = kllm_mount::pyjson::dumps_sorted_text(text);
        assert_eq!(dumped.as_deref(), Some(*python), "{text}");
        if value_exact {
            let v: serde_json::Value = serde_json::from_str(text).unwrap();
            assert_eq!(kllm_mount::pyjson::dumps_sorted(&v), *python, "{text}");
        }
    }
}

#[test]
fn python_json_floats_match_python() {
    // Floats parsed exactly (serde_json's float_roundtrip), then written as Python's repr.
    dumps_as_python(
        &[
            ("[1.2345e+29]", "[1.2345e+29]"),
            (
                "[0.1, 2.5e-08, 1e+16, 123456789.125]",
                "[0.1, 2.5e-08, 1e+16, 123456789.125]",
            ),
            ("[2.2250738585072014e-308]", "[2.2250738585072014e-308]"),
        ],
        true,
    );
}

/// Integers beyond 64 bits, which Python keeps exact and a `serde_json::Value` holds as
/// floats (its `arbitrary_precision` feature would keep them, but it breaks numbers under
/// `serde(flatten)`, which the safetensors header parser uses): written from their text.
/// The expected strings are Python 3's output.
#[test]
fn python_json_big_integers_match_python() {
    dumps_as_python(
        &[
            (
                "[123450000000000000000768276196]",
                "[123450000000000000000768276196]",
            ),
            ("[18446744073709551616]", "[18446744073709551616]"),
            (
                r#"{"b": -98765432109876543210987654321, "a": [0, -0, 1E2, 1e400, -0.0, 5e-324]}"#,
                r#"{"a": [0, 0, 100.0, Infinity, -0.0, 5e-324], "b": -98765432109876543210987654321}"#,
            ),
            (
                r#"{ "z" : { "\u00e9": 1, "e": 2 } , "z": {"k": 340282366920938463463374607431768211456}}"#,
                r#"{"z": {"k": 340282366920938463463374607431768211456}}"#,
            ),
        ],
        false,
    );
}
