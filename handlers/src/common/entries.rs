//! What an async provider handler reads and writes (docs/protocol.md §9): every active
//! entry in, one answer per entry out, with the markers a handler may use for an entry it
//! refuses or is still working on, and a request to be run again.

use std::collections::BTreeMap;

use fort_core::names::{parse_entry_key, NeedKey};
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// One entry of the input, as the agent sends it.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawEntry {
    request: Value,
    #[serde(default)]
    response: Option<Value>,
    #[serde(default)]
    renew: bool,
}

/// One active entry: who asked (the authenticated origin, never a field of the request),
/// for which need, what, and what it holds now.
#[derive(Debug, Clone)]
pub struct Entry {
    /// `<origin>:<type>/<id>`.
    pub key: String,
    /// The caller the agent verified: a host or a principal of hosts.json.
    pub origin: String,
    pub need: NeedKey,
    pub request: Value,
    /// The cached response (`cacheResponse`), `None` without one or in a `--force` run.
    pub response: Option<Value>,
    /// The consumer asked for a new payload (its current one is expiring).
    pub renew: bool,
}

/// Why the handler runs (`FORT_TRIGGER`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Trigger {
    Request,
    Initialize,
    Systemd,
    Gc,
    Manual,
    /// Anything else (a newer agent): treated as a request run.
    Other,
}

impl Trigger {
    pub fn from_env() -> Trigger {
        match std::env::var("FORT_TRIGGER").as_deref() {
            Ok("request") => Trigger::Request,
            Ok("initialize") => Trigger::Initialize,
            Ok("systemd") => Trigger::Systemd,
            Ok("gc") => Trigger::Gc,
            Ok("manual") => Trigger::Manual,
            _ => Trigger::Other,
        }
    }

    /// Runs on which a handler reconciles with the outside world (drift, rotation).
    pub fn reconciles(self) -> bool {
        matches!(
            self,
            Trigger::Initialize | Trigger::Systemd | Trigger::Manual
        )
    }
}

/// Parses the handler's stdin. An entry key that does not split is an error: the agent
/// never sends one, so the input is not what the contract says.
pub fn parse_input(bytes: &[u8]) -> anyhow::Result<Vec<Entry>> {
    let raw: BTreeMap<String, RawEntry> = serde_json::from_slice(bytes)
        .map_err(|e| anyhow::anyhow!("the input is not the agent's entry object: {e}"))?;
    raw.into_iter()
        .map(|(key, e)| {
            let (origin, need) = parse_entry_key(&key)
                .ok_or_else(|| anyhow::anyhow!("{key:?} is not an entry key"))?;
            Ok(Entry {
                origin: origin.to_owned(),
                need,
                key,
                request: e.request,
                response: e.response,
                renew: e.renew,
            })
        })
        .collect()
}

/// What the handler says about one entry.
#[derive(Debug, Clone, PartialEq)]
pub enum Answer {
    /// The entry's response: its consumer is called back when it changed.
    Response(Value),
    /// Refused, with a one-line reason the consumer's need state shows.
    Refused(String),
    /// Work under way: the entry keeps the response it had; the consumer learns why it
    /// waits.
    Pending(String),
    /// No response (a response it had is revoked).
    Nothing,
}

/// Longest reason a handler sends; the agent bounds it again.
const REASON_CHARS: usize = 300;

/// One line of printable text, bounded: reasons travel to other hosts and terminals.
pub fn one_line(reason: &str) -> String {
    let mut out: String = reason
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .take(REASON_CHARS)
        .collect();
    if reason.chars().count() > REASON_CHARS {
        out.push('…');
    }
    out
}

/// The handler's stdout: one answer per entry it decided, and optionally when to run again.
#[derive(Debug, Default)]
pub struct Output {
    pub answers: BTreeMap<String, Answer>,
    /// Seconds until the agent should run the handler again (slow backends).
    pub rerun_after: Option<u64>,
}

impl Output {
    pub fn set(&mut self, entry: &Entry, answer: Answer) {
        self.answers.insert(entry.key.clone(), answer);
    }

    pub fn respond(&mut self, entry: &Entry, response: Value) {
        self.set(entry, Answer::Response(response));
    }

