//! The mount table as this process sees it (`/proc/self/mountinfo`), and the options that
//! `mount -t fuse.kllm-mount`, fstab and `mount.fuse3` hand to the command line.
//!
//! Both serve the operating paths around the daemon: refusing a second mount on a mount
//! point that already shows a view (the kernel would stack it silently, and one unmount
//! would then remove only the top one), and being started by mount(8) as
//! `kllm-mount SEALED MOUNTPOINT -o rw,key=FILE,...,dev,suid`.

use std::ffi::OsString;
use std::os::unix::ffi::OsStringExt;
use std::path::{Path, PathBuf};

use crate::{Error, Result};

/// The file system type in `/proc/mounts`, as `fuse.sshfs` is for sshfs; also what fstab
/// and `mount -t` name.
pub const FS_TYPE: &str = "fuse.kllm-mount";
/// The FUSE subtype that makes [`FS_TYPE`].
pub const SUBTYPE: &str = "kllm-mount";

/// One line of `/proc/self/mountinfo`, with its escapes decoded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MountEntry {
    pub mount_point: PathBuf,
    pub fs_type: String,
    pub source: String,
}

impl MountEntry {
    /// Whether this is a view of ours: the current type, or the plain `fuse` with the
    /// `kllm:` source that earlier versions mounted as root.
    pub fn is_kllm(&self) -> bool {
        self.fs_type == FS_TYPE || (self.fs_type == "fuse" && self.source.starts_with("kllm:"))
    }
}

/// The kernel writes space, tab, newline and backslash in mount table fields as `\ooo`.
fn unescape(field: &str) -> Vec<u8> {
    let b = field.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let octal = b.get(i + 1..i + 4).filter(|d| {
            b[i] == b'\\' && d.iter().all(|c| (b'0'..=b'7').contains(c)) && d[0] <= b'3'
        });
        match octal {
            Some(d) => {
                out.push((d[0] - b'0') << 6 | (d[1] - b'0') << 3 | (d[2] - b'0'));
                i += 4;
            }
            None => {
                out.push(b[i]);
                i += 1;
            }
        }
    }
    out
}

/// Parse mountinfo text: `ID PARENT MAJ:MIN ROOT MOUNT_POINT OPTIONS [OPTIONAL...] - TYPE
/// SOURCE SUPER_OPTIONS`. Lines that do not have that shape are skipped.
pub fn parse_mountinfo(text: &str) -> Vec<MountEntry> {
    text.lines()
        .filter_map(|line| {
            let fields: Vec<&str> = line.split(' ').collect();
            let sep = fields.iter().position(|f| *f == "-")?;
            if sep < 6 {
                return None;
            }
            let fs_type = fields.get(sep + 1)?;
            let source = fields.get(sep + 2)?;
            Some(MountEntry {
                mount_point: PathBuf::from(OsString::from_vec(unescape(fields[4]))),
                fs_type: String::from_utf8_lossy(&unescape(fs_type)).into_owned(),
                source: String::from_utf8_lossy(&unescape(source)).into_owned(),
            })
        })
        .collect()
}

/// The kllm mount at exactly `mount_point` (already absolute and resolved), if any, in
/// `mountinfo` text. The last one wins: it is the top of a stack.
pub fn kllm_mount_in(mountinfo: &str, mount_point: &Path) -> Option<MountEntry> {
    parse_mountinfo(mountinfo)
        .into_iter()
        .rfind(|e| e.mount_point == mount_point && e.is_kllm())
}

