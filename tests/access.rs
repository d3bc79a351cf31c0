//! Who may enter the mount: its owner only, unless `-o allow_other`, and then with the
//! sealed files' permissions checked.
//!
//! They mount the binary in temporary directories (root, /dev/fuse and fusermount3, as the
//! CI machine has), through FUSE (`--mode fuse`: they hold the daemon's own read path to
//! account); a guard unmounts and ends the daemon even when a test panics.

mod common;

use std::ffi::OsStr;
use std::fs;
use std::io::{self};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::process::{Command, Output};

use kllm_mount::blob;

use common::*;

const KEY: [u8; 32] = [0x6b; 32];
const NOBODY: u32 = 65534;

// ---------------------------------------------------------------------------------------
// Who may enter the mount
// ---------------------------------------------------------------------------------------

/// Run `prog args` as nobody; its output.
fn as_nobody(prog: &str, args: &[&OsStr]) -> Output {
    let mut c = Command::new(prog);
    c.args(args).env_clear().env("PATH", "/usr/bin:/bin");
    // SAFETY: only async-signal-safe calls between fork and exec.
    unsafe {
        c.pre_exec(|| {
            if libc::setgroups(0, std::ptr::null()) != 0
                || libc::setgid(NOBODY) != 0
                || libc::setuid(NOBODY) != 0
            {
                return Err(io::Error::last_os_error());
            }
            Ok(())
        });
    }
    c.output().expect("run as nobody")
}

fn denied(out: &Output) -> bool {
    !out.status.success() && String::from_utf8_lossy(&out.stderr).contains("Permission denied")
}

#[test]
fn other_users_cannot_enter_without_allow_other() {
    let s = Sample::small(KEY);
    let m = s.mount_fuse(&[]);
    // The way there is open to them.
    let parent = m.mp.parent().unwrap().as_os_str();
    assert!(
        as_nobody("stat", &[parent]).status.success(),
        "nobody cannot reach the mount's parent"
    );
    for (prog, path) in [
        ("stat", m.mp.clone()),
        ("ls", m.mp.clone()),
        ("cat", m.path("config.json")),
        ("cat", m.path("tokenizer.json")),
        ("stat", m.path("model-00001-of-00002.safetensors")),
    ] {
        let out = as_nobody(prog, &[path.as_os_str()]);
        assert!(
            denied(&out),
            "nobody: {prog} {}: {} {:?}",
            path.display(),
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    // The owner (root here) still reads.
    assert!(fs::read(m.path("config.json")).is_ok());
}

#[test]
fn allow_other_lets_others_in_with_permissions_checked() {
    let s = Sample::small(KEY);
    let sealed = s.sealed();
    fs::set_permissions(
        sealed.join("tokenizer_config.json"),
        fs::Permissions::from_mode(0o600),
    )
    .unwrap();
    fs::set_permissions(
        sealed.join("config.json"),
        fs::Permissions::from_mode(0o644),
    )
    .unwrap();
    // The secret files take the blob's mode.
    fs::set_permissions(
        sealed.join(blob::FILE_NAME),
        fs::Permissions::from_mode(0o600),
    )
    .unwrap();
    let view = s.view();
    let m = s.mount_fuse(&["-o", "allow_other"]);
    assert!(as_nobody("stat", &[m.mp.as_os_str()]).status.success());
    assert!(as_nobody("ls", &[m.mp.as_os_str()]).status.success());
    let out = as_nobody("cat", &[m.path("config.json").as_os_str()]);
    assert!(
        out.status.success(),
        "{:?}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(out.stdout, view["config.json"]);
    for private in ["tokenizer_config.json", "tokenizer.json", "vocab.json"] {
        let out = as_nobody("cat", &[m.path(private).as_os_str()]);
        assert!(
            denied(&out),
            "nobody read {private} (mode 0600): {}",
            out.status
        );
    }
    // Writes are refused to everyone.
    let out = as_nobody("touch", &[m.path("new-file").as_os_str()]);
    assert!(!out.status.success());
}
