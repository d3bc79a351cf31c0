//! Giving memory back before the kernel takes the process.
//!
//! What the daemon holds only for speed (decoded shards kept after their last close, the
//! FUSE path's cached blocks) can be let go at any time; shards open in passthrough mode,
//! and what other processes in the same cgroup use, cannot. A watcher thread compares what
//! counts against the limit and cannot be reclaimed ([`Limits::usage`]) with a high
//! watermark and, past it, asks the daemon to give back enough to get under a low one.
//!
//! A watermark and not the kernel's pressure signals, because those fire on the wrong
//! thing. Measured on cgroup v1 (kernel 6.18): a cgroup reading 1 GiB of files through a
//! 256 MiB limit raised 576 `low`, 23 `medium` and 21 `critical` events of
//! `memory.pressure_level` (and 1175 of `memory.failcnt`) with 8 MiB that could not be
//! reclaimed, nothing at risk; the same cgroup filling shared memory toward its limit, 16 MiB
//! at a time, raised no `medium` or `critical` event until the OOM kill itself. cgroup v2's
//! `memory.events` (`high`, `max`) count the same reclaim of page cache, and PSI measures
//! stalls that reclaiming page cache causes too. The charge less file pages is what an OOM
//! kill depends on, on both versions; polled every 100 ms it costs two small reads.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use crate::limits::Limits;

/// How often the watcher reads the usage.
pub const POLL: Duration = Duration::from_millis(100);

/// Past `high` the daemon gives back memory until it is under `low`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Watermarks {
    pub high: u64,
    pub low: u64,
}

impl Watermarks {
    /// For a limit with `headroom` kept for the daemon's own working memory: the budgets
    /// stay below `limit - headroom`, so past half the headroom someone else is using it.
    /// Giving back goes down to the full headroom.
    pub fn for_limit(limit: u64, headroom: u64) -> Watermarks {
        let headroom = headroom.min(limit);
        Watermarks {
            high: limit - headroom / 2,
            low: limit - headroom,
        }
    }

    /// Bytes that may still be taken before the high watermark, at `usage`.
    pub fn room(&self, usage: u64) -> u64 {
        self.high.saturating_sub(usage)
    }
}

/// Asked to free at least the given number of bytes; returns how many it freed.
pub type GiveBack = Box<dyn Fn(u64) -> u64 + Send>;

/// What the watcher saw, for `--status`.
#[derive(Debug, Default)]
pub struct PressureStats {
    /// Times usage went past the high watermark.
    pub episodes: AtomicU64,
    /// Bytes given back under pressure.
    pub given_back: AtomicU64,
    /// The last usage read.
    pub usage: AtomicU64,
}

/// The limit and its watermarks, shared by the watcher and by opens about to take memory
/// (a passthrough decode asks [`Guard::room_for`] first).
pub struct Guard {
    limits: Limits,
    marks: Watermarks,
    stats: PressureStats,
}

impl Guard {
    pub fn new(limits: Limits, marks: Watermarks) -> Guard {
        Guard {
            limits,
            marks,
            stats: PressureStats::default(),
        }
    }

    pub fn limits(&self) -> &Limits {
        &self.limits
    }

    pub fn marks(&self) -> Watermarks {
        self.marks
    }

    pub fn stats(&self) -> &PressureStats {
        &self.stats
    }

    /// What counts against the limit now and cannot be reclaimed (src/limits.rs).
    pub fn usage(&self) -> Option<u64> {
        let usage = self.limits.usage()?;
        self.stats.usage.store(usage, Ordering::Relaxed);
        Some(usage)
    }

    /// Whether `bytes` more stay under the high watermark now; yes when the usage cannot
    /// be read (the budgets alone then keep the limit).
    pub fn room_for(&self, bytes: u64) -> bool {
        self.shortfall(bytes) == 0
    }

    /// How much must be given back for `bytes` more to stay under the high watermark now.
    pub fn shortfall(&self, bytes: u64) -> u64 {
        self.usage()
            .map_or(0, |u| bytes.saturating_sub(self.marks.room(u)))
    }
}

/// One decision of the watcher: how much to ask for at `usage`, and whether a new episode
/// began (the first reading past `high` since usage was last under `low`).
#[derive(Debug, Default)]
struct Episodes {
    in_one: bool,
}

impl Episodes {
    fn step(&mut self, usage: u64, marks: Watermarks) -> Option<(u64, bool)> {
        if usage > marks.high {
            let new = !self.in_one;
            self.in_one = true;
            Some((usage - marks.low, new))
        } else {
            if usage <= marks.low {
                self.in_one = false;
            }
            None
        }
    }
}

/// The watcher thread; it stops when dropped.
pub struct Watcher {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Watcher {
    /// Watch `guard`'s limit every `every`, giving back past its watermarks. `None` when
    /// the usage cannot be read here (the limit is then kept by the budgets alone).
    pub fn start(guard: Arc<Guard>, every: Duration, give_back: GiveBack) -> Option<Watcher> {
        guard.usage()?;
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let stop = stop.clone();
            std::thread::Builder::new()
                .name("kllm-pressure".into())
                .spawn(move || watch(&guard, every, &give_back, &stop))
                .ok()?
        };
        Some(Watcher {
            stop,
            thread: Some(thread),
        })
    }
}