/// Refuse to mount where a kllm view is already mounted. A mount point whose daemon died
/// fails every stat with ENOTCONN; it is named as such, with the way to clear it.
pub fn check_not_mounted(mount_point: &Path) -> Result<()> {
    let Ok(table) = std::fs::read_to_string("/proc/self/mountinfo") else {
        return Ok(());
    };
    // realpath(3) reads no attributes, so it resolves a dead FUSE mount too. The kernel
    // may still answer a stat from its attribute cache; opening the directory always asks
    // the daemon, so it tells a live view from one whose daemon is gone.
    let resolved = std::fs::canonicalize(mount_point)
        .or_else(|_| std::path::absolute(mount_point))
        .unwrap_or_else(|_| mount_point.to_path_buf());
    let Some(entry) = kllm_mount_in(&table, &resolved) else {
        return Ok(());
    };
    let stat_error = std::fs::read_dir(&resolved).err();
    let shown = mount_point.display();
    Err(match stat_error {
        Some(e) if e.raw_os_error() == Some(libc::ENOTCONN) => Error::at(
            mount_point,
            format!(
                "a kllm-mount of {} is still mounted here but its daemon is gone ({e}); \
                 detach it with `fusermount3 -u -z {shown}` (or `umount -l {shown}`), then mount again",
                entry.source
            ),
        ),
        _ => Error::at(
            mount_point,
            format!(
                "a kllm-mount of {} is already mounted here; unmount it first (`fusermount3 -u {shown}`)",
                entry.source
            ),
        ),
    })
}

/// What an `-o` entry of ours is: a setting with a value, or a flag.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ours {
    Value,
    Flag,
}

/// Options that belong to mount(8), fstab or systemd and say nothing to the daemon. The
/// view is always read-only, nodev and nosuid: mount(8) adds `rw`, and `mount.fuse3`
/// adds `dev,suid`, unless the line says otherwise, so those are dropped rather than
/// refused.
fn is_mount_level(opt: &str) -> bool {
    matches!(
        opt,
        "rw" | "dev"
            | "suid"
            | "defaults"
            | "auto"
            | "noauto"
            | "user"
            | "nouser"
            | "users"
            | "owner"
            | "group"
            | "_netdev"
            | "nofail"
            | "sync"
            | "async"
            | "relatime"
            | "norelatime"
            | "strictatime"
            | "lazytime"
    ) || opt.starts_with("x-")
        || opt.starts_with("comment=")
}

