//! Files and peers of other fort releases: what this release announces, and how it reads a
//! document another release wrote. Members it does not know are kept, with their values,
//! and written back when the document is rewritten (so rolling forward again loses
//! nothing); a document it cannot read is refused naming the file, the field and the
//! release that wrote it, never guessed at.

use serde::de::DeserializeOwned;
use serde::Serialize;
use serde_json::{Map, Value};

/// The fort release (the workspace version).
pub const RELEASE: &str = env!("CARGO_PKG_VERSION");

/// The wire protocol this release speaks (docs/protocol.md §11.12).
pub const PROTOCOL: &str = "1.2";
pub const PROTOCOL_MAJOR: u64 = 1;

/// `X-Fort-Protocol` and `X-Fort-Release` (§11.12): sent on every request and reply.
pub const H_PROTOCOL: &str = "x-fort-protocol";
pub const H_RELEASE: &str = "x-fort-release";

/// How a file records who wrote it (`"written_by": "fort 0.2.0"`).
pub const WRITTEN_BY: &str = "written_by";

/// This release, as files record it.
pub fn writer() -> String {
    format!("fort {RELEASE}")
}

/// Who wrote a document, for messages: its `written_by` when it has a sane one.
pub fn written_by(doc: &Map<String, Value>) -> String {
    match doc.get(WRITTEN_BY).and_then(Value::as_str) {
        Some(w) if is_release_text(w) => w.to_owned(),
        Some(_) => "a writer whose name is not printable".to_owned(),
        None => "a fort release before 0.2.0 (it does not record itself)".to_owned(),
    }
}

/// Printable ASCII, at most 64 bytes: what a release name or `X-Fort-Release` may be.
pub fn is_release_text(s: &str) -> bool {
    !s.is_empty() && s.len() <= 64 && s.bytes().all(|b| (0x20..0x7f).contains(&b))
}

/// `<major>.<minor>` of a well-formed `X-Fort-Protocol` value; `None` otherwise (a 1.1
/// peer, or one not worth believing).
pub fn parse_protocol(s: &str) -> Option<(u64, u64)> {
    let (major, minor) = s.split_once('.')?;
    let digits = |p: &str| !p.is_empty() && p.len() <= 4 && p.bytes().all(|b| b.is_ascii_digit());
    if !digits(major) || !digits(minor) {
        return None;
    }
    Some((major.parse().ok()?, minor.parse().ok()?))
}

/// A file fort writes, and its format: the version this release writes and those it reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Format {
    pub file: &'static str,
    pub writes: u32,
    pub reads: &'static [u32],
}

/// Every file fort writes, as this release writes it (docs/compatibility.md). A format
/// change raises `writes` here and in the file's own constant (tests hold them equal).
pub const FORMATS: &[Format] = &[
    Format {
        file: "provider-state.json",
        writes: crate::store::SNAPSHOT_VERSION,
        reads: &crate::store::SNAPSHOT_READS,
    },
    Format {
        file: "fulfillment-state.json",
        writes: crate::store::SNAPSHOT_VERSION,
        // Version 3 with a state key (the payloads it keeps sealed, docs/at-rest.md).
        reads: &crate::store::SNAPSHOT_READS,
    },
    Format {
        file: "nonces.log",
        writes: 1,
        reads: &[1],
    },
    Format {
        file: "keys/",
        writes: 1,
        reads: &[1],
    },
    Format {
        file: "acme state",
        writes: 1,
        reads: &[1],
    },
    Format {
        file: "acme state .kept",
        writes: 1,
        reads: &[1],
    },
    Format {
        file: "dns-record state",
        writes: 1,
        reads: &[1],
    },
    Format {
        file: "oidc state",
        writes: 1,
        reads: &[1],
    },
    Format {
        file: "postgres state",
        writes: 1,
        reads: &[1],
    },
    Format {
        file: "proxy state",
        writes: 1,
        reads: &[1],
    },
    Format {
        file: "ssh-ca state",
        writes: 1,
        reads: &[1],
    },
];

/// What a release that does not announce its formats (fort 0.1.0) writes: the same
/// versions as [`FORMATS`] had then.
pub fn formats_before_announcing(file: &str) -> Option<u32> {
    match file {
        "provider-state.json" | "fulfillment-state.json" => Some(2),
        _ if FORMATS.iter().any(|f| f.file == file) => Some(1),
        _ => None,
    }
}

/// The status document's `state_formats` (docs/protocol.md §11.12).
pub fn formats_json() -> Value {
    formats_json_ref().clone()
}

