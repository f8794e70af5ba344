//! `fort audit pull HOST… --out DIR`: each host's audit trail copied into `DIR/<host>/`
//! over signed calls of the `audit` built-in (docs/protocol.md §5a), each file fetched from
//! where the copy ends. A copy is never changed, only appended to: when the host's file no
//! longer begins with what was pulled before (rewritten, or cut short), that is a finding,
//! kept in `DIR/<host>/.pulled.json` for `fort audit verify --fleet`, and nothing more is
//! pulled from that host.

use std::io::{Read, Write};
use std::path::Path;

use base64::Engine;
use fort_core::audit::INDEX_FILE;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use sha2::{Digest, Sha256};

use super::{judge, Session};
use crate::builtins::audit::{is_trail_name, MAX_CHUNK};

/// What a pull keeps beside the copy: when it last pulled, how long each file was then,
/// and what it found.
pub const PULLED_FILE: &str = ".pulled.json";

/// The longest file taken from a host (the trail's files are closed at `max_file_bytes`,
/// 16 MiB by default): a host that hands out more is not sending its trail.
const MAX_FILE_BYTES: u64 = 1 << 32;

/// `DIR/<host>/.pulled.json`.
#[derive(Debug, Default, Serialize, Deserialize)]
pub struct Pulled {
    /// Unix seconds of the last pull that fetched.
    #[serde(default)]
    pub pulled_at: Option<u64>,
    /// Each file's length after that pull.
    #[serde(default)]
    pub files: std::collections::BTreeMap<String, u64>,
    /// What pulls found wrong, oldest first; they stay until the operator removes them.
    #[serde(default)]
    pub findings: Vec<Finding>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Finding {
    pub at: u64,
    pub file: String,
    pub what: String,
}

impl Pulled {
    /// The record beside a copy, or an empty one when there is none yet.
    pub fn read(dir: &Path) -> Result<Pulled, String> {
        let path = dir.join(PULLED_FILE);
        match fort_core::fsx::read_regular(&path, 1 << 20) {
            Ok(bytes) => serde_json::from_slice(&bytes)
                .map_err(|e| format!("{}: not what fort audit pull writes: {e}", path.display())),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Pulled::default()),
            Err(e) => Err(format!("{}: {e}", path.display())),
        }
    }

    fn write(&self, dir: &Path) -> Result<(), String> {
        let bytes = serde_json::to_vec_pretty(self).expect("serialises");
        fort_core::store::write_atomic(&dir.join(PULLED_FILE), &bytes)
            .map_err(|e| format!("{}: {e}", dir.join(PULLED_FILE).display()))
    }
}

/// What a pull of one host did.
#[derive(Debug, Default)]
pub struct PullReport {
    pub host: String,
    /// Files something was fetched of, and those of them that were new here.
    pub files: std::collections::BTreeSet<String>,
    pub new_files: std::collections::BTreeSet<String>,
    pub bytes: u64,
    /// Files the copy keeps that the host rotated away.
    pub kept: usize,
    /// Why the host's pull failed (then nothing of it was changed after that point).
    pub error: Option<String>,
}

impl PullReport {
    /// One line for the operator.
    pub fn text(&self) -> String {
        match &self.error {
            Some(e) => format!("{}: FAILED: {e}", self.host),
            None => {
                let mut line = format!(
                    "{}: fetched {} bytes of {} file{} ({} new)",
                    self.host,
                    self.bytes,
                    self.files.len(),
                    if self.files.len() == 1 { "" } else { "s" },
                    self.new_files.len()
                );
                if self.kept > 0 {
                    line.push_str(&format!(
                        "; kept {} file{} the host rotated away",
                        self.kept,
                        if self.kept == 1 { "" } else { "s" }
                    ));
                }
                line
            }
        }
    }
}

/// A remote file and its length when listed.
struct Remote {
    name: String,
    bytes: u64,
}

/// Pulls `host`'s trail into `out/<host>/`, first checking that the copy is still the
/// beginning of the host's files.
pub async fn pull(session: &Session, host: &str, out: &Path) -> PullReport {
    let mut report = PullReport {
        host: host.to_owned(),
        ..PullReport::default()
    };
    if let Err(e) = pull_into(session, host, out, true, &mut report).await {
        report.error = Some(e);
    }
    report
}

/// Pulls every host concurrently, then each again for what was added meanwhile (without
/// the check, made a moment before): a consumer's copy then holds no checkpoint it
/// witnessed during the first round that its provider's copy lacks, unless it was signed
/// during the second, short one. The reports are in the order the hosts were given.
pub async fn pull_all(session: &Session, hosts: &[String], out: &Path) -> Vec<PullReport> {
    let mut reports =
        futures_util::future::join_all(hosts.iter().map(|h| pull(session, h, out))).await;
    futures_util::future::join_all(reports.iter_mut().filter(|r| r.error.is_none()).map(
        |r| async move {
            let host = r.host.clone();
            if let Err(e) = pull_into(session, &host, out, false, r).await {
                r.error = Some(e);
            }
        },
    ))
    .await;
    reports
}