impl Drop for Watcher {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn watch(guard: &Guard, every: Duration, give_back: &GiveBack, stop: &AtomicBool) {
    let limit = guard.limits.effective();
    let stats = &guard.stats;
    let mut episodes = Episodes::default();
    while !stop.load(Ordering::Relaxed) {
        std::thread::sleep(every);
        let Some(usage) = guard.usage() else {
            continue;
        };
        let Some((ask, new)) = episodes.step(usage, guard.marks) else {
            continue;
        };
        let freed = give_back(ask);
        stats.given_back.fetch_add(freed, Ordering::Relaxed);
        if new {
            stats.episodes.fetch_add(1, Ordering::Relaxed);
            log::warn!(
                "memory pressure: {} MiB of the limit ({limit}) is in use and cannot be reclaimed; gave back {} MiB of kept shards and cached blocks",
                usage >> 20,
                freed >> 20
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limits::Rlimits;
    use std::path::Path;
    use std::sync::Mutex;

    const MIB: u64 = 1 << 20;

    #[test]
    fn watermarks_keep_the_headroom() {
        let m = Watermarks::for_limit(256 * MIB, 64 * MIB);
        assert_eq!((m.high, m.low), (224 * MIB, 192 * MIB));
        assert_eq!(m.room(200 * MIB), 24 * MIB);
        assert_eq!(m.room(300 * MIB), 0);
        assert_eq!(Watermarks::for_limit(MIB, 4 * MIB).low, 0);
    }

    #[test]
    fn episodes_begin_past_high_and_end_under_low() {
        let marks = Watermarks { high: 100, low: 80 };
        let mut e = Episodes::default();
        assert_eq!(e.step(100, marks), None);
        assert_eq!(e.step(120, marks), Some((40, true)));
        assert_eq!(e.step(110, marks), Some((30, false)));
        assert_eq!(e.step(90, marks), None, "between the marks: nothing asked");
        assert_eq!(
            e.step(101, marks),
            Some((21, false)),
            "still the same episode"
        );
        assert_eq!(e.step(80, marks), None);
        assert_eq!(e.step(101, marks), Some((21, true)));
    }

    /// A copy of a fixture tree whose usage the test changes while the watcher runs.
    fn fixture_copy(case: &str) -> tempfile::TempDir {
        let from = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/memory-limits")
            .join(case);
        let to = tempfile::tempdir().unwrap();
        let status = std::process::Command::new("cp")
            .arg("-a")
            .arg(format!("{}/.", from.display()))
            .arg(to.path())
            .status()
            .unwrap();
        assert!(status.success());
        to
    }

    #[test]
    fn the_watcher_gives_back_under_pressure() {
        let tree = fixture_copy("v2-namespace");
        let limits = Limits::read(tree.path(), Rlimits::default());
        assert_eq!(limits.effective().bytes, 512 * MIB);
        let asked = Arc::new(Mutex::new(Vec::new()));
        let guard = Arc::new(Guard::new(
            limits,
            Watermarks::for_limit(512 * MIB, 64 * MIB),
        ));
        // 140 MiB in use of a high mark at 480 MiB.
        assert!(guard.room_for(340 * MIB) && !guard.room_for(341 * MIB));
        assert_eq!(guard.shortfall(400 * MIB), 60 * MIB);
        let watcher = {
            let asked = asked.clone();
            Watcher::start(
                guard.clone(),
                Duration::from_millis(5),
                Box::new(move |n| {
                    asked.lock().unwrap().push(n);
                    n / 2
                }),
            )
            .expect("usage readable")
        };
        std::thread::sleep(Duration::from_millis(50));
        assert!(
            asked.lock().unwrap().is_empty(),
            "asked with 140 MiB in use"
        );
        // Another process in the cgroup takes 360 MiB more that cannot be reclaimed.
        let current = tree.path().join("sys/fs/cgroup/memory.current");
        std::fs::write(&current, (660 * MIB).to_string()).unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while asked.lock().unwrap().is_empty() {
            assert!(std::time::Instant::now() < deadline, "never asked");
            std::thread::sleep(Duration::from_millis(5));
        }
        // 500 MiB unreclaimable, the low mark at 448 MiB.
        assert_eq!(asked.lock().unwrap()[0], 52 * MIB);
        assert!(!guard.room_for(1), "past the high mark");
        std::fs::write(&current, (300 * MIB).to_string()).unwrap();
        std::thread::sleep(Duration::from_millis(50));
        drop(watcher);
        let stats = guard.stats();
        assert_eq!(stats.episodes.load(Ordering::Relaxed), 1);
        assert!(stats.given_back.load(Ordering::Relaxed) >= 26 * MIB);
        assert_eq!(stats.usage.load(Ordering::Relaxed), 140 * MIB);
    }
}
