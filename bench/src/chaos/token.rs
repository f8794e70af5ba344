//! The chaos run's single-provider capability: a token issuer whose handler keeps its own
//! record of every token it issued and revoked, outside any agent's state, as the server
//! behind a real capability would. The run checks the consumers' files against that
//! record, never against fort's account of what it delivered.
//!
//! Input and output as every async handler's (docs/handlers.md). A request is
//! `{"scope": "…", "round": N}`; a response `{"token", "scope", "round", "issued_at",
//! "expires_at"}`, `expires_at` being what the consumer renews by (§11.4). A cached
//! response is kept while its round is the request's, no renewal was asked for and more
//! than a quarter of its lifetime is left. A renewed or re-requested entry's earlier
//! token stays valid until it expires (a service may still hold it); an entry gone from
//! the input (released, or collected by GC) has every token it held revoked.
//!
//! The record, in `--record DIR`: `issued.jsonl` and `revoked.jsonl` (one JSON object a
//! line, appended before the output is printed, so every token an agent can have been
//! given is in it), and `live.json` (entry → tokens not yet expired), replaced whole.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use serde_json::{json, Map, Value};

/// What every token starts with: the run searches disks and trails for it.
pub const CANARY: &str = "chaos-canary-";

#[derive(clap::Args, Debug)]
pub struct TokenHandlerArgs {
    /// The issuer's record directory.
    #[arg(long)]
    record: PathBuf,
    /// A token's lifetime in seconds.
    #[arg(long, default_value_t = 120)]
    lifetime: u64,
}

fn now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

fn random_hex() -> Result<String> {
    let mut bytes = [0u8; 16];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut bytes))
        .context("read /dev/urandom")?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}

fn append(path: &Path, lines: &[Value]) -> Result<()> {
    if lines.is_empty() {
        return Ok(());
    }
    let mut text = String::new();
    for l in lines {
        text.push_str(&l.to_string());
        text.push('\n');
    }
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .with_context(|| format!("open {}", path.display()))?;
    f.write_all(text.as_bytes())?;
    f.sync_data()?;
    Ok(())
}

/// Whether the cached response may be answered again.
fn keep(entry: &Value, round: u64, lifetime: u64, now: u64) -> bool {
    let r = &entry["response"];
    r["token"].is_string()
        && r["round"].as_u64() == Some(round)
        && entry["renew"] != json!(true)
        && r["expires_at"].as_u64().unwrap_or(0) > now + lifetime / 4
}

pub fn run(args: TokenHandlerArgs) -> Result<()> {
    let mut input = String::new();
    std::io::stdin().read_to_string(&mut input)?;
    let input: Map<String, Value> = serde_json::from_str(&input).context("input")?;
    std::fs::create_dir_all(&args.record)?;
    let live_path = args.record.join("live.json");
    let mut live: BTreeMap<String, Vec<Value>> = std::fs::read(&live_path)
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
        .unwrap_or_default();
    let host = std::env::var("FORT_HOST").unwrap_or_default();
    let now = now();
    let mut out = Map::new();
    let mut issued = Vec::new();
    for (key, entry) in &input {
        let scope = entry["request"]["scope"].as_str().unwrap_or("").to_owned();
        let round = entry["request"]["round"].as_u64().unwrap_or(0);
        if scope.is_empty() || scope.len() > 32 {
            eprintln!("token: {key}: request.scope must be a short word");
            out.insert(key.clone(), Value::Null);
            continue;
        }
        if keep(entry, round, args.lifetime, now) {
            out.insert(key.clone(), entry["response"].clone());
            continue;
        }
        let token = format!("{CANARY}{}", random_hex()?);
        let expires_at = now + args.lifetime;
        issued.push(json!({"token": token, "entry": key, "issued_at": now,
                           "expires_at": expires_at, "by": host}));
        live.entry(key.clone())
            .or_default()
            .push(json!({"token": token, "expires_at": expires_at}));
        out.insert(
            key.clone(),
            json!({"token": token, "scope": scope, "round": round,
                   "issued_at": now, "expires_at": expires_at}),
        );
    }
    // Entries gone from the input were released or collected: what they held is revoked.
    let mut revoked = Vec::new();
    let gone: Vec<String> = live
        .keys()
        .filter(|k| !input.contains_key(*k))
        .cloned()
        .collect();
    for key in gone {
        for t in live.remove(&key).unwrap_or_default() {
            revoked.push(json!({"token": t["token"], "entry": key, "at": now}));
        }
    }
    for tokens in live.values_mut() {
        tokens.retain(|t| t["expires_at"].as_u64().unwrap_or(0) > now);
    }
    append(&args.record.join("issued.jsonl"), &issued)?;
    append(&args.record.join("revoked.jsonl"), &revoked)?;
    let tmp = args
        .record
        .join(format!("live.json.{}", std::process::id()));
    std::fs::write(&tmp, serde_json::to_vec(&live)?)?;
    std::fs::rename(&tmp, &live_path)?;
    println!("{}", Value::Object(out));
    Ok(())
}

/// What the run reads of the record: every token issued and revoked so far.
#[derive(Default)]
pub struct Record {
    pub issued: BTreeMap<String, Issued>,
    /// token → when it was revoked.
    pub revoked: BTreeMap<String, u64>,
    read_issued: u64,
    read_revoked: u64,
}

#[derive(Debug, Clone)]
pub struct Issued {
    pub expires_at: u64,
}

impl Record {
    /// Reads what was appended since the last call (a torn last line is read next time).
    pub fn refresh(&mut self, dir: &Path) {
        for (file, offset) in [
            ("issued.jsonl", &mut self.read_issued),
            ("revoked.jsonl", &mut self.read_revoked),
        ] {
            let Ok(bytes) = std::fs::read(dir.join(file)) else {
                continue;
            };
            let Some(rest) = bytes.get(*offset as usize..) else {
                continue;
            };
            let complete = rest.iter().rposition(|b| *b == b'\n').map_or(0, |p| p + 1);
            for line in rest[..complete].split(|b| *b == b'\n') {
                let Ok(v) = serde_json::from_slice::<Value>(line) else {
                    continue;
                };
                let Some(token) = v["token"].as_str() else {
                    continue;
                };
                if file == "issued.jsonl" {
                    self.issued.insert(
                        token.to_owned(),
                        Issued {
                            expires_at: v["expires_at"].as_u64().unwrap_or(0),
                        },
                    );
                } else {
                    self.revoked
                        .insert(token.to_owned(), v["at"].as_u64().unwrap_or(0));
                }
            }
            *offset += complete as u64;
        }
    }
}
