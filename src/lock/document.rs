//! The `kllm.lock` document a locked shard carries in its safetensors metadata: which
//! tensors are locked, each one's domain and (v2) format, and the codec that gives for the
//! tensor's dtype.
//!
//! - v1: `{"<name>": m, ...}`, every tensor a float;
//! - v2: `{"version": "v2", "tensors": {"<name>": [m, "<format>"], ...}}`.

use std::path::Path;

use safetensors::Dtype;
use serde_json::Value;

use super::{Codec, Version};
use crate::{Error, Result};

/// The metadata key a locked shard records its tensors' domains under.
pub const LOCK_META: &str = "kllm.lock";

/// One entry of `kllm.lock`: a v1 domain, or a v2 domain and format name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LockEntry {
    pub name: String,
    pub version: Version,
    pub m: u64,
    pub format: Option<String>,
}

/// The entries of a `kllm.lock` document; `path` names the shard in errors.
pub fn parse(path: &Path, text: &str) -> Result<Vec<LockEntry>> {
    let bad = |msg: String| Error::at(path, format!("{LOCK_META}: {msg}"));
    let doc: Value = serde_json::from_str(text).map_err(|e| bad(format!("not JSON ({e})")))?;
    let Value::Object(doc) = doc else {
        return Err(bad("not a JSON object".into()));
    };
    let mut out = Vec::new();
    match doc.get("version") {
        Some(Value::String(v)) if v == Version::V2.label() => {
            let Some(Value::Object(tensors)) = doc.get("tensors") else {
                return Err(bad("v2 document without a \"tensors\" object".into()));
            };
            for (name, entry) in tensors {
                let pair = entry.as_array().filter(|a| a.len() == 2);
                let (m, fmt) = match pair.map(|a| (a[0].as_u64(), a[1].as_str())) {
                    Some((Some(m), Some(fmt))) => (m, fmt),
                    _ => return Err(bad(format!("entry of {name:?} is not [domain, format]"))),
                };
                out.push(LockEntry {
                    name: name.clone(),
                    version: Version::V2,
                    m,
                    format: Some(fmt.to_string()),
                });
            }
        }
        Some(other) => {
            let shown = other
                .as_str()
                .map(str::to_string)
                .unwrap_or_else(|| other.to_string());
            return Err(bad(format!(
                "unknown lock version {shown} (this kllm-mount reads {})",
                Version::supported_text()
            )));
        }
        None => {
            for (name, entry) in &doc {
                let m = entry
                    .as_u64()
                    .ok_or_else(|| bad(format!("v1 entry of {name:?} is not a domain size")))?;
                out.push(LockEntry {
                    name: name.clone(),
                    version: Version::V1,
                    m,
                    format: None,
                });
            }
        }
    }
    Ok(out)
}

impl LockEntry {
    /// The codec this entry calls for on a tensor of `dtype`, its domain checked; the
    /// error says why it cannot apply.
    pub fn codec(&self, dtype: Dtype) -> std::result::Result<Codec, String> {
        let name = &self.name;
        let codec = match &self.format {
            Some(fmt) => Codec::v2(fmt, dtype).ok_or_else(|| {
                format!(
                    "{LOCK_META}: tensor {name:?} is {dtype:?}, which format {fmt:?} cannot hold"
                )
            })?,
            None => Codec::float(dtype).ok_or_else(|| {
                format!(
                    "{LOCK_META}: tensor {name:?} is {dtype:?}, which lock {} cannot hold",
                    self.version.label()
                )
            })?,
        };
        if !codec.valid_domain(self.m) {
            let fmt = self.format.as_deref().unwrap_or("float");
            return Err(format!(
                "{LOCK_META}: domain {} of tensor {name:?} is impossible for {dtype:?} in format {fmt}",
                self.m
            ));
        }
        Ok(codec)
    }
}

/// The `kllm.lock` document of `entries` (name, domain, codec), as kLLM writes it (the
/// test sealer's side).
#[cfg(feature = "seal")]
pub fn render(version: Version, entries: &[(String, u64, Codec)]) -> String {
    use serde_json::json;
    let mut map = serde_json::Map::new();
    for (name, m, codec) in entries {
        let entry = match version {
            Version::V1 => json!(m),
            Version::V2 => json!([m, codec.format_name()]),
        };
        map.insert(name.clone(), entry);
    }
    let doc = match version {
        Version::V1 => Value::Object(map),
        Version::V2 => json!({"version": Version::V2.label(), "tensors": map}),
    };
    crate::pyjson::dumps_sorted(&doc)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_versions_parse() {
        let p = Path::new("s.safetensors");
        let v1 = parse(p, r#"{"a": 128, "b": 5}"#).unwrap();
        assert!(v1[1].codec(Dtype::BF16).unwrap_err().contains("impossible"));
        assert!(v1[0].codec(Dtype::I32).unwrap_err().contains("lock v1"));
        assert_eq!(v1[0].version, Version::V1);
        assert_eq!(
            v1[0].codec(Dtype::BF16),
            Ok(Codec::float(Dtype::BF16).unwrap())
        );
        let v2 = parse(p, r#"{"version": "v2", "tensors": {"b": [3, "index"]}}"#).unwrap();
        assert_eq!((v2[0].m, v2[0].format.as_deref()), (3, Some("index")));
        assert_eq!(v2[0].codec(Dtype::I32), Ok(Codec::Index { bytes: 4 }));
        assert!(v2[0]
            .codec(Dtype::BF16)
            .unwrap_err()
            .contains("cannot hold"));
    }

    #[test]
    fn unknown_versions_name_the_supported_ones() {
        let err = parse(Path::new("s"), r#"{"version": "v9", "tensors": {}}"#).unwrap_err();
        assert!(err.message().contains("v9"), "{err}");
        assert!(err.message().contains(&Version::supported_text()), "{err}");
    }
}
