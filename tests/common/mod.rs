//! Shared by the integration tests: the sealed cases and their expected views (`vectors`),
//! samples sealed by the project's own sealer and fixtures of them (`sample`), facts of
//! sealed shards (`shards`), and the library's kernel-mount harness (`testkit`, which
//! examples/kllm-stress.rs uses too); a mounted daemon's log and status (`watch`); an S3
//! server (`s3server`) and a fault-injecting proxy (`faultproxy`) for remote sources.
#![allow(dead_code, unused_imports)]

pub mod faultproxy;
pub mod s3server;
pub mod sample;
pub mod shards;
pub mod vectors;
pub mod watch;

pub use kllm_mount::testkit::*;
pub use sample::{Fixture, Sample};
pub use shards::*;
pub use vectors::*;
pub use watch::*;
