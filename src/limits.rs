//! The memory this process may use, and where that number comes from: the least of the
//! machine's memory, its memory cgroup's limit and `RLIMIT_AS` / `RLIMIT_DATA`.
//!
//! Containers and units set their limit in the memory cgroup: cgroup v2's `memory.max`, or
//! its `memory.high`, past which the kernel throttles the cgroup (decoded data can be
//! neither swapped nor dropped, so the daemon would stall there for good); cgroup v1's
//! `memory.limit_in_bytes`, or the `hierarchical_memory_limit` an ancestor sets. The
//! process's cgroup is the path `/proc/self/cgroup` names, found where
//! `/proc/self/mountinfo` shows its hierarchy mounted: a container sees its own cgroup (or
//! its cgroup namespace's root) as the mount's root, so the path is taken relative to that.
//! Everything is read under a root directory, so tests read fixture trees.
//!
//! [`Limits::usage`] is what counts against the limit now and cannot be reclaimed: the
//! cgroup's charge less its file pages (page cache the kernel drops before it kills),
//! which is what the pressure watcher (src/pressure.rs) compares with the limit.

use std::fmt;
use std::path::{Path, PathBuf};

/// Values at or above this mean "no limit": cgroup v1 writes its unlimited as the largest
/// page count (9223372036854771712 with 4 KiB pages), cgroup v2 writes `max`.
const UNLIMITED: u64 = 1 << 62;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Version {
    V1,
    V2,
}

/// The process's memory cgroup, as this mount namespace shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cgroup {
    pub version: Version,
    /// Its directory, under the root it was read from.
    pub dir: PathBuf,
    /// Where its hierarchy is mounted: no ancestor above it is visible.
    top: PathBuf,
}

/// Where a limit comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Origin {
    /// `MemTotal` in /proc/meminfo.
    Machine,
    /// A memory cgroup's limit: the file as the process sees it, and for cgroup v1's
    /// hierarchical limit the key in it.
    Cgroup {
        file: PathBuf,
        key: Option<&'static str>,
    },
    /// `ulimit -v`.
    RlimitAs,
    /// `ulimit -d`.
    RlimitData,
}

impl fmt::Display for Origin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Origin::Machine => f.write_str("the machine's memory (MemTotal, /proc/meminfo)"),
            Origin::Cgroup { file, key: None } => {
                write!(f, "the memory cgroup's limit ({})", file.display())
            }
            Origin::Cgroup {
                file,
                key: Some(key),
            } => write!(f, "the memory cgroup's limit ({key} in {})", file.display()),
            Origin::RlimitAs => f.write_str("RLIMIT_AS (ulimit -v)"),
            Origin::RlimitData => f.write_str("RLIMIT_DATA (ulimit -d)"),
        }
    }
}

impl Origin {
    /// A short name for `--status`: `machine`, `cgroup`, `rlimit_as`, `rlimit_data`.
    pub fn kind(&self) -> &'static str {
        match self {
            Origin::Machine => "machine",
            Origin::Cgroup { .. } => "cgroup",
            Origin::RlimitAs => "rlimit_as",
            Origin::RlimitData => "rlimit_data",
        }
    }
}

/// A number of bytes and where it comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Limit {
    pub bytes: u64,
    pub source: Origin,
}

impl fmt::Display for Limit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} MiB, {}", self.bytes >> 20, self.source)
    }
}

/// The process's resource limits on memory (`None`: unlimited).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Rlimits {
    pub address_space: Option<u64>,
    pub data: Option<u64>,
}

impl Rlimits {
    pub fn of_this_process() -> Rlimits {
        let soft = |resource| {
            let mut r = libc::rlimit {
                rlim_cur: 0,
                rlim_max: 0,
            };
            // SAFETY: getrlimit fills the struct it is given.
            let ok = unsafe { libc::getrlimit(resource, &mut r) } == 0;
            (ok && r.rlim_cur != libc::RLIM_INFINITY).then_some(r.rlim_cur)
        };
        Rlimits {
            address_space: soft(libc::RLIMIT_AS),
            data: soft(libc::RLIMIT_DATA),
        }
    }
}

/// Every limit on the memory of this process, as read once.
#[derive(Debug, Clone)]
pub struct Limits {
    root: PathBuf,
    pub machine: u64,
    pub cgroup: Option<Cgroup>,
    /// The least limit of the cgroup and the ancestors it can see.
    pub cgroup_limit: Option<Limit>,
    pub rlimits: Rlimits,
}

