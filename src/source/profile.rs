//! `AWS_PROFILE`: a named profile of the AWS shared files (`~/.aws/credentials` and
//! `~/.aws/config`, or `AWS_SHARED_CREDENTIALS_FILE` / `AWS_CONFIG_FILE`), which
//! `object_store` does not read. Only static settings are taken: keys, session token, region
//! and endpoint; a profile that names another way to get credentials is used for the rest.

use std::path::PathBuf;

use zeroize::Zeroizing;

#[derive(Default)]
pub struct Profile {
    pub access_key_id: Option<String>,
    pub secret_access_key: Option<Zeroizing<String>>,
    pub session_token: Option<Zeroizing<String>>,
    pub region: Option<String>,
    pub endpoint_url: Option<String>,
}

fn home_file(env: &str, rel: &str) -> Option<PathBuf> {
    match std::env::var_os(env) {
        Some(p) if !p.is_empty() => Some(PathBuf::from(p)),
        _ => std::env::var_os("HOME").map(|h| PathBuf::from(h).join(rel)),
    }
}

/// The profile `name` (`default` when `None`). `Ok(None)` when no shared file has it, which
/// is an error only when the profile was named.
pub fn load(name: Option<&str>) -> Result<Option<Profile>, String> {
    let wanted = name.unwrap_or("default");
    let mut found = false;
    let mut p = Profile::default();
    // The config file's sections are `[profile NAME]` (`[default]` for the default); the
    // credentials file's are `[NAME]`. Credentials win over config.
    let config_section = if wanted == "default" {
        "default".to_string()
    } else {
        format!("profile {wanted}")
    };
    for (file, section) in [
        (home_file("AWS_CONFIG_FILE", ".aws/config"), config_section),
        (
            home_file("AWS_SHARED_CREDENTIALS_FILE", ".aws/credentials"),
            wanted.to_string(),
        ),
    ] {
        let Some(file) = file else { continue };
        let Ok(text) = std::fs::read_to_string(&file).map(Zeroizing::new) else {
            continue;
        };
        for (k, v) in section_of(&text, &section) {
            found = true;
            match k.as_str() {
                "aws_access_key_id" => p.access_key_id = Some(v.to_string()),
                "aws_secret_access_key" => {
                    p.secret_access_key = Some(Zeroizing::new(v.to_string()))
                }
                "aws_session_token" => p.session_token = Some(Zeroizing::new(v.to_string())),
                "region" => p.region = Some(v.to_string()),
                "endpoint_url" => p.endpoint_url = Some(v.to_string()),
                _ => {}
            }
        }
    }
    match (found, name) {
        (true, _) => Ok(Some(p)),
        (false, Some(n)) => Err(format!(
            "AWS_PROFILE={n}: no such profile in the AWS config or credentials file"
        )),
        (false, None) => Ok(None),
    }
}

/// The `key = value` lines of `[section]` in an INI-style AWS file.
fn section_of<'a>(text: &'a str, section: &str) -> Vec<(String, &'a str)> {
    let mut inside = false;
    let mut out = Vec::new();
    for line in text.lines() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') || line.starts_with(';') {
            continue;
        }
        if let Some(name) = line.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
            inside = name.trim() == section;
            continue;
        }
        if inside {
            if let Some((k, v)) = line.split_once('=') {
                out.push((k.trim().to_ascii_lowercase(), v.trim()));
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sections_are_read_by_name() {
        let text = "[default]\naws_access_key_id = A\n\n[profile x]\nregion=eu-west-1\n# c\nendpoint_url = http://127.0.0.1:9000\n[y]\nregion = z\n";
        assert_eq!(
            section_of(text, "default"),
            vec![("aws_access_key_id".into(), "A")]
        );
        assert_eq!(
            section_of(text, "profile x"),
            vec![
                ("region".into(), "eu-west-1"),
                ("endpoint_url".into(), "http://127.0.0.1:9000")
            ]
        );
        assert!(section_of(text, "x").is_empty());
    }
}
