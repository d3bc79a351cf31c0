//! Symbolic links in a sealed directory: links inside it are followed, links out of it,
//! dangling or looping, and files that are neither files nor folders are not shown; links
//! to hidden files stay hidden; a file or folder swapped for a link after mounting is not
//! followed.
//!
//! They mount the binary in temporary directories (root, /dev/fuse and fusermount3, as the
//! CI machine has), through FUSE (`--mode fuse`: they hold the daemon's own read path to
//! account); a guard unmounts and ends the daemon even when a test panics.

mod common;

use std::fs;
use std::os::unix::fs::{symlink, PermissionsExt};

use kllm_mount::lock::Version;

use common::*;

const KEY: [u8; 32] = [0x6b; 32];

// ---------------------------------------------------------------------------------------
// Symbolic links
// ---------------------------------------------------------------------------------------

#[test]
fn symlinks_inside_are_followed_outside_ones_are_not_shown() {
    let s = Sample::small(KEY);
    let sealed = s.sealed();
    let shard = locked_shards(&sealed)[0].clone();
    let outside = s.root().join("outside.txt");
    fs::write(&outside, "outside the sealed directory\n".repeat(10)).unwrap();
    fs::create_dir_all(sealed.join("sub/inner")).unwrap();
    fs::write(sealed.join("sub/inner/notes.txt"), b"inner notes").unwrap();
    // Inside: a file, a locked shard in the same folder, a folder, relative and absolute.
    symlink("tokenizer_config.json", sealed.join("link-to-file.json")).unwrap();
    symlink(&shard, sealed.join("alias.safetensors")).unwrap();
    // Sorted after "sub", so the real folder is walked first (see the ignored test below).
    symlink("sub/inner", sealed.join("z-link-to-dir")).unwrap();
    symlink(
        sealed.join("sub/inner/notes.txt"),
        sealed.join("abs-inside.txt"),
    )
    .unwrap();
    symlink("inner/notes.txt", sealed.join("sub/down.txt")).unwrap();
    // Up and out and back in again: still inside.
    symlink(
        "../../sub/../tokenizer_config.json",
        sealed.join("sub/inner/up.json"),
    )
    .unwrap();
    // Outside, dangling, loops.
    symlink(&outside, sealed.join("abs-outside.txt")).unwrap();
    symlink("../outside.txt", sealed.join("rel-outside.txt")).unwrap();
    symlink("/etc", sealed.join("dir-outside")).unwrap();
    symlink("../../..", sealed.join("sub/escape")).unwrap();
    symlink("does-not-exist", sealed.join("dangling")).unwrap();
    symlink("loop-b", sealed.join("loop-a")).unwrap();
    symlink("loop-a", sealed.join("loop-b")).unwrap();
    symlink("..", sealed.join("sub/inner/parent-loop")).unwrap();
    symlink(".", sealed.join("self-loop")).unwrap();
    // Neither files nor folders: a FIFO (opening it would block the mount forever), a
    // character device (/dev/zero's numbers), and a link to the FIFO.
    // SAFETY: plain calls with NUL-terminated paths.
    unsafe {
        assert_eq!(libc::mkfifo(cpath(&sealed.join("fifo")).as_ptr(), 0o644), 0);
        libc::mknod(
            cpath(&sealed.join("zero-device")).as_ptr(),
            libc::S_IFCHR | 0o644,
            libc::makedev(1, 5),
        );
    }
    symlink("fifo", sealed.join("link-to-fifo")).unwrap();

    let view = s.view();
    let m = s.mount_fuse(&[]);
    let top = listing(&m.mp);
    for shown in [
        "link-to-file.json",
        "alias.safetensors",
        "abs-inside.txt",
        "sub",
    ] {
        assert!(top.contains(shown), "{shown} not shown: {top:?}");
    }
    for hidden in [
        "abs-outside.txt",
        "rel-outside.txt",
        "dir-outside",
        "dangling",
        "loop-a",
        "loop-b",
        "self-loop",
        "fifo",
        "zero-device",
        "link-to-fifo",
    ] {
        assert!(!top.contains(hidden), "{hidden} shown");
    }
    assert!(!listing(&m.path("sub")).contains("escape"));
    assert!(!listing(&m.path("sub/inner")).contains("parent-loop"));
    assert_eq!(
        fs::read(m.path("link-to-file.json")).unwrap(),
        fs::read(sealed.join("tokenizer_config.json")).unwrap()
    );
    assert_eq!(fs::read(m.path("abs-inside.txt")).unwrap(), b"inner notes");
    assert_eq!(fs::read(m.path("sub/down.txt")).unwrap(), b"inner notes");
    assert_eq!(
        fs::read(m.path("sub/inner/up.json")).unwrap(),
        fs::read(sealed.join("tokenizer_config.json")).unwrap()
    );
    assert_eq!(
        fs::read(m.path("sub/inner/notes.txt")).unwrap(),
        b"inner notes"
    );
    // A link to a folder shown anyway: shown with its content, or not at all.
    if top.contains("z-link-to-dir") {
        assert!(fs::symlink_metadata(m.path("z-link-to-dir"))
            .unwrap()
            .is_dir());
        assert_eq!(
            fs::read(m.path("z-link-to-dir/notes.txt")).unwrap(),
            b"inner notes"
        );
    }
    // Links show as what they point at, never as links.
    assert!(fs::symlink_metadata(m.path("alias.safetensors"))
        .unwrap()
        .is_file());
    // A link to a locked shard of the same folder decodes as that shard.
    assert_eq!(
        read_direct(&m.path("alias.safetensors")).unwrap(),
        view[&shard]
    );
    assert_eq!(view["alias.safetensors"], view[&shard]);
    // Nothing of the outside file anywhere.
    let needle = b"outside the sealed directory";
    for (rel, bytes) in &view {
        assert!(!bytes.windows(needle.len()).any(|w| w == needle), "{rel}");
    }
}

