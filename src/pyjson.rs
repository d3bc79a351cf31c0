//! JSON written the way Python's `json` module writes it.
//!
//! kLLM authenticates a key file against `json.dumps(doc, sort_keys=True)`, so the associated
//! data must be reproduced byte for byte; and the view's `config.json` / `kllm.json` should
//! read exactly as kLLM's own unlocked copy (`json.dumps(doc, indent=2)`), so the lock member
//! is cut out of the original text rather than the document being re-serialized.

use indexmap::IndexMap;
use serde_json::value::RawValue;
use serde_json::Value;

/// `json.dumps(value, sort_keys=True)` with the default separators and `ensure_ascii`.
pub fn dumps_sorted(value: &Value) -> String {
    let mut out = String::new();
    write_value(&mut out, value);
    out
}

fn write_value(out: &mut String, value: &Value) {
    match value {
        Value::Null => out.push_str("null"),
        Value::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        Value::Number(n) => match (n.as_i64(), n.as_u64(), n.as_f64()) {
            (Some(i), _, _) => out.push_str(&i.to_string()),
            (_, Some(u), _) => out.push_str(&u.to_string()),
            (_, _, Some(f)) => out.push_str(&float_repr(f)),
            _ => out.push_str(&n.to_string()),
        },
        Value::String(s) => write_str(out, s),
        Value::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                write_value(out, item);
            }
            out.push(']');
        }
        Value::Object(map) => {
            write_sorted_object(out, map.iter().map(|(k, v)| (k.as_str(), v)), |out, v| {
                write_value(out, v);
                Some(())
            });
        }
    }
}

/// An object's members sorted by key as Python sorts `str` keys (by code point, which for
/// these is UTF-16 order), each value written by `write`.
fn write_sorted_object<'a, V>(
    out: &mut String,
    members: impl Iterator<Item = (&'a str, V)>,
    write: impl Fn(&mut String, V) -> Option<()>,
) -> Option<()> {
    let mut members: Vec<(&str, V)> = members.collect();
    members.sort_by(|a, b| a.0.encode_utf16().cmp(b.0.encode_utf16()));
    out.push('{');
    for (i, (k, v)) in members.into_iter().enumerate() {
        if i > 0 {
            out.push_str(", ");
        }
        write_str(out, k);
        out.push_str(": ");
        write(out, v)?;
    }
    out.push('}');
    Some(())
}

/// `json.dumps(json.loads(text), sort_keys=True)`, read from the text itself: every
/// number keeps its digits, so an integer of any size comes out exact, as Python keeps it
/// (a `serde_json::Value` holds one beyond 64 bits as a float). `None` when `text` is not
/// JSON.
pub fn dumps_sorted_text(text: &str) -> Option<String> {
    // Checked whole once here; every value below is a `RawValue`'s text, without the
    // whitespace around it.
    let raw: &RawValue = serde_json::from_str(text).ok()?;
    let mut out = String::new();
    write_raw(&mut out, raw.get())?;
    Some(out)
}

/// As [`dumps_sorted_text`] for the object in `text` less its top-level `member`: what
/// kLLM authenticates a passphrase key file by (less its `ciphertext`). `None` when `text`
/// is not a JSON object.
pub fn dumps_sorted_text_without(text: &str, member: &str) -> Option<String> {
    let mut out = String::new();
    write_raw_object(&mut out, text, Some(member))?;
    Some(out)
}

/// The JSON value `raw` (valid, no whitespace around it) as Python writes it.
fn write_raw(out: &mut String, raw: &str) -> Option<()> {
    match raw.as_bytes().first()? {
        b'{' => write_raw_object(out, raw, None),
        b'[' => {
            let items: Vec<&RawValue> = serde_json::from_str(raw).ok()?;
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                write_raw(out, item.get())?;
            }
            out.push(']');
            Some(())
        }
        b'-' | b'0'..=b'9' => {
            if raw.contains(['.', 'e', 'E']) {
                // Python's float(): correctly rounded, out of range to an infinity.
                out.push_str(&float_repr(raw.parse().ok()?));
            } else if raw.trim_start_matches('-').bytes().all(|b| b == b'0') {
                out.push('0');
            } else {
                out.push_str(raw);
            }
            Some(())
        }
        _ => {
            write_value(out, &serde_json::from_str(raw).ok()?);
            Some(())
        }
    }
}

/// The object `raw`, less its member `skip`, sorted as Python sorts it. `None` when `raw`
/// is not a JSON object.
fn write_raw_object(out: &mut String, raw: &str, skip: Option<&str>) -> Option<()> {
    let map: IndexMap<String, &RawValue> = serde_json::from_str(raw).ok()?;
    let kept = map.iter().filter(|(k, _)| Some(k.as_str()) != skip);
    write_sorted_object(out, kept.map(|(k, v)| (k.as_str(), v.get())), write_raw)
}