/// mount(8), fstab and `mount.fuse3` pass every setting in `-o`: rewrite the command line
/// so our own become flags again (`-o key=F,cache_size=1G,allow_other` becomes
/// `--key F --cache-size 1G -o allow_other`), and drop the mount-level options. `ours` says
/// which names (with `-`, as the long flags are spelled) are ours.
pub fn expand_options(
    argv: Vec<OsString>,
    ours: impl Fn(&str) -> Option<Ours>,
) -> Result<Vec<OsString>> {
    let mut out = Vec::with_capacity(argv.len());
    let mut args = argv.into_iter();
    while let Some(arg) = args.next() {
        let value = match arg.to_str() {
            Some("-o") => match args.next() {
                Some(v) => v,
                None => {
                    out.push(arg);
                    continue;
                }
            },
            Some(a) if a.starts_with("-o") && a.len() > 2 => OsString::from(&a[2..]),
            _ => {
                out.push(arg);
                continue;
            }
        };
        let Some(text) = value.to_str() else {
            out.extend([OsString::from("-o"), value]);
            continue;
        };
        let mut fuse = Vec::new();
        for opt in text.split(',').map(str::trim).filter(|o| !o.is_empty()) {
            let (name, v) = match opt.split_once('=') {
                Some((n, v)) => (n, Some(v)),
                None => (opt, None),
            };
            match (ours(&name.replace('_', "-")), v) {
                (Some(Ours::Value), Some(v)) if !v.is_empty() => {
                    out.push(format!("--{}", name.replace('_', "-")).into());
                    out.push(v.into());
                }
                (Some(Ours::Flag), None) => {
                    out.push(format!("--{}", name.replace('_', "-")).into())
                }
                (Some(_), _) => {
                    return Err(Error::new(format!("-o {opt}: missing or unexpected value")))
                }
                (None, _) if is_mount_level(opt) => {}
                (None, _) => fuse.push(opt),
            }
        }
        if !fuse.is_empty() {
            out.extend([OsString::from("-o"), fuse.join(",").into()]);
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    const TABLE: &str = "\
22 1 254:0 / / rw,relatime shared:1 - ext4 /dev/vda rw
61 22 0:54 / /srv/model\\040view rw,nosuid,nodev,relatime shared:4 - fuse.kllm-mount /srv/sealed\\040dir\\134x ro,user_id=0,group_id=0
62 22 0:55 / /mnt/other rw,relatime - fuse.sshfs host:/x rw
63 22 0:56 / /mnt/old rw,relatime master:3 - fuse kllm:/srv/old ro
64 22 0:57 / /mnt/plain rw,relatime - fuse /dev/fuse ro
garbage line
";

    #[test]
    fn mountinfo_fields_and_escapes() {
        let all = parse_mountinfo(TABLE);
        assert_eq!(all.len(), 5, "{all:?}");
        assert_eq!(all[1].mount_point, Path::new("/srv/model view"));
        assert_eq!(all[1].fs_type, FS_TYPE);
        assert_eq!(all[1].source, "/srv/sealed dir\\x");
        assert_eq!(all[2].fs_type, "fuse.sshfs");
        // Optional fields (shared:, master:) of any number before the separator.
        assert_eq!(all[3].source, "kllm:/srv/old");
    }

    #[test]
    fn unescape_leaves_what_is_not_an_octal_escape() {
        assert_eq!(unescape("a\\040b"), b"a b");
        assert_eq!(unescape("a\\011\\012"), b"a\t\n");
        assert_eq!(unescape("\\\\x"), b"\\\\x");
        assert_eq!(unescape("tail\\04"), b"tail\\04");
        assert_eq!(unescape("\\999"), b"\\999");
    }

    #[test]
    fn finds_only_our_mounts_at_exactly_that_path() {
        let at = |p: &str| kllm_mount_in(TABLE, Path::new(p)).map(|e| e.source);
        assert_eq!(at("/srv/model view").as_deref(), Some("/srv/sealed dir\\x"));
        assert_eq!(at("/mnt/old").as_deref(), Some("kllm:/srv/old"));
        assert_eq!(at("/mnt/other"), None);
        assert_eq!(at("/mnt/plain"), None);
        assert_eq!(at("/srv/model"), None);
        assert_eq!(at("/"), None);
    }

    #[test]
    fn the_top_of_a_stack_is_reported() {
        let table =
            "1 0 0:1 / /m rw - fuse.kllm-mount /a ro\n2 1 0:2 / /m rw - fuse.kllm-mount /b ro\n";
        assert_eq!(kllm_mount_in(table, Path::new("/m")).unwrap().source, "/b");
    }

    fn ours(name: &str) -> Option<Ours> {
        match name {
            "key" | "cache-size" | "log-file" | "mode" => Some(Ours::Value),
            "foreground" => Some(Ours::Flag),
            _ => None,
        }
    }

    fn expand(args: &[&str]) -> Result<Vec<String>> {
        expand_options(args.iter().map(OsString::from).collect(), ours)
            .map(|v| v.into_iter().map(|a| a.into_string().unwrap()).collect())
    }

    #[test]
    fn settings_in_o_become_flags() {
        assert_eq!(
            expand(&[
                "/s",
                "/m",
                "-o",
                "rw,key=/k,cache_size=1G,allow_other,_netdev,x-systemd.after=a"
            ])
            .unwrap(),
            [
                "/s",
                "/m",
                "--key",
                "/k",
                "--cache-size",
                "1G",
                "-o",
                "allow_other"
            ]
        );
        assert_eq!(
            expand(&["-oro,mode=fuse,foreground,fsname=x", "--verify", "off"]).unwrap(),
            [
                "--mode",
                "fuse",
                "--foreground",
                "-o",
                "ro,fsname=x",
                "--verify",
                "off"
            ]
        );
        assert_eq!(expand(&["-o", "dev,suid"]).unwrap(), Vec::<String>::new());
    }

    #[test]
    fn bad_settings_are_refused_by_name() {
        for bad in ["key", "key=", "foreground=1", "mode"] {
            let e = expand(&["-o", bad]).unwrap_err();
            assert!(e.message().contains(bad), "{bad}: {e}");
        }
    }

    #[test]
    fn a_plain_directory_is_not_refused() {
        let dir = std::env::temp_dir();
        assert!(check_not_mounted(&dir).is_ok());
    }
}
