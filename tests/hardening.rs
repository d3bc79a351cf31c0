//! Hardening (issue 5): tampering with a sealed directory at rest and while mounted,
//! symbolic links, a header of 100k tensors, deep folders, odd names, nothing plain reaching
//! a disk, key hygiene in the daemon, and who may enter the mount.
//!
//! tests/mount.rs covers the vectors through the kernel and the daemon's lifecycle;
//! tests/refusals.rs one refusal per problem. Tests here that need the kernel mount the
//! binary in temporary directories (root, /dev/fuse and fusermount3, as the CI machine has);
//! a guard unmounts and ends the daemon even when a test panics.
//!
//! Tests marked `#[ignore]` pin a known bug or a missing feature of src/ (the reason names
//! it, and docs/SECURITY.md lists them); run them with `cargo test --test hardening --
//! --ignored`.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::ffi::OsStr;
use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::os::fd::AsRawFd;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{symlink, FileExt, PermissionsExt};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::harness::*;
use common::Sample;
use kllm_mount::blob;
use kllm_mount::key::ModelKey;
use kllm_mount::lock::Version;
use kllm_mount::sealed::{self, Options};
use kllm_mount::shard::Shard;
use kllm_mount::testseal::{self, safetensors_bytes, Tensor};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use safetensors::Dtype;
use tempfile::TempDir;

const KEY: [u8; 32] = [0x6b; 32];
const EIO: i32 = libc::EIO;
const NOBODY: u32 = 65534;

fn key() -> ModelKey {
    ModelKey::new(KEY)
}

// ---------------------------------------------------------------------------------------
// Sealed samples and the expected view
// ---------------------------------------------------------------------------------------

impl Sample {
    fn small() -> Self {
        Sample::new(KEY, 64, 2, Some(Version::V2), |_| {})
    }
}

fn build_view(sealed: &Path) -> kllm_mount::Result<kllm_mount::view::View> {
    sealed::open(
        sealed,
        &key(),
        &"test",
        &Options {
            cache_bytes: 0,
            ..Options::default()
        },
    )
}

/// Every file of the view, built in process (the oracle: tests/core_vectors.rs holds it to
/// the shared vectors).
fn view_files(sealed: &Path) -> BTreeMap<String, Vec<u8>> {
    common::sample::files_of(&build_view(sealed).unwrap())
}

/// Where a safetensors file's data starts.
fn data_start(bytes: &[u8]) -> usize {
    8 + u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize
}

/// The locked shards of a sealed directory, by relative path, largest first.
fn locked_shards(sealed: &Path) -> Vec<String> {
    let mut out: Vec<(u64, String)> = common::tree(sealed)
        .into_iter()
        .filter(|(rel, p)| {
            rel.ends_with(".safetensors")
                && fs::read(p)
                    .map(|b| String::from_utf8_lossy(&b[..data_start(&b)]).contains("kllm.lock"))
                    .unwrap_or(false)
        })
        .map(|(rel, p)| (fs::metadata(p).unwrap().len(), rel))
        .collect();
    out.sort_by(|a, b| b.cmp(a));
    out.into_iter().map(|(_, r)| r).collect()
}

// ---------------------------------------------------------------------------------------
// Mounting the binary
// ---------------------------------------------------------------------------------------

/// A background mount of the binary and its daemon. Dropping it unmounts, ends the daemon
/// and removes the mount point.
struct Mounted {
    mnt: Mnt,
    pid: i32,
}

impl std::ops::Deref for Mounted {
    type Target = Mnt;
    fn deref(&self) -> &Mnt {
        &self.mnt
    }
}

impl Mounted {
    fn assert_alive(&self, what: &str) {
        assert!(alive(self.pid), "{what}: the daemon died");
        assert!(is_mounted(&self.mp), "{what}: no longer mounted");
        fs::metadata(&self.mp).unwrap_or_else(|e| panic!("{what}: the mount does not answer: {e}"));
    }
}

/// Mount `sealed` in the background with `args`, in the mount's temporary directory (where a
/// core file would land); `tweak` may change the command first. Through FUSE: these tests
/// hold the daemon's own read path to account (exact O_DIRECT ranges, files changed while
/// mounted, its locked cache); tests/passthrough.rs and tests/integrity.rs cover the other
/// mode.
fn mount_with(sealed: &Path, args: &[&OsStr], tweak: impl FnOnce(&mut Command)) -> Mounted {
    let mnt = Mnt::new();
    let mut c = mnt.cmd(sealed);
    c.args(["--mode", "fuse"])
        .args(args)
        .current_dir(mnt.mp.parent().unwrap());
    tweak(&mut c);
    let pid = mnt.mount(c);
    Mounted { mnt, pid }
}

