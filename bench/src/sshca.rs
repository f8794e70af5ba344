//! The SSH CA handler (`fort-handler ssh-ca`) as the agent runs it: one run issuing N new
//! certificates, beside what operators run instead (`ssh-keygen -s` once per
//! certificate, same CA, same keys); one run over M entries that are all unchanged
//! (proof that nothing was signed: the serial counter and the state file stay as they
//! were); and one run after a release, where every response gets the new KRL without
//! a signature.

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use serde_json::{json, Value};
use ssh_key::rand_core::OsRng;
use ssh_key::{Algorithm, LineEnding, PrivateKey};

use crate::util::{self, ms, Report};

#[derive(clap::Args, Debug)]
pub struct SshCaArgs {
    /// Certificates issued in the first run (new entries, each its own key).
    #[arg(long, default_value_t = 500)]
    certs: usize,
    /// Entries in the unchanged run.
    #[arg(long, default_value_t = 10_000)]
    unchanged: usize,
    /// Hosts in hosts.json; entries are spread over them (one host certificate each, the
    /// rest user certificates).
    #[arg(long, default_value_t = 1_000)]
    hosts: usize,
    /// Leave out the `ssh-keygen -s` comparison.
    #[arg(long)]
    no_compare: bool,
    /// The fort-handler binary. Default: $FORT_BIN_FORT_HANDLER, else next to fort-bench.
    #[arg(long)]
    handler_bin: Option<PathBuf>,
}

struct Run {
    wall: Duration,
    cpu: Duration,
    output: Value,
}

struct Bench {
    dir: PathBuf,
    handler: PathBuf,
}

impl Bench {
    fn run(&self, input: &Value) -> Result<Run> {
        let bytes = serde_json::to_vec(input)?;
        let cpu0 = util::children_cpu();
        let mut cmd = Command::new(&self.handler);
        cmd.args(["ssh-ca", "--config"])
            .arg(self.dir.join("config.json"))
            .env_clear()
            .env("FORT_TRIGGER", "request")
            .env("FORT_HOST", "forge")
            .env("FORT_HANDLER_LOG", "warn");
        let (wall, out) = util::run_handler_once(&mut cmd, bytes, "fort-handler ssh-ca")?;
        Ok(Run {
            wall,
            cpu: util::children_cpu() - cpu0,
            output: serde_json::from_slice(&out.stdout)?,
        })
    }

    fn state(&self) -> Result<(u64, u64, Value)> {
        let path = self.dir.join("state.json");
        let meta = std::fs::metadata(&path)?;
        let v: Value = serde_json::from_slice(&std::fs::read(&path)?)?;
        Ok((meta.ino(), meta.mtime_nsec() as u64, v))
    }
}

pub(crate) fn public(k: &PrivateKey) -> String {
    k.public_key().to_openssh().expect("encodes")
}

/// `n` entries over `hosts` hosts: `h0000:ssh-ca/host` (a host certificate for its
/// default principals) and `h0000:ssh-ca/uNNNN` (user certificates for `deploy`). Keys
/// are shared round-robin from a pool: the handler's cost does not depend on which.
pub(crate) fn entries(n: usize, hosts: usize, keys: &[String], tag: &str) -> Value {
    let mut map = serde_json::Map::new();
    for i in 0..n {
        let host = format!("h{:04}", i % hosts);
        let key = &keys[i % keys.len()];
        let (id, request) = if i < hosts {
            (
                "host".to_owned(),
                json!({"kind": "host", "public_key": key}),
            )
        } else {
            (
                format!("{tag}{i:05}"),
                json!({"kind": "user", "public_key": key, "principals": ["deploy"]}),
            )
        };
        map.insert(
            format!("{host}:ssh-ca/{id}"),
            json!({"request": request, "response": null}),
        );
    }
    Value::Object(map)
}

pub(crate) fn fed_back(input: &Value, output: &Value) -> Value {
    let mut next = input.clone();
    for (k, v) in next.as_object_mut().expect("object") {
        v["response"] = output.get(k).cloned().unwrap_or(Value::Null);
    }
    next
}