/// A string literal as Python writes it with `ensure_ascii=True`.
pub fn write_str(out: &mut String, s: &str) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 || (c as u32) > 0x7e => {
                let mut buf = [0u16; 2];
                for unit in c.encode_utf16(&mut buf) {
                    out.push_str(&format!("\\u{unit:04x}"));
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// Python's `repr(float)`: shortest round-trip digits, scientific below 1e-4 and from 1e16.
fn float_repr(f: f64) -> String {
    if f.is_nan() {
        return "NaN".into();
    }
    if f.is_infinite() {
        return if f > 0.0 { "Infinity" } else { "-Infinity" }.into();
    }
    let sci = format!("{f:e}");
    let (mantissa, exp) = sci
        .split_once('e')
        .expect("LowerExp always has an exponent");
    let exp: i32 = exp.parse().expect("LowerExp exponent is an integer");
    if (-4..16).contains(&exp) {
        let fixed = format!("{f}");
        if fixed.contains('.') {
            fixed
        } else {
            format!("{fixed}.0")
        }
    } else {
        let sign = if exp < 0 { '-' } else { '+' };
        format!("{mantissa}e{sign}{:02}", exp.abs())
    }
}

/// The document in `text` without `member`, either at the top level (`within` is `None`) or
/// inside the top-level object `within`. Every other member keeps its original text, laid
/// out as `json.dumps(doc, indent=2)` lays it out. Returns `None` when `text` is not a JSON
/// object (or `within` is not one).
pub fn without_member(text: &str, within: Option<&str>, member: &str) -> Option<String> {
    let top: IndexMap<String, Box<RawValue>> = serde_json::from_str(text).ok()?;
    let trailing = &text[text.trim_end().len()..];
    let mut out = String::new();
    let entries: Vec<(String, String)> = top
        .iter()
        .filter(|(k, _)| within.is_some() || k.as_str() != member)
        .map(|(k, raw)| {
            let v = match within {
                Some(w) if k == w => {
                    let inner: IndexMap<String, Box<RawValue>> =
                        serde_json::from_str(raw.get()).ok()?;
                    let kept = inner
                        .iter()
                        .filter(|(ik, _)| ik.as_str() != member)
                        .map(|(ik, iv)| (ik.clone(), iv.get().to_string()))
                        .collect::<Vec<_>>();
                    indented_object(&kept, 1)
                }
                _ => raw.get().to_string(),
            };
            Some((k.clone(), v))
        })
        .collect::<Option<_>>()?;
    out.push_str(&indented_object(&entries, 0));
    out.push_str(trailing);
    Some(out)
}

fn indented_object(entries: &[(String, String)], depth: usize) -> String {
    if entries.is_empty() {
        return "{}".into();
    }
    let pad = "  ".repeat(depth + 1);
    let mut out = String::from("{\n");
    for (i, (k, v)) in entries.iter().enumerate() {
        if i > 0 {
            out.push_str(",\n");
        }
        out.push_str(&pad);
        write_str(&mut out, k);
        out.push_str(": ");
        out.push_str(v);
    }
    out.push('\n');
    out.push_str(&"  ".repeat(depth));
    out.push('}');
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sorted_dump_matches_python() {
        let v: Value = serde_json::from_str(
            r#"{"version": 1, "format": "kllm-key", "kdf": {"salt": "x", "n": 131072, "name": "scrypt"}, "u": "é😀\n", "f": [1e-06, 0.5, 1e16, 3.0]}"#,
        )
        .unwrap();
        assert_eq!(
            dumps_sorted(&v),
            r#"{"f": [1e-06, 0.5, 1e+16, 3.0], "format": "kllm-key", "kdf": {"n": 131072, "name": "scrypt", "salt": "x"}, "u": "\u00e9\ud83d\ude00\n", "version": 1}"#
        );
    }

    #[test]
    fn member_removed_keeps_the_rest_verbatim() {
        let text = "{\n  \"a\": 1e-06,\n  \"kllm\": {\n    \"scheme\": \"l1\",\n    \"lock\": \"v2\"\n  }\n}";
        let out = without_member(text, Some("kllm"), "lock").unwrap();
        assert_eq!(
            out,
            "{\n  \"a\": 1e-06,\n  \"kllm\": {\n    \"scheme\": \"l1\"\n  }\n}"
        );
        let top = "{\n  \"scheme\": \"l1\",\n  \"lock\": \"v1\"\n}\n";
        assert_eq!(
            without_member(top, None, "lock").unwrap(),
            "{\n  \"scheme\": \"l1\"\n}\n"
        );
        assert!(without_member("[1]", None, "lock").is_none());
    }
}