    pub fn refuse(&mut self, entry: &Entry, reason: impl AsRef<str>) {
        self.set(entry, Answer::Refused(one_line(reason.as_ref())));
    }

    pub fn pending(&mut self, entry: &Entry, reason: impl AsRef<str>) {
        self.set(entry, Answer::Pending(one_line(reason.as_ref())));
    }

    /// Asks to be run again within `seconds` (the earliest request wins), 1..=3600.
    pub fn rerun_within(&mut self, seconds: u64) {
        let s = seconds.clamp(1, 3600);
        self.rerun_after = Some(self.rerun_after.map_or(s, |t| t.min(s)));
    }

    /// The JSON the agent reads (docs/protocol.md §9), without copying the responses
    /// (10,000 certificates are megabytes).
    pub fn into_json(self) -> Value {
        let mut map = serde_json::Map::new();
        let rerun = self.rerun_after;
        for (key, answer) in self.answers {
            let value = match answer {
                Answer::Response(v) => v,
                other => Output::marker(&other),
            };
            map.insert(key, value);
        }
        if let Some(s) = rerun {
            map.insert("$fort_rerun_after".into(), Value::from(s));
        }
        Value::Object(map)
    }

    fn marker(answer: &Answer) -> Value {
        match answer {
            Answer::Refused(r) => serde_json::json!({"$fort_refused": r}),
            Answer::Pending(r) => serde_json::json!({"$fort_pending": r}),
            Answer::Response(v) => v.clone(),
            Answer::Nothing => Value::Null,
        }
    }

    /// The JSON the agent reads (docs/protocol.md §9).
    pub fn to_json(&self) -> Value {
        #[derive(Serialize)]
        struct Marker<'a> {
            #[serde(rename = "$fort_refused", skip_serializing_if = "Option::is_none")]
            refused: Option<&'a str>,
            #[serde(rename = "$fort_pending", skip_serializing_if = "Option::is_none")]
            pending: Option<&'a str>,
        }
        let mut map = serde_json::Map::new();
        for (key, answer) in &self.answers {
            let value = match answer {
                Answer::Response(v) => v.clone(),
                Answer::Refused(r) => serde_json::to_value(Marker {
                    refused: Some(r),
                    pending: None,
                })
                .expect("marker serialises"),
                Answer::Pending(r) => serde_json::to_value(Marker {
                    refused: None,
                    pending: Some(r),
                })
                .expect("marker serialises"),
                Answer::Nothing => Value::Null,
            };
            map.insert(key.clone(), value);
        }
        if let Some(s) = self.rerun_after {
            map.insert("$fort_rerun_after".into(), Value::from(s));
        }
        Value::Object(map)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn input_and_output_round_trip() {
        let input = br#"{"app:ssl-cert/web":{"request":{"domains":["a.test"]},"response":null,"renew":true},
                         "ops:ssl-cert/x":{"request":{},"response":{"k":1}}}"#;
        let entries = parse_input(input).unwrap();
        assert_eq!(entries.len(), 2);
        assert_eq!(entries[0].origin, "app");
        assert_eq!(entries[0].need.id(), "web");
        assert!(entries[0].renew);
        assert_eq!(entries[1].response, Some(json!({"k": 1})));
        let mut out = Output::default();
        out.refuse(&entries[0], "b.test is not\nyours");
        out.pending(&entries[1], "order placed");
        out.rerun_within(9000);
        out.rerun_within(5);
        assert_eq!(
            out.to_json(),
            json!({"app:ssl-cert/web": {"$fort_refused": "b.test is not yours"},
                   "ops:ssl-cert/x": {"$fort_pending": "order placed"},
                   "$fort_rerun_after": 5})
        );
        let json = out.to_json();
        assert_eq!(out.into_json(), json);
        assert!(parse_input(br#"{"nokey":{"request":{}}}"#).is_err());
        assert!(parse_input(br#"{"a:b/c":{"request":{},"extra":1}}"#).is_err());
    }

    #[test]
    fn reasons_are_one_bounded_line() {
        let long = "x".repeat(1000);
        assert_eq!(one_line(&long).chars().count(), REASON_CHARS + 1);
        assert_eq!(one_line("a\u{1b}[2Jb"), "a [2Jb");
    }
}
