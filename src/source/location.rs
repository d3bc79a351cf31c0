//! `<SEALED>` on the command line: a local directory, `s3://BUCKET/PREFIX`, or
//! `http(s)://HOST/PATH/`; and opening the source it names.

use std::path::{Path, PathBuf};
#[cfg(feature = "remote")]
use std::sync::Arc;

use super::without_secrets;
#[cfg(feature = "remote")]
use super::{local::LocalDir, remote::RemoteSettings, Source};
use crate::{Error, Result};

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Location {
    Local(PathBuf),
    #[cfg(feature = "remote")]
    S3(url::Url),
    #[cfg(feature = "remote")]
    Http(url::Url),
}

impl Location {
    pub fn parse(sealed: &Path) -> Result<Location> {
        let Some(text) = sealed.to_str() else {
            return Ok(Location::Local(sealed.to_path_buf()));
        };
        let scheme = text.split_once("://").map(|(s, _)| s.to_ascii_lowercase());
        let s3 = match scheme.as_deref() {
            Some("s3") => true,
            Some("http" | "https") => false,
            _ => return Ok(Location::Local(sealed.to_path_buf())),
        };
        Self::parse_url(text, s3)
    }

    #[cfg(not(feature = "remote"))]
    fn parse_url(text: &str, _s3: bool) -> Result<Location> {
        Err(Error::at(
            Path::new(&without_secrets(text)),
            "this build of kllm-mount reads local directories only \
             (object storage and HTTP are its cargo feature `remote`)",
        ))
    }

    #[cfg(feature = "remote")]
    fn parse_url(text: &str, s3: bool) -> Result<Location> {
        let url = url::Url::parse(text).map_err(|e| {
            Error::at(
                Path::new(&without_secrets(text)),
                format!("not a URL ({e})"),
            )
        })?;
        if !url.username().is_empty() || url.password().is_some() {
            return Err(Error::at(
                Path::new(&without_secrets(text)),
                "credentials in the URL are not taken: give them in the environment \
                 (AWS_ACCESS_KEY_ID, ...) or an AWS profile",
            ));
        }
        if url.query().is_some() || url.fragment().is_some() {
            return Err(Error::at(
                Path::new(&without_secrets(text)),
                "a query or fragment in the URL is not taken (it may hold a token)",
            ));
        }
        Ok(if s3 {
            Location::S3(url)
        } else {
            Location::Http(url)
        })
    }

    pub fn is_remote(&self) -> bool {
        #[cfg(feature = "remote")]
        return !matches!(self, Location::Local(_));
        #[cfg(not(feature = "remote"))]
        false
    }

    /// The source it names, listed and ready to open files.
    #[cfg(feature = "remote")]
    pub fn open(&self, settings: &RemoteSettings) -> Result<Arc<dyn Source>> {
        Ok(match self {
            Location::Local(dir) => Arc::new(LocalDir::new(dir)?),
            Location::S3(url) => Arc::new(super::s3::open(url, settings)?),
            Location::Http(url) => Arc::new(super::http::open(url, settings)?),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[cfg(not(feature = "remote"))]
    #[test]
    fn urls_are_refused_by_a_build_without_remote_sources() {
        let e = Location::parse(Path::new("s3://user:secret@bucket/model"))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("s3://bucket/model") && e.contains("`remote`"),
            "{e}"
        );
        assert!(!e.contains("secret"), "{e}");
        assert_eq!(
            Location::parse(Path::new("/srv/model")).unwrap(),
            Location::Local("/srv/model".into())
        );
    }

    #[cfg(feature = "remote")]
    #[test]
    fn urls_and_paths() {
        let p = |s: &str| Location::parse(Path::new(s));
        assert_eq!(
            p("/srv/model").unwrap(),
            Location::Local("/srv/model".into())
        );
        assert_eq!(p("s3:model").unwrap(), Location::Local("s3:model".into()));
        assert!(matches!(p("s3://bucket/a/b").unwrap(), Location::S3(_)));
        assert!(matches!(p("S3://bucket").unwrap(), Location::S3(_)));
        assert!(matches!(p("https://h/x/").unwrap(), Location::Http(_)));
        assert!(matches!(
            p("http://127.0.0.1:9/x").unwrap(),
            Location::Http(_)
        ));
        let e = p("https://user:secret@h/x").unwrap_err().to_string();
        assert!(e.contains("credentials") && !e.contains("secret"), "{e}");
        let e = p("https://h/x?X-Amz-Signature=abc")
            .unwrap_err()
            .to_string();
        assert!(!e.contains("abc"), "{e}");
        // Not URLs: named all the same, without their secrets.
        let e = p("https://[bad/x?X-Amz-Signature=abc")
            .unwrap_err()
            .to_string();
        assert!(e.contains("https://[bad/x") && !e.contains("abc"), "{e}");
        let e = p("https://u:pa/ss@h:x/y").unwrap_err().to_string();
        assert!(e.contains("https://h:x/y") && !e.contains("pa/ss"), "{e}");
    }
}
