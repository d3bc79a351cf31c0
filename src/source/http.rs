//! A sealed checkpoint on any server that answers ranged GETs: `https://HOST/PATH/` (or
//! `http://`), a model hub or a bucket's object URLs.
//!
//! HTTP has no listing, so the files come from kLLM's manifest: `kllm-manifest.json` at the
//! URL, or `--manifest FILE`. Each listed file's size and ETag (or modification time) come
//! from a HEAD at mount time, and fix the version every later read must match. `kllm.key`
//! at the URL is offered too when the server has one (the key source `<SEALED>/kllm.key`).

use std::collections::BTreeMap;
use std::path::Path;

use object_store::http::HttpBuilder;
use object_store::path::Path as StorePath;
use object_store::ObjectStoreExt;

use super::remote::{
    client_options, connect_with, counting_connector, one_line, retry_config, Remote,
    RemoteSettings, RemoteSource,
};
use crate::manifest::Manifest;
use crate::{Error, Result};

const MANIFEST: &str = "kllm-manifest.json";
const KEY_FILE: &str = "kllm.key";

/// Connect to the URL and HEAD each file the manifest names (and `kllm.key`). Any failure is
/// one line naming the URL or the file.
pub fn open(url: &url::Url, settings: &RemoteSettings) -> Result<RemoteSource> {
    let shown = url.as_str().trim_end_matches('/').to_string();
    let b = HttpBuilder::new()
        // The store puts a `/` between its URL and each file's path.
        .with_url(&shown)
        // A plain `http://` server may still redirect to `https://` (a hub to its CDN).
        .with_client_options(client_options(
            &settings.tuning,
            url.scheme() == "http",
            true,
        ))
        .with_retry(retry_config(&settings.tuning))
        .with_http_connector(counting_connector(&settings.stats));
    let connect = connect_with(&shown, "bad URL", move || b.clone().build());
    let remote = Remote::new(connect, shown.clone(), settings)?;
    let at = |rel: &str| format!("{shown}/{rel}");

    // The manifest names the files: from --manifest, else fetched whole from the URL.
    let (manifest, manifest_meta) = match &settings.manifest {
        Some(file) => (Manifest::load(file)?, None),
        None => {
            let meta = remote
                .call("the manifest", |store| async move {
                    store.head(&StorePath::from(MANIFEST)).await
                })?
                .map_err(|e| match e {
                    object_store::Error::NotFound { .. } => Error::at(
                        Path::new(&at(MANIFEST)),
                        "not found: an HTTP source needs its manifest here, or --manifest FILE",
                    ),
                    e => Error::at(
                        Path::new(&at(MANIFEST)),
                        format!("cannot fetch ({})", one_line(&e)),
                    ),
                })?;
            let object = remote.object(meta.clone(), at(MANIFEST));
            let bytes = super::read_all(&object)
                .map_err(|e| Error::at(Path::new(&at(MANIFEST)), format!("cannot fetch ({e})")))?;
            (
                Manifest::parse(Path::new(&at(MANIFEST)), &bytes)?,
                Some(meta),
            )
        }
    };
    let names: Vec<(String, StorePath)> = manifest
        .files()
        .map(|(rel, _)| rel)
        .chain([KEY_FILE])
        .map(|rel| (rel.to_string(), StorePath::from(rel)))
        .collect();
    let heads = remote
        .head_all("the files' sizes", names)?
        .map_err(|e| Error::at(Path::new(&shown), one_line(&e)))?;
    let mut objects = BTreeMap::new();
    if let Some(meta) = manifest_meta {
        objects.insert(MANIFEST.to_string(), meta);
    }
    for (rel, r) in heads {
        match r {
            Ok(meta) => {
                objects.insert(rel, meta);
            }
            // The key file is offered only when there is one; a listed file that is not
            // there is named by the manifest check.
            Err(object_store::Error::NotFound { .. }) => {}
            Err(e) => {
                return Err(Error::at(
                    Path::new(&at(&rel)),
                    format!("cannot fetch ({})", one_line(&e)),
                ))
            }
        }
    }
    Ok(RemoteSource::new(
        remote,
        shown,
        objects,
        "not listed in the manifest",
    ))
}