fn mount_sample(s: &Sample, extra: &[&str]) -> Mounted {
    let key_file = s.key_file();
    let mut args: Vec<&OsStr> = vec![OsStr::new("--key"), key_file.as_os_str()];
    args.extend(extra.iter().map(OsStr::new));
    mount_with(&s.sealed(), &args, |_| {})
}

/// The whole file through the daemon (O_DIRECT: no page cache in between).
fn read_direct(path: &Path) -> io::Result<Vec<u8>> {
    let f = open_direct(path);
    let len = f.metadata()?.len() as usize;
    pread(&f, 0, len)
}

// ---------------------------------------------------------------------------------------
// 1. Every region of trusted.kllm altered
// ---------------------------------------------------------------------------------------

/// A trusted.kllm of several chunks (128 bytes) holding two secret files.
fn small_chunked_blob() -> Vec<u8> {
    let files = [
        ("tokenizer.json", testseal::pseudo_random(1, 700)),
        ("vocab.json", testseal::pseudo_random(2, 300)),
    ];
    let tensors: Vec<Tensor> = files
        .iter()
        .map(|(n, d)| Tensor {
            name: format!("file/{n}"),
            dtype: Dtype::U8,
            shape: vec![d.len()],
            data: d.clone(),
        })
        .collect();
    let payload = safetensors_bytes(&tensors, &Default::default());
    blob::seal(&payload, &key(), [9; 16], 128)
}

#[test]
fn every_byte_of_trusted_kllm_altered_is_refused() {
    let good = small_chunked_blob();
    let p = Path::new("trusted.kllm");
    assert!(blob::open(p, &good, &key()).is_ok());
    let hlen = u32::from_le_bytes(good[10..14].try_into().unwrap()) as usize;
    let chunks = (good.len() - 14 - hlen).div_ceil(144);
    assert!(chunks >= 8, "{chunks} chunks");
    // Every bit of every byte: magic, header length, header JSON, each chunk's ciphertext
    // and tag.
    let mut refused = 0;
    for i in 0..good.len() {
        for bit in 0..8 {
            let mut bad = good.clone();
            bad[i] ^= 1 << bit;
            assert!(
                blob::open(p, &bad, &key()).is_err(),
                "bit {bit} of byte {i} (of {}) flipped: still opens",
                good.len()
            );
            refused += 1;
        }
    }
    // Cut at every length, and extended.
    for n in 0..good.len() {
        assert!(
            blob::open(p, &good[..n], &key()).is_err(),
            "cut to {n} opens"
        );
    }
    for extra in [1usize, 15, 16, 17, 128, 144] {
        let mut longer = good.clone();
        longer.extend(std::iter::repeat_n(0u8, extra));
        assert!(
            blob::open(p, &longer, &key()).is_err(),
            "+{extra} bytes opens"
        );
    }
    // And through the whole mount path, one alteration per region.
    let s = Sample::small();
    let blob_path = s.sealed().join(blob::FILE_NAME);
    let start = 14 + hlen;
    for (what, at) in [
        ("magic", 3),
        ("header length", 11),
        ("header", 14 + hlen / 2),
        ("first chunk", start + 5),
        ("first tag", start + 130),
        ("middle chunk", start + 144 * (chunks / 2) + 40),
        ("last tag", good.len() - 1),
    ] {
        let mut bad = good.clone();
        bad[at] ^= 0x20;
        fs::write(&blob_path, &bad).unwrap();
        let err = match build_view(&s.sealed()) {
            Ok(_) => panic!("{what} altered: the view builds"),
            Err(e) => e.to_string(),
        };
        assert!(err.contains("trusted.kllm"), "{what}: {err}");
    }
    eprintln!(
        "trusted.kllm of {} bytes ({chunks} chunks): {refused} single-bit alterations, {} cuts, 6 extensions, all refused",
        good.len(),
        good.len()
    );
}

// ---------------------------------------------------------------------------------------
// 2. Every byte of a locked shard's header altered
// ---------------------------------------------------------------------------------------

#[derive(Default, Debug)]
struct HeaderOutcomes {
    refused: usize,
    eio: usize,
    same_data: usize,
    different_data: Vec<usize>,
}

