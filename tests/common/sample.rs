//! A sample checkpoint sealed by the project's own sealer in a temporary directory other
//! users can reach (mode 0755), and its view as the kernel-free core reads it.

use std::collections::BTreeMap;
use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use kllm_mount::key::ModelKey;
use kllm_mount::lock::Version;
use kllm_mount::sealed::{self, Options};
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

    /// Every file of the view as the core reads it now (no cache), by path.
    pub fn view(&self) -> BTreeMap<String, Vec<u8>> {
        let opts = Options {
            cache_bytes: 0,
            ..Options::default()
        };
        files_of(&sealed::open(&self.sealed(), &self.key, &"test", &opts).unwrap())
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