#[test]
fn symlink_to_a_folder_never_hides_the_folder() {
    let s = Sample::new(KEY, 16, 1, Some(Version::V2), |plain| {
        fs::create_dir(plain.join("sub")).unwrap();
        fs::write(plain.join("sub/model.safetensors"), small_shard(11)).unwrap();
    });
    let sealed = s.sealed();
    assert!(locked_shards(&sealed).contains(&"sub/model.safetensors".to_string()));
    let want = s.view()["sub/model.safetensors"].clone();
    symlink("sub", sealed.join("a-link")).unwrap();
    let view = s.view();
    assert!(
        view.get("sub/model.safetensors") == Some(&want),
        "sub/model.safetensors is {}",
        if view.contains_key("sub/model.safetensors") {
            "different"
        } else {
            "not shown"
        }
    );
    if let Some(alias) = view.get("a-link/model.safetensors") {
        assert!(*alias == want, "a-link/model.safetensors: wrong bytes");
    }
}

#[test]
fn symlink_to_a_shard_in_another_folder_reads_as_that_shard() {
    let s = Sample::small(KEY);
    let sealed = s.sealed();
    let shard = locked_shards(&sealed)[0].clone();
    fs::create_dir(sealed.join("sub")).unwrap();
    symlink(format!("../{shard}"), sealed.join("sub/alias.safetensors")).unwrap();
    let want = s.view()[&shard].clone();
    let m = s.mount_fuse(&["--cache-size", "0"]);
    match read_direct(&m.path("sub/alias.safetensors")) {
        Ok(got) => assert!(got == want, "sub/alias.safetensors: wrong bytes"),
        Err(e) => assert_eq!(e.raw_os_error(), Some(libc::ENOENT), "{e}"),
    }
}

#[test]
fn plain_file_swapped_for_a_symlink_after_mount_is_not_followed() {
    let s = Sample::small(KEY);
    let sealed = s.sealed();
    let secret = s.root().join("root-only.txt");
    fs::write(&secret, "SECRET OUTSIDE THE SEALED DIRECTORY ".repeat(20)).unwrap();
    fs::set_permissions(&secret, fs::Permissions::from_mode(0o600)).unwrap();
    let want = fs::read(sealed.join("tokenizer_config.json")).unwrap();
    let m = s.mount_fuse(&[]);
    // Never read before the swap.
    fs::remove_file(sealed.join("tokenizer_config.json")).unwrap();
    symlink(&secret, sealed.join("tokenizer_config.json")).unwrap();
    match fs::read(m.path("tokenizer_config.json")) {
        Ok(got) => {
            assert!(
                !String::from_utf8_lossy(&got).contains("SECRET OUTSIDE"),
                "the mount served a file outside the sealed directory: {:?}",
                String::from_utf8_lossy(&got)
            );
            assert_eq!(got, want);
        }
        Err(e) => assert!(e.raw_os_error().is_some(), "{e}"),
    }
}

/// The same swap one level up: a folder of the sealed directory replaced by a link to a
/// folder outside that holds a file of the same name. O_NOFOLLOW on the last component does
/// not stop this; the file must be opened beneath the sealed root without following links
/// (openat2 RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS), or opened at mount time.
#[test]
fn verbatim_file_under_a_folder_swapped_for_a_link_is_not_followed() {
    let s = Sample::new(KEY, 16, 1, Some(Version::V2), |plain| {
        fs::create_dir(plain.join("sub")).unwrap();
        fs::write(plain.join("sub/notes.txt"), "notes ".repeat(50)).unwrap();
    });
    let sealed = s.sealed();
    let want = fs::read(sealed.join("sub/notes.txt")).unwrap();
    let outside = s.root().join("elsewhere");
    fs::create_dir(&outside).unwrap();
    fs::write(
        outside.join("notes.txt"),
        "SECRET OUTSIDE THE SEALED DIRECTORY ".repeat(20),
    )
    .unwrap();
    fs::set_permissions(outside.join("notes.txt"), fs::Permissions::from_mode(0o600)).unwrap();
    let m = s.mount_fuse(&[]);
    // Never read before the swap.
    fs::rename(sealed.join("sub"), s.root().join("sub.moved")).unwrap();
    symlink(&outside, sealed.join("sub")).unwrap();
    match fs::read(m.path("sub/notes.txt")) {
        Ok(got) => {
            assert!(
                !String::from_utf8_lossy(&got).contains("SECRET OUTSIDE"),
                "the mount served a file outside the sealed directory"
            );
            assert_eq!(got, want);
        }
        Err(e) => assert!(e.raw_os_error().is_some(), "{e}"),
    }
}

#[test]
fn links_to_hidden_files_stay_hidden() {
    let s = Sample::small(KEY);
    let sealed = s.sealed();
    fs::copy(s.key_file(), sealed.join("kllm.key")).unwrap();
    symlink("kllm.key", sealed.join("key.json")).unwrap();
    symlink("trusted.kllm", sealed.join("blob.bin")).unwrap();
    let view = s.view();
    for shown in ["key.json", "blob.bin"] {
        assert!(
            !view.contains_key(shown),
            "{shown} (a link to a hidden file) is shown"
        );
    }
}
