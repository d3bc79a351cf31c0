//! A sealed checkpoint under a prefix of an S3-compatible bucket: `s3://BUCKET/PREFIX`.
//!
//! The usual AWS settings apply: `AWS_ENDPOINT_URL` (or `--endpoint-url`; an `http://`
//! endpoint is allowed, for a local MinIO or test server), `AWS_REGION`, `AWS_ACCESS_KEY_ID` /
//! `AWS_SECRET_ACCESS_KEY` / `AWS_SESSION_TOKEN`, and `AWS_PROFILE` (the shared credentials
//! and config files, read by [`profile`]). Requests are signed, retried and timed out by
//! `object_store`; listing the prefix gives every object's size and ETag, which fixes the
//! version each read must match.

use std::collections::BTreeMap;
use std::path::Path;

use futures::TryStreamExt;
use object_store::aws::{AmazonS3Builder, AmazonS3ConfigKey};
use object_store::path::Path as StorePath;
use object_store::ObjectMeta;

use super::profile;
use super::remote::{
    client_options, connect_with, counting_connector, one_line, retry_config, Remote,
    RemoteSettings, RemoteSource,
};
use crate::{Error, Result};

/// The endpoint (`--endpoint-url`, `AWS_ENDPOINT_URL`, a profile's `endpoint_url`) names
/// the server and nothing else: credentials or a token in it would be repeated by every
/// error and log line that names a request.
fn check_endpoint(endpoint: &str) -> std::result::Result<(), String> {
    let shown = super::without_secrets(endpoint);
    let url = url::Url::parse(endpoint)
        .map_err(|e| format!("the endpoint {shown} is not a URL ({e})"))?;
    if !url.username().is_empty() || url.password().is_some() {
        return Err(format!(
            "the endpoint {shown}: credentials in it are not taken: give them in the \
             environment (AWS_ACCESS_KEY_ID, ...) or an AWS profile"
        ));
    }
    if url.query().is_some() || url.fragment().is_some() {
        return Err(format!(
            "the endpoint {shown}: a query or fragment in it is not taken (it may hold a token)"
        ));
    }
    Ok(())
}

/// Connect and list `s3://BUCKET/PREFIX`: every object under the prefix, by its path
/// relative to it. Any failure is one line naming the URL.
pub fn open(url: &url::Url, settings: &RemoteSettings) -> Result<RemoteSource> {
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
    if let Some(e) = &endpoint {
        check_endpoint(e).map_err(|why| Error::at(Path::new(&shown), why))?;
    }
    let plain_http = endpoint
        .as_deref()
        .is_some_and(|e| e.starts_with("http://"));
    // With keys given, every request goes to the endpoint; other credentials may come over
    // TLS (a web identity's exchange with STS, a container credentials URL).
    let static_keys = b
        .get_config_value(&AmazonS3ConfigKey::AccessKeyId)
        .is_some();
    let b = b
        .with_client_options(client_options(
            &settings.tuning,
            plain_http,
            !(plain_http && static_keys),
        ))
        .with_retry(retry_config(&settings.tuning))
        .with_http_connector(counting_connector(&settings.stats));
    let connect = connect_with(&shown, "bad S3 settings", move || b.clone().build());
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
    let untagged: Vec<(String, StorePath)> = objects
        .iter()
        .filter(|(_, m)| m.e_tag.is_none())
        .map(|(rel, m)| (rel.clone(), m.location.clone()))
        .collect();
    if !untagged.is_empty() {
        let heads = remote
            .head_all("the objects' versions", untagged)?
            .map_err(|e| Error::at(Path::new(&shown), one_line(&e)))?;
        for (rel, head) in heads {
            let m = head.map_err(|e| {
                Error::at(Path::new(&shown), format!("cannot stat ({})", one_line(&e)))
            })?;
            objects.insert(rel, m);
        }
    }
    Ok(RemoteSource::new(remote, shown, objects, "no such object"))
}

#[cfg(test)]
mod tests {
    use super::check_endpoint;

    #[test]
    fn an_endpoint_names_the_server_and_nothing_else() {
        assert!(check_endpoint("http://127.0.0.1:9000").is_ok());
        assert!(check_endpoint("https://minio.internal/").is_ok());
        for (endpoint, secret) in [
            ("http://key:s3cret@127.0.0.1:9000", "s3cret"),
            (
                "https://minio.internal/?X-Amz-Security-Token=t0ken",
                "t0ken",
            ),
            ("https://minio.internal/#t0ken", "t0ken"),
            ("https://[minio/?t0ken", "t0ken"),
        ] {
            let e = check_endpoint(endpoint).unwrap_err();
            assert!(e.contains("the endpoint") && !e.contains(secret), "{e}");
        }
    }
}