/// [`formats_json`] without a copy: every status document carries it, built once.
pub fn formats_json_ref() -> &'static Value {
    static FORMATS_JSON: std::sync::OnceLock<Value> = std::sync::OnceLock::new();
    FORMATS_JSON.get_or_init(|| {
        let map: Map<String, Value> = FORMATS
            .iter()
            .map(|f| {
                (
                    f.file.to_owned(),
                    serde_json::json!({"writes": f.writes, "reads": [f.reads.iter().min(), f.reads.iter().max()]}),
                )
            })
            .collect();
        Value::Object(map)
    })
}

/// One step from a document's root to a member.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Step {
    Key(String),
    Index(usize),
    /// Into the content of an externally tagged enum variant (`{"variant": …}`).
    Variant,
}

#[derive(Debug, Clone, PartialEq)]
struct Member {
    /// Steps to the member's parent, then the member's own name.
    parent: Vec<Step>,
    name: String,
    value: Value,
    /// For a member inside an array element: the element's position among the steps and
    /// what this release read of it, so the member goes back to that element only (an
    /// array reordered or shortened since must not move it to another).
    element: Option<(usize, Value)>,
}

/// The members of a document this release does not know, as read.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Unknown {
    members: Vec<Member>,
}

/// Why a document could not be read as this release's type.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{path}: {message}")]
pub struct ReadError {
    /// Where in the document (`needs.oidc/wiki.phase`; `.` for the whole).
    pub path: String,
    pub message: String,
}

impl Unknown {
    pub fn is_empty(&self) -> bool {
        self.members.is_empty()
    }

    pub fn len(&self) -> usize {
        self.members.len()
    }

    /// The unknown members' paths, dotted (`keys.cert.issuer`), for messages and tests.
    pub fn paths(&self) -> Vec<String> {
        self.members
            .iter()
            .map(|m| {
                let mut parts: Vec<String> = m
                    .parent
                    .iter()
                    .filter_map(|s| match s {
                        Step::Key(k) => Some(k.clone()),
                        Step::Index(i) => Some(i.to_string()),
                        Step::Variant => None,
                    })
                    .collect();
                parts.push(m.name.clone());
                parts.join(".")
            })
            .collect()
    }

    /// Puts the members back into `written` (this release's serialisation of what it
    /// read, changed or not) wherever their parent still exists and does not have them.
    /// A member whose parent is gone (an entry removed, an array element changed) goes
    /// with it. Returns how many were put back.
    pub fn restore(&self, written: &mut Value) -> usize {
        let mut restored = 0;
        for m in &self.members {
            let Some(parent) = navigate_mut(written, &m.parent, m.element.as_ref()) else {
                continue;
            };
            let Some(object) = parent.as_object_mut() else {
                continue;
            };
            if !object.contains_key(&m.name) {
                object.insert(m.name.clone(), m.value.clone());
                restored += 1;
            }
        }
        restored
    }

    /// Drops the members under `prefix` (a first step), returning them relative to it: a
    /// log record's `v` becomes the record's own document.
    fn strip_first(self, first: &str) -> Unknown {
        let members = self
            .members
            .into_iter()
            .filter_map(|mut m| {
                if m.parent.first() != Some(&Step::Key(first.to_owned())) {
                    return None;
                }
                m.parent.remove(0);
                m.element = m.element.map(|(i, v)| (i - 1, v));
                Some(m)
            })
            .collect();
        Unknown { members }
    }
}

/// Reads `T` from `doc`, keeping the members `T` does not know. An error names the path
/// of the member at fault.
pub fn read<T: DeserializeOwned + Serialize>(doc: &Value) -> Result<(T, Unknown), ReadError> {
    let mut ignored: Vec<Vec<Step>> = Vec::new();
    let result = serde_ignored::deserialize(doc, |path| ignored.push(steps(&path)));
    let value: T = match result {
        Ok(v) => v,
        Err(_) => return Err(locate::<T>(doc)),
    };
    let unknown = collect(doc, &value, ignored);
    Ok((value, unknown))
}

/// Like [`read`], straight from bytes: a document with no unknown member (the usual case)
/// is never built as a tree. `None` for bytes that are not JSON of the right shape is
/// told apart by the error: `Err` names the path.
pub fn read_slice<T: DeserializeOwned + Serialize>(
    bytes: &[u8],
) -> Result<(T, Unknown), ReadError> {
    let mut ignored: Vec<Vec<Step>> = Vec::new();
    let mut de = serde_json::Deserializer::from_slice(bytes);
    let result = serde_ignored::deserialize(&mut de, |path| ignored.push(steps(&path)))
        .and_then(|v: T| de.end().map(|()| v));
    match result {
        Ok(value) if ignored.is_empty() => Ok((value, Unknown::default())),
        Ok(value) => {
            let doc: Value = serde_json::from_slice(bytes).map_err(|e| ReadError {
                path: ".".into(),
                message: e.to_string(),
            })?;
            let unknown = collect(&doc, &value, ignored);
            Ok((value, unknown))
        }
        Err(e) => match serde_json::from_slice::<Value>(bytes) {
            Ok(doc) => Err(locate::<T>(&doc)),
            Err(_) => Err(ReadError {
                path: ".".into(),
                message: e.to_string(),
            }),
        },
    }
}

