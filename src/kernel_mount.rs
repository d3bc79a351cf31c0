//! Mounting as root the way libfuse does: `mount(2)` with the type `fuse.<subtype>` and the
//! file system name as its source, so `/proc/mounts`, `findmnt` and `umount -t` show
//! `fuse.kllm-mount` and the sealed path. `fuser` mounts plain `fuse` as root (it keeps the
//! subtype for `fusermount3`), which tells an operator nothing. Without the privilege the
//! mount goes through `fuser` and `fusermount3`, which apply the subtype themselves.

use std::ffi::CString;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use fuser::{Config, Filesystem, MountOption, Session, SessionACL, SessionUnmounter};

/// Unmounts what [`mount`] mounted, once.
pub enum Unmounter {
    Fuser(SessionUnmounter),
    Direct(Option<PathBuf>),
}

impl Unmounter {
    pub fn unmount(&mut self) -> io::Result<()> {
        match self {
            Unmounter::Fuser(u) => u.unmount(),
            Unmounter::Direct(mount_point) => {
                let Some(mp) = mount_point.take() else {
                    return Ok(());
                };
                let c = CString::new(mp.as_os_str().as_bytes())?;
                // SAFETY: a NUL-terminated path and no flags.
                if unsafe { libc::umount2(c.as_ptr(), 0) } == 0 {
                    Ok(())
                } else {
                    let e = io::Error::last_os_error();
                    // Still mounted (busy): the caller may detach it instead.
                    *mount_point = Some(mp);
                    Err(e)
                }
            }
        }
    }
}

/// The kernel's mount data and flags for `cfg`, and the type and source to mount with.
struct Plan {
    fs_type: String,
    source: String,
    data: String,
    flags: libc::c_ulong,
}

fn plan(cfg: &Config, fd: i32, root_mode: u32) -> Plan {
    let mut fs_type = "fuse".to_string();
    let mut source = "/dev/fuse".to_string();
    // SAFETY: getuid and getgid cannot fail.
    let (uid, gid) = unsafe { (libc::getuid(), libc::getgid()) };
    let mut data = format!("fd={fd},rootmode={root_mode:o},user_id={uid},group_id={gid}");
    let mut flags: libc::c_ulong = libc::MS_NODEV | libc::MS_NOSUID;
    for opt in &cfg.mount_options {
        match opt {
            MountOption::FSName(name) => source = name.clone(),
            MountOption::Subtype(sub) => fs_type = format!("fuse.{sub}"),
            MountOption::RO => flags |= libc::MS_RDONLY,
            MountOption::NoExec => flags |= libc::MS_NOEXEC,
            MountOption::NoAtime => flags |= libc::MS_NOATIME,
            MountOption::DirSync => flags |= libc::MS_DIRSYNC,
            MountOption::Sync => flags |= libc::MS_SYNCHRONOUS,
            MountOption::Dev => flags &= !libc::MS_NODEV,
            MountOption::Suid => flags &= !libc::MS_NOSUID,
            MountOption::DefaultPermissions => data.push_str(",default_permissions"),
            MountOption::CUSTOM(o) => {
                data.push(',');
                data.push_str(o);
            }
            MountOption::RW
            | MountOption::Exec
            | MountOption::Atime
            | MountOption::Async
            | MountOption::NoDev
            | MountOption::NoSuid
            | MountOption::AutoUnmount => {}
        }
    }
    // fuser checks the caller against the ACL itself; the kernel only has to let others in.
    if cfg.acl != SessionACL::Owner {
        data.push_str(",allow_other");
    }
    Plan {
        fs_type,
        source,
        data,
        flags,
    }
}

/// `fusermount3` reads options as a comma-separated list and has no escape for a comma.
fn for_fusermount(cfg: &Config) -> Config {
    let mut cfg = cfg.clone();
    for opt in &mut cfg.mount_options {
        if let MountOption::FSName(name) = opt {
            *name = name.replace(',', "_");
        }
    }
    cfg
}

