//! `journal` — `journalctl` for one unit: `{"unit": "nginx.service", "lines": 100,
//! "since": "2024-01-01 00:00:00", "until": "1h ago"}`. Lines are capped at 1000.

use std::time::Duration;

use fort_core::process::RunSpec;
use serde::Deserialize;

use super::{is_unit_name, ParamError};

pub const MAX_LINES: u32 = 1000;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JournalParams {
    pub unit: String,
    #[serde(default = "default_lines")]
    pub lines: u32,
    #[serde(default)]
    pub since: Option<String>,
    #[serde(default)]
    pub until: Option<String>,
}

fn default_lines() -> u32 {
    100
}

/// Times journalctl understands, limited to characters that cannot smuggle an option.
fn is_time_spec(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 64
        && !s.starts_with('-')
        && s.bytes()
            .all(|c| c.is_ascii_alphanumeric() || b" :+-.".contains(&c))
}

pub fn command(params: &serde_json::Value, timeout: Duration) -> Result<RunSpec, ParamError> {
    let p: JournalParams =
        serde_json::from_value(params.clone()).map_err(|e| ParamError(format!("journal: {e}")))?;
    if !is_unit_name(&p.unit) {
        return Err(ParamError(format!(
            "journal: unit {:?} is not a unit name",
            p.unit
        )));
    }
    if p.lines == 0 || p.lines > MAX_LINES {
        return Err(ParamError(format!(
            "journal: lines must be 1..={MAX_LINES}"
        )));
    }
    let mut spec = RunSpec::new("journalctl", Vec::new(), timeout)
        .arg("--no-pager")
        .arg("--output=short-iso")
        .arg(format!("--unit={}", p.unit))
        .arg(format!("--lines={}", p.lines));
    for (flag, value) in [("--since", &p.since), ("--until", &p.until)] {
        if let Some(v) = value {
            if !is_time_spec(v) {
                return Err(ParamError(format!("journal: {flag} {v:?} is not a time")));
            }
            spec = spec.arg(format!("{flag}={v}"));
        }
    }
    // 1000 lines of journal fit comfortably; more means something is wrong.
    spec.max_stdout = 4 * 1024 * 1024;
    Ok(spec)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn params_are_strict() {
        let t = Duration::from_secs(1);
        assert!(command(&json!({"unit": "nginx.service"}), t).is_ok());
        assert!(command(&json!({"unit": "--all"}), t).is_err());
        assert!(command(&json!({"unit": "a b"}), t).is_err());
        assert!(command(&json!({"unit": "x", "lines": 1001}), t).is_err());
        assert!(command(&json!({"unit": "x", "since": "-1"}), t).is_err());
        assert!(command(&json!({"unit": "x", "bogus": 1}), t).is_err());
        let spec = command(&json!({"unit": "x", "lines": 5, "since": "1h ago"}), t).unwrap();
        assert!(spec.args.contains(&"--since=1h ago".to_owned()));
    }
}
