pub mod blob;
pub mod error;
pub mod kernel_mount;
pub mod key;
pub mod lock;
pub mod mounttab;
pub mod notify;
pub mod pyjson;
pub use error::{Error, Result};
pub mod cache;
pub mod cli;
pub mod fuse;
pub mod sealed;
pub mod secmem;
pub mod shard;
#[cfg(feature = "seal")]
pub mod testseal;
pub mod view;