/// `value` as JSON with `unknown` put back.
pub fn to_value<T: Serialize>(value: &T, unknown: &Unknown) -> Result<Value, serde_json::Error> {
    let mut v = serde_json::to_value(value)?;
    unknown.restore(&mut v);
    Ok(v)
}

/// Where reading `doc` as `T` fails, and why.
fn locate<T: DeserializeOwned>(doc: &Value) -> ReadError {
    match serde_path_to_error::deserialize::<_, T>(doc) {
        Ok(_) => ReadError {
            path: ".".into(),
            message: "does not read".into(),
        },
        Err(e) => {
            let path = e.path().to_string();
            ReadError {
                path,
                message: e.into_inner().to_string(),
            }
        }
    }
}

fn steps(path: &serde_ignored::Path<'_>) -> Vec<Step> {
    use serde_ignored::Path;
    let mut out = match path {
        Path::Root => return Vec::new(),
        Path::Seq { parent, .. }
        | Path::Map { parent, .. }
        | Path::Some { parent }
        | Path::NewtypeStruct { parent }
        | Path::NewtypeVariant { parent } => steps(parent),
    };
    match path {
        Path::Seq { index, .. } => out.push(Step::Index(*index)),
        Path::Map { key, .. } => out.push(Step::Key(key.clone())),
        Path::NewtypeVariant { .. } => out.push(Step::Variant),
        _ => {}
    }
    out
}

/// The ignored members' values, taken from `doc`.
fn collect<T: Serialize>(doc: &Value, value: &T, ignored: Vec<Vec<Step>>) -> Unknown {
    let known = if ignored
        .iter()
        .any(|p| p.iter().any(|s| matches!(s, Step::Index(_))))
    {
        serde_json::to_value(value).ok()
    } else {
        None
    };
    let mut members = Vec::new();
    for mut path in ignored {
        let Some(Step::Key(name)) = path.pop() else {
            continue; // an ignored array element or variant: nothing to name it by
        };
        path.push(Step::Key(name));
        let Some((mut exact, value)) = resolve(doc, &path) else {
            continue;
        };
        let Some(Step::Key(name)) = exact.pop() else {
            continue;
        };
        let element = exact
            .iter()
            .rposition(|s| matches!(s, Step::Index(_)))
            .and_then(|at| {
                let known = known.as_ref()?;
                resolve(known, &exact[..=at]).map(|(_, v)| (at, v.clone()))
            });
        members.push(Member {
            parent: exact,
            name,
            value: value.clone(),
            element,
        });
    }
    Unknown { members }
}

/// Follows `path` in `doc`, and returns it with a [`Step::Variant`] wherever it went
/// into an externally tagged enum's content (`{"variant": {…}}`): serde names a struct
/// variant's fields without a step for the variant.
fn resolve<'a>(doc: &'a Value, path: &[Step]) -> Option<(Vec<Step>, &'a Value)> {
    let mut exact = Vec::with_capacity(path.len() + 1);
    let mut v = doc;
    for step in path {
        v = match step {
            Step::Key(k) => {
                let o = v.as_object()?;
                match o.get(k) {
                    Some(inner) => inner,
                    None if o.len() == 1 => {
                        let inner = o.values().next()?.as_object()?.get(k)?;
                        exact.push(Step::Variant);
                        inner
                    }
                    None => return None,
                }
            }
            Step::Index(i) => v.as_array()?.get(*i)?,
            Step::Variant => v.as_object().filter(|o| o.len() == 1)?.values().next()?,
        };
        exact.push(step.clone());
    }
    Some((exact, v))
}

/// Follows exact steps (from [`resolve`]) in a document being written. An array element
/// is found by what was read of it (`element`), wherever it now is, and only if it is
/// unchanged.
fn navigate_mut<'a>(
    mut v: &'a mut Value,
    path: &[Step],
    element: Option<&(usize, Value)>,
) -> Option<&'a mut Value> {
    for (at, step) in path.iter().enumerate() {
        v = match step {
            Step::Key(k) => v.as_object_mut()?.get_mut(k)?,
            Step::Index(i) => {
                let items = v.as_array_mut()?;
                match element {
                    Some((e, read)) if *e == at => {
                        let pos = if items.get(*i) == Some(read) {
                            *i
                        } else {
                            items.iter().position(|x| x == read)?
                        };
                        items.get_mut(pos)?
                    }
                    _ => items.get_mut(*i)?,
                }
            }
            Step::Variant => v
                .as_object_mut()
                .filter(|o| o.len() == 1)?
                .values_mut()
                .next()?,
        };
    }
    Some(v)
}