/// Flip one bit of every byte of a locked shard's length prefix and header, and decode the
/// whole file as the mount would.
fn alter_every_header_byte(bit: u8) -> HeaderOutcomes {
    let s = Sample::new(KEY, 16, 1, Some(Version::V2), |_| {});
    let rel = &locked_shards(&s.sealed())[0];
    let path = s.sealed().join(rel);
    let sealed = fs::read(&path).unwrap();
    let want = &view_files(&s.sealed())[rel];
    let ds = data_start(&sealed);
    let mut out = HeaderOutcomes::default();
    for i in 0..ds {
        let mut bad = sealed.clone();
        bad[i] ^= 1 << bit;
        let n = u64::from_le_bytes(bad[..8].try_into().unwrap());
        if n > kllm_mount::shard::MAX_HEADER || 8 + n > bad.len() as u64 {
            out.refused += 1;
            continue;
        }
        let shard = match Shard::from_header(
            &path,
            &bad[8..8 + n as usize],
            bad.len() as u64,
            "",
            &key(),
        ) {
            Ok(s) => s,
            Err(_) => {
                out.refused += 1;
                continue;
            }
        };
        let raw = |at: u64, buf: &mut [u8]| -> io::Result<()> {
            buf.copy_from_slice(&bad[at as usize..at as usize + buf.len()]);
            Ok(())
        };
        let mut got = vec![0u8; bad.len()];
        match shard.read(0, &mut got, &raw) {
            Err(_) => out.eio += 1,
            // Same data region: the header may say something else (a metadata string), the
            // tensors are what was sealed.
            Ok(()) if got.len() == want.len() && got[ds..] == want[ds..] => out.same_data += 1,
            Ok(()) => out.different_data.push(i),
        }
    }
    out
}

#[test]
fn every_byte_of_a_shard_header_altered_is_refused_or_harmless() {
    // Flipping bit 0 turns digits into digits and letters into letters: the alterations
    // most likely to keep the JSON valid.
    let out = alter_every_header_byte(0);
    eprintln!("shard header, bit 0 of every byte flipped: {out:?}");
    // No panic got here. What the format cannot catch is pinned by the ignored test below.
    assert!(out.refused > 0);
}

#[test]
#[ignore = "format limit, not fixable in src alone: shard headers carry no authentication, so \
            some one-bit edits of a header (a tensor name in kllm.lock) are served as \
            silently different tensor data; see docs/SECURITY.md"]
fn no_header_alteration_serves_different_data() {
    for bit in [0, 1, 5] {
        let out = alter_every_header_byte(bit);
        assert!(
            out.different_data.is_empty(),
            "bit {bit}: header bytes whose alteration changes the data served: {:?}",
            out.different_data
        );
    }
}

// ---------------------------------------------------------------------------------------
// 3. A locked shard truncated, extended, replaced while mounted
// ---------------------------------------------------------------------------------------

/// A sample mounted without the decoded-block cache, its largest locked shard, that
/// shard's view and the whole view.
struct Tamper {
    s: Sample,
    m: Mounted,
    rel: String,
    want: Vec<u8>,
    view: BTreeMap<String, Vec<u8>>,
}

fn mounted_for_tamper() -> Tamper {
    let s = Sample::new(KEY, 128, 2, Some(Version::V2), |_| {});
    let rel = locked_shards(&s.sealed())[0].clone();
    let view = view_files(&s.sealed());
    let want = view[&rel].clone();
    let m = mount_sample(&s, &["--cache-size", "0"]);
    assert_eq!(
        read_direct(&m.path(&rel)).unwrap(),
        want,
        "before tampering"
    );
    Tamper {
        s,
        m,
        rel,
        want,
        view,
    }
}

impl Tamper {
    /// The other files of the view still read as they should.
    fn others_unharmed(&self) {
        for (rel, bytes) in self.view.iter().filter(|(r, _)| **r != self.rel) {
            assert!(
                read_direct(&self.m.path(rel)).unwrap() == *bytes,
                "{rel} differs"
            );
        }
    }
}

/// Every 4 KiB piece of the view read on its own: each must equal the view or fail with
/// EIO. Returns the offsets that failed.
fn pieces_eio_or_right(m: &Mounted, rel: &str, want: &[u8], what: &str) -> Vec<u64> {
    let f = open_direct(&m.path(rel));
    let mut failed = Vec::new();
    for off in (0..want.len() as u64).step_by(4096) {
        let end = (off as usize + 4096).min(want.len());
        match pread(&f, off, 4096) {
            Ok(got) => assert!(
                got == want[off as usize..end],
                "{what}: wrong bytes served at [{off}, {end})"
            ),
            Err(e) => {
                assert_eq!(e.raw_os_error(), Some(EIO), "{what} at {off}: {e}");
                failed.push(off);
            }
        }
    }
    failed
}

