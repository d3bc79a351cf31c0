//! A sealed checkpoint under a prefix of an S3-compatible bucket: `s3://BUCKET/PREFIX`.
//!
//! The usual AWS settings apply: `AWS_ENDPOINT_URL` (or `--endpoint-url`; an `http://`
//! endpoint is allowed, for a local MinIO or test server), `AWS_REGION`, `AWS_ACCESS_KEY_ID` /
//! `AWS_SECRET_ACCESS_KEY` / `AWS_SESSION_TOKEN`, and `AWS_PROFILE` (the shared credentials
//! and config files, read by [`profile`]). Requests are signed, retried and timed out by
//! `object_store`; listing the prefix gives every object's size and ETag, which fixes the
//! version each read must match.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use futures::{StreamExt, TryStreamExt};
use object_store::aws::{AmazonS3Builder, AmazonS3ConfigKey};
use object_store::path::Path as StorePath;
use object_store::{ObjectMeta, ObjectStore, ObjectStoreExt};

use super::remote::{client_options, listing, retry_config, Connect, Remote, RemoteSettings};
use super::{profile, Entry, Object, Source};
use crate::{Error, Result};

pub struct S3Source {
    remote: Arc<Remote>,
    /// `s3://BUCKET/PREFIX`, as given (never with credentials).
    shown: String,
    /// Every object under the prefix, by its path relative to it.
    objects: BTreeMap<String, ObjectMeta>,
}

impl S3Source {
    /// Connect and list `s3://BUCKET/PREFIX`; any failure is one line naming the URL.
    pub fn open(url: &url::Url, settings: &RemoteSettings) -> Result<S3Source> {
        let shown = url.as_str().trim_end_matches('/').to_string();
        let bucket = url.host_str().filter(|b| !b.is_empty()).ok_or_else(|| {
            Error::at(
                Path::new(&shown),
                "no bucket in the URL (s3://BUCKET/PREFIX)",
            )
        })?;
        let prefix = url.path().trim_matches('/').to_string();

        let mut b = AmazonS3Builder::from_env().with_bucket_name(bucket);
        let env_has_keys = std::env::var_os("AWS_ACCESS_KEY_ID").is_some();
        let profile = profile::load(std::env::var("AWS_PROFILE").ok().as_deref())
            .map_err(|e| Error::at(Path::new(&shown), e))?;
        if let Some(p) = &profile {
            if !env_has_keys {
                if let (Some(id), Some(secret)) = (&p.access_key_id, &p.secret_access_key) {
                    b = b
                        .with_access_key_id(id)
                        .with_secret_access_key(secret.as_str());
                    if let Some(t) = &p.session_token {
                        b = b.with_token(t.as_str());
                    }
                }
            }
            if std::env::var_os("AWS_REGION").is_none()
                && std::env::var_os("AWS_DEFAULT_REGION").is_none()
            {
                if let Some(r) = &p.region {
                    b = b.with_region(r);
                }
            }
            if b.get_config_value(&AmazonS3ConfigKey::Endpoint).is_none() {
                if let Some(e) = &p.endpoint_url {
                    b = b.with_endpoint(e);
                }
            }
        }
        if let Some(e) = &settings.endpoint_url {
            b = b.with_endpoint(e);
        }
        if std::env::var_os("AWS_DEFAULT_REGION").is_some()
            && b.get_config_value(&AmazonS3ConfigKey::Region).is_none()
        {
            b = b.with_region(std::env::var("AWS_DEFAULT_REGION").unwrap_or_default());
        }
        let endpoint = b.get_config_value(&AmazonS3ConfigKey::Endpoint);
        let plain_http = endpoint
            .as_deref()
            .is_some_and(|e| e.starts_with("http://"));
        let b = b
            .with_client_options(client_options(&settings.tuning, plain_http))
            .with_retry(retry_config(&settings.tuning));
        let err_at = shown.clone();
        let connect: Connect = Box::new(move || {
            let store = b.clone().build().map_err(|e| {
                Error::at(
                    Path::new(&err_at),
                    format!("bad S3 settings ({})", one_line(&e)),
                )
            })?;
            Ok(Arc::new(store) as Arc<dyn ObjectStore>)
        });
        let name = match &endpoint {
            Some(e) => format!("{shown} at {e}"),
            None => shown.clone(),
        };
        let remote = Remote::new(connect, name, settings)?;

        let list_prefix = (!prefix.is_empty()).then(|| StorePath::from(prefix.as_str()));
        let metas: Vec<ObjectMeta> = remote
            .call("listing", |store| async move {
                store.list(list_prefix.as_ref()).try_collect().await
            })?
            .map_err(|e| Error::at(Path::new(&shown), format!("cannot list ({})", one_line(&e))))?;
        let mut objects = BTreeMap::new();
        for m in metas {
            let full = m.location.as_ref();
            let rel = if prefix.is_empty() {
                full
            } else {
                match full
                    .strip_prefix(prefix.as_str())
                    .and_then(|r| r.strip_prefix('/'))
                {
                    Some(r) => r,
                    // `PREFIX-other/...`: another prefix that shares our name's start.
                    None => continue,
                }
            };
            objects.insert(rel.to_string(), m);
        }
        if objects.is_empty() {
            return Err(Error::at(Path::new(&shown), "no objects under this prefix"));
        }
        // Some servers list no ETags: a HEAD each gives the version reads must match.
        let untagged: Vec<ObjectMeta> = objects
            .values()
            .filter(|m| m.e_tag.is_none())
            .cloned()
            .collect();
        if !untagged.is_empty() {
            let in_flight = settings.tuning.in_flight.max(1);
            let heads: Vec<object_store::Result<ObjectMeta>> = remote
                .call("the objects' versions", |store| async move {
                    Ok(futures::stream::iter(untagged.into_iter().map(|m| {
                        let store = store.clone();
                        async move { store.head(&m.location).await }
                    }))
                    .buffer_unordered(in_flight)
                    .collect::<Vec<_>>()
                    .await)
                })?
                .map_err(|e| Error::at(Path::new(&shown), one_line(&e)))?;
            for head in heads {
                let m = head.map_err(|e| {
                    Error::at(Path::new(&shown), format!("cannot stat ({})", one_line(&e)))
                })?;
                if let Some(slot) = objects.values_mut().find(|o| o.location == m.location) {
                    *slot = m;
                }
            }
        }
        Ok(S3Source {
            remote,
            shown,
            objects,
        })
    }
}

/// An `object_store` error as one line (some carry a response body over several).
pub(crate) fn one_line(e: &dyn std::fmt::Display) -> String {
    e.to_string()
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ")
}

impl Source for S3Source {
    fn describe(&self) -> String {
        self.shown.clone()
    }

    fn at(&self, rel: &Path) -> PathBuf {
        if rel.as_os_str().is_empty() {
            PathBuf::from(&self.shown)
        } else {
            PathBuf::from(format!("{}/{}", self.shown, rel.display()))
        }
    }

    fn list(&self) -> Result<Vec<Entry>> {
        Ok(listing(self.objects.iter().map(|(rel, m)| {
            (rel.as_str(), m.size, m.last_modified.into())
        })))
    }

    fn open(&self, rel: &Path) -> Result<Arc<dyn Object>> {
        let key = rel.to_string_lossy();
        let meta = self
            .objects
            .get(key.as_ref())
            .ok_or_else(|| Error::at(&self.at(rel), "no such object"))?;
        Ok(Arc::new(
            self.remote
                .object(meta.clone(), self.at(rel).display().to_string()),
        ))
    }
}
