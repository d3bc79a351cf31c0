//! The HTTP client every remote source uses: `object_store`'s own (reqwest) with our
//! timeouts and retries, counting the ranged GETs it sends.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use object_store::client::{
    HttpClient, HttpConnector, HttpError, HttpRequest, HttpResponse, HttpService, ReqwestConnector,
};
use object_store::{BackoffConfig, ClientOptions, ObjectStore, RetryConfig};

use super::Tuning;
use crate::metrics::Stats;
use crate::{Error, Result};

/// The HTTP client's settings: each request bounded in time; plain `http://` only when the
/// endpoint asks for it. Where `tls` is false no request can go over TLS, and the system's
/// trust store is not loaded: 30-50 ms of each mount from a cold page cache here (paid twice,
/// since the client is made again after the fork).
pub(crate) fn client_options(tuning: &Tuning, allow_http: bool, tls: bool) -> ClientOptions {
    let request = tuning.timeout.min(Duration::from_secs(30));
    ClientOptions::new()
        .with_allow_http(allow_http)
        .with_no_system_certificates(!tls)
        .with_timeout(request)
        .with_connect_timeout(request.min(Duration::from_secs(5)))
        .with_pool_max_idle_per_host(tuning.in_flight.max(1))
}

/// Retries with backoff on 5xx, throttling, timeouts and resets, all within the read's bound.
pub(crate) fn retry_config(tuning: &Tuning) -> RetryConfig {
    RetryConfig {
        backoff: BackoffConfig {
            init_backoff: Duration::from_millis(50),
            max_backoff: Duration::from_secs(2),
            base: 2.0,
        },
        max_retries: 6,
        retry_timeout: tuning.timeout,
    }
}

/// An `object_store` error as one line (some carry a response body over several).
pub(crate) fn one_line(e: &dyn std::fmt::Display) -> String {
    e.to_string()
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ")
}

/// The HTTP client of [`object_store`]'s own (reqwest), counting the ranged GETs it sends:
/// every one, the store's retries included, so `remote_gets` and `remote_get_retries` say what
/// the source was asked.
pub(crate) fn counting_connector(stats: &Arc<Stats>) -> impl HttpConnector {
    CountingConnector(stats.clone())
}

#[derive(Debug)]
struct CountingConnector(Arc<Stats>);

impl HttpConnector for CountingConnector {
    fn connect(&self, options: &ClientOptions) -> object_store::Result<HttpClient> {
        Ok(HttpClient::new(CountingClient {
            inner: ReqwestConnector::default().connect(options)?,
            stats: self.0.clone(),
        }))
    }
}

#[derive(Debug)]
struct CountingClient {
    inner: HttpClient,
    stats: Arc<Stats>,
}

tokio::task_local! {
    /// The ranged GETs sent so far for the part a fetch task is getting: past the first,
    /// each is a retry (the store's, on 5xx, throttling, timeouts and resets, or ours).
    pub(super) static PART_GETS: std::cell::Cell<u64>;
}

// `object_store` declares `HttpService` with `#[async_trait]`; this is that signature.
impl HttpService for CountingClient {
    fn call<'s, 'f>(
        &'s self,
        req: HttpRequest,
    ) -> std::pin::Pin<
        Box<
            dyn std::future::Future<Output = std::result::Result<HttpResponse, HttpError>>
                + Send
                + 'f,
        >,
    >
    where
        's: 'f,
        Self: 'f,
    {
        if req.method() == "GET" && req.headers().contains_key("range") {
            Stats::add(&self.stats.remote_gets, 1);
            // Outside a part's fetch (none such today) a GET is no one's retry.
            let earlier = PART_GETS.try_with(|n| n.replace(n.get() + 1)).unwrap_or(0);
            if earlier > 0 {
                Stats::add(&self.stats.remote_get_retries, 1);
            }
        }
        Box::pin(self.inner.execute(req))
    }
}

/// Makes the store's client: again after a fork, since a client's connections belong to the
/// runtime that made them.
pub(crate) type Connect = Box<dyn Fn() -> Result<Arc<dyn ObjectStore>> + Send + Sync>;

/// A [`Connect`] that makes the client with `build`; its failure names the source `shown`
/// and says `bad` (the settings it came from) with the reason.
pub(crate) fn connect_with<S: ObjectStore>(
    shown: &str,
    bad: &'static str,
    build: impl Fn() -> object_store::Result<S> + Send + Sync + 'static,
) -> Connect {
    let shown = shown.to_string();
    Box::new(move || {
        let store = build()
            .map_err(|e| Error::at(Path::new(&shown), format!("{bad} ({})", one_line(&e))))?;
        Ok(Arc::new(store) as Arc<dyn ObjectStore>)
    })
}
