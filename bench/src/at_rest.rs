//! `fort-bench at-rest`: what sealing the state with a state key (docs/at-rest.md) costs
//! a capability run. The ssh-ca handler over M unchanged entries, once with plaintext
//! state and once with sealed state (its state and its CA key), in alternating runs of
//! one process, so that both see the same machine; the ratio of the medians is the cost.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::{bail, Result};
use serde_json::{json, Value};
use ssh_key::rand_core::OsRng;
use ssh_key::{Algorithm, PrivateKey};

use crate::sshca::{certificates, entries, fed_back, public};
use crate::util::{self, ms, Report};

#[derive(clap::Args, Debug)]
pub struct AtRestArgs {
    /// Entries in the unchanged runs.
    #[arg(long, default_value_t = 10_000)]
    unchanged: usize,
    /// Hosts in hosts.json; entries are spread over them.
    #[arg(long, default_value_t = 1_000)]
    hosts: usize,
    /// Unchanged runs of each kind (alternating; the medians are compared).
    #[arg(long, default_value_t = 7)]
    runs: usize,
    /// The fort-handler binary. Default: $FORT_BIN_FORT_HANDLER, else next to fort-bench.
    #[arg(long)]
    handler_bin: Option<PathBuf>,
}

/// One CA: its directory, and the state key its runs get (none: plaintext).
struct Side {
    dir: PathBuf,
    key: Option<PathBuf>,
}

impl Side {
    fn new(root: &Path, name: &str, hosts_file: &Path, key: Option<PathBuf>) -> Result<Side> {
        let dir = root.join(name);
        std::fs::create_dir_all(&dir)?;
        std::fs::write(
            dir.join("config.json"),
            json!({
                "ca_key_file": dir.join("ca"),
                "generate_ca_key": true,
                "state_file": dir.join("state.json"),
                "hosts_file": hosts_file,
                "host_principals": {"*": ["{origin}"]},
                "user_principals": {"*": ["deploy"]},
                "max_new_certificates_per_caller_per_hour": 100_000,
            })
            .to_string(),
        )?;
        Ok(Side { dir, key })
    }

    /// One run as the agent makes it: (wall, CPU, output).
    fn run(&self, handler: &Path, input: &[u8]) -> Result<(Duration, Duration, Value)> {
        let mut cmd = Command::new(handler);
        cmd.args(["ssh-ca", "--config"])
            .arg(self.dir.join("config.json"))
            .env_clear()
            .env("FORT_TRIGGER", "request")
            .env("FORT_HOST", "forge")
            .env("FORT_HANDLER_LOG", "warn");
        if let Some(k) = &self.key {
            cmd.env(fort_core::sealed::KEY_FILE_ENV, k);
        }
        let cpu0 = util::children_cpu();
        let (wall, out) = util::run_handler_once(&mut cmd, input.to_vec(), "fort-handler ssh-ca")?;
        Ok((
            wall,
            util::children_cpu().saturating_sub(cpu0),
            serde_json::from_slice(&out.stdout)?,
        ))
    }
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

pub async fn run(args: AtRestArgs, json_out: bool) -> Result<()> {
    let handler = util::handler_bin(args.handler_bin)?;
    let fleet = util::new_fleet();
    let root = fleet.dir.path().to_path_buf();
    let hosts = args.hosts.max(1);
    let keys: Vec<String> = (0..hosts.min(200))
        .map(|_| PrivateKey::random(&mut OsRng, Algorithm::Ed25519).map(|k| public(&k)))
        .collect::<Result<_, _>>()?;
    let registry: serde_json::Map<String, Value> = (0..hosts)
        .map(|i| {
            (
                format!("h{i:04}"),
                json!({"address": format!("https://10.{}.{}.{}:7770", i / 65536 % 256, i / 256 % 256, i % 256),
                       "keys": [&keys[i % keys.len()]]}),
            )
        })
        .collect();
    let hosts_file = root.join("hosts.json");
    std::fs::write(&hosts_file, json!({"hosts": registry}).to_string())?;
    let key_file = root.join("state-key");
    std::fs::write(
        &key_file,
        fort_core::sealed::StateKey::generate_hex().as_bytes(),
    )?;
    let plain = Side::new(&root, "plain", &hosts_file, None)?;
    let sealed = Side::new(&root, "sealed", &hosts_file, Some(key_file))?;

    let mut r = Report::new("at-rest", json_out);
    // Both CAs issue the same entries once; then every run is over unchanged entries.
    let first_in = entries(args.unchanged, hosts, &keys, "u");
    let first_bytes = serde_json::to_vec(&first_in)?;
    let mut inputs = Vec::new();
    for side in [&plain, &sealed] {
        let (_, _, out) = side.run(&handler, &first_bytes)?;
        let issued = certificates(&out);
        if issued != args.unchanged {
            bail!("{issued} of {} certificates issued", args.unchanged);
        }
        inputs.push(serde_json::to_vec(&fed_back(&first_in, &out))?);
    }
    let state = std::fs::read(sealed.dir.join("state.json"))?;
    let ca = std::fs::read(sealed.dir.join("ca"))?;
    if !fort_core::sealed::is_sealed(&state) || !fort_core::sealed::is_sealed(&ca) {
        bail!("the sealed side's state or CA key is not sealed");
    }
    let state_kib = state.len() / 1024;

    let (mut plain_wall, mut plain_cpu, mut sealed_wall, mut sealed_cpu) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for i in 0..args.runs.max(1) {
        // Alternating which goes first, so neither always runs on a warmer cache.
        let order = if i % 2 == 0 { [0, 1] } else { [1, 0] };
        for s in order {
            let side = [&plain, &sealed][s];
            let (wall, cpu, _) = side.run(&handler, &inputs[s])?;
            if s == 0 {
                plain_wall.push(wall);
                plain_cpu.push(cpu);
            } else {
                sealed_wall.push(wall);
                sealed_cpu.push(cpu);
            }
        }
    }
    let (pw, pc, sw, sc) = (
        median(plain_wall),
        median(plain_cpu),
        median(sealed_wall),
        median(sealed_cpu),
    );
    r.line(
        "unchanged_entries",
        args.unchanged,
        format!(
            "{} unchanged ssh-ca entries, {state_kib} KiB of sealed state, {} runs each",
            args.unchanged,
            args.runs.max(1)
        ),
    );
    r.line(
        "plain_run_ms_wall_cpu",
        json!([ms(pw), ms(pc)]),
        format!(
            "plaintext state: {:.1} ms ({:.1} ms CPU), median",
            ms(pw),
            ms(pc)
        ),
    );
    r.line(
        "sealed_run_ms_wall_cpu",
        json!([ms(sw), ms(sc)]),
        format!(
            "sealed state: {:.1} ms ({:.1} ms CPU), median",
            ms(sw),
            ms(sc)
        ),
    );
    let ratio_cpu = sc.as_secs_f64() / pc.as_secs_f64().max(1e-9);
    let ratio_wall = sw.as_secs_f64() / pw.as_secs_f64().max(1e-9);
    r.line(
        "sealed_over_plain_cpu",
        ratio_cpu,
        format!("{ratio_cpu:.3}x CPU (wall {ratio_wall:.3}x)"),
    );
    r.target("sealed within 1.2x of plaintext (CPU)", ratio_cpu <= 1.2);
    r.finish();
    Ok(())
}