pub(crate) fn certificates(output: &Value) -> usize {
    output.as_object().map_or(0, |m| {
        m.values()
            .filter(|v| v.get("certificate").is_some())
            .count()
    })
}

pub async fn run(args: SshCaArgs, json_out: bool) -> Result<()> {
    let handler = util::handler_bin(args.handler_bin)?;
    let fleet = util::new_fleet();
    let dir = fleet.dir.path().to_path_buf();
    let bench = Bench {
        dir: dir.clone(),
        handler,
    };
    let ca_key = PrivateKey::random(&mut OsRng, Algorithm::Ed25519)?;
    let ca_path = dir.join("ca");
    std::fs::write(&ca_path, ca_key.to_openssh(LineEnding::LF)?.as_bytes())?;
    std::fs::set_permissions(&ca_path, std::fs::Permissions::from_mode(0o400))?;
    let hosts = args.hosts.max(1);
    let pool: Vec<PrivateKey> = (0..hosts.min(200))
        .map(|_| PrivateKey::random(&mut OsRng, Algorithm::Ed25519))
        .collect::<Result<_, _>>()?;
    let keys: Vec<String> = pool.iter().map(public).collect();
    let registry: serde_json::Map<String, Value> = (0..hosts)
        .map(|i| {
            (
                format!("h{i:04}"),
                json!({"address": format!("https://10.{}.{}.{}:7770", i / 65536 % 256, i / 256 % 256, i % 256),
                       "keys": [&keys[i % keys.len()]]}),
            )
        })
        .collect();
    std::fs::write(
        dir.join("hosts.json"),
        json!({"hosts": registry}).to_string(),
    )?;
    std::fs::write(
        dir.join("config.json"),
        json!({
            "ca_key_file": ca_path,
            "state_file": dir.join("state.json"),
            "hosts_file": dir.join("hosts.json"),
            "host_principals": {"*": ["{origin}", "{origin}.example.test"]},
            "user_principals": {"*": ["deploy"]},
            // What is measured is signing; the bound on one caller's new certificates
            // would hold most of a host's entries back.
            "max_new_certificates_per_caller_per_hour": 100_000,
        })
        .to_string(),
    )?;

    let mut r = Report::new("ssh-ca", json_out);
    r.line("hosts", hosts, format!("{hosts} hosts in hosts.json"));

    // 1. N new certificates in one run.
    let first_in = entries(args.certs, hosts, &keys, "new");
    let first = bench.run(&first_in)?;
    let issued = certificates(&first.output);
    if issued != args.certs {
        bail!("{issued} of {} certificates issued", args.certs);
    }
    r.line(
        "issue_run_ms",
        ms(first.wall),
        format!(
            "{:.1} ms for {issued} new certificates in one run ({:.3} ms each, CPU {:.0} ms)",
            ms(first.wall),
            ms(first.wall) / issued as f64,
            ms(first.cpu)
        ),
    );

    // What operators run instead: ssh-keygen -s, once per certificate.
    if !args.no_compare {
        match compare_ssh_keygen(&dir, &ca_path, &pool, args.certs) {
            Ok(t) => {
                r.line(
                    "ssh_keygen_ms",
                    ms(t),
                    format!(
                        "{:.1} ms for {} `ssh-keygen -s` runs ({:.3} ms each)",
                        ms(t),
                        args.certs,
                        ms(t) / args.certs as f64
                    ),
                );
                r.line(
                    "speedup_vs_ssh_keygen",
                    t.as_secs_f64() / first.wall.as_secs_f64(),
                    format!("{:.1}x", t.as_secs_f64() / first.wall.as_secs_f64()),
                );
            }
            Err(e) => r.note(&format!("no ssh-keygen comparison: {e:#}")),
        }
    }

    // 2. M entries: issued once (timed too), then a run where all are unchanged.
    std::fs::remove_file(dir.join("state.json"))?;
    let big_in = entries(args.unchanged, hosts, &keys, "u");
    let big = bench.run(&big_in)?;
    r.line(
        "issue_all_ms",
        ms(big.wall),
        format!(
            "{:.1} ms to issue all {} (CPU {:.0} ms)",
            ms(big.wall),
            args.unchanged,
            ms(big.cpu)
        ),
    );
    let input = fed_back(&big_in, &big.output);
    let input_mb = serde_json::to_vec(&input)?.len() as f64 / 1e6;
    let (ino0, mtime0, state0) = bench.state()?;
    let mut walls = Vec::new();
    let mut last = None;
    for _ in 0..3 {
        let run = bench.run(&input)?;
        walls.push(run.wall);
        last = Some(run);
    }
    let unchanged = last.expect("ran");
    let (ino1, mtime1, state1) = bench.state()?;
    let strip = |v: &Value| {
        let mut v = v.clone();
        v.as_object_mut().map(|m| m.remove("$fort_rerun_after"));
        v
    };
    let same = strip(&unchanged.output) == strip(&big.output);
    let nothing_signed = state0["state"]["next_serial"] == state1["state"]["next_serial"]
        && ino0 == ino1
        && mtime0 == mtime1;
    util::unchanged_summary(&mut r, &walls, args.unchanged, &dir.join("state.json"));
    walls.sort();
    let best = walls[0];
    r.line(
        "unchanged_run_ms",
        ms(best),
        format!(
            "{:.1} ms for {} unchanged entries (best of 3: {}; input {input_mb:.1} MB, CPU {:.0} ms)",
            ms(best),
            args.unchanged,
            walls.iter().map(|w| format!("{:.1}", ms(*w))).collect::<Vec<_>>().join(" / "),
            ms(unchanged.cpu)
        ),
    );
    r.line(
        "unchanged_identical",
        same && nothing_signed,
        format!(
            "responses identical: {same}; next serial still {} and the state file untouched: {nothing_signed}",
            state1["state"]["next_serial"]
        ),
    );
    r.target("unchanged < 200 ms", best < Duration::from_millis(200));
    r.target("unchanged signs nothing", same && nothing_signed);

    // 3. One release: every response carries the new KRL, still without a signature.
    let mut released = input.clone();
    let gone = released
        .as_object()
        .and_then(|m| m.keys().find(|k| k.contains("/u")).cloned())
        .ok_or_else(|| anyhow!("no user entry to release"))?;
    released.as_object_mut().expect("object").remove(&gone);
    let after = bench.run(&released)?;
    let (_, _, state2) = bench.state()?;
    let krls: std::collections::BTreeSet<&str> = after
        .output
        .as_object()
        .map(|m| m.values().filter_map(|v| v["krl"].as_str()).collect())
        .unwrap_or_default();
    r.line(
        "release_run_ms",
        ms(after.wall),
        format!(
            "{:.1} ms to revoke one and send {} responses the new KRL ({} distinct KRL, next serial {})",
            ms(after.wall),
            args.unchanged - 1,
            krls.len(),
            state2["state"]["next_serial"]
        ),
    );
    r.finish();
    Ok(())
}

/// `ssh-keygen -s CA -I ID -n deploy -z SERIAL KEY.pub` for `n` keys, one after another.
fn compare_ssh_keygen(dir: &Path, ca: &Path, pool: &[PrivateKey], n: usize) -> Result<Duration> {
    let work = dir.join("ssh-keygen");
    std::fs::create_dir_all(&work)?;
    for (i, k) in pool.iter().enumerate() {
        std::fs::write(work.join(format!("k{i}.pub")), public(k))?;
    }
    let t = Instant::now();
    for i in 0..n {
        let key = work.join(format!("k{}.pub", i % pool.len()));
        let st = Command::new("ssh-keygen")
            .args(["-q", "-s"])
            .arg(ca)
            .args([
                "-I",
                &format!("bench-{i}"),
                "-n",
                "deploy",
                "-V",
                "+8h",
                "-z",
                &(i + 1).to_string(),
            ])
            .arg(&key)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .context("run ssh-keygen")?;
        if !st.success() {
            bail!("ssh-keygen -s failed");
        }
    }
    Ok(t.elapsed())
}
