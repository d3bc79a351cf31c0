//! Shared by the integration tests: the sealed cases and their expected views (`vectors`),
//! samples sealed by the project's own sealer and fixtures of them (`sample`), facts of
//! sealed shards (`shards`), and the library's kernel-mount harness (`testkit`, which
//! examples/kllm-stress.rs uses too).
#![allow(dead_code, unused_imports)]

pub mod sample;
pub mod shards;
pub mod vectors;

pub use kllm_mount::testkit::*;
pub use sample::{Fixture, Sample};
pub use shards::*;
pub use vectors::*;
