//! What an async provider handler reads and writes (docs/protocol.md §9): every active
//! entry in, one answer per entry out, with the markers a handler may use for an entry it
//! refuses or is still working on, and a request to be run again.

use std::collections::BTreeMap;

use fort_core::names::{parse_entry_key, NeedKey};
use serde::Deserialize;
use serde_json::Value;

/// One entry of the input, as the agent sends it. Members this handler does not know
/// (a newer agent's) are ignored, as the contract lets every handler do.
#[derive(Debug, Clone, Deserialize)]
struct RawEntry {
    request: Value,
    #[serde(default)]
    response: Option<Value>,
    #[serde(default)]
    renew: bool,
    #[serde(default)]
    held: Option<String>,
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
    /// The hash of the response the entry holds (protocol §11.11), `None` without one or
    /// in a `--force` run: answering [`Answer::Keep`] with it keeps that response.
    pub held: Option<String>,
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
                held: e.held,
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
    /// `$fort_keep`: the entry keeps the response it holds, whose hash this is (protocol
    /// §11.11), as if it were printed again.
    Keep(String),
}

/// The hash the agent gives a response (its payload bytes, protocol §7): a string's text,
/// anything else as compact JSON (serde_json's, keys sorted).
pub fn payload_sha256(response: &Value) -> String {
    use sha2::{Digest, Sha256};
    let digest = match response {
        Value::String(text) => Sha256::digest(text.as_bytes()),
        other => Sha256::digest(serde_json::to_vec(other).expect("a JSON value serialises")),
    };
    hex::encode(digest)
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

    /// Answers `response` whose hash is `sha256`: kept without printing it when the entry
    /// holds exactly that (protocol §11.11), printed otherwise.
    pub fn respond_hashed(
        &mut self,
        entry: &Entry,
        sha256: &str,
        response: impl FnOnce() -> Value,
    ) {
        if entry.held.as_deref() == Some(sha256) {
            self.set(entry, Answer::Keep(sha256.to_owned()));
        } else {
            self.respond(entry, response());
        }
    }

    /// Asks to be run again within `seconds` (the earliest request wins), 1..=3600.
    pub fn rerun_within(&mut self, seconds: u64) {
        let s = seconds.clamp(1, 3600);
        self.rerun_after = Some(self.rerun_after.map_or(s, |t| t.min(s)));
    }

    /// The refusals among the answers: what a capability's `vet` reports.
    pub fn into_refusals(self) -> crate::Refusals {
        self.answers
            .into_iter()
            .filter_map(|(key, answer)| match answer {
                Answer::Refused(why) => Some((key, why)),
                _ => None,
            })
            .collect()
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
            Answer::Keep(sha256) => serde_json::json!({"$fort_keep": sha256}),
        }
    }

    /// The JSON the agent reads (docs/protocol.md §9), leaving the answers in place.
    pub fn to_json(&self) -> Value {
        let mut map: serde_json::Map<String, Value> = self
            .answers
            .iter()
            .map(|(key, answer)| (key.clone(), Output::marker(answer)))
            .collect();
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
    use sha2::Digest;

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
        assert!(parse_input(br#"{"a:b/c":{"request":{},"extra":1}}"#).is_ok());
        assert!(parse_input(br#"{"a:b/c":{"response":{}}}"#).is_err());
    }

    #[test]
    fn a_response_the_entry_holds_is_kept_by_its_hash() {
        let response = json!({"chain": "c\n", "certificate": "a"});
        // What the agent names: the payload bytes' SHA-256, keys sorted, compact.
        let sha = payload_sha256(&response);
        assert_eq!(
            sha,
            hex::encode(sha2::Sha256::digest(
                br#"{"certificate":"a","chain":"c\n"}"#
            ))
        );
        assert_eq!(
            payload_sha256(&json!("PEM\n")),
            hex::encode(sha2::Sha256::digest(b"PEM\n"))
        );
        let input = format!(
            r#"{{"app:c/a":{{"request":{{}},"response":null,"held":"{sha}"}},"app:c/b":{{"request":{{}}}}}}"#
        );
        let entries = parse_input(input.as_bytes()).unwrap();
        assert_eq!(entries[0].held.as_deref(), Some(sha.as_str()));
        let mut out = Output::default();
        for e in &entries {
            out.respond_hashed(e, &sha, || response.clone());
        }
        assert_eq!(
            out.into_json(),
            json!({"app:c/a": {"$fort_keep": sha}, "app:c/b": response})
        );
    }

    #[test]
    fn reasons_are_one_bounded_line() {
        let long = "x".repeat(1000);
        assert_eq!(one_line(&long).chars().count(), REASON_CHARS + 1);
        assert_eq!(one_line("a\u{1b}[2Jb"), "a [2Jb");
    }
}
