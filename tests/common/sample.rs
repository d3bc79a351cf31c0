//! A sample checkpoint sealed by the project's own sealer in a temporary directory other
//! users can reach (mode 0755), its view as the kernel-free core reads it, and [`Fixture`]:
//! a sample with that view kept, to compare with what a mount serves.

use std::collections::BTreeMap;
use std::ffi::OsStr;
use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use kllm_mount::key::ModelKey;
use kllm_mount::lock::Version;
use kllm_mount::sealed::{self, Options};
use kllm_mount::testkit::{Mnt, Mounted};
use kllm_mount::testseal;
use kllm_mount::view::View;
use tempfile::TempDir;

/// `plain/`, `sealed/` and `kllm.key` (an open key file, readable by all).
pub struct Sample {
    tmp: TempDir,
    key: ModelKey,
}

impl Sample {
    /// A sample checkpoint (`hidden` wide, `layers` deep), plus whatever `extra` writes into
    /// the plain directory, sealed under `key` with `lock`.
    pub fn new(
        key: [u8; 32],
        hidden: usize,
        layers: usize,
        lock: Option<Version>,
        extra: impl FnOnce(&Path),
    ) -> Sample {
        let tmp = tempfile::Builder::new()
            .prefix("kllm-sample.")
            .tempdir()
            .unwrap();
        fs::set_permissions(tmp.path(), fs::Permissions::from_mode(0o755)).unwrap();
        let s = Sample {
            tmp,
            key: ModelKey::new(key),
        };
        testseal::write_sample_model(&s.plain(), hidden, layers).unwrap();
        extra(&s.plain());
        testseal::seal_dir(&s.plain(), &s.sealed(), &s.key, lock, [3; 16]).unwrap();
        fs::write(s.key_file(), testseal::open_key_file(&s.key)).unwrap();
        fs::set_permissions(s.key_file(), fs::Permissions::from_mode(0o644)).unwrap();
        s
    }

    /// A small sample (64 wide, 2 layers) locked with v2.
    pub fn small(key: [u8; 32]) -> Sample {
        Sample::new(key, 64, 2, Some(Version::V2), |_| {})
    }

    pub fn key(&self) -> &ModelKey {
        &self.key
    }
    pub fn root(&self) -> PathBuf {
        fs::canonicalize(self.tmp.path()).unwrap()
    }
    pub fn plain(&self) -> PathBuf {
        self.root().join("plain")
    }
    pub fn sealed(&self) -> PathBuf {
        self.root().join("sealed")
    }
    pub fn key_file(&self) -> PathBuf {
        self.root().join("kllm.key")
    }

    /// The view of the sealed directory as it is now, built by the core (no cache).
    pub fn open_view(&self) -> kllm_mount::Result<View> {
        let opts = Options {
            cache_bytes: 0,
            ..Options::default()
        };
        sealed::open(&self.sealed(), &self.key, &"test", &opts)
    }

    /// The shards (`*.safetensors`) of the sealed directory by path, with their sealed sizes.
    pub fn sealed_shards(&self) -> Vec<(String, u64)> {
        self.view()
            .into_keys()
            .filter(|rel| rel.ends_with(".safetensors"))
            .map(|rel| {
                let len = fs::metadata(self.sealed().join(&rel)).unwrap().len();
                (rel, len)
            })
            .collect()
    }

    /// Every file of the view as the core reads it now (no cache), by path: the oracle
    /// (tests/core_vectors.rs holds the core to the shared vectors).
    pub fn view(&self) -> BTreeMap<String, Vec<u8>> {
        files_of(&self.open_view().unwrap())
    }

    /// [`Mounted::fuse`] of the sealed directory with `--key` and `extra`.
    pub fn mount_fuse(&self, extra: &[&str]) -> Mounted {
        let key_file = self.key_file();
        let mut args: Vec<&OsStr> = vec![OsStr::new("--key"), key_file.as_os_str()];
        args.extend(extra.iter().map(OsStr::new));
        Mounted::fuse(&self.sealed(), &args, |_| {})
    }
}

/// A sample and its view as sealed, for comparing with what a mount serves.
pub struct Fixture {
    pub s: Sample,
    pub view: BTreeMap<String, Vec<u8>>,
}

impl Fixture {
    /// A sample `hidden` wide and `layers` deep, locked with v2, and its view.
    pub fn new(key: [u8; 32], hidden: usize, layers: usize) -> Fixture {
        let s = Sample::new(key, hidden, layers, Some(Version::V2), |_| {});
        let view = s.view();
        Fixture { s, view }
    }

    pub fn sealed(&self) -> PathBuf {
        self.s.sealed()
    }

    pub fn key_file(&self) -> PathBuf {
        self.s.key_file()
    }

    /// A file of the view.
    pub fn bytes(&self, rel: &str) -> &[u8] {
        &self.view[rel]
    }

    /// Every file of the mount, read through the page cache, equals the view.
    pub fn assert_view(&self, m: &Mnt, label: &str) {
        for (rel, want) in &self.view {
            let got = fs::read(m.path(rel)).unwrap_or_else(|e| panic!("{label}: {rel}: {e}"));
            assert!(&got == want, "{label}: {rel} differs from the view");
        }
    }
}

/// Every file of a view, read whole through the core, by path.
pub fn files_of(view: &View) -> BTreeMap<String, Vec<u8>> {
    view.file_paths()
        .into_iter()
        .map(|(rel, ino)| {
            let size = view.node(ino).unwrap().attr.size as usize;
            (rel, view.read(ino, 0, size).unwrap().to_vec())
        })
        .collect()
}
