//! Seeing what a fleet runs: the manifest hash each agent reports, `fort fleet --expect`
//! against what was built, and `fort fleet --graph`.

use std::time::Duration;

use fort_core::canonical::manifest_sha256;
use fort_tests::{eventually, Fleet};
use serde_json::json;

/// What `host` should report: the hash of its three files as on disk now.
fn expected_hash(f: &Fleet, host: &str) -> String {
    let read = |name: &str| std::fs::read(f.host_dir(host).join(name)).unwrap_or_default();
    manifest_sha256(
        &read("hosts.json"),
        &read("needs.json"),
        &read("capabilities.json"),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_reports_the_hash_of_the_files_as_loaded() {
    let mut f = Fleet::new();
    let h = f.script("provide", r#"jq -c 'with_entries(.value = "OK")'"#);
    f.capability("p", "web", json!({"handler": h, "mode": "async"}));
    f.need("c", "web/site", "p", json!({}));
    f.start();
    for host in ["p", "c"] {
        assert_eq!(
            f.status(host)["manifest_sha256"],
            json!(expected_hash(&f, host)),
            "{host}"
        );
    }
    // A new needs.json counts once it is loaded; an absent one counts as empty.
    let before = expected_hash(&f, "c");
    f.need("c", "web/other", "p", json!({}));
    f.write_files();
    assert_eq!(
        f.status("c")["manifest_sha256"],
        json!(before),
        "not loaded yet"
    );
    f.agents["c"].hup();
    let after = expected_hash(&f, "c");
    assert_ne!(before, after);
    assert!(
        eventually(Duration::from_secs(10), || f.status("c")["manifest_sha256"]
            == json!(after))
        .await
    );
    std::fs::remove_file(f.host_dir("c").join("needs.json")).unwrap();
    f.agents["c"].hup();
    let empty = expected_hash(&f, "c");
    assert!(
        eventually(Duration::from_secs(10), || f.status("c")["manifest_sha256"]
            == json!(empty))
        .await
    );
}
