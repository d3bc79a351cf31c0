//! SHA-256 of whole files, read by `pread` with reading and hashing overlapped: the hasher
//! of the manifest check and of the view's check of a file on first use. And a digest fed by
//! whoever reads a file's bytes in order anyway (a fill of a remote file), so that its
//! check does not read the file a second time.

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::mpsc;

use parking_lot::{Condvar, Mutex};
use sha2::{Digest, Sha256};

/// Reads per `pread`: large enough that the syscall cost vanishes next to hashing, small
/// enough that two buffers per hashing thread stay cheap.
pub const READ_CHUNK: usize = 4 << 20;

/// Opens a regular file for reading; anything else is refused without blocking (opening a
/// FIFO would wait for a writer).
pub fn open_regular(path: &Path) -> io::Result<File> {
    use std::os::unix::fs::OpenOptionsExt;
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY)
        .open(path)?;
    if !file.metadata()?.is_file() {
        return Err(io::Error::other("not a regular file"));
    }
    Ok(file)
}

/// A file's SHA-256 being computed by a [`DigestFeeder`], for whoever waits for it.
#[derive(Default)]
pub struct DigestFeed {
    state: Mutex<Feed>,
    changed: Condvar,
    /// Bytes hashed so far.
    fed: std::sync::atomic::AtomicU64,
}

#[derive(Default, Clone, Copy)]
enum Feed {
    #[default]
    Pending,
    Ready([u8; 32]),
    GaveUp,
}

impl DigestFeed {
    /// A feed and its only feeder, for a file of `len` bytes.
    pub fn start(len: u64) -> (std::sync::Arc<DigestFeed>, DigestFeeder) {
        let feed = std::sync::Arc::new(DigestFeed::default());
        let feeder = DigestFeeder {
            feed: feed.clone(),
            hasher: Sha256::new(),
            next: 0,
            len,
        };
        (feed, feeder)
    }

    /// The digest once fed whole; `None` when the feeder gave up (the caller hashes the file
    /// itself).
    pub fn wait(&self) -> Option<[u8; 32]> {
        let mut s = self.state.lock();
        loop {
            match *s {
                Feed::Pending => self.changed.wait(&mut s),
                Feed::Ready(d) => return Some(d),
                Feed::GaveUp => return None,
            }
        }
    }

    /// How many bytes from the start were hashed so far.
    pub fn fed(&self) -> u64 {
        self.fed.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Whether the feeder gave up.
    pub fn gave_up(&self) -> bool {
        matches!(*self.state.lock(), Feed::GaveUp)
    }

    fn end(&self, to: Feed) {
        let mut s = self.state.lock();
        if matches!(*s, Feed::Pending) {
            *s = to;
            self.changed.notify_all();
        }
    }
}

/// Hashes a file's bytes given in order from offset 0. Bytes given out of order, or a feeder
/// dropped before the end, give up the feed: no waiter waits forever.
pub struct DigestFeeder {
    feed: std::sync::Arc<DigestFeed>,
    hasher: Sha256,
    next: u64,
    len: u64,
}

impl DigestFeeder {
    /// Hash `bytes`, the file's bytes at `off`; the digest is given once the last byte is.
    /// False (and the feed given up) unless `off` is where the bytes before ended.
    pub fn feed(&mut self, off: u64, bytes: &[u8]) -> bool {
        if off != self.next || self.next >= self.len {
            self.feed.end(Feed::GaveUp);
            return false;
        }
        self.hasher.update(bytes);
        self.next += bytes.len() as u64;
        self.feed
            .fed
            .store(self.next, std::sync::atomic::Ordering::Relaxed);
        self.finish_if_whole();
        true
    }

