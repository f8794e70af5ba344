//! References between one host's needs (docs/protocol.md §11.5): a value anywhere in a
//! need's `request` may be `{"$fort_ref": "<type>/<id>"}` (that need's whole payload, as
//! a string) or `{"$fort_ref": "<type>/<id>#<JSON pointer>"}` (the value at the pointer
//! in that need's JSON payload). The consumer substitutes them before sending.

use serde_json::Value;

use crate::names::NeedKey;

pub const REF_KEY: &str = "$fort_ref";

/// One reference: which need, and where in its payload (`""`: all of it, as text).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct NeedRef {
    pub need: NeedKey,
    pub pointer: String,
}

impl std::fmt::Display for NeedRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.pointer.is_empty() {
            write!(f, "{}", self.need)
        } else {
            write!(f, "{}#{}", self.need, self.pointer)
        }
    }
}

/// Parses `<type>/<id>` or `<type>/<id>#<pointer>` (the pointer empty or starting with `/`).
pub fn parse_ref(s: &str) -> Option<NeedRef> {
    let (need, pointer) = match s.split_once('#') {
        Some((n, p)) => (n, p),
        None => (s, ""),
    };
    if !(pointer.is_empty() || pointer.starts_with('/')) {
        return None;
    }
    Some(NeedRef {
        need: NeedKey::parse(need)?,
        pointer: pointer.to_owned(),
    })
}

/// The reference a value is, if it is one; an object that carries `$fort_ref` beside
/// other keys, or a non-string one, is an error.
fn as_ref(v: &Value) -> Result<Option<NeedRef>, String> {
    let Value::Object(map) = v else {
        return Ok(None);
    };
    let Some(target) = map.get(REF_KEY) else {
        return Ok(None);
    };
    if map.len() != 1 {
        return Err(format!("an object with {REF_KEY} must have no other key"));
    }
    let text = target
        .as_str()
        .ok_or_else(|| format!("{REF_KEY} must be a string \"<type>/<id>[#<pointer>]\""))?;
    parse_ref(text)
        .map(Some)
        .ok_or_else(|| format!("{REF_KEY} {text:?} is not \"<type>/<id>[#/json/pointer]\""))
}

/// Every reference inside `request`, in document order.
pub fn references(request: &Value) -> Result<Vec<NeedRef>, String> {
    let mut out = Vec::new();
    let mut stack = vec![request];
    while let Some(v) = stack.pop() {
        if let Some(r) = as_ref(v)? {
            out.push(r);
            continue;
        }
        match v {
            Value::Object(m) => stack.extend(m.values().rev()),
            Value::Array(a) => stack.extend(a.iter().rev()),
            _ => {}
        }
    }
    Ok(out)
}

/// `request` with every reference replaced by `lookup(reference)`; the first reference
/// `lookup` cannot answer is the error.
pub fn resolve(
    request: &Value,
    lookup: &mut dyn FnMut(&NeedRef) -> Result<Value, String>,
) -> Result<Value, String> {
    if let Some(r) = as_ref(request)? {
        return lookup(&r);
    }
    Ok(match request {
        Value::Object(m) => Value::Object(
            m.iter()
                .map(|(k, v)| Ok((k.clone(), resolve(v, lookup)?)))
                .collect::<Result<_, String>>()?,
        ),
        Value::Array(a) => Value::Array(
            a.iter()
                .map(|v| resolve(v, lookup))
                .collect::<Result<_, _>>()?,
        ),
        other => other.clone(),
    })
}

/// What a reference stands for in a payload: with no pointer, the whole payload as a
/// string (it must be UTF-8); with one, the JSON value at it.
pub fn extract(payload: &[u8], pointer: &str) -> Result<Value, String> {
    if pointer.is_empty() {
        return std::str::from_utf8(payload)
            .map(|s| Value::String(s.to_owned()))
            .map_err(|_| "the payload is not UTF-8 text".to_owned());
    }
    let json: Value = serde_json::from_slice(payload)
        .map_err(|_| "the payload is not JSON, so a pointer cannot reach into it".to_owned())?;
    json.pointer(pointer)
        .cloned()
        .ok_or_else(|| format!("the payload has nothing at {pointer}"))
}