#[test]
fn truncated_shard_gives_eio_past_the_cut_and_right_bytes_before() {
    let t = mounted_for_tamper();
    let (s, m, rel, want) = (&t.s, &t.m, &t.rel, &t.want);
    let path = s.sealed().join(rel);
    let original = fs::read(&path).unwrap();
    let ds = data_start(&original) as u64;
    let cut = ds + (original.len() as u64 - ds) / 2;
    OpenOptions::new()
        .write(true)
        .open(&path)
        .unwrap()
        .set_len(cut)
        .unwrap();
    // The size changed: the mount cannot tell which bytes stayed, so every piece is EIO
    // or right, and those past the cut cannot be right.
    let failed = pieces_eio_or_right(m, rel, want, "truncated");
    assert!(
        failed.iter().any(|&off| off + 4096 > cut),
        "nothing failed past the cut at {cut}"
    );
    assert_eq!(errno_of(read_direct(&m.path(rel)), "whole file"), EIO);
    // Through the page cache too.
    let e = fs::read(m.path(rel));
    assert!(
        e.as_ref().is_err_and(|e| e.raw_os_error() == Some(EIO))
            || e.as_ref().is_ok_and(|v| v == want),
        "buffered read of the truncated shard: {:?}",
        e.map(|v| v.len())
    );
    m.assert_alive("after reads of a truncated shard");
    // Put back: the same size with a new modification time is a rewrite the mount cannot
    // tell from another content, so it serves the view's bytes or EIO, never others.
    fs::write(&path, &original).unwrap();
    match read_direct(&m.path(rel)) {
        Ok(v) => assert!(v == *want, "restored shard served other bytes"),
        Err(e) => assert_eq!(e.raw_os_error(), Some(EIO), "restored: {e}"),
    }
    // Cut inside the header region of the file: the view's header is in memory, the data fails.
    OpenOptions::new()
        .write(true)
        .open(&path)
        .unwrap()
        .set_len(ds / 2)
        .unwrap();
    let f = open_direct(&m.path(rel));
    assert_eq!(pread(&f, 0, ds as usize).unwrap(), want[..ds as usize]);
    assert_eq!(errno_of(pread(&f, ds, 100), "data after a cut header"), EIO);
    fs::write(&path, b"").unwrap();
    assert_eq!(errno_of(pread(&f, ds, 1), "emptied shard"), EIO);
    m.assert_alive("after reads of an emptied shard");
    t.others_unharmed();
}

#[test]
fn extended_shard_reads_as_its_view_or_eio() {
    let t = mounted_for_tamper();
    let (s, m, rel, want) = (&t.s, &t.m, &t.rel, &t.want);
    let path = s.sealed().join(rel);
    let mut f = OpenOptions::new().append(true).open(&path).unwrap();
    f.write_all(&testseal::pseudo_random(7, 1 << 20)).unwrap();
    f.sync_all().unwrap();
    assert_eq!(
        fs::metadata(m.path(rel)).unwrap().len(),
        want.len() as u64,
        "the view keeps the size it was mounted with"
    );
    // Bytes appended cannot be told from a rewrite of another size by stat alone: the
    // mount may serve the view or refuse with EIO, never other bytes.
    pieces_eio_or_right(m, rel, want, "extended");
    let f = open_direct(&m.path(rel));
    assert_eq!(
        pread(&f, want.len() as u64, 4096).unwrap(),
        b"",
        "past the end"
    );
    m.assert_alive("after reads of an extended shard");
    t.others_unharmed();
}

/// The same layout sealed under another key: every tensor's bytes differ, every value is
/// still inside its domain.
fn other_sealing(rel: &str) -> (TempDir, Vec<u8>) {
    let tmp = tempfile::tempdir().unwrap();
    testseal::write_sample_model(&tmp.path().join("plain"), 128, 2).unwrap();
    testseal::seal_dir(
        &tmp.path().join("plain"),
        &tmp.path().join("sealed"),
        &ModelKey::new([0x17; 32]),
        Some(Version::V2),
        [3; 16],
    )
    .unwrap();
    let bytes = fs::read(tmp.path().join("sealed").join(rel)).unwrap();
    (tmp, bytes)
}

#[test]
fn shard_replaced_by_rename_serves_the_mounted_file_or_eio() {
    let t = mounted_for_tamper();
    let (s, m, rel, want) = (&t.s, &t.m, &t.rel, &t.want);
    let (_other_dir, other) = other_sealing(rel);
    let path = s.sealed().join(rel);
    assert_eq!(other.len() as u64, fs::metadata(&path).unwrap().len());
    let tmp = s.sealed().join(".replacement");
    fs::write(&tmp, &other).unwrap();
    fs::rename(&tmp, &path).unwrap();
    // The daemon holds the mounted inode, whose bytes did not change: serving them is best.
    // EIO is safe too (the unlink changes the inode's link count and change time, which a
    // check of the change time would see).
    pieces_eio_or_right(m, rel, want, "replaced by rename");
    let whole = |what: &str| match read_direct(&m.path(rel)) {
        Ok(got) => assert!(got == *want, "{what}: wrong bytes"),
        Err(e) => assert_eq!(e.raw_os_error(), Some(EIO), "{what}: {e}"),
    };
    whole("after rename");
    // Removed altogether: still the mounted file, or EIO.
    fs::remove_file(&path).unwrap();
    whole("after unlink");
    m.assert_alive("after the shard was replaced");
    t.others_unharmed();
}