    /// Give the digest if every byte was fed (an empty file at once).
    pub fn finish_if_whole(&mut self) {
        if self.next == self.len {
            let digest = std::mem::take(&mut self.hasher).finalize().into();
            self.feed.end(Feed::Ready(digest));
        }
    }
}

impl Drop for DigestFeeder {
    fn drop(&mut self) {
        self.feed.end(Feed::GaveUp);
    }
}

/// Reads `buf.len()` bytes at `offset`, or fewer at the end of the file.
fn read_full_at(file: &File, buf: &mut [u8], offset: u64) -> io::Result<usize> {
    let mut done = 0;
    while done < buf.len() {
        match file.read_at(&mut buf[done..], offset + done as u64) {
            Ok(0) => break,
            Ok(n) => done += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(done)
}

/// SHA-256 of a whole file from offset 0, by `pread` (the file's position is untouched).
pub fn sha256_file(file: &File) -> io::Result<[u8; 32]> {
    sha256_file_counting(file, &|_| {})
}

/// [`sha256_file`], calling `on_bytes(n)` after each `n` bytes hashed. A file larger than
/// one [`READ_CHUNK`] is read on a second thread into one buffer while the other is hashed.
pub fn sha256_file_counting(file: &File, on_bytes: &(dyn Fn(u64) + Sync)) -> io::Result<[u8; 32]> {
    // SAFETY: advice only; a failure changes nothing but speed.
    unsafe {
        use std::os::fd::AsRawFd;
        libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_SEQUENTIAL);
    }
    let mut hasher = Sha256::new();
    let mut first = vec![0u8; READ_CHUNK];
    let n = read_full_at(file, &mut first, 0)?;
    if n < READ_CHUNK {
        hasher.update(&first[..n]);
        on_bytes(n as u64);
        return Ok(hasher.finalize().into());
    }
    let (full_tx, full_rx) = mpsc::sync_channel::<io::Result<(Vec<u8>, usize)>>(1);
    let (empty_tx, empty_rx) = mpsc::sync_channel::<Vec<u8>>(2);
    empty_tx.send(vec![0u8; READ_CHUNK]).expect("fresh channel");
    // `move`: the channel ends live in the scope, so the reader sees a hang-up when it ends.
    // SAFETY: gettid has no preconditions.
    let hasher_tid = unsafe { libc::gettid() };
    std::thread::scope(move |scope| {
        // Named after its hasher, whose place (background or urged) it takes before each
        // read: it inherits the hasher's policy when started, but only the hasher is urged
        // (`crate::background::follow`).
        let reader = std::thread::Builder::new().name(format!("kllm-rd{hasher_tid}"));
        let started = reader.spawn_scoped(scope, move || {
            let mut offset = n as u64;
            // Ends when the hasher hangs up (error or done) or at the end of the file.
            while let Ok(mut buf) = empty_rx.recv() {
                crate::background::follow(hasher_tid);
                let got = read_full_at(file, &mut buf, offset);
                let last = !matches!(got, Ok(k) if k == READ_CHUNK);
                if let Ok(k) = got {
                    offset += k as u64;
                }
                if full_tx.send(got.map(|k| (buf, k))).is_err() || last {
                    break;
                }
            }
        });
        // Without its reader the loop below would end early with a wrong digest.
        started?;
        hasher.update(&first);
        on_bytes(n as u64);
        let mut spare = Some(first);
        loop {
            if let Some(buf) = spare.take() {
                // The reader may already be gone after its last chunk.
                let _ = empty_tx.send(buf);
            }
            let (buf, k) = match full_rx.recv() {
                Ok(r) => r?,
                Err(_) => break,
            };
            hasher.update(&buf[..k]);
            on_bytes(k as u64);
            if k < READ_CHUNK {
                break;
            }
            spare = Some(buf);
        }
        Ok(hasher.finalize().into())
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU64, Ordering};

    /// The thread that reads a file for its hash takes the hasher's place before each read:
    /// in the background while the hasher is, in the foreground once the hasher is urged.
    #[test]
    fn the_reader_takes_its_hashers_place() {
        use crate::background::{background_place, place_of, run_in_background, Background};
        let mut file = tempfile::tempfile().unwrap();
        let chunks = 8;
        io::Write::write_all(&mut file, &vec![7u8; chunks * READ_CHUNK]).unwrap();
        let hashing = std::thread::spawn(move || {
            // SAFETY: gettid has no preconditions.
            let me = unsafe { libc::gettid() };
            run_in_background(me, true);
            let seen = Mutex::new(Vec::new());
            let reader = format!("kllm-rd{me}");
            let on_bytes = |_| {
                let mut seen = seen.lock();
                let tasks = std::fs::read_dir("/proc/thread-self/..").unwrap();
                let found = tasks.filter_map(|t| t.ok()).find(|t| {
                    std::fs::read_to_string(t.path().join("comm"))
                        .is_ok_and(|c| c.trim_end() == reader)
                });
                if let Some(t) = found {
                    let tid: libc::pid_t = t.file_name().to_str().unwrap().parse().unwrap();
                    seen.push((place_of(me), place_of(tid)));
                    if seen.len() == 2 {
                        run_in_background(me, false);
                    }
                }
            };
            sha256_file_counting(&file, &on_bytes).unwrap();
            seen.into_inner()
        });
        let seen = hashing.join().unwrap();
        assert!(seen.len() >= 5, "the reader was not seen: {seen:?}");
        assert_eq!(seen[0].1, background_place(), "(hasher, reader): {seen:?}");
        let (hasher, reader) = *seen.last().unwrap();
        assert_eq!(reader, hasher, "urged: (hasher, reader): {seen:?}");
        if Background::chosen() == Background::Idle {
            assert_eq!(reader, (libc::SCHED_OTHER, 0), "{seen:?}");
        }
    }

    #[test]
    fn a_feed_gives_the_digest_of_bytes_fed_in_order() {
        let (feed, mut feeder) = DigestFeed::start(6);
        assert!(feeder.feed(0, b"ab"));
        assert!(feeder.feed(2, b"cdef"));
        let want: [u8; 32] = Sha256::digest(b"abcdef").into();
        assert_eq!(feed.wait(), Some(want));
        drop(feeder);
        assert_eq!(feed.wait(), Some(want), "a finished feed stays given");

        let (feed, mut feeder) = DigestFeed::start(0);
        feeder.finish_if_whole();
        assert_eq!(
            feed.wait().map(hex::encode).as_deref(),
            Some("e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855")
        );
    }

    #[test]
    fn a_feed_is_given_up_out_of_order_or_when_its_feeder_goes() {
        let (feed, mut feeder) = DigestFeed::start(6);
        assert!(feeder.feed(0, b"ab"));
        assert!(!feeder.feed(4, b"ef"), "a gap");
        assert_eq!(feed.wait(), None);

        let (feed, mut feeder) = DigestFeed::start(6);
        assert!(feeder.feed(0, b"abc"));
        feeder.finish_if_whole();
        assert!(!feed.gave_up());
        // A waiter on another thread is woken when the feeder goes half way.
        let waiter = {
            let feed = feed.clone();
            std::thread::spawn(move || feed.wait())
        };
        std::thread::sleep(std::time::Duration::from_millis(20));
        drop(feeder);
        assert_eq!(waiter.join().unwrap(), None);
        assert!(feed.gave_up());
    }

    #[test]
    fn digest_of_known_files_across_the_double_buffered_path() {
        let tmp = tempfile::tempdir().unwrap();
        let empty = tmp.path().join("empty");
        std::fs::write(&empty, b"").unwrap();
        assert_eq!(
            hex::encode(sha256_file(&File::open(&empty).unwrap()).unwrap()),
            "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
        );
        let abc = tmp.path().join("abc");
        std::fs::write(&abc, b"abc").unwrap();
        assert_eq!(
            hex::encode(sha256_file(&File::open(&abc).unwrap()).unwrap()),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
        // Sizes around the chunk edges take the reader thread; compare with one-shot hashing.
        for len in [
            READ_CHUNK,
            READ_CHUNK + 1,
            2 * READ_CHUNK,
            2 * READ_CHUNK + 7,
        ] {
            let data: Vec<u8> = (0..len).map(|i| (i * 7 + i / 4099) as u8).collect();
            let p = tmp.path().join(format!("f{len}"));
            std::fs::write(&p, &data).unwrap();
            let counted = AtomicU64::new(0);
            let got = sha256_file_counting(&File::open(&p).unwrap(), &|n| {
                counted.fetch_add(n, Ordering::Relaxed);
            })
            .unwrap();
            assert_eq!(got, <[u8; 32]>::from(Sha256::digest(&data)), "len {len}");
            assert_eq!(counted.load(Ordering::Relaxed), len as u64);
        }
    }
}
