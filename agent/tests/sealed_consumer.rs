//! What a consumer keeps of payloads, sealed with its state key (docs/at-rest.md), with
//! real agents: a payload recorded before it is applied and one kept for a need that
//! refers to it are in no file of the consumer's state directory in the clear, neither
//! plain nor as the base64 the state holds, in the snapshot or the logs; the consumer
//! restarts on them; and without a key it keeps them as before.

use std::path::Path;
use std::time::Duration;

use base64::Engine;
use fort_tests::{contains_bytes, eventually, files_under, Fleet};
use serde_json::json;

/// What every payload holds, to search the disk for.
const CANARY: &str = "canary-0f3b9c2e7a1d4c8bb6e5f09a3d2c1b7e-canary";

fn fleet() -> Fleet {
    let mut f = Fleet::new();
    let h = f.script(
        "provide",
        &format!(
            r#"jq -c --arg c "{CANARY}" 'with_entries(.value = {{"secret": ($c + "-" + .key)}})'"#
        ),
    );
    f.capability("p", "cred", json!({"handler": h, "mode": "async"}));
    let out = f.dir.path().join("out");
    f.need(
        "c",
        "cred/a",
        "p",
        json!({"files": [{"path": out.join("a"), "pointer": "/secret"}]}),
    );
    // Refers to cred/a: the consumer keeps cred/a's payload to build this request.
    f.need(
        "c",
        "cred/b",
        "p",
        json!({"request": {"from_a": {"$fort_ref": "cred/a#/secret"}},
               "files": [{"path": out.join("b"), "pointer": "/secret"}]}),
    );
    f
}

/// Every spelling of `needle` a state file could hold: as it is, and inside base64 at
/// each of the three alignments (the stretch of characters that depends on it alone).
fn spellings(needle: &str) -> Vec<Vec<u8>> {
    let b64 = base64::engine::general_purpose::STANDARD;
    let mut out = vec![needle.as_bytes().to_vec()];
    for offset in 0..3usize {
        let mut data = vec![b'x'; offset];
        data.extend_from_slice(needle.as_bytes());
        let text = b64.encode(&data);
        let skip = (offset * 4).div_ceil(3) + 1;
        out.push(text.as_bytes()[skip..text.len() - 4].to_vec());
    }
    out
}

fn holding(dir: &Path, needle: &str) -> Vec<String> {
    let spellings = spellings(needle);
    files_under(dir)
        .into_iter()
        .filter(|f| std::fs::read(f).is_ok_and(|b| spellings.iter().any(|s| contains_bytes(&b, s))))
        .map(|f| f.display().to_string())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_keeps_no_payload_in_the_clear_under_a_state_key() {
    let mut f = fleet();
    let key = f.new_state_key("c-key");
    f.host("c").extra_toml = format!("state_key_file = \"{}\"\n", key.display());
    f.start();
    let delivered = f.dir.path().join("out");
    assert!(
        eventually(Duration::from_secs(60), || f.all_satisfied("c")).await,
        "{}",
        f.status("c")
    );
    assert!(std::fs::read_to_string(delivered.join("b"))
        .unwrap()
        .contains(CANARY));
    let state = f.host_dir("c").join("state");
    // Live: the logs hold every inbox record since the start.
    assert_eq!(holding(&state, CANARY), Vec::<String>::new());
    // The search finds what it looks for where it is in the clear.
    assert!(!holding(&delivered, CANARY).is_empty());
    // And after a restart that folded the logs into a snapshot.
    f.kill("c");
    f.start_host("c");
    assert!(
        eventually(Duration::from_secs(30), || f.all_satisfied("c")).await,
        "{}",
        f.status("c")
    );
    assert_eq!(holding(&state, CANARY), Vec::<String>::new());
    let snapshot: serde_json::Value =
        serde_json::from_slice(&std::fs::read(state.join("fulfillment-state.json")).unwrap())
            .unwrap();
    assert_eq!(snapshot["version"], 3, "{snapshot}");

    // Without a key, as before: plain, and the kept payload is there to refer to.
    let mut plain = fleet();
    plain.start();
    assert!(
        eventually(Duration::from_secs(60), || plain.all_satisfied("c")).await,
        "{}",
        plain.status("c")
    );
    let state = plain.host_dir("c").join("state");
    assert!(!holding(&state, CANARY).is_empty(), "the control search");
}