impl Limits {
    pub fn of_this_process() -> Limits {
        Limits::read(Path::new("/"), Rlimits::of_this_process())
    }

    /// The limits seen under `root` (`/`, or a fixture tree) with the given rlimits.
    pub fn read(root: &Path, rlimits: Rlimits) -> Limits {
        let machine = meminfo(root, "MemTotal").unwrap_or_else(physical_memory);
        let cgroup = Cgroup::find(root);
        let cgroup_limit = cgroup.as_ref().and_then(|c| c.limit(root));
        Limits {
            root: root.to_path_buf(),
            machine,
            cgroup,
            cgroup_limit,
            rlimits,
        }
    }

    /// The memory the process may use: the least of all limits. On a tie the cgroup's
    /// limit is named, as the one an operator set.
    pub fn effective(&self) -> Limit {
        let candidates = [
            self.cgroup_limit.clone(),
            self.rlimits.address_space.map(|bytes| Limit {
                bytes,
                source: Origin::RlimitAs,
            }),
            self.rlimits.data.map(|bytes| Limit {
                bytes,
                source: Origin::RlimitData,
            }),
            Some(Limit {
                bytes: self.machine,
                source: Origin::Machine,
            }),
        ];
        candidates
            .into_iter()
            .flatten()
            .reduce(|least, l| if l.bytes < least.bytes { l } else { least })
            .expect("the machine's memory is always a candidate")
    }

    /// Bytes counted against the effective limit now that the kernel cannot reclaim: the
    /// cgroup's charge less its file pages; for the machine, what MemAvailable leaves; for
    /// the rlimits, the process's VmSize or VmData. `None` when it cannot be read.
    pub fn usage(&self) -> Option<u64> {
        match self.effective().source {
            Origin::Cgroup { file, .. } => {
                let cgroup = self.cgroup.as_ref()?;
                let dir = self.root.join(file.strip_prefix("/").ok()?);
                cgroup.unreclaimable(dir.parent()?)
            }
            Origin::Machine => {
                let available = meminfo(&self.root, "MemAvailable")?;
                Some(self.machine.saturating_sub(available))
            }
            Origin::RlimitAs => proc_status(&self.root, "VmSize"),
            Origin::RlimitData => proc_status(&self.root, "VmData"),
        }
    }

    /// The limits for `--status`.
    pub fn to_json(&self) -> serde_json::Value {
        let effective = self.effective();
        serde_json::json!({
            "bytes": effective.bytes,
            "source": effective.source.kind(),
            "from": effective.source.to_string(),
            "machine": self.machine,
            "cgroup": self.cgroup_limit.as_ref().map(|l| l.bytes),
            "rlimit_as": self.rlimits.address_space,
            "rlimit_data": self.rlimits.data,
        })
    }
}

impl Cgroup {
    /// The memory cgroup of this process under `root`: v1's memory hierarchy where one is
    /// mounted (hybrid machines keep memory there), else the unified v2 hierarchy. `None`
    /// when neither is mounted here or the process's cgroup lies outside what is mounted.
    pub fn find(root: &Path) -> Option<Cgroup> {
        let cgroups = std::fs::read_to_string(root.join("proc/self/cgroup")).ok()?;
        let mountinfo = std::fs::read_to_string(root.join("proc/self/mountinfo")).ok()?;
        let mut v1 = None;
        let mut v2 = None;
        for line in cgroups.lines() {
            let mut f = line.splitn(3, ':');
            let (Some(id), Some(controllers), Some(path)) = (f.next(), f.next(), f.next()) else {
                continue;
            };
            if controllers.split(',').any(|c| c == "memory") {
                v1 = Some(path);
            } else if id == "0" && controllers.is_empty() {
                v2 = Some(path);
            }
        }
        let (version, path) = match (v1, v2) {
            (Some(p), _) => (Version::V1, p),
            (None, Some(p)) => (Version::V2, p),
            (None, None) => return None,
        };
        let (top, rel) = mountinfo
            .lines()
            .filter_map(Mount::parse)
            .filter(|m| m.holds(version))
            .filter_map(|m| Some((m.root.len(), m.point, relative(path, &m.root)?)))
            .max_by_key(|(depth, ..)| *depth)
            .map(|(_, point, rel)| (root.join(point.trim_start_matches('/')), rel))?;
        let dir = top.join(rel);
        dir.is_dir().then_some(Cgroup { version, dir, top })
    }

