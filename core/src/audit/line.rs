//! A record's line, written field by field in the order of docs/protocol.md §12.2: the
//! very bytes serde_json writes for `seq`, `at`, `prev` and the event's fields as one
//! object, without building them through a flattened map. The writer thread writes every
//! record of the trail, so what a line costs is paid three times per need on a provider.

use super::Event;

/// Appends the record's line to `out`, without its `\n`.
pub(super) fn write_record(out: &mut Vec<u8>, seq: u64, at: u64, prev: &str, e: &Event) {
    out.extend_from_slice(b"{\"seq\":");
    number(out, seq);
    out.extend_from_slice(b",\"at\":");
    number(out, at);
    key(out, "prev");
    hex(out, prev);
    key(out, "event");
    string(out, e.event);
    // The order of the fields of `Event`, each only when present, as its derived
    // `Serialize` writes them.
    for (name, value) in [
        ("caller", &e.caller),
        ("key", &e.key),
        ("consumer", &e.consumer),
        ("provider", &e.provider),
        ("need", &e.need),
        ("capability", &e.capability),
        ("request", &e.request),
        ("response", &e.response),
        ("previous", &e.previous),
    ] {
        optional_string(out, name, value);
    }
    if let Some(v) = e.expires_at {
        key(out, "expires_at");
        number(out, v);
    }
    optional_string(out, "reason", &e.reason);
    if let Some(v) = e.status {
        key(out, "status");
        number(out, u64::from(v));
    }
    if let Some(v) = &e.detail {
        key(out, "detail");
        serde_json::to_writer(&mut *out, v).expect("a JSON value serialises");
    } else if let Some((trigger, force)) = e.run {
        // A JSON object's members as serde_json's map writes them: sorted by name.
        key(out, "detail");
        out.extend_from_slice(if force {
            b"{\"force\":true,\"trigger\":"
        } else {
            b"{\"force\":false,\"trigger\":"
        });
        string(out, trigger);
        out.push(b'}');
    }
    if let Some(v) = e.count {
        key(out, "count");
        number(out, v);
    }
    for (name, value) in [
        ("head", &e.head),
        ("signature", &e.signature),
        ("witness", &e.witness),
        ("index", &e.index),
    ] {
        optional_string(out, name, value);
    }
    out.push(b'}');
}

/// `,"name":`; every field but `seq` follows another.
fn key(out: &mut Vec<u8>, name: &str) {
    out.extend_from_slice(b",\"");
    out.extend_from_slice(name.as_bytes());
    out.extend_from_slice(b"\":");
}

fn optional_string(out: &mut Vec<u8>, name: &str, value: &Option<String>) {
    if let Some(v) = value {
        key(out, name);
        string(out, v);
    }
}

/// A JSON string as serde_json writes it. Most are hashes, names and events that need no
/// escape: those are copied at once; the rest go through serde_json, which escapes
/// exactly the control characters, `"` and `\`.
fn string(out: &mut Vec<u8>, s: &str) {
    if needs_escape(s.as_bytes()) {
        serde_json::to_writer(&mut *out, s).expect("a string serialises");
    } else {
        hex(out, s);
    }
}

/// A string known to need no escape (a hash this writer made), quoted.
fn hex(out: &mut Vec<u8>, s: &str) {
    out.reserve(s.len() + 2);
    out.push(b'"');
    out.extend_from_slice(s.as_bytes());
    out.push(b'"');
}

/// Whether serde_json would escape any byte of `bytes`. Looked at a block at a time
/// without stopping early inside one, which the compiler turns into vector compares.
fn needs_escape(bytes: &[u8]) -> bool {
    fn escaped(b: u8) -> bool {
        b < 0x20 || b == b'"' || b == b'\\'
    }
    let mut blocks = bytes.chunks_exact(32);
    for block in &mut blocks {
        if block.iter().fold(false, |any, b| any | escaped(*b)) {
            return true;
        }
    }
    blocks.remainder().iter().any(|b| escaped(*b))
}

