//! Watching a mounted daemon from a test: a mount that logs at debug level to a file, what
//! that log says, its `--status` counters, waiting for a condition to come true, and
//! processes reading a file of it side by side.

use std::fs;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use kllm_mount::testkit::{kllm_mount_bin, run, stderr_of, Mnt};
use serde_json::Value;

use super::sample::Sample;

/// Of `stored` bytes put into the kernel's page cache ahead of any open, how many a test lets
/// its reads still take from the daemon: proactive reclaim may page out single cold pages
/// between the store and the read. These VMs run a DAMON `pageout` scheme over physical
/// memory (`/sys/kernel/mm/damon/admin/kdamonds`), which took single pages of a shard stored
/// seconds before: 4-8 KiB reads at scattered offsets in the daemon's log, about 1 run in 8.
/// A sixteenth: without the store every byte would come from the daemon.
pub fn reclaim_allowance(stored: u64) -> u64 {
    stored / 16
}

/// Mount `s` in the background with `--key` and a debug log at `log`, plus `extra`; the
/// daemon's pid.
pub fn mount_logged(s: &Sample, m: &Mnt, log: &Path, extra: &[&str]) -> i32 {
    let mut c = m.cmd(&s.sealed());
    c.arg("--key")
        .arg(s.key_file())
        .arg("--log-file")
        .arg(log)
        .args(extra)
        .env("RUST_LOG", "kllm_mount=debug");
    m.mount(c)
}

/// The lines of the log at `log` that contain `needle` (none while it does not exist).
pub fn log_lines(log: &Path, needle: &str) -> Vec<String> {
    fs::read_to_string(log)
        .unwrap_or_default()
        .lines()
        .filter(|l| l.contains(needle))
        .map(str::to_string)
        .collect()
}

/// How many times the log says `rel` was decoded whole (a passthrough copy).
pub fn decodes_of(log: &Path, rel: &str) -> usize {
    log_lines(log, &format!("{rel}: decoded ")).len()
}

/// Retry `f` for up to `secs`; fails naming `what` if it never holds.
pub fn wait_for(secs: u64, what: &str, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(secs);
    while !f() {
        assert!(Instant::now() < deadline, "{what}: not within {secs} s");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// `kllm-mount --status MOUNTPOINT`: the status object (docs/STATUS.md).
pub fn status(m: &Mnt) -> Value {
    let mut c = Command::new(kllm_mount_bin());
    c.arg("--status").arg(&m.mp);
    let out = run(c);
    assert!(out.status.success(), "--status: {}", stderr_of(&out));
    serde_json::from_slice(&out.stdout).unwrap()
}

/// The counter `name` of the status object.
pub fn counter(m: &Mnt, name: &str) -> u64 {
    count(&status(m), name)
}

/// The counter `name` of status object `st`; fails showing `st` where it has none.
pub fn count(st: &Value, name: &str) -> u64 {
    st[name]
        .as_u64()
        .unwrap_or_else(|| panic!("no counter {name} in {st}"))
}

/// `n` processes comparing `path` with `want` (`cmp`) side by side; whether every one found
/// them equal.
pub fn cmp_side_by_side(n: usize, path: &Path, want: &Path) -> bool {
    let readers: Vec<_> = (0..n)
        .map(|_| {
            Command::new("cmp")
                .arg(path)
                .arg(want)
                .stdout(Stdio::null())
                .spawn()
                .unwrap()
        })
        .collect();
    // Every one waited for, even after one that failed.
    let ok: Vec<bool> = readers
        .into_iter()
        .map(|mut r| r.wait().unwrap().success())
        .collect();
    ok.into_iter().all(|ok| ok)
}
