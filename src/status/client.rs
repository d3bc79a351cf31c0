//! The `--status` side: asks a mount's socket and returns its answer.

use std::io::{self, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::Value;

use super::{runtime_dirs, socket_name};
use crate::{Error, Result};

/// The longest answer `query` accepts.
const MAX_ANSWER: u64 = 1 << 20;

fn no_daemon(mountpoint: &Path) -> Error {
    Error::at(
        mountpoint,
        "no kllm-mount daemon answers for this mount point",
    )
}

/// Sends `request` to the mount's socket in `dirs` (the first that answers) and returns the
/// answer.
fn ask(dirs: &[PathBuf], mountpoint: &Path, request: &str) -> Result<String> {
    let name = socket_name(mountpoint).map_err(|_| no_daemon(mountpoint))?;
    for dir in dirs {
        let socket = dir.join(&name);
        let Ok(mut stream) = UnixStream::connect(&socket) else {
            continue;
        };
        let io = |e: io::Error| Error::at(&socket, format!("status socket: {e}"));
        stream
            .set_read_timeout(Some(Duration::from_secs(5)))
            .map_err(io)?;
        stream
            .set_write_timeout(Some(Duration::from_secs(5)))
            .map_err(io)?;
        stream
            .write_all(format!("{request}\n").as_bytes())
            .map_err(io)?;
        let _ = stream.shutdown(std::net::Shutdown::Write);
        let mut text = String::new();
        (&mut stream)
            .take(MAX_ANSWER + 1)
            .read_to_string(&mut text)
            .map_err(io)?;
        if text.len() as u64 > MAX_ANSWER {
            return Err(Error::at(
                &socket,
                "the daemon's answer is larger than 1 MiB",
            ));
        }
        if text.is_empty() {
            return Err(Error::at(
                &socket,
                "the daemon closed without answering (it answers only its own user and root)",
            ));
        }
        return Ok(text);
    }
    Err(no_daemon(mountpoint))
}

/// The status object of the daemon serving `mountpoint`, from either socket folder.
pub fn query(mountpoint: &Path) -> Result<Value> {
    query_in(&runtime_dirs(), mountpoint)
}

/// [`query`] in the folders given.
pub fn query_in(dirs: &[PathBuf], mountpoint: &Path) -> Result<Value> {
    let text = ask(dirs, mountpoint, "status")?;
    serde_json::from_str(text.trim_end())
        .map_err(|e| Error::at(mountpoint, format!("the daemon's status is not JSON ({e})")))
}

/// The daemon's counters in Prometheus' text format.
pub fn metrics(mountpoint: &Path) -> Result<String> {
    ask(&runtime_dirs(), mountpoint, "metrics")
}

/// [`metrics`] in the folders given.
pub fn metrics_in(dirs: &[PathBuf], mountpoint: &Path) -> Result<String> {
    ask(dirs, mountpoint, "metrics")
}
