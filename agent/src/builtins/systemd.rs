//! `systemd` — `{"action": "status"|"restart"|"start"|"stop", "unit": "nginx.service"}`.

use std::time::Duration;

use fort_core::process::RunSpec;
use serde::Deserialize;

use super::{is_unit_name, ParamError};

#[derive(Debug, Deserialize, Clone, Copy, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum Action {
    Status,
    Restart,
    Start,
    Stop,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SystemdParams {
    pub action: Action,
    pub unit: String,
}

pub fn command(
    params: &serde_json::Value,
    timeout: Duration,
) -> Result<(Action, RunSpec), ParamError> {
    let p: SystemdParams =
        serde_json::from_value(params.clone()).map_err(|e| ParamError(format!("systemd: {e}")))?;
    if !is_unit_name(&p.unit) {
        return Err(ParamError(format!(
            "systemd: unit {:?} is not a unit name",
            p.unit
        )));
    }
    let action = match p.action {
        Action::Status => "status",
        Action::Restart => "restart",
        Action::Start => "start",
        Action::Stop => "stop",
    };
    let mut spec = RunSpec::new("systemctl", Vec::new(), timeout)
        .arg("--no-pager")
        .arg(action)
        .arg("--")
        .arg(p.unit);
    spec.max_stdout = 1024 * 1024;
    Ok((p.action, spec))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn params_are_strict() {
        let t = Duration::from_secs(1);
        assert!(command(&json!({"action": "restart", "unit": "nginx.service"}), t).is_ok());
        assert!(command(&json!({"action": "mask", "unit": "nginx.service"}), t).is_err());
        assert!(command(&json!({"action": "stop", "unit": "-H"}), t).is_err());
        let (_, spec) = command(&json!({"action": "stop", "unit": "a@b.service"}), t).unwrap();
        assert_eq!(spec.args.last().unwrap(), "a@b.service");
    }
}
