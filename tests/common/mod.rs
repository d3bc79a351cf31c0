//! Shared by the integration tests and the stress example: the sealed cases and their
//! expected views (`vectors`), and the kernel-mount harness (`harness`).
#![allow(dead_code, unused_imports)]

pub mod harness;
pub mod vectors;

pub use harness::*;
pub use vectors::*;