    /// The least limit set on this cgroup and the ancestors visible from it.
    fn limit(&self, root: &Path) -> Option<Limit> {
        let shown = |file: &Path| Path::new("/").join(file.strip_prefix(root).unwrap_or(file));
        match self.version {
            Version::V1 => {
                let own = self.dir.join("memory.limit_in_bytes");
                let stat = self.dir.join("memory.stat");
                let candidates = [
                    read_bytes(&own).map(|b| (b, own, None)),
                    stat_value(&stat, "hierarchical_memory_limit")
                        .map(|b| (b, stat, Some("hierarchical_memory_limit"))),
                ];
                candidates
                    .into_iter()
                    .flatten()
                    .filter(|(b, ..)| *b < UNLIMITED)
                    .reduce(|least, c| if c.0 < least.0 { c } else { least })
                    .map(|(bytes, file, key)| Limit {
                        bytes,
                        source: Origin::Cgroup {
                            file: shown(&file),
                            key,
                        },
                    })
            }
            Version::V2 => {
                let mut least: Option<(u64, PathBuf)> = None;
                let mut dir = self.dir.as_path();
                loop {
                    for name in ["memory.max", "memory.high"] {
                        let file = dir.join(name);
                        if let Some(b) = read_bytes(&file).filter(|b| *b < UNLIMITED) {
                            if least.as_ref().is_none_or(|(l, _)| b < *l) {
                                least = Some((b, file));
                            }
                        }
                    }
                    if dir == self.top {
                        break;
                    }
                    match dir.parent() {
                        Some(p) if p.starts_with(&self.top) => dir = p,
                        _ => break,
                    }
                }
                least.map(|(bytes, file)| Limit {
                    bytes,
                    source: Origin::Cgroup {
                        file: shown(&file),
                        key: None,
                    },
                })
            }
        }
    }

    /// The charge of the cgroup at `dir` (this one or an ancestor) less its file pages.
    fn unreclaimable(&self, dir: &Path) -> Option<u64> {
        let (current, active, inactive) = match self.version {
            Version::V1 => (
                "memory.usage_in_bytes",
                "total_active_file",
                "total_inactive_file",
            ),
            Version::V2 => ("memory.current", "active_file", "inactive_file"),
        };
        let current = read_bytes(&dir.join(current))?;
        let stat = dir.join("memory.stat");
        let file =
            stat_value(&stat, active).unwrap_or(0) + stat_value(&stat, inactive).unwrap_or(0);
        Some(current.saturating_sub(file))
    }
}

/// One line of /proc/self/mountinfo: the mounted root, where, and the file system.
struct Mount {
    root: String,
    point: String,
    fstype: String,
    options: String,
}

impl Mount {
    /// `ID PARENT MAJ:MIN ROOT POINT OPTIONS [OPTIONAL...] - FSTYPE SOURCE SUPEROPTIONS`
    fn parse(line: &str) -> Option<Mount> {
        let (before, after) = line.split_once(" - ")?;
        let mut b = before.split(' ');
        let root = unescape(b.nth(3)?);
        let point = unescape(b.next()?);
        let mut a = after.split(' ');
        let fstype = a.next()?.to_string();
        let options = a.nth(1).unwrap_or("").to_string();
        Some(Mount {
            root,
            point,
            fstype,
            options,
        })
    }

    fn holds(&self, version: Version) -> bool {
        match version {
            Version::V1 => {
                self.fstype == "cgroup" && self.options.split(',').any(|o| o == "memory")
            }
            Version::V2 => self.fstype == "cgroup2",
        }
    }
}

/// `path` below `root`, as a relative path; `None` when it lies outside (a cgroup
/// namespace shows cgroups outside it as `/..`).
fn relative(path: &str, root: &str) -> Option<PathBuf> {
    let rel = Path::new(path).strip_prefix(root).ok()?;
    (!rel
        .components()
        .any(|c| c == std::path::Component::ParentDir))
    .then(|| rel.to_path_buf())
}

