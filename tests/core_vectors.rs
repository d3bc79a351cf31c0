//! The kernel-free core against every case: the checked-in fixtures (tests/fixtures), then
//! the extra suite when there is one (`KLLM_VECTORS`, or ../shared/vectors): the whole view,
//! and random ranges.

mod common;

use std::path::Path;

use common::*;
use kllm_mount::key;
use kllm_mount::sealed::{self, Options};
use kllm_mount::view::View;
use rand::{Rng, SeedableRng};
use zeroize::Zeroizing;

fn open_case(case: &Case, opts: &Options) -> Result<View, kllm_mount::Error> {
    let (path, pass) = case.key_file();
    let text = std::fs::read_to_string(&path).unwrap();
    let k = key::parse_key_file(&path, &text, || {
        Ok(Zeroizing::new(pass.clone().unwrap_or_default()))
    })?;
    sealed::open(&case.sealed(), &k, &path.display(), opts)
}

fn full(view: &View, rel: &str) -> Vec<u8> {
    let ino = view
        .resolve(rel)
        .unwrap_or_else(|| panic!("{rel} missing from the view"));
    let size = view.node(ino).unwrap().attr.size as usize;
    view.read(ino, 0, size + 10).unwrap().to_vec()
}

#[test]
fn every_good_vector_matches_its_view() {
    for opts in [
        Options::default(),
        Options {
            cache_bytes: 0,
            block_size: 1 << 20,
            ..Options::default()
        },
        Options {
            cache_bytes: 1 << 16,
            block_size: 4096,
            ..Options::default()
        },
    ] {
        for case in cases().iter().filter(|c| c.ok()) {
            let view = open_case(case, &opts).unwrap_or_else(|e| panic!("{}: {e}", case.name));
            let want = tree(&case.view());
            let got: Vec<String> = view.file_paths().into_iter().map(|(p, _)| p).collect();
            assert_eq!(
                got,
                want.keys().cloned().collect::<Vec<_>>(),
                "{}: file list",
                case.name
            );
            for (rel, path) in &want {
                let expected = std::fs::read(path).unwrap();
                let bytes = full(&view, rel);
                assert_same_file(&format!("{}/{rel}", case.name), &bytes, &expected);
            }
        }
    }
}

#[test]
fn views_are_byte_exact() {
    // Stronger than the vectors demand: kLLM's own output, byte for byte.
    for case in cases().iter().filter(|c| c.ok()) {
        let view = open_case(case, &Options::default()).unwrap();
        for (rel, path) in tree(&case.view()) {
            let expected = std::fs::read(&path).unwrap();
            assert!(
                full(&view, &rel) == expected,
                "{}/{rel} not byte-exact",
                case.name
            );
        }
    }
}

#[test]
fn random_ranges_equal_slices_of_the_whole() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    for case in cases().iter().filter(|c| c.ok()) {
        let view = open_case(
            case,
            &Options {
                cache_bytes: 1 << 16,
                block_size: 4096,
                ..Options::default()
            },
        )
        .unwrap();
        for (rel, path) in tree(&case.view()) {
            let expected = std::fs::read(&path).unwrap();
            let ino = view.resolve(&rel).unwrap();
            for _ in 0..50 {
                let off = rng.gen_range(0..=expected.len() as u64 + 3);
                let len = rng.gen_range(0..9000usize);
                let got = view.read(ino, off, len).unwrap();
                let lo = (off as usize).min(expected.len());
                let hi = (lo + len).min(expected.len());
                assert!(
                    *got == expected[lo..hi],
                    "{}/{rel} [{off}, +{len})",
                    case.name
                );
            }
        }
    }
}

#[test]
fn bad_vectors_are_refused_with_their_words() {
    for case in cases().iter().filter(|c| !c.ok()) {
        let err = match open_case(case, &Options::default()) {
            Ok(_) => panic!("{}: mounted, must be refused", case.name),
            Err(e) => e.to_string(),
        };
        case.assert_error_names(&err, &err);
        let _ = Path::new(&case.name);
    }
}

/// The lock flag of a sealed case: config.json's `kllm.lock`, or kllm.json's `lock`.
fn lock_flag(case: &Case) -> Option<String> {
    let read = |name: &str| -> Option<serde_json::Value> {
        let text = std::fs::read_to_string(case.sealed().join(name)).ok()?;
        serde_json::from_str(&text).ok()
    };
    let flag = match read("kllm.json") {
        Some(meta) => meta["lock"].clone(),
        None => read("config.json")?["kllm"]["lock"].clone(),
    };
    flag.as_str().map(str::to_owned)
}

#[test]
fn fixtures_cover_both_lock_versions_llms_and_pipelines() {
    // Trimming the fixtures must not quietly drop what the tests above exist to cover.
    let good: Vec<Case> = fixture_cases().into_iter().filter(|c| c.ok()).collect();
    for (version, pipeline) in [("v1", false), ("v2", false), ("v2", true)] {
        assert!(
            good.iter().any(|c| lock_flag(c).as_deref() == Some(version)
                && c.sealed().join("kllm.json").is_file() == pipeline),
            "no fixture {} locked with {version}",
            if pipeline { "pipeline" } else { "LLM" }
        );
    }
    for name in ["kllm_v1", "kllm_v2"] {
        let flag = lock_flag(&case(name));
        assert_eq!(flag.as_deref(), Some(&name[5..]), "{name}: lock flag");
    }
}
