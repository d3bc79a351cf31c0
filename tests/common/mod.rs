//! Shared by the integration tests and the stress example: the sealed cases and their
//! expected views (`vectors`), samples sealed by the project's own sealer (`sample`), and the
//! kernel-mount harness (`harness`); an S3 server (`s3server`) and a fault-injecting proxy
//! (`faultproxy`) for remote sources.
#![allow(dead_code, unused_imports)]

pub mod faultproxy;
pub mod harness;
pub mod s3server;
pub mod sample;
pub mod vectors;

pub use harness::*;
pub use sample::Sample;
pub use vectors::*;