/// mountinfo writes space, tab, newline and backslash as octal escapes.
fn unescape(field: &str) -> String {
    let bytes = field.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let octal = bytes.get(i + 1..i + 4);
        if bytes[i] == b'\\' && octal.is_some_and(|o| o.iter().all(|b| (b'0'..=b'7').contains(b))) {
            let o = octal.expect("checked");
            out.push(o.iter().fold(0u8, |v, d| v.wrapping_mul(8) + (d - b'0')));
            i += 4;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// A number of bytes, or `max` (unlimited).
fn read_bytes(file: &Path) -> Option<u64> {
    let text = std::fs::read_to_string(file).ok()?;
    match text.trim() {
        "max" => Some(u64::MAX),
        t => t.parse().ok(),
    }
}

/// The value of `key` in a `KEY VALUE` file (memory.stat).
fn stat_value(file: &Path, key: &str) -> Option<u64> {
    let text = std::fs::read_to_string(file).ok()?;
    text.lines()
        .find_map(|l| l.strip_prefix(key)?.strip_prefix(' ')?.trim().parse().ok())
}

/// A `KEY: N kB` line of /proc/meminfo, in bytes.
fn meminfo(root: &Path, key: &str) -> Option<u64> {
    kib_line(&root.join("proc/meminfo"), key)
}

/// A `KEY: N kB` line of /proc/self/status, in bytes.
fn proc_status(root: &Path, key: &str) -> Option<u64> {
    kib_line(&root.join("proc/self/status"), key)
}

fn kib_line(file: &Path, key: &str) -> Option<u64> {
    let text = std::fs::read_to_string(file).ok()?;
    text.lines().find_map(|l| {
        let rest = l.strip_prefix(key)?.strip_prefix(':')?;
        let kib: u64 = rest.trim().strip_suffix("kB")?.trim().parse().ok()?;
        Some(kib << 10)
    })
}

fn physical_memory() -> u64 {
    // SAFETY: sysconf with valid names.
    let (pages, page) = unsafe {
        (
            libc::sysconf(libc::_SC_PHYS_PAGES),
            libc::sysconf(libc::_SC_PAGESIZE),
        )
    };
    pages.max(0) as u64 * page.max(0) as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    /// A fixture tree of tests/fixtures/memory-limits, read with no rlimit.
    fn limits_of(case: &str) -> Limits {
        limits_with(case, Rlimits::default())
    }

    fn limits_with(case: &str, rlimits: Rlimits) -> Limits {
        let root = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/memory-limits")
            .join(case);
        assert!(root.is_dir(), "{}", root.display());
        Limits::read(&root, rlimits)
    }

    fn cgroup_file(file: &str, key: Option<&'static str>) -> Origin {
        Origin::Cgroup {
            file: file.into(),
            key,
        }
    }

    #[test]
    fn cgroup_v1_on_a_hybrid_machine() {
        let l = limits_of("v1-hybrid");
        let c = l.cgroup.as_ref().expect("cgroup found");
        assert_eq!(c.version, Version::V1);
        assert!(c
            .dir
            .ends_with("sys/fs/cgroup/memory/process_api/c993373fbc013dc050e1bfc90becd4b1"));
        let file = "/sys/fs/cgroup/memory/process_api/c993373fbc013dc050e1bfc90becd4b1/memory.limit_in_bytes";
        assert_eq!(
            l.effective(),
            Limit {
                bytes: 256 * MIB,
                source: cgroup_file(file, None)
            }
        );
        assert_eq!(l.machine, 24683520 << 10);
        // Charged 192 MiB, of which 128 MiB are file pages the kernel can drop.
        assert_eq!(l.usage(), Some(64 * MIB));
        assert_eq!(
            l.effective().to_string(),
            format!("256 MiB, the memory cgroup's limit ({file})")
        );
    }

    #[test]
    fn cgroup_v1_container_limited_by_a_parent() {
        let l = limits_of("v1-container");
        let c = l.cgroup.as_ref().expect("cgroup found");
        assert!(
            c.dir.ends_with("sys/fs/cgroup/memory"),
            "{}",
            c.dir.display()
        );
        // memory.limit_in_bytes is v1's "unlimited"; the parent's limit binds.
        assert_eq!(
            l.effective(),
            Limit {
                bytes: 1024 * MIB,
                source: cgroup_file(
                    "/sys/fs/cgroup/memory/memory.stat",
                    Some("hierarchical_memory_limit")
                )
            }
        );
        assert_eq!(l.usage(), Some(80 * MIB));
    }

    #[test]
    fn cgroup_v2_namespace_memory_high_binds_before_memory_max() {
        let l = limits_of("v2-namespace");
        assert_eq!(l.cgroup.as_ref().unwrap().version, Version::V2);
        assert_eq!(
            l.effective(),
            Limit {
                bytes: 512 * MIB,
                source: cgroup_file("/sys/fs/cgroup/memory.high", None)
            }
        );
        // 300 MiB charged, 160 MiB of it file pages (shmem is not among them).
        assert_eq!(l.usage(), Some(140 * MIB));
    }

    #[test]
    fn cgroup_v2_the_slice_of_a_service_binds() {
        let l = limits_of("v2-systemd");
        assert!(l
            .cgroup
            .as_ref()
            .unwrap()
            .dir
            .ends_with("system.slice/kllm-mount@qwen3.service"));
        assert_eq!(
            l.effective(),
            Limit {
                bytes: 2048 * MIB,
                source: cgroup_file("/sys/fs/cgroup/system.slice/memory.max", None)
            }
        );
        // The slice's charge counts, not the service's alone: 1.5 GiB less 1 GiB of files.
        assert_eq!(l.usage(), Some(512 * MIB));
    }

    #[test]
    fn no_visible_cgroup_falls_back_to_the_machine() {
        for case in ["v2-outside-namespace", "no-cgroup-mounted"] {
            let l = limits_of(case);
            assert!(l.cgroup.is_none(), "{case}");
            assert_eq!(
                l.effective(),
                Limit {
                    bytes: 8 * 1024 * MIB,
                    source: Origin::Machine
                },
                "{case}"
            );
        }
        // MemTotal 8 GiB, MemAvailable 7000000 kB.
        assert_eq!(
            limits_of("no-cgroup-mounted").usage(),
            Some((8388608 - 7000000) << 10)
        );
    }

    #[test]
    fn rlimits_bind_when_they_are_the_least() {
        let rl = |address_space, data| Rlimits {
            address_space,
            data,
        };
        let l = limits_with("no-cgroup-mounted", rl(Some(4096 * MIB), Some(3072 * MIB)));
        assert_eq!(l.effective().source, Origin::RlimitData);
        assert_eq!(l.effective().bytes, 3072 * MIB);
        assert_eq!(l.usage(), Some(512 * MIB), "VmData");
        let l = limits_with("no-cgroup-mounted", rl(Some(2048 * MIB), None));
        assert_eq!(l.effective().source, Origin::RlimitAs);
        assert_eq!(l.usage(), Some(2048 * MIB), "VmSize");
        // Above the cgroup's limit they do not bind.
        let l = limits_with("v1-hybrid", rl(Some(4096 * MIB), Some(4096 * MIB)));
        assert_eq!(l.effective().source.kind(), "cgroup");
    }

    #[test]
    fn status_shows_every_limit() {
        let j = limits_with(
            "v2-namespace",
            Rlimits {
                address_space: None,
                data: Some(8192 * MIB),
            },
        )
        .to_json();
        assert_eq!(j["bytes"], 512 * MIB);
        assert_eq!(j["source"], "cgroup");
        assert_eq!(j["cgroup"], 512 * MIB);
        assert_eq!(j["machine"], 67108864u64 << 10);
        assert_eq!(j["rlimit_data"], 8192 * MIB);
        assert!(j["rlimit_as"].is_null());
    }

    #[test]
    fn mountinfo_fields() {
        let m = Mount::parse(
            "920 900 0:60 /a\\040b /mnt/with\\040space\\134x rw,relatime shared:3 - cgroup cgroup rw,cpu,memory",
        )
        .unwrap();
        assert_eq!(m.root, "/a b");
        assert_eq!(m.point, "/mnt/with space\\x");
        assert!(m.holds(Version::V1) && !m.holds(Version::V2));
        assert!(Mount::parse("no separator here").is_none());
        assert_eq!(unescape("trailing\\04"), "trailing\\04");
        assert_eq!(relative("/a/b", "/a"), Some(PathBuf::from("b")));
        assert_eq!(relative("/a", "/a"), Some(PathBuf::new()));
        assert_eq!(relative("/ab", "/a"), None);
        assert_eq!(relative("/../x", "/"), None);
    }

    #[test]
    fn this_process_has_a_limit() {
        let l = Limits::of_this_process();
        let e = l.effective();
        assert!(e.bytes > 0 && e.bytes <= l.machine, "{e}");
        assert!(l.usage().is_some(), "usage of {e}");
    }
}