/// Mount `fs` at `mount_point` and complete the FUSE handshake.
pub fn mount<FS: Filesystem>(
    fs: FS,
    mount_point: &Path,
    cfg: &Config,
) -> io::Result<(Session<FS>, Unmounter)> {
    // auto_unmount needs fusermount3, which stays behind to unmount.
    let direct = !cfg.mount_options.contains(&MountOption::AutoUnmount)
        // SAFETY: geteuid cannot fail.
        && unsafe { libc::geteuid() } == 0;
    if direct {
        match mount_direct(mount_point, cfg)? {
            Some((fd, mp)) => {
                return match Session::from_fd(fs, fd, cfg.acl, cfg.clone()) {
                    Ok(session) => Ok((session, Unmounter::Direct(Some(mp)))),
                    Err(e) => {
                        let _ = Unmounter::Direct(Some(mp)).unmount();
                        Err(e)
                    }
                };
            }
            None => log::debug!("mount(2) was refused (EPERM); trying fusermount3"),
        }
    }
    let mut session = Session::new(fs, mount_point, &for_fusermount(cfg))?;
    let unmounter = Unmounter::Fuser(session.unmount_callable());
    Ok((session, unmounter))
}

/// `None` where the kernel refuses the mount for lack of privilege (a user namespace).
fn mount_direct(mount_point: &Path, cfg: &Config) -> io::Result<Option<(OwnedFd, PathBuf)>> {
    use std::os::unix::fs::MetadataExt;
    let mp = std::fs::canonicalize(mount_point)?;
    let root_mode = std::fs::metadata(&mp)?.mode() & libc::S_IFMT;
    let dev: OwnedFd = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/fuse")?
        .into();
    let plan = plan(cfg, dev.as_raw_fd(), root_mode);
    let c = |s: &[u8]| CString::new(s).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput));
    let (source, target) = (c(plan.source.as_bytes())?, c(mp.as_os_str().as_bytes())?);
    let (fs_type, data) = (c(plan.fs_type.as_bytes())?, c(plan.data.as_bytes())?);
    // SAFETY: NUL-terminated strings that outlive the call.
    let rc = unsafe {
        libc::mount(
            source.as_ptr(),
            target.as_ptr(),
            fs_type.as_ptr(),
            plan.flags,
            data.as_ptr().cast(),
        )
    };
    if rc == 0 {
        return Ok(Some((dev, mp)));
    }
    let e = io::Error::last_os_error();
    if e.raw_os_error() == Some(libc::EPERM) {
        return Ok(None);
    }
    Err(io::Error::new(
        e.kind(),
        format!("mount -t {} of {}: {e}", plan.fs_type, plan.source),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(opts: Vec<MountOption>, acl: SessionACL) -> Config {
        let mut c = Config::default();
        c.mount_options = opts;
        c.acl = acl;
        c
    }

    #[test]
    fn type_source_flags_and_data_follow_the_options() {
        let p = plan(
            &cfg(
                vec![
                    MountOption::FSName("/srv/sealed,1 x".into()),
                    MountOption::Subtype("kllm-mount".into()),
                    MountOption::RO,
                    MountOption::NoDev,
                    MountOption::NoSuid,
                    MountOption::DefaultPermissions,
                    MountOption::NoExec,
                    MountOption::CUSTOM("max_read=131072".into()),
                ],
                SessionACL::Owner,
            ),
            7,
            libc::S_IFDIR,
        );
        assert_eq!(p.fs_type, "fuse.kllm-mount");
        // The source is its own argument of mount(2): commas and spaces survive.
        assert_eq!(p.source, "/srv/sealed,1 x");
        assert_eq!(
            p.flags,
            libc::MS_RDONLY | libc::MS_NODEV | libc::MS_NOSUID | libc::MS_NOEXEC
        );
        assert!(
            p.data.starts_with("fd=7,rootmode=40000,user_id="),
            "{}",
            p.data
        );
        assert!(
            p.data.ends_with(",default_permissions,max_read=131072"),
            "{}",
            p.data
        );
        assert!(!p.data.contains("allow_other"));
    }

    #[test]
    fn others_are_let_in_only_when_asked() {
        for (acl, allowed) in [
            (SessionACL::All, true),
            (SessionACL::RootAndOwner, true),
            (SessionACL::Owner, false),
        ] {
            let p = plan(&cfg(vec![], acl), 3, libc::S_IFDIR);
            assert_eq!(p.data.contains(",allow_other"), allowed, "{acl:?}");
            assert_eq!(p.fs_type, "fuse");
            assert_eq!(p.source, "/dev/fuse");
        }
    }

    #[test]
    fn fusermount_gets_a_name_without_commas() {
        let c = for_fusermount(&cfg(
            vec![MountOption::FSName("/a,b".into())],
            SessionACL::Owner,
        ));
        assert_eq!(c.mount_options, vec![MountOption::FSName("/a_b".into())]);
    }
}
