//! docs/without-nixos.md's three-host fleet, run as the page says: every `sh` block of
//! its section "A three-host fleet", in order, in one shell (with `-e`: any command that
//! fails fails the test), in an empty directory, with the workspace's binaries on `PATH`.
//! The page cannot drift from what works: the commands run are read from it. Then what
//! the page claims is checked, and that its last block stopped every agent it started.

use std::io::Read;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use fort_tests::cleanup::{adopt_orphans, leftovers};
use fort_tests::dns::find_program;
use fort_tests::{bin, files_under, free_addr, skip};

/// The `sh` blocks of the page's section `heading`, in order.
fn shell_blocks(page: &str, heading: &str) -> Vec<String> {
    let start = page
        .find(&format!("\n{heading}\n"))
        .unwrap_or_else(|| panic!("no section {heading:?}"));
    let section = &page[start + 1..];
    let section = match section[heading.len()..].find("\n## ") {
        Some(end) => &section[..heading.len() + end],
        None => section,
    };
    let mut blocks = Vec::new();
    let mut rest = section;
    while let Some(open) = rest.find("```sh\n") {
        let body = &rest[open + "```sh\n".len()..];
        let close = body.find("\n```").expect("a closed block");
        blocks.push(body[..close].to_owned());
        rest = &body[close + 4..];
    }
    blocks
}

