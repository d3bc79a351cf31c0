//! Remote sources for real: every fixture case served by a real S3 server on 127.0.0.1
//! (moto_server), mounted as `s3://BUCKET/PREFIX` and over plain HTTP through the same
//! server's object URLs with a manifest, in both serving modes, byte-exact against its
//! expected view; faults injected by a loopback proxy (5xx, resets, stalls, short bodies, an
//! object replaced while mounted) giving exact bytes or EIO; mount-time errors as one line;
//! credentials kept out of logs, `--status` and the mount table; the node cache; the remote
//! counters of `--status` (GETs, retries, failures, bytes fetched, node-cache lookups).
//!
//! Needs moto_server (tests/common/s3server.rs says where it is looked for): without it each
//! test skips with a message, except under CI, where it fails.
#![cfg(feature = "remote")]

mod common;

use std::fs::{self, File};
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use common::faultproxy::{Fault, FaultProxy, Rule};
use common::s3server::{manifest_of, S3Server, ACCESS_KEY, SECRET_KEY};
use common::*;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::Value;

const BUCKET: &str = "kllm-fixtures";
const SESSION_TOKEN: &str = "kllmTestSessionToken/AlsoNeverLogged9876";
const EIO: i32 = libc::EIO;

/// The server with every fixture case under `s3/<case>` (its sealed directory as it is) and
/// `http/<case>` (with a manifest of its files, for the HTTP source), or `None` to skip.
fn server_with_fixtures() -> Option<S3Server> {
    let server = S3Server::start()?;
    server.make_bucket(BUCKET);
    for case in fixture_cases() {
        server.put_tree(BUCKET, &format!("s3/{}", case.name), &case.sealed(), &[]);
        if case.ok() {
            let skip = ["kllm.key", "kllm-manifest.json"];
            server.put_tree(
                BUCKET,
                &format!("http/{}", case.name),
                &case.sealed(),
                &skip,
            );
            server.put(
                BUCKET,
                &format!("http/{}/kllm-manifest.json", case.name),
                &manifest_of(&case.sealed(), &skip),
            );
        }
    }
    Some(server)
}

/// The URL of `case` as the HTTP source reads it: its files beside a manifest of them.
fn http_url(server: &S3Server, case: &Case) -> String {
    server.object_url(BUCKET, &format!("http/{}", case.name))
}

/// A manifest of `case`'s sealed files (its key left out) in which `wrong` has another
/// digest, written into `dir`; its path.
fn manifest_with_wrong_digest(case: &Case, wrong: &str, dir: &Path) -> std::path::PathBuf {
    let skip = ["kllm.key", "kllm-manifest.json"];
    let mut doc: Value = serde_json::from_slice(&manifest_of(&case.sealed(), &skip)).unwrap();
    doc["files"][wrong] = Value::String("00".repeat(32));
    let path = dir.join("bad-manifest.json");
    fs::write(&path, serde_json::to_vec(&doc).unwrap()).unwrap();
    path
}

/// Each of `case`'s sealed files served (its key left out), with its length.
fn served_files(case: &Case) -> Vec<(String, u64)> {
    fs::read_dir(case.sealed())
        .unwrap()
        .map(|e| e.unwrap())
        .filter(|e| e.file_name() != "kllm.key")
        .map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            (name, e.metadata().unwrap().len())
        })
        .collect()
}

/// Mounted in `mode` under a manifest in which shard 2 has another digest: that shard
/// fails with EIO (twice, once its verdict is in when `after_check_ahead`), and its
/// neighbour reads byte-exact.
fn a_wrong_digest_refuses_its_shard_alone(
    case: &Case,
    url: &str,
    mode: &str,
    after_check_ahead: bool,
) {
    let keep = tempfile::tempdir().unwrap();
    let bad = manifest_with_wrong_digest(case, "model-00002-of-00005.safetensors", keep.path());
    let m = Mnt::new();
    mount_remote(
        &m,
        url,
        case,
        &["--manifest", bad.to_str().unwrap(), "--mode", mode],
    );
    if after_check_ahead {
        wait_for(30, "the bad shard's verdict", || {
            counter(&m, "failed_files") == 1
        });
    }
    for _ in 0..2 {
        assert_eq!(
            errno_of(
                fs::read(m.path("model-00002-of-00005.safetensors")),
                "a shard not matching the manifest"
            ),
            EIO
        );
    }
    let want = fs::read(case.view().join("model-00003-of-00005.safetensors")).unwrap();
    assert!(fs::read(m.path("model-00003-of-00005.safetensors")).unwrap() == want);
}