/// Decimal digits, as serde_json writes an unsigned integer.
fn number(out: &mut Vec<u8>, mut n: u64) {
    let mut digits = [0u8; 20];
    let mut i = digits.len();
    loop {
        i -= 1;
        digits[i] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    out.extend_from_slice(&digits[i..]);
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde::Serialize;
    use serde_json::json;

    /// What the trail wrote before: serde_json's own record, the event flattened into it.
    #[derive(Serialize)]
    struct Flattened<'a> {
        seq: u64,
        at: u64,
        prev: &'a str,
        #[serde(flatten)]
        event: &'a Event,
    }

    fn both(seq: u64, at: u64, prev: &str, event: &Event) -> (String, String) {
        let mut ours = Vec::new();
        write_record(&mut ours, seq, at, prev, event);
        let theirs = serde_json::to_string(&Flattened {
            seq,
            at,
            prev,
            event,
        })
        .unwrap();
        (String::from_utf8(ours).unwrap(), theirs)
    }

    #[test]
    fn lines_are_the_bytes_serde_json_writes() {
        let awkward = "a \"quoted\" \\ back\tslash\n, \u{1} \u{7f} é 🔑 </script>";
        let mut every = Event::named("checkpoint")
            .caller(awkward)
            .key(Some("SHA256:abc/+=".into()))
            .consumer("app")
            .provider("forge")
            .need("oidc/wiki")
            .capability("oidc")
            .response(Some("ab".repeat(32)))
            .previous(Some("cd".repeat(32)))
            .expires_at(Some(u64::MAX))
            .reason(awkward)
            .status(429)
            .detail(json!({"z": [1, -2, 3.5, null, true], "a": {"s": awkward}, "m": "x"}));
        every.request = Some("ef".repeat(32));
        every.count = Some(0);
        every.head = Some("01".repeat(32));
        every.signature = Some("U1NIU0lH+/=".into());
        every.witness = Some("d2l0bmVzcw==".into());
        every.index = Some("23".repeat(32));
        let events = [
            Event::named("start"),
            Event::named("accepted")
                .caller("app")
                .entry("app:oidc/wiki")
                .detail(json!({"renew": true})),
            Event::named("issued")
                .entry("app:oidc/wiki")
                .response(Some("ab".repeat(32)))
                .detail(json!({"trigger": "request", "force": false}))
                .expires_at(Some(1_800_000_000)),
            Event::named("delivered").entry("no-colon"),
            Event::named("refused").reason(""),
            every,
        ];
        let mut events = events.to_vec();
        for need in [
            "x".repeat(64),
            format!("{}\"", "x".repeat(40)),
            format!("{}\n{}", "x".repeat(33), "y".repeat(40)),
            format!("{}\\", "x".repeat(31)),
        ] {
            events.push(Event::named("kept").consumer("app").need(need));
        }
        for (i, event) in events.iter().enumerate() {
            for (seq, at) in [(1, 0), (10, 9), (u64::MAX, 1_700_000_000 + i as u64)] {
                let (ours, theirs) = both(seq, at, crate::audit::GENESIS, event);
                assert_eq!(ours, theirs);
            }
        }
    }

    #[test]
    fn a_run_is_the_detail_its_object_would_be() {
        for trigger in ["request", "manual", "a \"quoted\" one"] {
            for force in [false, true] {
                let built = Event::named("issued")
                    .entry("app:oidc/wiki")
                    .detail(json!({"trigger": trigger, "force": force}));
                let run = Event::named("issued")
                    .entry("app:oidc/wiki")
                    .run(trigger, force);
                let (ours, _) = both(7, 8, crate::audit::GENESIS, &run);
                let (_, theirs) = both(7, 8, crate::audit::GENESIS, &built);
                assert_eq!(ours, theirs);
            }
        }
    }

    #[test]
    fn numbers_are_decimal() {
        for n in [0, 7, 10, 99, 100, 12_345, u64::from(u32::MAX), u64::MAX] {
            let mut out = Vec::new();
            number(&mut out, n);
            assert_eq!(String::from_utf8(out).unwrap(), n.to_string());
        }
    }
}