#[test]
fn the_three_host_fleet_runs_as_the_page_says() {
    const T: &str = "the_three_host_fleet_runs_as_the_page_says";
    for tool in ["ssh-keygen", "jq", "openssl", "timeout"] {
        if find_program(tool).is_none() {
            return skip(T, &format!("{tool} is not installed"));
        }
    }
    let page = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/without-nixos.md"),
    )
    .expect("read docs/without-nixos.md");
    let blocks = shell_blocks(&page, "## A three-host fleet");
    assert!(blocks.len() >= 8, "{} blocks", blocks.len());
    assert!(
        blocks.last().is_some_and(|b| b.contains("kill")),
        "the page ends by stopping the agents"
    );
    let script = blocks.join("\n");

    adopt_orphans();
    let dir = tempfile::tempdir().unwrap();
    let binaries = bin("fort-agent").parent().unwrap().to_owned();
    let path = std::env::join_paths(
        std::iter::once(binaries).chain(std::env::split_paths(&std::env::var_os("PATH").unwrap())),
    )
    .unwrap();
    let out_file = dir.path().join("output");
    let mut shell = Command::new("bash")
        .args(["-e", "-c", &script])
        .current_dir(dir.path())
        .env("PATH", path)
        // Free addresses instead of the page's defaults, as the page offers.
        .env("CA_ADDRESS", free_addr("127.0.0.1").to_string())
        .env("VAULT_ADDRESS", free_addr("127.0.0.1").to_string())
        .env("APP_ADDRESS", free_addr("127.0.0.1").to_string())
        .env_remove("FORT_HOSTS")
        .env_remove("FORT_SSH_KEY")
        .env_remove("FORT_ORIGIN")
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&out_file).unwrap())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run bash");
    let mut stderr = shell.stderr.take().unwrap();
    let reader = std::thread::spawn(move || {
        let mut text = String::new();
        let _ = stderr.read_to_string(&mut text);
        text
    });
    let deadline = Instant::now() + Duration::from_secs(120);
    let status = loop {
        if let Some(status) = shell.try_wait().unwrap() {
            break Some(status);
        }
        if Instant::now() > deadline {
            let _ = shell.kill();
            let _ = shell.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let stderr = reader.join().unwrap();
    let stdout = std::fs::read_to_string(&out_file).unwrap_or_default();
    let left = leftovers(&[]);
    let logs: String = ["ca", "vault", "app"]
        .iter()
        .map(|h| {
            let log =
                std::fs::read_to_string(dir.path().join(h).join("agent.log")).unwrap_or_default();
            format!("--- {h}/agent.log\n{log}")
        })
        .collect();
    assert!(
        status.is_some_and(|s| s.success()),
        "the page's commands failed ({status:?}):\n{stdout}\n{stderr}\n{logs}"
    );
    assert!(
        left.is_empty(),
        "the page's last block left running: {left:?}"
    );

    // What the page says happened.
    assert!(
        stdout.contains("NEEDS (2 of 2 satisfied)"),
        "{stdout}\n{stderr}\n{logs}"
    );
    assert!(
        stdout.contains("ok: 3 hosts, 2 consumer → provider pairs checked"),
        "{stdout}"
    );
    let run = dir.path().join("app/run");
    let listing = Command::new("ssh-keygen")
        .args(["-L", "-f"])
        .arg(run.join("ssh_host_ed25519_key-cert.pub"))
        .output()
        .unwrap();
    let listing = String::from_utf8_lossy(&listing.stdout);
    assert!(listing.contains("host certificate"), "{listing}");
    assert!(listing.contains("app.example.org"), "{listing}");
    // The certificate is for the key app made.
    let fingerprint = Command::new("ssh-keygen")
        .args(["-l", "-f"])
        .arg(run.join("ssh_host_ed25519_key"))
        .output()
        .unwrap();
    let fingerprint = String::from_utf8_lossy(&fingerprint.stdout);
    let fingerprint = fingerprint
        .split_whitespace()
        .nth(1)
        .expect("a fingerprint");
    assert!(
        listing.contains(fingerprint),
        "the certificate is not for app's key {fingerprint}:\n{listing}"
    );
    // That key never left app: no file of ca or vault holds it.
    let private = std::fs::read_to_string(run.join("ssh_host_ed25519_key")).unwrap();
    // Past the header every OpenSSH key file starts with: the private part.
    let secret = private.lines().nth(3).expect("a key body");
    for host in ["ca", "vault"] {
        for file in files_under(&dir.path().join(host)) {
            let text = std::fs::read(&file).unwrap_or_default();
            assert!(
                !String::from_utf8_lossy(&text).contains(secret),
                "{} holds app's private key",
                file.display()
            );
        }
    }
    let token = std::fs::read_to_string(run.join("api-token")).unwrap();
    assert!(
        token.len() == 64 && token.bytes().all(|b| b.is_ascii_hexdigit()),
        "{token:?}"
    );
}

/// `fort-handler <capability> --schema` prints what the NixOS module writes as
/// `request_schema` for a capability that handler serves (nixos-module/tests/expected).
#[test]
fn fort_handler_prints_the_schema_the_module_writes() {
    let expected = Path::new(env!("CARGO_MANIFEST_DIR")).join("../nixos-module/tests/expected");
    let mut compared = Vec::new();
    for host in std::fs::read_dir(&expected).unwrap().flatten() {
        let file = host.path().join("capabilities.json");
        let Ok(text) = std::fs::read_to_string(&file) else {
            continue;
        };
        let caps: serde_json::Value = serde_json::from_str(&text).unwrap();
        for (name, cap) in caps.as_object().unwrap() {
            let handler = cap["handler"].as_str().unwrap_or_default();
            let Some(served) = cap["args"][0]
                .as_str()
                .filter(|_| handler.ends_with("/fort-handler"))
            else {
                continue;
            };
            let out = Command::new(bin("fort-handler"))
                .args([served, "--schema"])
                .output()
                .unwrap();
            assert!(
                out.status.success(),
                "{}",
                String::from_utf8_lossy(&out.stderr)
            );
            let printed: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
            assert_eq!(printed, cap["request_schema"], "{name} ({served})");
            compared.push(served.to_owned());
        }
    }
    compared.sort();
    compared.dedup();
    assert_eq!(
        compared,
        [
            "acme",
            "backup-repo",
            "dns-record",
            "mesh",
            "oidc",
            "postgres",
            "proxy",
            "scrape",
            "ssh-ca"
        ],
        "every capability fort-handler serves is rendered by the module's test fleet"
    );
}