/// `kllm-mount URL MP` with the test credentials and no other AWS setting from outside.
fn remote_cmd(m: &Mnt, url: &str) -> Command {
    let mut c = m.cmd(Path::new(url));
    for (k, _) in std::env::vars_os() {
        if k.to_string_lossy().starts_with("AWS_") {
            c.env_remove(k);
        }
    }
    c.env("AWS_ACCESS_KEY_ID", ACCESS_KEY)
        .env("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
        .env("AWS_SESSION_TOKEN", SESSION_TOKEN)
        .env("AWS_REGION", "us-east-1");
    c
}

/// Mount `url` with the case's key and `args`; what the command wrote to stderr.
fn mount_remote(m: &Mnt, url: &str, case: &Case, args: &[&str]) -> String {
    let (key_args, env) = case.key_setup();
    let mut c = remote_cmd(m, url);
    c.args(&key_args).args(args).envs(env);
    m.mount_reporting(c).1
}

/// The whole view compared with the case's expected one, then random ranges through
/// `O_DIRECT` (every read reaches the daemon unless the kernel serves it by passthrough).
fn assert_view(case: &Case, m: &Mnt, label: &str, seed: u64) {
    let want = tree(&case.view());
    assert_eq!(
        tree(&m.mp).into_keys().collect::<Vec<_>>(),
        want.keys().cloned().collect::<Vec<_>>(),
        "{label}: file list"
    );
    let mut rng = StdRng::seed_from_u64(seed);
    for (rel, path) in &want {
        let exp = fs::read(path).unwrap();
        let got = fs::read(m.path(rel)).unwrap_or_else(|e| panic!("{label} {rel}: {e}"));
        assert_same_file(&format!("{label} {rel}"), &got, &exp);
        assert!(got == exp, "{label} {rel}: not byte-exact");
        let f = File::open(m.path(rel)).unwrap();
        for _ in 0..8 {
            let off = rng.gen_range(0..=exp.len() as u64);
            let len = rng.gen_range(1..=(exp.len() as u64 - off).clamp(1, 300_000)) as usize;
            drop_page_cache(&f);
            let got = pread(&f, off, len).unwrap_or_else(|e| panic!("{label} {rel} @{off}: {e}"));
            let hi = (off as usize + len).min(exp.len());
            assert!(
                got == exp[off as usize..hi],
                "{label} {rel}: bytes {off}+{len} differ"
            );
        }
    }
}

/// A refusal: exit 1, one line `kllm-mount: ...`, nothing mounted; the line.
fn assert_refused(m: &Mnt, c: Command, what: &str) -> String {
    let t0 = Instant::now();
    let out = run(c);
    let err = stderr_of(&out);
    assert_eq!(
        out.status.code(),
        Some(1),
        "{what}: exit status; stderr {err:?}"
    );
    assert!(
        err.starts_with("kllm-mount: ") && err.ends_with('\n') && err.matches('\n').count() == 1,
        "{what}: not one line: {err:?}"
    );
    assert!(!is_mounted(&m.mp), "{what}: refused but mounted");
    assert!(pids_with_arg(&m.mp).is_empty(), "{what}: a process is left");
    assert!(
        t0.elapsed() < Duration::from_secs(60),
        "{what}: took {:?} to refuse",
        t0.elapsed()
    );
    err
}

#[test]
fn every_fixture_from_s3_in_both_modes() {
    let Some(server) = server_with_fixtures() else {
        return;
    };
    let endpoint = server.endpoint();
    for case in fixture_cases() {
        let url = format!("s3://{BUCKET}/s3/{}", case.name);
        if !case.ok() {
            let m = Mnt::new();
            let (key_args, env) = case.key_setup();
            let mut c = remote_cmd(&m, &url);
            c.args(&key_args)
                .args(["--endpoint-url", &endpoint])
                .envs(env);
            let err = assert_refused(&m, c, &case.name);
            case.assert_error_names(&err, &err);
            continue;
        }
        for (i, mode) in ["fuse", "passthrough"].iter().enumerate() {
            let m = Mnt::new();
            mount_remote(
                &m,
                &url,
                &case,
                &["--endpoint-url", &endpoint, "--mode", mode],
            );
            assert_view(
                &case,
                &m,
                &format!("s3 --mode {mode} {}", case.name),
                i as u64,
            );
        }
    }
}

#[test]
fn a_verified_passthrough_load_downloads_each_file_once() {
    // A fill of a remote file hashes the bytes it fetches for the manifest check, instead
    // of the check reading the file again: one download of the model, not two.
    let Some(server) = server_with_fixtures() else {
        return;
    };
    let case = case("llm_v2");
    let url = http_url(&server, &case);
    let m = Mnt::new();
    mount_remote(&m, &url, &case, &["--mode", "passthrough"]);
    assert_view(&case, &m, "http passthrough, checked", 30);
    let st = status(&m);
    let n = |k: &str| count(&st, k);
    let served: u64 = served_files(&case).iter().map(|(_, len)| len).sum();
    assert!(n("verified_files") >= 5, "the shards were checked: {st}");
    assert_eq!(n("failed_files"), 0, "{st}");
    assert!(
        n("remote_bytes_fetched") < served + served / 2,
        "{} bytes fetched for {served} bytes of files: {st}",
        n("remote_bytes_fetched")
    );
    drop(m);

    // The digest fed by the fill is judged as any other: a shard that does not match its
    // manifest digest fails with EIO, and its neighbours still read.
    a_wrong_digest_refuses_its_shard_alone(&case, &url, "passthrough", false);
}

#[test]
fn a_fuse_mount_under_a_manifest_downloads_a_shard_checked_ahead_once() {
    // Through FUSE, check ahead hashes each remote shard from the bytes it also decodes into
    // the kernel's page cache: read after its check, a shard is not downloaded again.
    let Some(server) = server_with_fixtures() else {
        return;
    };
    let case = case("llm_v2");
    let url = http_url(&server, &case);
    let sizes = served_files(&case);
    let shards: u64 = sizes
        .iter()
        .filter(|(n, _)| n.ends_with(".safetensors"))
        .map(|(_, len)| len)
        .sum();
    let m = Mnt::new();
    mount_remote(&m, &url, &case, &["--mode", "fuse"]);
    wait_for(30, "every shard checked and stored ahead", || {
        let st = status(&m);
        st["failed_files"].as_u64() != Some(0) || st["bytes_stored_ahead"].as_u64() >= Some(shards)
    });
    let st = status(&m);
    let n = |k: &str| count(&st, k);
    assert_eq!(n("failed_files"), 0, "{st}");
    // Each file hashed once (the small ones then read again); the shards not fetched again
    // to be stored (hashed, then fetched ahead, they came in twice: 521 against 270 kB).
    let fetched_at_check = n("remote_bytes_fetched");
    assert!(
        fetched_at_check < n("verified_bytes") + shards / 2,
        "{fetched_at_check} bytes fetched to check and store {shards} bytes of shards: {st}"
    );
    for (name, _) in sizes.iter().filter(|(n, _)| n.ends_with(".safetensors")) {
        let want = fs::read(case.view().join(name)).unwrap();
        assert!(
            fs::read(m.path(name)).unwrap() == want,
            "{name}: not byte-exact"
        );
    }
    let st = status(&m);
    let read_shards = count(&st, "remote_bytes_fetched") - fetched_at_check;
    assert!(
        read_shards < shards / 2,
        "the shards ({shards} bytes) fetched again by their reads: {read_shards} bytes: {st}"
    );
    // Every file exact, and ranges of each through O_DIRECT (decoded by the daemon).
    assert_view(&case, &m, "http fuse, checked ahead", 41);
    drop(m);

    // A shard opened the moment the mount is up is taken by check ahead next, hashed and
    // stored from one download, instead of hashed by the open and downloaded again.
    let m = Mnt::new();
    mount_remote(&m, &url, &case, &["--mode", "fuse"]);
    let first = "model-00001-of-00005.safetensors";
    let want = fs::read(case.view().join(first)).unwrap();
    assert!(
        fs::read(m.path(first)).unwrap() == want,
        "{first}: not byte-exact"
    );
    wait_for(30, "every shard, the first one too, stored ahead", || {
        counter(&m, "bytes_stored_ahead") >= shards
    });
    let st = status(&m);
    let n = |k: &str| count(&st, k);
    assert!(
        n("remote_bytes_fetched") < n("verified_bytes") + shards / 2,
        "{} bytes fetched for {shards} bytes of shards: {st}",
        n("remote_bytes_fetched")
    );
    drop(m);

    // A shard that does not match its manifest digest is refused, whatever was decoded of
    // it ahead; its neighbours read.
    a_wrong_digest_refuses_its_shard_alone(&case, &url, "fuse", true);
}

#[test]
fn every_fixture_over_http_with_a_manifest() {
    let Some(server) = server_with_fixtures() else {
        return;
    };
    for case in fixture_cases().into_iter().filter(|c| c.ok()) {
        let url = http_url(&server, &case);
        for (i, mode) in ["fuse", "passthrough"].iter().enumerate() {
            let m = Mnt::new();
            mount_remote(&m, &url, &case, &["--mode", mode]);
            assert_view(
                &case,
                &m,
                &format!("http --mode {mode} {}", case.name),
                10 + i as u64,
            );
        }
    }
    // The manifest from a local file instead, for a server that has none: the s3/ copy.
    let case = case("llm_v2");
    let m = Mnt::new();
    let manifest = m.scratch().join("kllm-manifest.json");
    fs::write(&manifest, manifest_of(&case.sealed(), &["kllm.key"])).unwrap();
    let url = server.object_url(BUCKET, "s3/llm_v2");
    mount_remote(
        &m,
        &url,
        &case,
        &[
            "--manifest",
            manifest.to_str().unwrap(),
            "--verify",
            "mount",
        ],
    );
    assert_view(&case, &m, "http --manifest FILE --verify mount", 20);
    drop(m);
    // The manifest is checked as for a local directory: one file that does not match fails
    // with EIO on open (--verify open), or refuses the mount (--verify mount).
    let keep = tempfile::tempdir().unwrap();
    let bad = manifest_with_wrong_digest(&case, "generation_config.json", keep.path());
    let m = Mnt::new();
    mount_remote(
        &m,
        &url,
        &case,
        &["--manifest", bad.to_str().unwrap(), "--mode", "fuse"],
    );
    assert_eq!(
        errno_of(
            fs::read(m.path("generation_config.json")),
            "a file not matching the manifest"
        ),
        libc::EIO
    );
    assert!(fs::read(m.path("config.json")).is_ok());
    drop(m);
    let m = Mnt::new();
    let mut c = remote_cmd(&m, &url);
    c.args(["--key", case.dir.join("kllm.key").to_str().unwrap()])
        .args(["--manifest", bad.to_str().unwrap(), "--verify", "mount"]);
    let err = assert_refused(&m, c, "--verify mount with a file not matching");
    assert!(err.contains("generation_config.json"), "{err}");
    // Without either: one line naming where the manifest was looked for.
    let m = Mnt::new();
    let mut c = remote_cmd(&m, &url);
    c.args(["--key", case.dir.join("kllm.key").to_str().unwrap()]);
    let err = assert_refused(&m, c, "http without a manifest");
    assert!(err.contains("kllm-manifest.json"), "{err}");
}

/// Through FUSE without check ahead a file under a manifest is hashed whole before its
/// first byte, then downloaded again by its reads: the mount says so, with what avoids it,
/// and says nothing where check ahead hashes and stores each shard from one download, a
/// node cache keeps the first download, nothing is checked, or passthrough's fill hashes
/// what it downloads.
#[test]
fn a_fuse_mount_under_a_manifest_says_each_file_is_downloaded_twice() {
    let Some(server) = server_with_fixtures() else {
        return;
    };
    let case = case("llm_v2");
    let url = http_url(&server, &case);
    let said = |args: &[&str]| mount_remote(&Mnt::new(), &url, &case, args);
    let err = said(&["--mode", "fuse", "--no-decode-ahead"]);
    assert!(
        err.starts_with("kllm-mount: warning: ")
            && err.contains("downloaded twice")
            && err.contains("--cache-dir"),
        "{err:?}"
    );
    let cache = tempfile::tempdir().unwrap();
    let quiet = [
        vec!["--mode", "fuse"],
        vec![
            "--mode",
            "fuse",
            "--no-decode-ahead",
            "--cache-dir",
            cache.path().to_str().unwrap(),
        ],
        vec!["--mode", "fuse", "--no-decode-ahead", "--verify", "off"],
    ];
    for args in &quiet {
        let err = said(args);
        assert!(!err.contains("downloaded twice"), "{args:?}: {err:?}");
    }
    if rustix::process::geteuid().is_root() {
        let err = said(&["--mode", "passthrough"]);
        assert!(!err.contains("downloaded twice"), "passthrough: {err:?}");
    }
}

#[test]
fn an_http_source_follows_redirects_to_where_the_bytes_are() {
    // A hub answers each file's URL with a redirect to its CDN, HEADs and ranged GETs alike.
    let Some(server) = S3Server::start() else {
        return;
    };
    server.make_bucket(BUCKET);
    let case = case("llm_v2");
    let skip = ["kllm.key", "kllm-manifest.json"];
    server.put_tree(BUCKET, "http/m", &case.sealed(), &skip);
    server.put(
        BUCKET,
        "http/m/kllm-manifest.json",
        &manifest_of(&case.sealed(), &skip),
    );
    // The CDN signs its URLs; some of its answers fail, so errors naming them are logged.
    let cdn = FaultProxy::start(server.addr);
    let hub = FaultProxy::start(server.addr);
    hub.add(Rule::new(
        "",
        Fault::Redirect(cdn.endpoint(), "?hub-token=tok3n".into()),
        usize::MAX,
    ));
    let url = format!("{}/{BUCKET}/http/m", hub.endpoint());
    for (i, mode) in ["fuse", "passthrough"].iter().enumerate() {
        let m = Mnt::new();
        let log = m.scratch().join("daemon.log");
        cdn.add(Rule::new("", Fault::Status(500), 9).ranged());
        mount_remote(
            &m,
            &url,
            &case,
            &["--mode", mode, "--log-file", log.to_str().unwrap()],
        );
        assert_view(
            &case,
            &m,
            &format!("redirected, --mode {mode}"),
            30 + i as u64,
        );
        let log = fs::read_to_string(&log).unwrap();
        drop(m);
        assert!(log.contains("asking again"), "errors were logged: {log}");
        assert!(!log.contains("tok3n"), "the log shows a signed URL: {log}");
        cdn.clear();
    }
    // The manifest, a HEAD a file and the data's GETs: all sent on by the hub.
    let files = tree(&case.view()).len();
    assert!(
        hub.fired() > files && hub.fired() == hub.requests() && cdn.requests() >= hub.fired(),
        "redirected {} of {} requests ({files} files), {} at the CDN",
        hub.fired(),
        hub.requests(),
        cdn.requests()
    );
}

/// The llm_v2 case alone, behind a fault proxy, parts of 64 KiB so one file is many GETs.
struct Faulty {
    server: S3Server,
    proxy: FaultProxy,
    case: Case,
}

fn faulty() -> Option<Faulty> {
    let server = S3Server::start()?;
    server.make_bucket(BUCKET);
    let case = case("llm_v2");
    server.put_tree(BUCKET, "m", &case.sealed(), &[]);
    let proxy = FaultProxy::start(server.addr);
    Some(Faulty {
        server,
        proxy,
        case,
    })
}

impl Faulty {
    /// Mount through the proxy in FUSE mode, without the decoded-block cache, parts of 4 KiB
    /// (so a shard is many GETs); `--source-timeout 4` unless `extra` sets one.
    fn mount(&self, m: &Mnt, extra: &[&str]) {
        let endpoint = self.proxy.endpoint();
        let mut args = vec![
            "--endpoint-url",
            &endpoint,
            "--mode",
            "fuse",
            "--cache-size",
            "0",
        ]
        .into_iter()
        .chain(["--part-size", "4K"])
        .map(str::to_string)
        .collect::<Vec<_>>();
        if !extra.contains(&"--source-timeout") {
            args.extend(["--source-timeout".to_string(), "4".to_string()]);
        }
        args.extend(extra.iter().map(|s| s.to_string()));
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        mount_remote(m, &format!("s3://{BUCKET}/m"), &self.case, &args);
    }

    fn expected(&self, rel: &str) -> Vec<u8> {
        fs::read(self.case.view().join(rel)).unwrap()
    }
}

/// Read a whole file with O_DIRECT in 1 MiB requests; the bytes, or the first error's errno.
fn read_direct(path: &Path) -> Result<Vec<u8>, i32> {
    let f = open_direct(path);
    let mut out = Vec::new();
    loop {
        match pread_direct_aligned(&f, out.len() as u64, 1 << 20) {
            Ok(b) if b.is_empty() => return Ok(out),
            Ok(b) => out.extend_from_slice(&b),
            Err(e) => return Err(e.raw_os_error().unwrap_or(0)),
        }
    }
}

#[test]
fn faults_give_exact_bytes_or_eio() {
    let Some(w) = faulty() else {
        return;
    };
    let m = Mnt::new();
    w.mount(&m, &[]);
    let shard = |i: u32| format!("model-0000{i}-of-00005.safetensors");

    // Passing faults: 5xx and throttling, resets, short bodies. Retried; exact bytes.
    w.proxy
        .add(Rule::new(&shard(1), Fault::Status(503), 3).ranged());
    w.proxy
        .add(Rule::new(&shard(1), Fault::Status(500), 2).ranged());
    w.proxy.add(Rule::new(&shard(2), Fault::Reset, 3).ranged());
    w.proxy
        .add(Rule::new(&shard(3), Fault::Truncate(1000), 3).ranged());
    w.proxy
        .add(Rule::new(&shard(3), Fault::Status(429), 2).ranged());
    for i in 1..=3 {
        let got =
            read_direct(&m.path(&shard(i))).unwrap_or_else(|e| panic!("{}: errno {e}", shard(i)));
        assert!(
            got == w.expected(&shard(i)),
            "{}: not byte-exact after faults",
            shard(i)
        );
    }
    assert_eq!(w.proxy.fired(), 13, "every injected fault was met");

    // `--status` counts what the source was asked: every part of the three shards at least
    // once, and for each fault another GET of its part, or that part given up.
    let st = status(&m);
    let n = |k: &str| count(&st, k);
    let sealed: Vec<u64> = (1..=3)
        .map(|i| fs::metadata(w.case.sealed().join(shard(i))).unwrap().len())
        .collect();
    let parts: u64 = sealed.iter().map(|len| len.div_ceil(4096)).sum();
    assert!(
        n("remote_bytes_fetched") >= sealed.iter().sum::<u64>(),
        "bytes fetched {} < the shards' {sealed:?}",
        n("remote_bytes_fetched")
    );
    assert!(
        n("remote_gets") >= parts + n("remote_get_retries"),
        "GETs: {st}"
    );
    assert!(
        n("remote_get_retries") + n("remote_get_failures") >= 13,
        "retries: {st}"
    );
    assert_eq!(
        (n("node_cache_hits"), n("node_cache_misses")),
        (0, 0),
        "no node cache"
    );
    let failures = n("remote_get_failures");

    // A stall: EIO within the bound, never a hang.
    w.proxy.add(
        Rule::new(
            &shard(4),
            Fault::Stall(Duration::from_secs(600)),
            usize::MAX,
        )
        .ranged(),
    );
    let t0 = Instant::now();
    assert_eq!(
        read_direct(&m.path(&shard(4))),
        Err(EIO),
        "a stalled source"
    );
    assert!(
        t0.elapsed() < Duration::from_secs(30),
        "EIO took {:?}",
        t0.elapsed()
    );
    assert!(
        counter(&m, "remote_get_failures") > failures,
        "the stalled part is not counted as failed"
    );

    // A source that stays unreachable: EIO within the bound; served again once it is back.
    w.proxy.clear();
    w.proxy.add(Rule::new("", Fault::Reset, usize::MAX));
    let t0 = Instant::now();
    assert_eq!(
        read_direct(&m.path(&shard(5))),
        Err(EIO),
        "an unreachable source"
    );
    assert!(
        t0.elapsed() < Duration::from_secs(30),
        "EIO took {:?}",
        t0.elapsed()
    );
    w.proxy.clear();
    for i in [4, 5] {
        let got =
            read_direct(&m.path(&shard(i))).unwrap_or_else(|e| panic!("{}: errno {e}", shard(i)));
        assert!(
            got == w.expected(&shard(i)),
            "{}: not byte-exact once back",
            shard(i)
        );
    }
}

#[test]
fn an_object_replaced_while_mounted_fails_with_eio() {
    let Some(w) = faulty() else {
        return;
    };
    let m = Mnt::new();
    w.mount(&m, &[]);
    let rel = "model-00002-of-00005.safetensors";
    let want = w.expected(rel);
    assert!(want.len() > 8 * 4096, "the shard spans several parts");
    let f = open_direct(&m.path(rel));
    let head = pread_direct_aligned(&f, 0, 4096).unwrap();
    assert!(head == want[..4096]);
    // Another version of the object, same length: the bytes must not be served.
    let mut other = fs::read(w.case.sealed().join(rel)).unwrap();
    let n = other.len();
    other[n - 1] ^= 0xff;
    other[n / 2] ^= 0xff;
    w.server.put(BUCKET, &format!("m/{rel}"), &other);
    assert_eq!(
        errno_of(
            pread_direct_aligned(&f, (n / 2) as u64 & !4095, 4096),
            "read after the replace"
        ),
        EIO
    );
    // From then on every read of it fails, also of parts fetched before.
    assert_eq!(
        errno_of(pread_direct_aligned(&f, 0, 4096), "read of an old part"),
        EIO
    );
    // Other files are served as before.
    let other_rel = "config.json";
    assert!(read_direct(&m.path(other_rel)).unwrap() == w.expected(other_rel));
}

#[test]
fn mount_time_errors_are_one_line_and_leave_nothing_mounted() {
    let Some(w) = faulty() else {
        return;
    };
    let key = w.case.dir.join("kllm.key");
    let key = key.to_str().unwrap();
    let endpoint = w.server.endpoint();
    let refuse = |url: &str, args: &[&str], what: &str| -> String {
        let m = Mnt::new();
        let mut c = remote_cmd(&m, url);
        c.args(["--key", key]).args(args);
        let err = assert_refused(&m, c, what);
        assert!(
            !err.contains(SECRET_KEY) && !err.contains(SESSION_TOKEN),
            "{what}: {err}"
        );
        err
    };
    let err = refuse(
        "s3://no-such-bucket/m",
        &["--endpoint-url", &endpoint],
        "no bucket",
    );
    assert!(
        err.contains("s3://no-such-bucket/m") && err.contains("NoSuchBucket"),
        "{err}"
    );
    let err = refuse(
        &format!("s3://{BUCKET}/nothing-here"),
        &["--endpoint-url", &endpoint],
        "empty prefix",
    );
    assert!(err.contains("no objects"), "{err}");
    let closed_port = common::s3server::ClosedPort::new();
    let closed = format!("http://127.0.0.1:{}", closed_port.port);
    let err = refuse(
        &format!("s3://{BUCKET}/m"),
        &["--endpoint-url", &closed, "--source-timeout", "3"],
        "bad endpoint",
    );
    assert!(err.contains(&format!("s3://{BUCKET}/m")), "{err}");
    w.proxy.add(Rule::new("", Fault::Status(403), usize::MAX));
    let err = refuse(
        &format!("s3://{BUCKET}/m"),
        &[
            "--endpoint-url",
            &w.proxy.endpoint(),
            "--source-timeout",
            "3",
        ],
        "access denied",
    );
    assert!(
        err.contains("403") || err.to_lowercase().contains("denied"),
        "{err}"
    );
    w.proxy.clear();
    // The wrong model key, named by its fingerprint as for a local directory.
    let other = case("kllm_v2").dir.join("kllm.key");
    let m = Mnt::new();
    let mut c = remote_cmd(&m, &format!("s3://{BUCKET}/m"));
    c.args([
        "--endpoint-url",
        &endpoint,
        "--key",
        other.to_str().unwrap(),
    ]);
    let err = assert_refused(&m, c, "wrong key");
    assert!(err.contains("fingerprint"), "{err}");
    // Credentials in a URL are refused, not shown.
    let err = refuse(
        "https://user:pw@127.0.0.1:1/m",
        &[],
        "credentials in the URL",
    );
    assert!(!err.contains("pw@"), "{err}");
    let err = refuse(
        "https://[127.0.0.1/m?X-Amz-Signature=tok3n",
        &[],
        "a URL that does not parse",
    );
    assert!(err.contains("not a URL") && !err.contains("tok3n"), "{err}");
    // So are they in the endpoint, from the flag or the environment, which every error
    // naming a request would repeat.
    let with_user = endpoint.replacen("://", "://user:pw@", 1);
    let err = refuse(
        &format!("s3://{BUCKET}/m"),
        &["--endpoint-url", &with_user],
        "credentials in the endpoint",
    );
    assert!(err.contains("endpoint") && !err.contains("pw@"), "{err}");
    let m = Mnt::new();
    let mut c = remote_cmd(&m, &format!("s3://{BUCKET}/m"));
    c.args(["--key", key])
        .env("AWS_ENDPOINT_URL", format!("{endpoint}/?token=tok3n"));
    let err = assert_refused(&m, c, "a token in AWS_ENDPOINT_URL");
    assert!(err.contains("endpoint") && !err.contains("tok3n"), "{err}");
}

#[test]
fn credentials_never_show() {
    let Some(w) = faulty() else {
        return;
    };
    let m = Mnt::new();
    let log = m.scratch().join("daemon.log");
    let mut c = remote_cmd(&m, &format!("s3://{BUCKET}/m"));
    c.args(["--key", w.case.dir.join("kllm.key").to_str().unwrap()])
        .args([
            "--endpoint-url",
            &w.proxy.endpoint(),
            "--log-file",
            log.to_str().unwrap(),
        ])
        .args(["--mode", "fuse", "--source-timeout", "3"])
        .env("RUST_LOG", "trace");
    let pid = m.mount(c);
    // Some failures too, so errors are logged.
    w.proxy.add(Rule::new("", Fault::Status(500), 4).ranged());
    for (rel, _) in tree(&w.case.view()) {
        let _ = read_direct(&m.path(&rel));
    }
    let mut status = Command::new(kllm_mount_bin());
    status.arg("--status").arg(&m.mp);
    let status = run(status);
    assert!(status.status.success(), "{}", stderr_of(&status));
    let shown = [
        ("the log", fs::read_to_string(&log).unwrap()),
        (
            "--status",
            String::from_utf8_lossy(&status.stdout).into_owned(),
        ),
        (
            "the mount table",
            fs::read_to_string("/proc/self/mountinfo").unwrap(),
        ),
        (
            "the daemon's command line",
            String::from_utf8_lossy(&fs::read(format!("/proc/{pid}/cmdline")).unwrap())
                .into_owned(),
        ),
        (
            "the daemon's environment",
            String::from_utf8_lossy(&fs::read(format!("/proc/{pid}/environ")).unwrap())
                .into_owned(),
        ),
    ];
    assert!(
        shown[0].1.len() > 100,
        "the log has lines: {:?}",
        shown[0].1
    );
    for (what, text) in &shown {
        for secret in [SECRET_KEY, SESSION_TOKEN] {
            assert!(!text.contains(secret), "{what} shows a credential");
        }
    }
    for (rel, _) in tree(&m.mp) {
        let bytes = fs::read(m.path(&rel)).unwrap();
        assert!(
            !bytes
                .windows(SECRET_KEY.len())
                .any(|w| w == SECRET_KEY.as_bytes()),
            "the view shows a credential in {rel}"
        );
    }
}

#[test]
fn the_node_cache_serves_a_remount_without_downloading() {
    let Some(w) = faulty() else {
        return;
    };
    let cache = tempfile::tempdir().unwrap();
    let cache_dir = cache.path().to_str().unwrap();
    let files: Vec<String> = tree(&w.case.view()).into_keys().collect();
    {
        let m = Mnt::new();
        w.mount(&m, &["--cache-dir", cache_dir]);
        for rel in &files {
            assert!(
                read_direct(&m.path(rel)).unwrap() == w.expected(rel),
                "{rel}"
            );
        }
        // An empty cache at first: every part not found there was fetched.
        let st = status(&m);
        assert!(st["node_cache_misses"].as_u64() > Some(0), "{st}");
        assert!(
            st["remote_gets"].as_u64() >= st["node_cache_misses"].as_u64(),
            "{st}"
        );
        assert!(st["remote_bytes_fetched"].as_u64() > Some(0), "{st}");
    }
    // Every data GET now fails: a remount with the cache reads it all, one without cannot.
    w.proxy
        .add(Rule::new("", Fault::Status(500), usize::MAX).ranged());
    let m = Mnt::new();
    w.mount(&m, &["--cache-dir", cache_dir]);
    for rel in &files {
        assert!(
            read_direct(&m.path(rel)).unwrap() == w.expected(rel),
            "{rel} from the cache"
        );
    }
    // Every part from the cache, nothing downloaded.
    let st = status(&m);
    assert!(st["node_cache_hits"].as_u64() > Some(0), "{st}");
    let zero = Value::from(0);
    assert_eq!(
        (
            &st["node_cache_misses"],
            &st["remote_gets"],
            &st["remote_bytes_fetched"]
        ),
        (&zero, &zero, &zero),
        "{st}"
    );
    drop(m);
    // Without it the mount cannot even read the metadata: one line, nothing mounted.
    let m = Mnt::new();
    let endpoint = w.proxy.endpoint();
    let mut c = remote_cmd(&m, &format!("s3://{BUCKET}/m"));
    c.args(["--key", w.case.dir.join("kllm.key").to_str().unwrap()])
        .args(["--endpoint-url", &endpoint, "--source-timeout", "2"]);
    let err = assert_refused(&m, c, "every GET failing, no cache");
    assert!(err.contains("config.json"), "{err}");
    drop(m);
    // A damaged cache file is fetched again, never served.
    w.proxy.clear();
    let parts = cache.path().join("kllm-parts-v1");
    for e in fs::read_dir(&parts).unwrap() {
        let p = e.unwrap().path();
        let mut b = fs::read(&p).unwrap();
        b[0] ^= 1;
        fs::write(&p, b).unwrap();
    }
    let m = Mnt::new();
    w.mount(&m, &["--cache-dir", cache_dir]);
    for rel in &files {
        assert!(
            read_direct(&m.path(rel)).unwrap() == w.expected(rel),
            "{rel} past a damaged cache"
        );
    }
}

#[test]
fn an_aws_profile_gives_keys_region_and_endpoint() {
    let Some(w) = faulty() else {
        return;
    };
    let m = Mnt::new();
    let aws = m.home.join(".aws");
    fs::create_dir_all(&aws).unwrap();
    fs::write(
        aws.join("credentials"),
        format!(
            "[kllmtest]\naws_access_key_id = {ACCESS_KEY}\naws_secret_access_key = {SECRET_KEY}\n"
        ),
    )
    .unwrap();
    fs::write(
        aws.join("config"),
        format!(
            "[profile kllmtest]\nregion = us-east-1\nendpoint_url = {}\n",
            w.server.endpoint()
        ),
    )
    .unwrap();
    let mut c = remote_cmd(&m, &format!("s3://{BUCKET}/m"));
    c.env_remove("AWS_ACCESS_KEY_ID")
        .env_remove("AWS_SECRET_ACCESS_KEY")
        .env_remove("AWS_SESSION_TOKEN")
        .env_remove("AWS_REGION")
        .env("AWS_PROFILE", "kllmtest")
        .args([
            "--key",
            w.case.dir.join("kllm.key").to_str().unwrap(),
            "--mode",
            "fuse",
        ]);
    m.mount(c);
    assert_view(&w.case, &m, "AWS_PROFILE", 30);
}

#[test]
fn the_key_sources_work_on_a_remote_source() {
    let Some(w) = faulty() else {
        return;
    };
    let endpoint = w.server.endpoint();
    // The key shipped beside the sealed files, in the bucket.
    w.server.put(
        BUCKET,
        "with-key/kllm.key",
        &fs::read(w.case.dir.join("kllm.key")).unwrap(),
    );
    w.server.put_tree(BUCKET, "with-key", &w.case.sealed(), &[]);
    let m = Mnt::new();
    let mut c = remote_cmd(&m, &format!("s3://{BUCKET}/with-key"));
    c.args(["--endpoint-url", &endpoint, "--mode", "fuse"]);
    m.mount(c);
    assert_view(&w.case, &m, "kllm.key in the bucket", 40);
    drop(m);
    // KLLM_MODEL_KEY, and no key file anywhere.
    let m = Mnt::new();
    let hex = fs::read_to_string(w.case.dir.join("key.hex")).unwrap();
    let mut c = remote_cmd(&m, &format!("s3://{BUCKET}/m"));
    c.args(["--endpoint-url", &endpoint, "--mode", "fuse"])
        .env("KLLM_MODEL_KEY", hex.trim());
    m.mount(c);
    assert_view(&w.case, &m, "KLLM_MODEL_KEY", 41);
    drop(m);
    // None: one line naming where a key was looked for.
    let m = Mnt::new();
    let mut c = remote_cmd(&m, &format!("s3://{BUCKET}/m"));
    c.args(["--endpoint-url", &endpoint]);
    let err = assert_refused(&m, c, "no key");
    assert!(err.contains(&format!("s3://{BUCKET}/m/kllm.key")), "{err}");
}

#[test]
fn a_mount_reads_only_the_headers_of_its_shards() {
    // Each shard's header comes by one small GET, all shards at once: a mount that fetched
    // a whole part per shard, one shard after another, would wait for a model's first
    // parts before it answers.
    let Some(server) = server_with_fixtures() else {
        return;
    };
    let sample = Sample::new([7; 32], 256, 8, Some(kllm_mount::lock::Version::V2), |_| {});
    server.put_tree(BUCKET, "big", &sample.sealed(), &[]);
    let files = tree(&sample.sealed());
    let shards: Vec<u64> = files
        .iter()
        .filter(|(rel, _)| rel.ends_with(".safetensors"))
        .map(|(_, p)| fs::metadata(p).unwrap().len())
        .collect();
    let others: u64 = files
        .iter()
        .filter(|(rel, _)| !rel.ends_with(".safetensors"))
        .map(|(_, p)| fs::metadata(p).unwrap().len())
        .sum();
    let prefix = 64u64 << 10;
    assert!(
        shards.iter().sum::<u64>() > 8 * prefix * shards.len() as u64,
        "shards large enough to tell headers from whole parts: {shards:?}"
    );

    let m = Mnt::new();
    let mut c = remote_cmd(&m, &format!("s3://{BUCKET}/big"));
    c.args(["--endpoint-url", &server.endpoint()])
        .args(["--key", sample.key_file().to_str().unwrap()])
        .args(["--mode", "fuse", "--no-decode-ahead"]);
    m.mount(c);
    let st = status(&m);
    let fetched = count(&st, "remote_bytes_fetched");
    let bound = others + prefix * shards.len() as u64;
    assert!(
        fetched <= bound,
        "{fetched} bytes fetched at mount, more than {bound} (the small files and 64 KiB of \
         each of {} shards): {st}",
        shards.len()
    );
    for (rel, want) in sample.view() {
        let got = fs::read(m.path(&rel)).unwrap();
        assert!(
            got == want,
            "{rel}: the view differs after a header-only mount"
        );
    }
}

/// A sample of several shards put under a prefix of the server, for the fetch-ahead tests:
/// what fetch ahead brings in and stores, and FUSE mounts of it.
struct AheadSample {
    sample: Sample,
    view: std::collections::BTreeMap<String, Vec<u8>>,
    shards: Vec<(String, u64)>,
    /// The shards' sealed bytes, and their view's.
    sealed: u64,
    decoded: u64,
    /// One part a shard: with smaller parts the kernel's readahead, whose reads reach the
    /// daemon out of order, can have a window fetch a part again that later reads already
    /// read through (harmless, and not seen with parts much larger than its reads: 69 GETs
    /// for 64 parts and the mount's own, reading 512 MiB in 8 MiB parts).
    part: u64,
    url: String,
}

impl AheadSample {
    fn put(server: &S3Server, key: [u8; 32], prefix: &str) -> AheadSample {
        let sample = Sample::new(key, 128, 4, Some(kllm_mount::lock::Version::V2), |_| {});
        server.put_tree(BUCKET, prefix, &sample.sealed(), &[]);
        let view = sample.view();
        let shards = sample.sealed_shards();
        assert!(shards.len() >= 2, "shards: {shards:?}");
        let sealed = shards.iter().map(|(_, len)| len).sum();
        let decoded = shards.iter().map(|(rel, _)| view[rel].len() as u64).sum();
        let largest = shards.iter().map(|(_, len)| *len).max().unwrap();
        AheadSample {
            sample,
            view,
            shards,
            sealed,
            decoded,
            part: largest.next_power_of_two().max(4096),
            url: format!("s3://{BUCKET}/{prefix}"),
        }
    }

    /// Mounted through FUSE with one part a shard, `parts` parts of `--source-memory` (half
    /// of them kept for reading ahead), and `extra`.
    fn mount_fuse(&self, server: &S3Server, parts: u64, extra: &[&str]) -> Mnt {
        let m = Mnt::new();
        let mut c = remote_cmd(&m, &self.url);
        c.args(["--endpoint-url", &server.endpoint()])
            .args(["--key", self.sample.key_file().to_str().unwrap()])
            .args(["--mode", "fuse"])
            .args(["--part-size", &format!("{}K", self.part / 1024)])
            .args(["--source-memory", &format!("{}K", parts * self.part / 1024)])
            .args(extra);
        m.mount(c);
        m
    }

    /// Every shard read through `m`, byte-exact: the GETs sent and the bytes served by the
    /// daemon meanwhile.
    fn read_shards(&self, m: &Mnt, label: &str) -> (u64, u64) {
        let n = |name: &str| counter(m, name);
        let (gets, served) = (n("remote_gets"), n("bytes_served"));
        for (rel, _) in &self.shards {
            let got = fs::read(m.path(rel)).unwrap();
            assert!(got == self.view[rel], "{rel}: not byte-exact ({label})");
        }
        (n("remote_gets") - gets, n("bytes_served") - served)
    }
}

#[test]
fn fuse_mode_fetches_the_shards_ahead_of_their_first_open() {
    // Through FUSE with nothing to hash first, a mount fetches its shards' parts right
    // after mounting (within the memory kept for reading ahead) and decodes them into the
    // kernel's page cache, so an engine that opens them seconds later reads them without a
    // GET, and without the daemon. With --no-decode-ahead it does neither.
    let Some(server) = server_with_fixtures() else {
        return;
    };
    let a = AheadSample::put(&server, [9; 32], "early");
    for ahead in [false, true] {
        // Room to read every part ahead: half of the source's memory.
        let parts = 4 * a.shards.len() as u64;
        let off: &[&str] = if ahead { &[] } else { &["--no-decode-ahead"] };
        let m = a.mount_fuse(&server, parts, off);
        let n = |name: &str| counter(&m, name);
        if ahead {
            wait_for(30, "every shard decoded ahead", || {
                n("bytes_stored_ahead") == a.decoded
            });
            assert_eq!(n("bytes_fetched_ahead"), a.sealed);
        } else {
            std::thread::sleep(Duration::from_millis(500));
            assert_eq!(n("bytes_fetched_ahead"), 0, "--no-decode-ahead");
        }
        let (sent, served) = a.read_shards(&m, &format!("ahead: {ahead}"));
        if ahead {
            assert_eq!(sent, 0, "GETs sent for shards fetched ahead");
            assert_eq!(served, 0, "bytes read through the daemon");
        } else {
            assert!(
                sent > 0,
                "--no-decode-ahead: the shards were read without a GET"
            );
        }
    }
}

#[test]
fn fuse_mode_fetch_ahead_stores_more_shards_than_its_memory_holds() {
    // The parts fetched ahead are memory only until they are decoded into the kernel's page
    // cache: with room for one part read ahead, every shard is still fetched and stored
    // ahead, each step asked again once the one before it was stored, and the reads then
    // need neither a GET nor the daemon.
    let Some(server) = server_with_fixtures() else {
        return;
    };
    let a = AheadSample::put(&server, [7; 32], "tight");
    // Half of it is kept for reading ahead: one part.
    let m = a.mount_fuse(&server, 2, &[]);
    let n = |name: &str| counter(&m, name);
    wait_for(30, "every shard decoded ahead", || {
        n("bytes_stored_ahead") == a.decoded
    });
    assert_eq!(n("bytes_fetched_ahead"), a.sealed);
    let (sent, served) = a.read_shards(&m, "one part of memory");
    assert_eq!(sent, 0, "GETs sent for shards stored ahead");
    assert_eq!(served, 0, "bytes read through the daemon");
}
