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
