//! `fort-agent audit show|verify`: the audit trail read back, filtered, and checked
//! (the chain and every checkpoint's signature) with the keys hosts.json lists.

use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use fort_core::audit::{self, AuditLine};
use fort_core::schema::Registry;
use fort_core::text::printable;
use serde_json::{json, Value};

use crate::config::Config;

/// Where the trail is and whose it is: from agent.toml, or given one by one.
#[derive(clap::Args, Debug, Clone)]
pub struct Source {
    /// The agent's config: its audit directory, host name and hosts.json.
    #[arg(long, default_value = "/etc/fort/agent.toml", value_name = "FILE")]
    pub config: PathBuf,
    /// The trail's directory (a copy taken elsewhere); default: the config's.
    #[arg(long, value_name = "DIR")]
    pub dir: Option<PathBuf>,
    /// The host that wrote it, whose keys sign its checkpoints; default: the config's.
    #[arg(long, value_name = "HOST")]
    pub signer: Option<String>,
    /// The registry holding that host's keys; default: the config's.
    #[arg(long, value_name = "FILE")]
    pub hosts: Option<PathBuf>,
    /// `verify`: copies of consumers' trails, whose witnessed checkpoints of this host
    /// must be in its trail as they saw them.
    #[arg(long, value_name = "DIR", num_args = 1..)]
    pub witnesses: Vec<PathBuf>,
}

/// What `show` prints.
#[derive(clap::Args, Debug, Clone, Default)]
pub struct Filter {
    /// Only records of this need (`<type>/<id>`).
    #[arg(long, value_name = "NEED")]
    pub need: Option<String>,
    /// Only records naming this host or principal (as caller, consumer or provider).
    #[arg(long, value_name = "NAME")]
    pub host: Option<String>,
    /// Only this kind of record (`issued`, `applied`, `operator`, `checkpoint`, …).
    #[arg(long, value_name = "EVENT")]
    pub event: Option<String>,
    /// Only records from then on: unix seconds, RFC 3339 (`2026-01-01T00:00:00Z`) or a
    /// time ago (`2h`, `3days`).
    #[arg(long, value_name = "TIME", value_parser = parse_time)]
    pub since: Option<u64>,
    /// Only records until then (same forms as --since).
    #[arg(long, value_name = "TIME", value_parser = parse_time)]
    pub until: Option<u64>,
}

struct Resolved {
    dir: PathBuf,
    host: String,
    hosts: Option<PathBuf>,
}

fn resolve(source: &Source) -> Result<Resolved, String> {
    let config = if source.dir.is_some() && source.signer.is_some() && source.hosts.is_some() {
        None
    } else {
        Some(Config::load(&source.config).map_err(|e| e.to_string())?)
    };
    Ok(Resolved {
        dir: source
            .dir
            .clone()
            .or_else(|| config.as_ref().map(Config::audit_dir))
            .expect("a dir or a config"),
        host: source
            .signer
            .clone()
            .or_else(|| config.as_ref().map(|c| c.host.clone()))
            .expect("a host or a config"),
        hosts: source
            .hosts
            .clone()
            .or_else(|| config.as_ref().map(|c| c.hosts.clone())),
    })
}

/// `unix seconds`, RFC 3339, or a duration before now.
pub fn parse_time(text: &str) -> Result<u64, String> {
    if let Ok(n) = text.parse::<u64>() {
        return Ok(n);
    }
    if let Ok(t) = humantime::parse_rfc3339_weak(text) {
        return Ok(t.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs()));
    }
    let ago = humantime::parse_duration(text).map_err(|_| {
        format!("{text:?} is not unix seconds, an RFC 3339 time or a duration such as 2h")
    })?;
    Ok(SystemTime::now()
        .checked_sub(ago)
        .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
        .map_or(0, |d| d.as_secs()))
}

