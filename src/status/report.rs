//! The answers: the status object (JSON) and the Prometheus text of one mount.

use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use serde_json::Value;

use crate::metrics::{Counters, Stats};

/// What every answer carries besides the counters.
pub(super) struct Identity {
    pub(super) mode: String,
    pub(super) sealed: PathBuf,
    pub(super) mounted_at: PathBuf,
    pub(super) started: SystemTime,
    pub(super) owner: u32,
}

pub(super) type Extra = Box<dyn Fn() -> Value + Send + 'static>;

fn unix_seconds(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

/// `YYYY-MM-DDTHH:MM:SSZ` for seconds since 1970 (UTC, proleptic Gregorian).
pub fn rfc3339(secs: u64) -> String {
    let days = (secs / 86_400) as i64;
    let rem = secs % 86_400;
    // Days to civil date (H. Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem / 60 % 60,
        rem % 60
    )
}

pub(super) fn status_object(id: &Identity, stats: &Stats, extra: &Extra) -> Value {
    let started = unix_seconds(id.started);
    let uptime = SystemTime::now()
        .duration_since(id.started)
        .map_or(0, |d| d.as_secs());
    // First, so it can bring the gauges up to date before they are read.
    let more = extra();
    let mode = more
        .get("mode")
        .and_then(Value::as_str)
        .map_or_else(|| id.mode.clone(), str::to_string);
    let mut obj = serde_json::Map::new();
    for (k, v) in [
        ("version", Value::from(env!("CARGO_PKG_VERSION"))),
        ("pid", Value::from(std::process::id())),
        ("mode", Value::from(mode)),
        ("sealed", Value::from(id.sealed.to_string_lossy())),
        ("mounted_at", Value::from(id.mounted_at.to_string_lossy())),
        ("started", Value::from(rfc3339(started))),
        ("started_unix", Value::from(started)),
        ("uptime_s", Value::from(uptime)),
    ] {
        obj.insert(k.to_owned(), v);
    }
    if let Ok(Value::Object(counters)) = serde_json::to_value(stats.snapshot()) {
        obj.extend(counters);
    }
    match more {
        Value::Object(more) => {
            for (k, v) in more {
                obj.entry(k).or_insert(v);
            }
        }
        Value::Null => {}
        other => {
            obj.entry("extra").or_insert(other);
        }
    }
    Value::Object(obj)
}

/// Prometheus text exposition (format 0.0.4): every counter as `kllm_mount_<name>`,
/// labelled with the mount point, plus an info metric and the start time.
pub(super) fn metrics_text(id: &Identity, counters: &Counters) -> String {
    use std::fmt::Write as _;
    let label = |s: &Path| {
        s.to_string_lossy()
            .replace('\\', "\\\\")
            .replace('"', "\\\"")
            .replace('\n', "\\n")
    };
    let mp = label(&id.mounted_at);
    let mut out = String::new();
    let _ = writeln!(
        out,
        "# HELP kllm_mount_info The mount, its sealed directory and mode."
    );
    let _ = writeln!(out, "# TYPE kllm_mount_info gauge");
    let _ = writeln!(
        out,
        "kllm_mount_info{{mountpoint=\"{mp}\",sealed=\"{}\",mode=\"{}\",version=\"{}\"}} 1",
        label(&id.sealed),
        label(Path::new(&id.mode)),
        env!("CARGO_PKG_VERSION")
    );
    let _ = writeln!(
        out,
        "# HELP kllm_mount_start_time_seconds When the mount started."
    );
    let _ = writeln!(out, "# TYPE kllm_mount_start_time_seconds gauge");
    let _ = writeln!(
        out,
        "kllm_mount_start_time_seconds{{mountpoint=\"{mp}\"}} {}",
        unix_seconds(id.started)
    );
    counters.write_prometheus(&mut out, &format!("mountpoint=\"{mp}\""));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rfc3339_dates() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00Z");
        assert_eq!(rfc3339(951_782_400), "2000-02-29T00:00:00Z");
        assert_eq!(rfc3339(1_796_083_199), "2026-11-30T23:59:59Z");
        assert_eq!(rfc3339(4_107_542_400), "2100-03-01T00:00:00Z");
    }
}
