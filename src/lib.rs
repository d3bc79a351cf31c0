pub mod blob;
pub mod error;
pub mod key;
pub mod lock;
pub mod pyjson;
pub use error::{Error, Result};
pub mod cache;
pub mod cli;
pub mod fuse;
pub mod manifest;
pub mod sealed;
pub mod secmem;
pub mod shard;
pub mod status;
#[cfg(feature = "seal")]
pub mod testseal;
pub mod view;