#[test]
fn shard_rewritten_in_place_gives_eio_or_the_old_bytes() {
    let t = mounted_for_tamper();
    let (s, m, rel, want) = (&t.s, &t.m, &t.rel, &t.want);
    let (_other_dir, other) = other_sealing(rel);
    let path = s.sealed().join(rel);
    let original = fs::read(&path).unwrap();
    let f = OpenOptions::new().write(true).open(&path).unwrap();
    // A range of zeros in place (a torn write, a hole punched).
    let ds = data_start(&original);
    f.write_all_at(&[0u8; 4096], (ds + 100) as u64).unwrap();
    f.sync_all().unwrap();
    pieces_eio_or_right(m, rel, want, "zero-filled in place");
    // Same inode, other content (what `cp`, `dd conv=notrunc` or a copy cut short leave).
    f.write_all_at(&other, 0).unwrap();
    f.sync_all().unwrap();
    pieces_eio_or_right(m, rel, want, "rewritten in place");
    m.assert_alive("after the in-place rewrite");
}

/// `cp other shard` onto the mounted shard truncates it and writes the other file, whose size
/// need not be the same; a torn copy leaves it shorter. Either way the inode is the mounted
/// one and its bytes are not.
#[test]
fn shard_rewritten_in_place_with_another_size_gives_eio_or_the_old_bytes() {
    let t = mounted_for_tamper();
    let (s, m, rel, want) = (&t.s, &t.m, &t.rel, &t.want);
    let (_other_dir, other) = other_sealing(rel);
    let path = s.sealed().join(rel);
    // Longer: the other sealing and a tail (as another model's larger shard would be).
    let mut longer = other.clone();
    longer.extend_from_slice(&testseal::pseudo_random(3, 64 << 10));
    fs::write(&path, &longer).unwrap(); // O_TRUNC: same inode
    pieces_eio_or_right(m, rel, want, "rewritten in place, longer");
    // Shorter: a copy cut short two thirds of the way.
    fs::write(&path, &other[..other.len() * 2 / 3]).unwrap();
    pieces_eio_or_right(m, rel, want, "rewritten in place, shorter");
    m.assert_alive("after the in-place rewrites");
}

/// A rewrite whose writer then sets the modification time back (`touch -r`, `cp -p`,
/// `rsync -t`, `utimensat`): size and mtime are as they were, the bytes are not. Only the
/// change time (which no caller can set) or the contents tell.
#[test]
fn shard_rewritten_with_its_time_set_back_gives_eio_or_the_old_bytes() {
    let t = mounted_for_tamper();
    let (s, m, rel, want) = (&t.s, &t.m, &t.rel, &t.want);
    let (_other_dir, other) = other_sealing(rel);
    let path = s.sealed().join(rel);
    let mtime = fs::metadata(&path).unwrap().modified().unwrap();
    let f = OpenOptions::new().write(true).open(&path).unwrap();
    assert_eq!(other.len() as u64, f.metadata().unwrap().len());
    f.write_all_at(&other, 0).unwrap();
    f.set_modified(mtime).unwrap();
    f.sync_all().unwrap();
    assert_eq!(fs::metadata(&path).unwrap().modified().unwrap(), mtime);
    pieces_eio_or_right(m, rel, want, "rewritten in place, time set back");
    m.assert_alive("after the rewrite");
}

// ---------------------------------------------------------------------------------------
// 4. Symbolic links
// ---------------------------------------------------------------------------------------

/// What the mount lists under `dir` (names), through the kernel.
fn listing(dir: &Path) -> BTreeSet<String> {
    fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("list {}: {e}", dir.display()))
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect()
}

#[test]
fn symlinks_inside_are_followed_outside_ones_are_not_shown() {
    let s = Sample::small();
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

    let view = view_files(&sealed);
    let m = mount_sample(&s, &[]);
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
    let want = view_files(&sealed)["sub/model.safetensors"].clone();
    symlink("sub", sealed.join("a-link")).unwrap();
    let view = view_files(&sealed);
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
    let s = Sample::small();
    let sealed = s.sealed();
    let shard = locked_shards(&sealed)[0].clone();
    fs::create_dir(sealed.join("sub")).unwrap();
    symlink(format!("../{shard}"), sealed.join("sub/alias.safetensors")).unwrap();
    let want = view_files(&sealed)[&shard].clone();
    let m = mount_sample(&s, &["--cache-size", "0"]);
    match read_direct(&m.path("sub/alias.safetensors")) {
        Ok(got) => assert!(got == want, "sub/alias.safetensors: wrong bytes"),
        Err(e) => assert_eq!(e.raw_os_error(), Some(libc::ENOENT), "{e}"),
    }
}