/// A log record's value with its unknown members: [`read_slice`] of `{"k": …, "v": …}`.
pub fn record_unknown(unknown: Unknown) -> Unknown {
    unknown.strip_first("v")
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde::Deserialize;
    use serde_json::json;
    use std::collections::BTreeMap;

    #[derive(Debug, Serialize, Deserialize, PartialEq, Default)]
    struct Doc {
        name: String,
        #[serde(default)]
        items: Vec<Item>,
        #[serde(default)]
        by_key: BTreeMap<String, Item>,
        #[serde(default)]
        tagged: Vec<Tagged>,
        #[serde(default, alias = "old_count")]
        count: u32,
    }

    #[derive(Debug, Serialize, Deserialize, PartialEq, Clone)]
    struct Item {
        n: u32,
    }

    #[derive(Debug, Serialize, Deserialize, PartialEq)]
    #[serde(rename_all = "snake_case")]
    enum Tagged {
        File { token: String },
    }

    #[test]
    fn unknown_members_are_kept_where_they_were() {
        let doc = json!({
            "name": "a", "future": {"x": [1, 2]},
            "items": [{"n": 1, "since": 5}, {"n": 2}],
            "by_key": {"k": {"n": 3, "why": "w"}},
            "tagged": [{"file": {"token": "t", "mode": 1}}],
            "old_count": 4,
        });
        let (mut d, unknown): (Doc, Unknown) = read(&doc).unwrap();
        assert_eq!(d.count, 4, "an alias is a known member");
        let mut paths = unknown.paths();
        paths.sort();
        assert_eq!(
            paths,
            ["by_key.k.why", "future", "items.0.since", "tagged.0.mode"]
        );
        // Unchanged: written back as read (the alias under its own name).
        let back = to_value(&d, &unknown).unwrap();
        assert_eq!(back["future"], json!({"x": [1, 2]}));
        assert_eq!(back["items"][0]["since"], 5);
        assert_eq!(back["by_key"]["k"]["why"], "w");
        assert_eq!(back["tagged"][0]["file"]["mode"], 1);
        assert!(back.get("old_count").is_none());

        // The element the member belonged to moved: it follows; a changed one loses it;
        // a removed map entry takes its members along.
        d.items.insert(0, Item { n: 9 });
        d.by_key.clear();
        let back = to_value(&d, &unknown).unwrap();
        assert_eq!(back["items"][1], json!({"n": 1, "since": 5}));
        assert!(back["items"][0].get("since").is_none());
        assert!(back["by_key"].as_object().unwrap().is_empty());
        d.items[1].n = 7;
        let back = to_value(&d, &unknown).unwrap();
        assert!(back["items"][1].get("since").is_none());
    }

    #[test]
    fn from_bytes_and_errors_name_the_path() {
        let (d, u): (Doc, Unknown) = read_slice(br#"{"name":"a"}"#).unwrap();
        assert!(u.is_empty());
        assert_eq!(d.name, "a");
        let (_, u): (Doc, Unknown) = read_slice(br#"{"name":"a","z":null}"#).unwrap();
        assert_eq!(u.paths(), ["z"]);
        let e = read_slice::<Doc>(br#"{"name":"a","tagged":[{"dir":{}}]}"#).unwrap_err();
        assert_eq!(e.path, "tagged[0]");
        assert!(e.message.contains("unknown variant `dir`"), "{e}");
        let e = read::<Doc>(&json!({"name": 1})).unwrap_err();
        assert_eq!(e.path, "name");
        assert!(read_slice::<Doc>(b"{").is_err());
    }

    #[test]
    fn record_values_are_their_own_documents() {
        #[derive(Serialize, Deserialize)]
        struct Record {
            k: String,
            v: Option<Item>,
        }
        let (r, u): (Record, Unknown) =
            read_slice(br#"{"k":"a","v":{"n":1,"extra":true},"t":3}"#).unwrap();
        let u = record_unknown(u);
        assert_eq!(u.paths(), ["extra"]);
        let back = to_value(r.v.as_ref().unwrap(), &u).unwrap();
        assert_eq!(back, json!({"n": 1, "extra": true}));
    }

    #[test]
    fn protocol_values() {
        assert_eq!(parse_protocol("1.2"), Some((1, 2)));
        assert_eq!(parse_protocol("10.0"), Some((10, 0)));
        for bad in [
            "", "1", "1.", ".2", "1.2.3", "a.b", "12345.1", "+1.2", " 1.2",
        ] {
            assert_eq!(parse_protocol(bad), None, "{bad:?}");
        }
        assert!(is_release_text("0.2.0"));
        assert!(!is_release_text("0.2\n"));
        assert!(!is_release_text(&"x".repeat(65)));
    }
}
