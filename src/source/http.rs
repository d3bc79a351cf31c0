//! A sealed checkpoint on any server that answers ranged GETs: `https://HOST/PATH/` (or
//! `http://`), a model hub or a bucket's object URLs.
//!
//! HTTP has no listing, so the files come from kLLM's manifest: `kllm-manifest.json` at the
//! URL, or `--manifest FILE`. Each listed file's size and ETag (or modification time) come
//! from a HEAD at mount time, and fix the version every later read must match. `kllm.key`
//! at the URL is offered too when the server has one (the key source `<SEALED>/kllm.key`).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use futures::StreamExt;
use object_store::http::HttpBuilder;
use object_store::path::Path as StorePath;
use object_store::{ObjectMeta, ObjectStore, ObjectStoreExt};

use super::remote::{client_options, listing, retry_config, Connect, Remote, RemoteSettings};
use super::s3::one_line;
use super::{Entry, Object, Source};
use crate::manifest::Manifest;
use crate::{Error, Result};

const MANIFEST: &str = "kllm-manifest.json";
const KEY_FILE: &str = "kllm.key";

pub struct HttpSource {
    remote: Arc<Remote>,
    shown: String,
    objects: BTreeMap<String, ObjectMeta>,
}

impl HttpSource {
    pub fn open(url: &url::Url, settings: &RemoteSettings) -> Result<HttpSource> {
        let shown = url.as_str().trim_end_matches('/').to_string();
        let b = HttpBuilder::new()
            // The store puts a `/` between its URL and each file's path.
            .with_url(&shown)
            .with_client_options(client_options(&settings.tuning, url.scheme() == "http"))
            .with_retry(retry_config(&settings.tuning));
        let err_at = shown.clone();
        let connect: Connect = Box::new(move || {
            let store = b.clone().build().map_err(|e| {
                Error::at(Path::new(&err_at), format!("bad URL ({})", one_line(&e)))
            })?;
            Ok(Arc::new(store) as Arc<dyn ObjectStore>)
        });
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
                let bytes = super::read_all(&object).map_err(|e| {
                    Error::at(Path::new(&at(MANIFEST)), format!("cannot fetch ({e})"))
                })?;
                (
                    Manifest::parse(Path::new(&at(MANIFEST)), &bytes)?,
                    Some(meta),
                )
            }
        };
        let mut names: Vec<String> = manifest.files().map(|(rel, _)| rel.to_string()).collect();
        names.push(KEY_FILE.to_string());
        let in_flight = settings.tuning.in_flight.max(1);
        let heads: Vec<(String, object_store::Result<ObjectMeta>)> = remote
            .call("the files' sizes", |store| async move {
                Ok(futures::stream::iter(names.into_iter().map(|rel| {
                    let store = store.clone();
                    async move {
                        let r = store.head(&StorePath::from(rel.as_str())).await;
                        (rel, r)
                    }
                }))
                .buffer_unordered(in_flight)
                .collect::<Vec<_>>()
                .await)
            })?
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
        Ok(HttpSource {
            remote,
            shown,
            objects,
        })
    }
}

impl Source for HttpSource {
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
            .ok_or_else(|| Error::at(&self.at(rel), "not listed in the manifest"))?;
        Ok(Arc::new(
            self.remote
                .object(meta.clone(), self.at(rel).display().to_string()),
        ))
    }
}
