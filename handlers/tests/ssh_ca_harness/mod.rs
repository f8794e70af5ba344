//! What the ssh-ca handler tests share: a scratch CA with its key, hosts.json and
//! config, runs of `fort-handler ssh-ca` as the agent makes them, and `ssh-keygen`.
// Each test file uses part of it.
#![allow(dead_code)]

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use serde_json::{json, Value};
use ssh_key::rand_core::OsRng;
use ssh_key::{Algorithm, LineEnding, PrivateKey};

pub struct Ca {
    pub dir: tempfile::TempDir,
}

pub fn key() -> PrivateKey {
    PrivateKey::random(&mut OsRng, Algorithm::Ed25519).unwrap()
}

pub fn public(k: &PrivateKey) -> String {
    k.public_key().to_openssh().unwrap()
}

pub fn have_ssh_keygen(test: &str) -> bool {
    let ok = Command::new("ssh-keygen")
        .arg("-?")
        .stderr(Stdio::null())
        .status()
        .is_ok();
    if !ok {
        fort_tests::skip(test, "ssh-keygen (openssh-client) is not installed");
    }
    ok
}

impl Ca {
    /// A CA key (0400), hosts.json with hosts `app` and `web` and principal `ops`, and a
    /// config: hosts get `{origin}` and `{origin}.example.test`, `app` may have user
    /// certificates for `deploy` and `{origin}-svc`, `ops` for `ops`.
    pub fn new(extra: Value) -> Ca {
        let dir = tempfile::tempdir().unwrap();
        let ca = Ca { dir };
        let host_key = public(&key());
        std::fs::write(
            ca.path("hosts.json"),
            json!({
                "hosts": {"app": {"address": "https://127.0.0.2:7770", "keys": [host_key]},
                          "web": {"address": "https://127.0.0.3:7770", "keys": [host_key]}},
                "principals": {"ops": {"keys": [host_key]}}
            })
            .to_string(),
        )
        .unwrap();
        std::fs::write(
            ca.path("ca"),
            key().to_openssh(LineEnding::LF).unwrap().as_bytes(),
        )
        .unwrap();
        std::fs::set_permissions(ca.path("ca"), std::fs::Permissions::from_mode(0o400)).unwrap();
        let mut config = json!({
            "ca_key_file": ca.path("ca"),
            "state_file": ca.path("state/ssh-ca.json"),
            "hosts_file": ca.path("hosts.json"),
            "host_principals": {"*": ["{origin}", "{origin}.example.test"]},
            "user_principals": {"app": ["deploy", "{origin}-svc"], "ops": ["ops"]},
        });
        for (k, v) in extra.as_object().unwrap() {
            config[k] = v.clone();
        }
        ca.write_config(&config);
        ca
    }

    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    pub fn write_config(&self, config: &Value) {
        std::fs::write(self.path("config.json"), config.to_string()).unwrap();
    }

    /// One run: (exit ok, stdout as JSON, stderr).
    pub fn run(&self, input: &Value) -> (bool, Value, String) {
        fort_tests::run_handler(
            "ssh-ca",
            &self.path("config.json"),
            "request",
            &[("FORT_HOST", "forge")],
            input,
        )
    }

    pub fn ok(&self, input: &Value) -> Value {
        let (ok, out, err) = self.run(input);
        assert!(ok, "run failed: {err}");
        out
    }

    pub fn state(&self) -> Value {
        serde_json::from_slice(&std::fs::read(self.path("state/ssh-ca.json")).unwrap()).unwrap()
    }

    /// Writes `text` to a file of the scratch dir and returns its path.
    pub fn file(&self, name: &str, text: &str) -> PathBuf {
        let p = self.path(name);
        std::fs::write(&p, text).unwrap();
        p
    }

    /// `ssh-keygen -Q -f KRL CERT`: true when the KRL revokes the certificate.
    pub fn revoked(&self, response: &Value, cert: &Path) -> bool {
        let krl = self.krl_file(response);
        let out = Command::new("ssh-keygen")
            .args(["-Q", "-f"])
            .arg(&krl)
            .arg(cert)
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        match out.status.code() {
            Some(0) => {
                assert!(text.contains(": ok"), "{text}");
                false
            }
            Some(1) => {
                assert!(text.contains("REVOKED"), "{text}");
                true
            }
            other => panic!(
                "ssh-keygen -Q: {other:?} {text} {}",
                String::from_utf8_lossy(&out.stderr)
            ),
        }
    }

    pub fn krl_file(&self, response: &Value) -> PathBuf {
        use base64::Engine;
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(response["krl"].as_str().unwrap())
            .unwrap();
        let p = self.path("krl");
        std::fs::write(&p, bytes).unwrap();
        p
    }
}

/// An input entry.
pub fn entry(request: Value) -> Value {
    json!({"request": request, "response": null})
}

/// The next input: the same requests, each with the response it got (cacheResponse).
pub fn fed_back(input: &Value, output: &Value) -> Value {
    let mut next = input.clone();
    for (k, v) in next.as_object_mut().unwrap() {
        v["response"] = output.get(k).cloned().unwrap_or(Value::Null);
        v.as_object_mut().unwrap().remove("renew");
    }
    next
}

pub fn keygen_list(cert: &Path) -> String {
    let out = Command::new("ssh-keygen")
        .arg("-L")
        .arg("-f")
        .arg(cert)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}
