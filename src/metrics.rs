//! The counters of a mount, each declared once in `counters!`'s table below: from that
//! one line come the atomic in [`Stats`], the field of its snapshot [`Counters`] (the status
//! object's JSON member of the same name), and its Prometheus sample. Core modules bump
//! these; `status` only reads and renders them. docs/STATUS.md lists every one.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;

use serde::{Deserialize, Serialize};

/// Whether a metric only grows or goes up and down (Prometheus' `# TYPE`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Counter,
    Gauge,
}

impl Kind {
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Counter => "counter",
            Kind::Gauge => "gauge",
        }
    }
}

/// One row of the table: the JSON field, its kind, and its Prometheus name and help.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Metric {
    /// Field of [`Stats`] and [`Counters`], member of the status object.
    pub field: &'static str,
    pub kind: Kind,
    /// Prometheus name after `kllm_mount_`.
    pub name: &'static str,
    pub help: &'static str,
}

/// Builds [`Stats`], [`Counters`], [`Stats::snapshot`], [`COUNT`], [`METRICS`] and
/// [`Counters::values`] from one table, so that they cannot fall out of step.
macro_rules! counters {
    ($(
        $(#[doc = $doc:literal])*
        $field:ident: $kind:ident, $name:literal, $help:literal;
    )*) => {
        /// Counters of a mount. Each is a relaxed atomic: bumping one costs one uncontended
        /// `lock xadd`, and a snapshot may be a few requests out of step between counters.
        #[derive(Debug, Default)]
        pub struct Stats {
            $( $(#[doc = $doc])* pub $field: AtomicU64, )*
        }

        /// A copy of [`Stats`] at one moment, under the same names (and in the same order
        /// in JSON).
        #[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
        pub struct Counters {
            $( pub $field: u64, )*
        }

        /// How many metrics the table declares.
        pub const COUNT: usize = [$( stringify!($field), )*].len();

        /// Every metric, in [`Counters`] order.
        pub const METRICS: [Metric; COUNT] = [
            $( Metric {
                field: stringify!($field),
                kind: Kind::$kind,
                name: $name,
                help: $help,
            }, )*
        ];

        impl Stats {
            pub fn snapshot(&self) -> Counters {
                Counters { $( $field: self.$field.load(Relaxed), )* }
            }
        }

        impl Counters {
            /// The values, in [`METRICS`] order.
            pub fn values(&self) -> [u64; COUNT] {
                [ $( self.$field, )* ]
            }
        }
    };
}

counters! {
    /// Gauge: files the kernel holds open now.
    files_open: Gauge, "files_open", "Files the kernel holds open now.";
    /// Opens since the mount, all files.
    opens: Counter, "opens_total", "Opens since the mount.";
    /// Opens answered with kernel passthrough (the kernel reads the backing file itself).
    passthrough_opens: Counter, "passthrough_opens_total", "Opens served by kernel passthrough.";
    /// Bytes returned to read requests.
    bytes_served: Counter, "served_bytes_total", "Bytes returned to read requests.";
    /// Bytes of locked tensor data decoded.
    bytes_decoded: Counter, "decoded_bytes_total", "Bytes of locked tensor data decoded.";
    cache_hits: Counter, "cache_hits_total", "Decoded-data cache hits.";
    cache_misses: Counter, "cache_misses_total", "Decoded-data cache misses.";
    /// Gauge: bytes held by the decoded-data cache.
    cache_bytes: Gauge, "cache_bytes", "Bytes held by the decoded-data cache.";
    /// Gauge: bytes of the sealed files the mount serves from.
    backing_bytes: Gauge, "backing_bytes", "Bytes of the sealed files served from.";
    /// Read requests answered with an error.
    read_errors: Counter, "read_errors_total", "Read requests answered with an error.";
    /// Files whose SHA-256 matched the manifest.
    verified_files: Counter, "verified_files_total", "Files that matched the manifest.";
    /// Files whose SHA-256 did not match, or that could not be read for checking.
    failed_files: Counter, "failed_files_total", "Files that failed the manifest check.";
    /// Bytes hashed to check files against the manifest.
    verified_bytes: Counter, "verified_bytes_total", "Bytes hashed for the manifest check.";
    /// Ranged GETs sent to a remote source (S3, HTTP), retries included.
    remote_gets: Counter, "remote_gets_total", "Ranged GETs sent to the remote source, retries included.";
    /// Of those, the ones that asked again for a part (the HTTP client's retries and ours).
    remote_get_retries: Counter, "remote_get_retries_total", "Ranged GETs that asked again for a part.";
    /// Parts that could not be had: their retries failed or ran out of time, or the object
    /// changed.
    remote_get_failures: Counter, "remote_get_failures_total", "Parts of remote objects not fetched, after retries.";
    /// Bytes of the bodies of ranged GETs, as received.
    remote_bytes_fetched: Counter, "remote_fetched_bytes_total", "Bytes received from the remote source.";
    /// Of the shards' sealed bytes, those brought in ahead of any open (fetch ahead, FUSE mode).
    bytes_fetched_ahead: Counter, "fetched_ahead_bytes_total", "Sealed bytes of shards brought in ahead of any open.";
    /// Of the shards' view bytes, those decoded into the kernel's page cache ahead of any open (fetch ahead, FUSE mode).
    bytes_stored_ahead: Counter, "stored_ahead_bytes_total", "Decoded bytes of shards put into the kernel's page cache ahead of any open.";
    /// Parts found whole and intact in the node cache (`--cache-dir`).
    node_cache_hits: Counter, "node_cache_hits_total", "Parts found in the node cache.";
    /// Parts looked for in the node cache and fetched from the source instead.
    node_cache_misses: Counter, "node_cache_misses_total", "Parts not in the node cache.";
}

impl Stats {
    pub fn new() -> Arc<Stats> {
        Arc::new(Stats::default())
    }

    pub fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Relaxed);
    }

    /// An open: `files_open` and `opens` up, `passthrough_opens` too when it applies.
    pub fn opened(&self, passthrough: bool) {
        self.files_open.fetch_add(1, Relaxed);
        self.opens.fetch_add(1, Relaxed);
        if passthrough {
            self.passthrough_opens.fetch_add(1, Relaxed);
        }
    }

    /// A release; never below zero, whatever the kernel sends.
    pub fn released(&self) {
        let _ = self
            .files_open
            .fetch_update(Relaxed, Relaxed, |n| Some(n.saturating_sub(1)));
    }
}

impl Counters {
    /// Appends each metric's `# HELP`, `# TYPE` and sample lines (Prometheus text format
    /// 0.0.4) to `out`; `labels` goes between the braces of every sample, already escaped.
    pub fn write_prometheus(&self, out: &mut String, labels: &str) {
        for (m, value) in METRICS.iter().zip(self.values()) {
            let (name, kind, help) = (m.name, m.kind.as_str(), m.help);
            let _ = writeln!(out, "# HELP kllm_mount_{name} {help}");
            let _ = writeln!(out, "# TYPE kllm_mount_{name} {kind}");
            let _ = writeln!(out, "kllm_mount_{name}{{{labels}}} {value}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn released_never_goes_below_zero() {
        let stats = Stats::new();
        stats.released();
        assert_eq!(stats.snapshot().files_open, 0);
    }

    #[test]
    fn the_table_serializes_in_order_and_counters_end_in_total() {
        let stats = Stats::new();
        stats.opened(true);
        Stats::add(&stats.verified_bytes, 9);
        let json = serde_json::to_value(stats.snapshot()).unwrap();
        let keys: Vec<&str> = json
            .as_object()
            .unwrap()
            .keys()
            .map(String::as_str)
            .collect();
        let fields: Vec<&str> = METRICS.iter().map(|m| m.field).collect();
        assert_eq!(keys, fields);
        assert_eq!(json["opens"], 1);
        assert_eq!(json["verified_bytes"], 9);
        for m in &METRICS {
            assert_eq!(m.kind == Kind::Counter, m.name.ends_with("_total"), "{m:?}");
        }
        let mut text = String::new();
        stats
            .snapshot()
            .write_prometheus(&mut text, "mountpoint=\"/m\"");
        assert_eq!(text.lines().count(), 3 * METRICS.len());
        assert!(
            text.contains(
                "# HELP kllm_mount_opens_total Opens since the mount.\n\
                 # TYPE kllm_mount_opens_total counter\n\
                 kllm_mount_opens_total{mountpoint=\"/m\"} 1\n"
            ),
            "{text}"
        );
    }

    #[test]
    fn docs_status_lists_every_metric_in_order() {
        let doc = include_str!("../docs/STATUS.md");
        let rows: Vec<String> = doc
            .lines()
            .filter(|l| l.starts_with("| `") && l.contains("| `kllm_mount_"))
            .map(str::to_owned)
            .collect();
        let want: Vec<String> = METRICS
            .iter()
            .map(|m| {
                let (field, name, kind) = (m.field, m.name, m.kind.as_str());
                format!("| `{field}` | `kllm_mount_{name}` | {kind} |")
            })
            .collect();
        assert_eq!(rows, want);
        for m in &METRICS {
            assert!(
                doc.contains(&format!("| `{}` |", m.field)),
                "docs/STATUS.md has no row for {}",
                m.field
            );
        }
    }
}
