//! One error type for everything that can stop a mount: a sentence that names the file and
//! the problem, printed as the single line the command line promises.

use std::fmt;
use std::path::Path;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Error(String);

pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    pub fn new(msg: impl Into<String>) -> Self {
        Error(msg.into())
    }

    /// `<path>: <problem>`, the shape of every error about a file.
    pub fn at(path: &Path, msg: impl fmt::Display) -> Self {
        Error(format!("{}: {msg}", path.display()))
    }

    pub fn message(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Error {}

/// A read that cannot be served correctly. Each kind maps to the errno the kernel gets
/// ([`ReadError::errno`]); the message says why, for the log.
#[derive(Debug)]
pub enum ReadError {
    /// No such node.
    NotFound,
    /// A read of a directory.
    IsDir,
    /// The sealed file could not be read.
    Io(std::io::Error),
    /// A locked value outside its domain: the data on disk is not what was locked.
    Corrupt { tensor: String, unit: u64 },
    /// The sealed file changed since it was mounted.
    Changed,
    /// The file does not match the manifest it was sealed with (or could not be checked).
    Unverified(String),
}

impl ReadError {
    /// What the kernel is told: anything that would serve wrong bytes is EIO.
    pub fn errno(&self) -> i32 {
        match self {
            ReadError::NotFound => libc::ENOENT,
            ReadError::IsDir => libc::EISDIR,
            ReadError::Io(_)
            | ReadError::Corrupt { .. }
            | ReadError::Changed
            | ReadError::Unverified(_) => libc::EIO,
        }
    }
}

impl fmt::Display for ReadError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ReadError::NotFound => write!(f, "no such file"),
            ReadError::IsDir => write!(f, "is a directory"),
            ReadError::Io(e) => write!(f, "read failed: {e}"),
            ReadError::Changed => write!(
                f,
                "the sealed file changed after it was mounted; remount to serve it"
            ),
            ReadError::Corrupt { tensor, unit } => write!(
                f,
                "tensor {tensor}: value {unit} is outside its locked domain (corrupt or altered data)"
            ),
            ReadError::Unverified(why) => write!(f, "{why}"),
        }
    }
}

impl std::error::Error for ReadError {}

impl From<std::io::Error> for ReadError {
    fn from(e: std::io::Error) -> Self {
        ReadError::Io(e)
    }
}

/// For readers that speak `io` (a shard's raw reader, hashing): the why is kept.
impl From<ReadError> for std::io::Error {
    fn from(e: ReadError) -> Self {
        match e {
            ReadError::Io(e) => e,
            ReadError::NotFound => std::io::ErrorKind::NotFound.into(),
            other => std::io::Error::other(other.to_string()),
        }
    }
}