/// Whether two JSON pointers reach into one another's value: the same value, or one
/// inside the other (`""` is the whole payload, around everything).
pub fn pointers_overlap(a: &str, b: &str) -> bool {
    let within = |inner: &str, outer: &str| {
        inner
            .strip_prefix(outer)
            .is_some_and(|rest| rest.is_empty() || rest.starts_with('/'))
    };
    within(a, b) || within(b, a)
}

/// The values of a JSON `payload` at `pointers` alone, each at its pointer in a document
/// of objects (an array index becomes an object key, which the same pointer reaches):
/// what references to it need, without anything else of it. `None` when the payload is
/// not JSON or a pointer reaches nothing.
pub fn project(payload: &[u8], pointers: &[&str]) -> Option<Vec<u8>> {
    let json: Value = serde_json::from_slice(payload).ok()?;
    let mut out = Value::Object(Default::default());
    for pointer in pointers {
        let value = json.pointer(pointer)?.clone();
        let tokens: Vec<String> = pointer
            .split('/')
            .skip(1)
            .map(|t| t.replace("~1", "/").replace("~0", "~"))
            .collect();
        let Some((last, path)) = tokens.split_last() else {
            return Some(serde_json::to_vec(&json).expect("JSON serialises"));
        };
        let mut at = &mut out;
        for t in path {
            if !at.get(t).is_some_and(Value::is_object) {
                at[t.as_str()] = Value::Object(Default::default());
            }
            at = &mut at[t.as_str()];
        }
        at[last.as_str()] = value;
    }
    Some(serde_json::to_vec(&out).expect("JSON serialises"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_projection_holds_what_references_reach_and_nothing_else() {
        let payload =
            br#"{"client_id":"wiki","client_secret":"s3","urls":["a","b"],"a/b":{"c":1}}"#;
        let kept = project(payload, &["/client_id", "/urls/1", "/a~1b/c"]).unwrap();
        assert!(!String::from_utf8_lossy(&kept).contains("s3"));
        for p in ["/client_id", "/urls/1", "/a~1b/c"] {
            assert_eq!(extract(&kept, p), extract(payload, p), "{p}");
        }
        assert!(project(payload, &["/nothing"]).is_none());
        assert!(project(b"not json", &["/x"]).is_none());
        assert!(pointers_overlap("", "/x") && pointers_overlap("/a/b", "/a"));
        assert!(pointers_overlap("/a", "/a") && !pointers_overlap("/ab", "/a"));
    }

    #[test]
    fn parse_find_and_resolve() {
        assert_eq!(
            parse_ref("ssl/outline#/fingerprint").unwrap().to_string(),
            "ssl/outline#/fingerprint"
        );
        assert!(parse_ref("ssl/outline#fingerprint").is_none());
        assert!(parse_ref("ssl").is_none());
        let req = json!({"a": {"$fort_ref": "ssl/x#/fp"}, "b": [1, {"$fort_ref": "tok/y"}]});
        let refs = references(&req).unwrap();
        assert_eq!(refs.len(), 2);
        assert!(references(&json!({"$fort_ref": "a/b", "x": 1})).is_err());
        assert!(references(&json!({"$fort_ref": 3})).is_err());
        let out = resolve(&req, &mut |r| {
            if r.need.kind() == "ssl" {
                extract(br#"{"fp":"AB:CD"}"#, &r.pointer)
            } else {
                extract(b"token-text", &r.pointer)
            }
        })
        .unwrap();
        assert_eq!(out, json!({"a": "AB:CD", "b": [1, "token-text"]}));
        assert!(extract(b"plain", "/x").is_err());
        assert!(extract(br#"{"a":1}"#, "/b").is_err());
    }
}