#[test]
fn plain_file_swapped_for_a_symlink_after_mount_is_not_followed() {
    let s = Sample::small();
    let sealed = s.sealed();
    let secret = s.root().join("root-only.txt");
    fs::write(&secret, "SECRET OUTSIDE THE SEALED DIRECTORY ".repeat(20)).unwrap();
    fs::set_permissions(&secret, fs::Permissions::from_mode(0o600)).unwrap();
    let want = fs::read(sealed.join("tokenizer_config.json")).unwrap();
    let m = mount_sample(&s, &[]);
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
fn pass_through_file_under_a_folder_swapped_for_a_link_is_not_followed() {
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
    let m = mount_sample(&s, &[]);
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

// ---------------------------------------------------------------------------------------
// 5. 100k tensors, deep folders, odd names
// ---------------------------------------------------------------------------------------

#[test]
fn header_with_100k_tensors() {
    const N: usize = 100_000;
    let tensors: Vec<Tensor> = (0..N)
        .map(|i| Tensor {
            name: format!("model.layers.{}.experts.{}.w", i / 1000, i % 1000),
            dtype: Dtype::BF16,
            shape: vec![4],
            data: testseal::sample_bf16(i as u64, 4),
        })
        .collect();
    let mut md = serde_json::Map::new();
    md.insert("format".into(), "pt".into());
    let t0 = Instant::now();
    let s = Sample::new(KEY, 16, 1, Some(Version::V2), |plain| {
        fs::write(
            plain.join("huge.safetensors"),
            safetensors_bytes(&tensors, &md),
        )
        .unwrap();
    });
    let sealed_in = t0.elapsed();
    let bytes = fs::read(s.sealed().join("huge.safetensors")).unwrap();
    let header_len = data_start(&bytes) - 8;
    assert!(String::from_utf8_lossy(&bytes[..header_len + 8]).contains("kllm.lock"));

    let t = Instant::now();
    let view = build_view(&s.sealed()).unwrap();
    let built_in = t.elapsed();
    let plain = fs::read(s.plain().join("huge.safetensors")).unwrap();
    let ino = view.resolve("huge.safetensors").unwrap();
    let got = view.read(ino, 0, bytes.len()).unwrap().to_vec();
    assert_eq!(got[data_start(&got)..], plain[data_start(&plain)..]);

    let t = Instant::now();
    let m = mount_sample(&s, &[]);
    let mounted_in = t.elapsed();
    let t = Instant::now();
    let through = read_direct(&m.path("huge.safetensors")).unwrap();
    let read_in = t.elapsed();
    assert!(through == got, "read through the mount differs");
    let mut rng = StdRng::seed_from_u64(100);
    let f = open_direct(&m.path("huge.safetensors"));
    for _ in 0..200 {
        let off = rng.gen_range(0..got.len() as u64);
        let len = rng.gen_range(1..=600);
        let end = (off as usize + len).min(got.len());
        assert_eq!(
            pread(&f, off, len).unwrap(),
            got[off as usize..end],
            "[{off}, +{len})"
        );
    }
    eprintln!(
        "100k tensors: header {header_len} bytes, file {} bytes; sealed in {sealed_in:?}, view built in {built_in:?}, \
         mounted (binary) in {mounted_in:?}, whole file read through the mount in {read_in:?}",
        bytes.len()
    );
    assert!(
        mounted_in < Duration::from_secs(60),
        "mount took {mounted_in:?}"
    );
    m.assert_alive("after the reads");
}

/// Compare the data region of every safetensors file of `plain` with the view's, and every
/// other file byte for byte (config.json and the secret files aside).
fn assert_view_matches_plain(plain: &Path, m: &Mounted, view: &BTreeMap<String, Vec<u8>>) {
    for (rel, path) in common::tree(plain) {
        // Names that are not UTF-8 are checked by the caller (tree() shows them lossily).
        if rel.contains('\u{FFFD}') {
            continue;
        }
        if rel == "config.json" || rel.ends_with("tokenizer.json") || rel.ends_with("vocab.json") {
            continue;
        }
        let want = fs::read(&path).unwrap();
        let got = read_direct(&m.path(&rel)).unwrap_or_else(|e| panic!("{rel:?}: {e}"));
        assert!(
            got == view[&rel],
            "{rel:?}: mount and in-process view differ"
        );
        if rel.ends_with(".safetensors") {
            assert!(
                got[data_start(&got)..] == want[data_start(&want)..],
                "{rel:?}: decoded tensors differ from the plain ones"
            );
        } else {
            assert!(got == want, "{rel:?}: differs");
        }
    }
}

fn small_shard(seed: u64) -> Vec<u8> {
    let tensors = [
        Tensor {
            name: "a.weight".into(),
            dtype: Dtype::BF16,
            shape: vec![32, 16],
            data: testseal::sample_bf16(seed, 512),
        },
        Tensor {
            name: "b.weight".into(),
            dtype: Dtype::BF16,
            shape: vec![300],
            data: testseal::sample_bf16(seed + 1, 300),
        },
    ];
    let mut md = serde_json::Map::new();
    md.insert("format".into(), "pt".into());
    safetensors_bytes(&tensors, &md)
}

#[test]
fn deep_folders() {
    const DEPTH: usize = 64;
    let rel_dir: PathBuf = (0..DEPTH).map(|i| format!("d{i:02}")).collect();
    let s = Sample::new(KEY, 16, 1, Some(Version::V2), |plain| {
        let dir = plain.join(&rel_dir);
        fs::create_dir_all(&dir).unwrap();
        fs::write(dir.join("model.safetensors"), small_shard(5)).unwrap();
        fs::write(dir.join("notes.txt"), b"at the bottom").unwrap();
        // Every level holds a file too.
        let mut d = plain.to_path_buf();
        for i in 0..DEPTH {
            d.push(format!("d{i:02}"));
            fs::write(d.join(format!("level-{i}.txt")), format!("level {i}")).unwrap();
        }
    });
    let deep = rel_dir.join("model.safetensors");
    assert!(locked_shards(&s.sealed()).contains(&deep.to_string_lossy().into_owned()));
    let view = view_files(&s.sealed());
    let m = mount_sample(&s, &[]);
    assert_view_matches_plain(&s.plain(), &m, &view);
    assert_eq!(
        fs::read(m.path(&rel_dir.join("notes.txt").to_string_lossy())).unwrap(),
        b"at the bottom"
    );
}

#[test]
fn odd_names() {
    let names: Vec<&str> = vec![
        "with space.json",
        "  leading and trailing  ",
        "ünïcödé-ファイル-😀.txt",
        "new\nline.txt",
        "tab\there",
        "-starts-with-dash",
        "quote\"s and 'apostrophes'",
        "back\\slash",
        "#hash%percent&amp;",
        "...",
        ".hidden",
        "trusted.kllm.bak",
        "kllm.key.txt",
    ];
    let long = "L".repeat(255);
    let odd_dir = "dir with space/ü ñ/new\nline";
    let s = Sample::new(KEY, 16, 1, Some(Version::V2), |plain| {
        for (i, n) in names
            .iter()
            .chain(std::iter::once(&long.as_str()))
            .enumerate()
        {
            fs::write(plain.join(n), format!("file {i}: {n}")).unwrap();
        }
        let d = plain.join(odd_dir);
        fs::create_dir_all(&d).unwrap();
        fs::write(d.join("odd shard ü.safetensors"), small_shard(9)).unwrap();
        fs::write(d.join("x y.txt"), b"in an odd folder").unwrap();
        // Not UTF-8 at all (kLLM cannot seal such a name, but the mount must not choke).
        fs::write(
            plain.join(OsStr::from_bytes(b"latin1-\xe9t\xe9.txt")),
            b"latin-1 name",
        )
        .unwrap();
    });
    let shard = format!("{odd_dir}/odd shard ü.safetensors");
    assert!(
        locked_shards(&s.sealed()).contains(&shard),
        "{shard:?} was not locked"
    );
    let view = view_files(&s.sealed());
    let m = mount_sample(&s, &[]);
    let top = listing(&m.mp);
    for n in names.iter().chain(std::iter::once(&long.as_str())) {
        assert!(top.contains(*n), "{n:?} not listed");
    }
    assert_view_matches_plain(&s.plain(), &m, &view);
    let latin = m.mp.join(OsStr::from_bytes(b"latin1-\xe9t\xe9.txt"));
    assert_eq!(fs::read(latin).unwrap(), b"latin-1 name");
}

// ---------------------------------------------------------------------------------------
// 6. Nothing plain reaches a disk
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
    if Path::new(target).starts_with(sealed) && flags & libc::O_ACCMODE == libc::O_RDONLY {
        return Ok(());
    }
    Err(format!("{target} (flags {flags:o})"))
}

#[test]
fn nothing_plain_reaches_a_disk_during_a_full_read() {
    let s = Sample::new(KEY, 512, 4, Some(Version::V2), |_| {});
    let view = view_files(&s.sealed());
    let m = mount_sample(&s, &["--cache-size", "64M"]);
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
        "descriptors other than the sealed files read-only, /dev/fuse, pipes and sockets: {bad:?}"
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
    let len = f.metadata().unwrap().len() as usize;
    if len == 0 {
        return Vec::new();
    }
    // SAFETY: a private read-only mapping of a file we hold open, unmapped below.
    unsafe {
        let p = libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ,
            libc::MAP_PRIVATE,
            f.as_raw_fd(),
            0,
        );
        assert_ne!(p, libc::MAP_FAILED, "mmap {}", path.display());
        let out = std::slice::from_raw_parts(p as *const u8, len).to_vec();
        libc::munmap(p, len);
        out
    }
}