async fn pull_into(
    session: &Session,
    host: &str,
    out: &Path,
    check_first: bool,
    report: &mut PullReport,
) -> Result<(), String> {
    // Host names are `[a-z0-9-]` (hosts.json is checked on load): never a path.
    if session.registry.get(host).is_none() || host.contains(['/', '.']) {
        return Err(super::unknown_host(
            &session.registry,
            &session.signing.hosts,
            host,
        ));
    }
    // Asked before anything is made here: a host that refuses leaves no directory.
    let (remote, index) = listing(session, host).await?;
    let dir = out.join(host);
    make_dir(&dir)?;
    let mut pulled = Pulled::read(&dir)?;
    let findings = if check_first {
        check(session, host, &dir, &remote, index).await?
    } else {
        Vec::new()
    };
    if !findings.is_empty() {
        let first = format!("{}: {}", findings[0].file, findings[0].what);
        let more = findings.len() - 1;
        pulled.findings.extend(findings);
        pulled.write(&dir)?;
        return Err(format!(
            "{first}{}; the copy in {} is kept as it was pulled, and nothing more was pulled from {host}",
            if more > 0 {
                format!(" (and {more} more in {PULLED_FILE})")
            } else {
                String::new()
            },
            dir.display()
        ));
    }
    // The index first: every checkpoint it names is then in the files fetched after it.
    if index.is_some() {
        fetch(session, host, &dir, INDEX_FILE, report).await?;
    }
    // Listed again after the index, so that a file begun meanwhile is fetched too.
    let (remote, _) = listing(session, host).await?;
    for r in &remote {
        fetch(session, host, &dir, &r.name, report).await?;
    }
    report.kept = local_files(&dir)?
        .iter()
        .filter(|n| !remote.iter().any(|r| &r.name == *n))
        .count();
    sync_dir(&dir)?;
    pulled.pulled_at = Some(fort_core::wire::unix_now());
    pulled.files = local_files(&dir)?
        .into_iter()
        .chain(index.map(|_| INDEX_FILE.to_owned()))
        .map(|n| {
            let len = local_len(&dir.join(&n)).ok().flatten().unwrap_or(0);
            (n, len)
        })
        .collect();
    pulled.write(&dir)
}

/// The host's files oldest first, and the length of its index (None: none yet).
async fn listing(session: &Session, host: &str) -> Result<(Vec<Remote>, Option<u64>), String> {
    let doc = ask(session, host, json!({})).await?;
    let files = doc["files"]
        .as_array()
        .ok_or_else(|| format!("{host}'s audit listing has no files list"))?;
    let mut out = Vec::with_capacity(files.len());
    for f in files {
        let (Some(name), Some(bytes)) = (f["name"].as_str(), f["bytes"].as_u64()) else {
            return Err(format!(
                "{host}'s audit listing holds {f} instead of a file"
            ));
        };
        if !is_trail_name(name) || name == INDEX_FILE {
            return Err(format!(
                "{host}'s audit listing names {:?}, which is not a file of a trail",
                fort_core::text::printable(name, 80)
            ));
        }
        out.push(Remote {
            name: name.to_owned(),
            bytes,
        });
    }
    out.sort_by(|a, b| a.name.cmp(&b.name));
    Ok((out, doc["index_bytes"].as_u64()))
}

/// Whether every file of the copy is still the beginning of the host's file of that
/// name, and the copy's files the host no longer has were rotated away (older than its
/// oldest). Changes nothing.
async fn check(
    session: &Session,
    host: &str,
    dir: &Path,
    remote: &[Remote],
    index: Option<u64>,
) -> Result<Vec<Finding>, String> {
    let now = fort_core::wire::unix_now();
    let mut findings = Vec::new();
    let mut finding = |file: &str, what: String| {
        findings.push(Finding {
            at: now,
            file: file.to_owned(),
            what,
        })
    };
    let mut held: Vec<(String, Option<u64>)> = remote
        .iter()
        .map(|r| (r.name.clone(), Some(r.bytes)))
        .collect();
    held.push((INDEX_FILE.to_owned(), index));
    let oldest = remote.first().map(|r| r.name.as_str());
    for name in local_files(dir)? {
        if !remote.iter().any(|r| r.name == name) && oldest.is_none_or(|o| name.as_str() > o) {
            finding(&name, format!("{host} no longer holds this file, and it is not older than {host}'s oldest file (which is how rotation removes them): the trail was cut short or rewritten"));
        }
    }
    for (name, bytes) in held {
        let local = dir.join(&name);
        let Some(have) = local_len(&local)? else {
            continue;
        };
        let Some(bytes) = bytes else {
            finding(&name, format!("{host} no longer holds this file (the checkpoint index is never rotated): the trail was cut short or rewritten"));
            continue;
        };
        if have > bytes {
            finding(&name, format!("the copy holds {have} bytes of it, {host} now {bytes}: rewritten or cut short on {host}"));
            continue;
        }
        if have == 0 {
            continue;
        }
        let doc = ask(
            session,
            host,
            json!({"file": name, "offset": have, "max_bytes": 0, "prefix_sha256": true}),
        )
        .await;
        let doc = match doc {
            Ok(d) => d,
            // Rotated away since the listing: the copy keeps it.
            Err(e) if e.starts_with("HTTP 404") => continue,
            Err(e) => return Err(e),
        };
        let theirs = doc["prefix_sha256"].as_str().unwrap_or("");
        let ours = file_sha256(&local)?;
        if theirs != ours {
            finding(&name, format!("its first {have} bytes on {host} are not what was pulled before (SHA-256 {} there, {} here): rewritten or cut short on {host}",
                fort_core::text::printable(theirs, 64), ours));
        }
    }
    Ok(findings)
}

