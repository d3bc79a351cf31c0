//! Tampering with a sealed directory: every byte of trusted.kllm and of a locked shard's
//! header altered, seal metadata the JSON parser chokes on, and a locked shard truncated,
//! extended, replaced or rewritten while mounted. Each is refused, fails with EIO, or serves
//! the bytes that were sealed; never other bytes, never a panic.
//!
//! Tests marked `#[ignore]` pin a limit of the format (the reason names it, and
//! docs/SECURITY.md lists them); run them with `cargo test --test tamper -- --ignored`.
//!
//! They mount the binary in temporary directories (root, /dev/fuse and fusermount3, as the
//! CI machine has), through FUSE (`--mode fuse`: they hold the daemon's own read path to
//! account); a guard unmounts and ends the daemon even when a test panics.

mod common;

use std::collections::BTreeMap;
use std::fs::{self, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::FileExt;
use std::path::Path;

use kllm_mount::blob;
use kllm_mount::key::ModelKey;
use kllm_mount::lock::Version;
use kllm_mount::shard::Shard;
use kllm_mount::testseal;
use tempfile::TempDir;

use common::*;

const KEY: [u8; 32] = [0x6b; 32];
const EIO: i32 = libc::EIO;

fn key() -> ModelKey {
    ModelKey::new(KEY)
}

// ---------------------------------------------------------------------------------------
// Every region of trusted.kllm altered
// ---------------------------------------------------------------------------------------

/// A trusted.kllm of several chunks (128 bytes) holding two secret files.
fn small_chunked_blob() -> Vec<u8> {
    let files = [
        ("tokenizer.json", testseal::pseudo_random(1, 700)),
        ("vocab.json", testseal::pseudo_random(2, 300)),
    ];
    let payload = testseal::secrets_payload(&files);
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
    let s = Sample::small(KEY);
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
        let err = match s.open_view() {
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
// Every byte of a locked shard's header altered
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
    let want = &s.view()[rel];
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
// A locked shard truncated, extended, replaced while mounted
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
    let view = s.view();
    let want = view[&rel].clone();
    let m = s.mount_fuse(&["--cache-size", "0"]);
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
// Seal metadata the JSON parser chokes on
// ---------------------------------------------------------------------------------------

/// Found by fuzz target seal_meta: serde_json (with `raw_value`) cannot parse a document
/// whose key is its private marker `$serde_json::private::RawValue`, though the JSON is
/// valid (Python reads it). The mount must refuse such seal metadata with its one line,
/// never panic; an escaped marker (`\u0024...`) parses and is kept.
#[test]
fn serde_raw_value_marker_in_seal_metadata_is_refused_cleanly() {
    let s = Sample::small(KEY);
    let cfg = s.sealed().join("config.json");
    let text = fs::read_to_string(&cfg).unwrap();
    let literal = text.replacen('{', "{\"$serde_json::private::RawValue\": 1,", 1);
    fs::write(&cfg, &literal).unwrap();
    let err = match s.open_view() {
        Ok(_) => panic!("seal metadata with the serde marker key was accepted"),
        Err(e) => e.to_string(),
    };
    assert!(err.contains("config.json"), "{err}");
    let escaped = text.replacen('{', "{\"\\u0024serde_json::private::RawValue\": 1,", 1);
    fs::write(&cfg, &escaped).unwrap();
    match s.open_view() {
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