// ---------------------------------------------------------------------------------------
// 7. Key hygiene
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
    let s = Sample::small();
    let m = mount_sample(&s, &[]);
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
    let s = Sample::small();
    let hexed = hex::encode(KEY);
    let m = mount_with(&s.sealed(), &[], |c| {
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
    let m = mount_with(&s.sealed(), &[OsStr::new("--key"), kf.as_os_str()], |c| {
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
    let want = view_files(&s.sealed())[&rel].clone();
    let m = mount_with(
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
    let m = mount_sample(&s, &["--cache-size", "64M"]);
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

// ---------------------------------------------------------------------------------------
// 8. Who may enter the mount
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
    let s = Sample::small();
    let m = mount_sample(&s, &[]);
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
    let s = Sample::small();
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
    let view = view_files(&sealed);
    let m = mount_sample(&s, &["-o", "allow_other"]);
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

// ---------------------------------------------------------------------------------------
// 9. Findings of the fuzzers and of review, pinned
// ---------------------------------------------------------------------------------------

#[test]
#[ignore = "kllm-mount bug (minor, fails safe): pyjson::dumps_sorted differs from Python's \
            json.dumps(sort_keys=True) for numbers serde_json cannot hold exactly: floats it \
            parses one ulp off (serde_json lacks its float_roundtrip feature) and integers \
            beyond 64 bits (Python keeps them exact). A passphrase key file holding such a \
            number is refused as a wrong passphrase. Found by fuzz target seal_meta."]
fn python_json_numbers_match_python() {
    // What Python 3 prints for json.dumps(json.loads(text), sort_keys=True).
    for (text, python) in [
        ("[1.2345e+29]", "[1.2345e+29]"),
        (
            "[123450000000000000000768276196]",
            "[123450000000000000000768276196]",
        ),
        ("[18446744073709551616]", "[18446744073709551616]"),
    ] {
        let v: serde_json::Value = serde_json::from_str(text).unwrap();
        assert_eq!(kllm_mount::pyjson::dumps_sorted(&v), python, "{text}");
    }
}

#[test]
fn links_to_hidden_files_stay_hidden() {
    let s = Sample::small();
    let sealed = s.sealed();
    fs::copy(s.key_file(), sealed.join("kllm.key")).unwrap();
    symlink("kllm.key", sealed.join("key.json")).unwrap();
    symlink("trusted.kllm", sealed.join("blob.bin")).unwrap();
    let view = view_files(&sealed);
    for shown in ["key.json", "blob.bin"] {
        assert!(
            !view.contains_key(shown),
            "{shown} (a link to a hidden file) is shown"
        );
    }
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
    let view = view_files(&s.sealed());
    let log = s.root().join("daemon.log");
    let key_file = s.key_file();
    let args: Vec<&OsStr> = vec![
        OsStr::new("--key"),
        key_file.as_os_str(),
        OsStr::new("--log-file"),
        log.as_os_str(),
    ];
    let m = mount_with(&s.sealed(), &args, |c| {
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

/// Found by fuzz target seal_meta: serde_json (with `raw_value`) cannot parse a document
/// whose key is its private marker `$serde_json::private::RawValue`, though the JSON is
/// valid (Python reads it). The mount must refuse such seal metadata with its one line,
/// never panic; an escaped marker (`\u0024...`) parses and is kept.
#[test]
fn serde_raw_value_marker_in_seal_metadata_is_refused_cleanly() {
    let s = Sample::small();
    let cfg = s.sealed().join("config.json");
    let text = fs::read_to_string(&cfg).unwrap();
    let literal = text.replacen('{', "{\"$serde_json::private::RawValue\": 1,", 1);
    fs::write(&cfg, &literal).unwrap();
    let err = match build_view(&s.sealed()) {
        Ok(_) => panic!("seal metadata with the serde marker key was accepted"),
        Err(e) => e.to_string(),
    };
    assert!(err.contains("config.json"), "{err}");
    let escaped = text.replacen('{', "{\"\\u0024serde_json::private::RawValue\": 1,", 1);
    fs::write(&cfg, &escaped).unwrap();
    match build_view(&s.sealed()) {
        Ok(view) => {
            let ino = view.resolve("config.json").unwrap();
            let size = view.node(ino).unwrap().attr.size as usize;
            let shown = view.read(ino, 0, size).unwrap().to_vec();
            let shown = String::from_utf8(shown).unwrap();
            assert!(!shown.contains("\"lock\""), "{shown}");
        }
        // Refusing it is safe too; panicking is not (reaching here means no panic).
        Err(e) => assert!(e.to_string().contains("config.json"), "{e}"),
    }
}