impl Filter {
    pub fn matches(&self, r: &Value) -> bool {
        let s = |k: &str| r.get(k).and_then(Value::as_str);
        let at = r.get("at").and_then(Value::as_u64).unwrap_or(0);
        self.need.as_deref().is_none_or(|n| s("need") == Some(n))
            && self.event.as_deref().is_none_or(|e| s("event") == Some(e))
            && self.host.as_deref().is_none_or(|h| {
                ["caller", "consumer", "provider"]
                    .iter()
                    .any(|k| s(k) == Some(h))
            })
            && self.since.is_none_or(|t| at >= t)
            && self.until.is_none_or(|t| at <= t)
    }
}

/// Prints the records that match; `--json` prints them as they are in the files.
pub fn show(source: &Source, filter: &Filter, json_out: bool) -> Result<(), String> {
    show_dir(&resolve(source)?.dir, filter, json_out)
}

/// [`show`] of the trail in `dir` (a copy taken from its host, say).
pub fn show_dir(dir: &Path, filter: &Filter, json_out: bool) -> Result<(), String> {
    let lines = audit::read_lines(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let mut out = String::new();
    for l in &lines {
        let Some(record) = &l.record else {
            if !json_out && filter == &Filter::default() {
                out.push_str(&format!("{}:{}: not a record\n", l.file.display(), l.line));
            }
            continue;
        };
        if !filter.matches(record) {
            continue;
        }
        if json_out {
            out.push_str(&String::from_utf8_lossy(&l.bytes));
        } else {
            out.push_str(&human(record));
        }
        out.push('\n');
    }
    print!("{out}");
    Ok(())
}

impl PartialEq for Filter {
    fn eq(&self, o: &Filter) -> bool {
        (&self.need, &self.host, &self.event, self.since, self.until)
            == (&o.need, &o.host, &o.event, o.since, o.until)
    }
}

/// One record on one line: time, seq, event, then what it names. Text from the file is
/// made printable: a changed file must not talk to the terminal.
pub fn human(r: &Value) -> String {
    let at = r.get("at").and_then(Value::as_u64).unwrap_or(0);
    let when = humantime::format_rfc3339_seconds(UNIX_EPOCH + Duration::from_secs(at));
    let mut line = format!(
        "{when}  #{:<6} {:<12}",
        r.get("seq").and_then(Value::as_u64).unwrap_or(0),
        printable(r.get("event").and_then(Value::as_str).unwrap_or("?"), 40)
    );
    let Some(fields) = r.as_object() else {
        return line;
    };
    for (k, v) in fields {
        if matches!(k.as_str(), "seq" | "at" | "prev" | "event" | "signature") {
            continue;
        }
        let shown = match (k.as_str(), v) {
            ("response" | "previous" | "request" | "head", Value::String(h)) => {
                audit::short_hash(h)
            }
            ("expires_at", Value::Number(n)) => n.as_u64().map_or(n.to_string(), |t| {
                humantime::format_rfc3339_seconds(UNIX_EPOCH + Duration::from_secs(t)).to_string()
            }),
            (_, Value::String(t)) if t.contains(' ') => format!("{:?}", printable(t, 300)),
            (_, Value::String(t)) => printable(t, 300),
            (_, other) => printable(&other.to_string(), 300),
        };
        line.push_str(&format!(" {}={shown}", printable(k, 40)));
    }
    line
}

/// Checks the chain and every checkpoint; prints what it found and returns whether it
/// holds.
pub fn verify(source: &Source, json_out: bool) -> Result<bool, String> {
    let r = resolve(source)?;
    verify_dir(
        &r.dir,
        &r.host,
        r.hosts.as_deref(),
        &source.witnesses,
        json_out,
    )
}

/// What checking one copy found: its chain and checkpoints, and the checkpoints of it
/// the witness copies hold.
pub struct Checked {
    pub verified: audit::Verified,
    pub held: audit::Held,
}

impl Checked {
    pub fn ok(&self) -> bool {
        self.verified.problems.is_empty() && self.held.problems.is_empty()
    }

    /// The document `verify --json` prints.
    pub fn json(&self, dir: &Path, host: &str) -> Value {
        let (v, held) = (&self.verified, &self.held);
        json!({
            "ok": self.ok(),
            "dir": dir,
            "host": host,
            "records": v.records,
            "checkpoints": v.checkpoints,
            "first_seq": v.first_seq,
            "last_seq": v.last_seq,
            "signed_through": v.signed_through,
            "first_bad": v.problems.first().map(problem_json),
            "problems": v.problems.iter().map(problem_json).collect::<Vec<_>>(),
            "notes": v.notes,
            "witnessed": {
                "checked": held.checked,
                "problems": held.problems,
                "unverified": held.unverified,
                "predating": held.predating,
                "notes": held.notes,
            },
        })
    }
}

/// `host`'s keys in the registry `file`.
pub fn host_keys(file: &Path, host: &str) -> Result<Vec<ssh_key::PublicKey>, String> {
    let registry = Registry::load(file).map_err(|e| e.to_string())?;
    registry
        .get(host)
        .map(|p| p.keys.clone())
        .ok_or_else(|| format!("{} lists no host {host}", file.display()))
}

/// Checks the trail in `dir` as written by `host` (signed with one of `keys`), and
/// against the checkpoints of it the trails in `witnesses` hold.
pub fn check_dir(
    dir: &Path,
    host: &str,
    keys: &[ssh_key::PublicKey],
    witnesses: &[PathBuf],
) -> Result<Checked, String> {
    let verified = audit::verify(dir, host, keys).map_err(|e| format!("{}: {e}", dir.display()))?;
    let held = if witnesses.is_empty() {
        audit::Held::default()
    } else {
        audit::hold(dir, host, keys, witnesses).map_err(|e| e.to_string())?
    };
    Ok(Checked { verified, held })
}

/// [`verify`] of the trail in `dir`, written by `host`, whose keys `hosts` lists.
pub fn verify_dir(
    dir: &Path,
    host: &str,
    hosts: Option<&Path>,
    witnesses: &[PathBuf],
    json_out: bool,
) -> Result<bool, String> {
    let keys = match hosts {
        Some(file) => host_keys(file, host)?,
        None => Vec::new(),
    };
    let checked = check_dir(dir, host, &keys, witnesses)?;
    let ok = checked.ok();
    let (v, held) = (&checked.verified, &checked.held);
    if json_out {
        println!(
            "{}",
            serde_json::to_string_pretty(&checked.json(dir, host)).expect("serialises")
        );
    } else {
        for n in &v.notes {
            println!("note: {n}");
        }
        if let Some(first) = v.problems.first() {
            println!("first bad record: {first}");
            for p in v.problems.iter().skip(1).take(20) {
                println!("  then: {p}");
            }
        }
        for n in held.notes.iter().take(20) {
            println!("note: {n}");
        }
        for p in held.problems.iter().take(20) {
            println!("witnessed: {p}");
        }
        for u in held.unverified.iter().take(20) {
            println!("copy: {u}");
        }
        if !witnesses.is_empty() {
            println!(
                "{} checkpoints witnessed by the copies given, {} of them not in the trail as witnessed; {} older than the trail's first kept record, proven its ancestors by the checkpoint index; {} records of the copies not signed by {host}",
                held.checked,
                held.problems.len(),
                held.predating,
                held.unverified.len()
            );
        }
        println!(
            "{}: {} records ({} to {}), {} checkpoints, signed by {} through record {}",
            if ok { "ok" } else { "BROKEN" },
            v.records,
            v.first_seq.map_or("-".into(), |s| s.to_string()),
            v.last_seq.map_or("-".into(), |s| s.to_string()),
            v.checkpoints,
            host,
            v.signed_through.map_or("-".into(), |s| s.to_string()),
        );
        if v.signed_through < v.last_seq {
            println!(
                "the records after the last checkpoint are not signed yet (the agent signs every checkpoint_interval and when it stops)"
            );
        }
    }
    Ok(ok)
}

fn problem_json(p: &audit::Problem) -> Value {
    json!({"file": p.file, "line": p.line, "seq": p.seq, "problem": p.what})
}

/// The lines of `dir`, for tests and tools.
pub fn lines(dir: &Path) -> std::io::Result<Vec<AuditLine>> {
    audit::read_lines(dir)
}