/// Appends to the copy of `name` what the host's file holds after it, chunk by chunk,
/// each synced before the next is asked for.
async fn fetch(
    session: &Session,
    host: &str,
    dir: &Path,
    name: &str,
    report: &mut PullReport,
) -> Result<(), String> {
    let path = dir.join(name);
    let start = local_len(&path)?.unwrap_or(0);
    let mut offset = start;
    let mut file: Option<std::fs::File> = None;
    loop {
        let doc = match ask(
            session,
            host,
            json!({"file": name, "offset": offset, "max_bytes": MAX_CHUNK}),
        )
        .await
        {
            Ok(d) => d,
            // Rotated away since it was listed.
            Err(e) if e.starts_with("HTTP 404") && offset == start => return Ok(()),
            Err(e) => return Err(format!("{name}: {e}")),
        };
        if doc["name"] != name || doc["offset"] != offset {
            return Err(format!(
                "{name}: {host} answered a chunk of another file or offset"
            ));
        }
        let data = base64::engine::general_purpose::STANDARD
            .decode(doc["data"].as_str().unwrap_or_default())
            .map_err(|e| format!("{name}: {host}'s chunk is not base64: {e}"))?;
        let eof = doc["eof"].as_bool().unwrap_or(true);
        if data.len() as u64 > MAX_CHUNK || data.last().is_some_and(|b| *b != b'\n') {
            return Err(format!(
                "{name}: {host}'s chunk at {offset} is not whole lines of at most {MAX_CHUNK} bytes"
            ));
        }
        if data.is_empty() {
            if eof {
                break;
            }
            return Err(format!(
                "{name}: {host} handed out nothing at {offset} but says more follows"
            ));
        }
        let end = offset.saturating_add(data.len() as u64);
        if end > MAX_FILE_BYTES {
            return Err(format!(
                "{name}: {host} hands out more than {MAX_FILE_BYTES} bytes of one file"
            ));
        }
        if file.is_none() {
            if start == 0 {
                report.new_files.insert(name.to_owned());
            }
            report.files.insert(name.to_owned());
            file = Some(
                fort_core::fsx::open_append(&path)
                    .map_err(|e| format!("{}: {e}", path.display()))?,
            );
        }
        let f = file.as_mut().expect("opened above");
        f.write_all(&data)
            .and_then(|()| f.sync_data())
            .map_err(|e| format!("{}: {e}", path.display()))?;
        report.bytes += data.len() as u64;
        offset = end;
        if eof {
            break;
        }
    }
    Ok(())
}

/// A signed call of `audit` on `host`, its verified 2xx body parsed; otherwise why not
/// (`HTTP 403: …`, as `fort` says it).
async fn ask(session: &Session, host: &str, body: Value) -> Result<Value, String> {
    let reply = session
        .call(host, "audit", body.to_string().into_bytes())
        .await
        .map_err(|(_, e)| e)?;
    let (code, _, note) = judge(&reply, false, host, &session.signing);
    if code != 0 {
        return Err(note.unwrap_or_else(|| format!("HTTP {}", reply.status)));
    }
    serde_json::from_slice(&reply.body)
        .map_err(|e| format!("{host}'s audit reply is not JSON: {e}"))
}

fn make_dir(dir: &Path) -> Result<(), String> {
    use std::os::unix::fs::DirBuilderExt;
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .map_err(|e| format!("{}: {e}", dir.display()))
}

fn sync_dir(dir: &Path) -> Result<(), String> {
    std::fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| format!("{}: {e}", dir.display()))
}

/// The copy's record files (not the index), oldest first.
fn local_files(dir: &Path) -> Result<Vec<String>, String> {
    let files = fort_core::audit::files(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    Ok(files
        .iter()
        .filter_map(|p| p.file_name()?.to_str().map(str::to_owned))
        .collect())
}

/// The copy's length of a file; None: it has none. Only a regular file counts.
fn local_len(path: &Path) -> Result<Option<u64>, String> {
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_file() => Ok(Some(m.len())),
        Ok(_) => Err(format!(
            "{}: not a regular file; the copy holds only the trail's files",
            path.display()
        )),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(format!("{}: {e}", path.display())),
    }
}

fn file_sha256(path: &Path) -> Result<String, String> {
    let mut file =
        fort_core::fsx::open_regular(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 16];
    loop {
        let n = file
            .read(&mut buf)
            .map_err(|e| format!("{}: {e}", path.display()))?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    Ok(hex::encode(hasher.finalize()))
}
