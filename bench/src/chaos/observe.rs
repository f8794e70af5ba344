//! The invariants checked the whole run, every poll, from the consumers' files, the
//! issuers' own records and the agents' status (never from fort's account alone):
//!
//! - a credential in a consumer's files that is expired, revoked (the token issuer's
//!   record; the SSH CA's KRL the consumer holds, through `ssh-keygen -Q`; a database
//!   password PostgreSQL refuses) or was never issued is a violation unless a fault
//!   concerned the need around then;
//! - a need is bad (unsatisfied in status, or its credential missing or unusable) for at
//!   most failover time plus two nag intervals (and `--slack`) past the later of when it
//!   went bad and the end of the last fault that concerned it;
//! - a need naming several CAs applies certificates only from its home of the moment,
//!   and its home never changes twice within `failover_after`.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::process::Command;

use serde_json::{json, Value};

use super::layout::{Layout, API, DB, EXTRA, HOST_CERT};
use super::procs::State;
use super::timeline::{now, Fault};
use super::token::Record;
use super::World;
use crate::util;

/// How often a consumer's certificate is held against its KRL and its password is tried.
const SLOW_CHECK_SECONDS: f64 = 30.0;

#[derive(Default)]
struct Track {
    bad: Option<(f64, String)>,
    reported: bool,
    credential: Option<String>,
    /// The credential's failing slow check (KRL, login), until the credential changes.
    refused: Option<(String, String)>,
    checked_at: f64,
    home: Option<(String, Option<u64>)>,
    hard: BTreeSet<String>,
}

#[derive(Debug, Clone, Default)]
pub struct Longest {
    pub seconds: f64,
    pub consumer: String,
    pub need: String,
    pub why: String,
    pub cause: String,
}

#[derive(Default)]
pub struct Observer {
    tracks: BTreeMap<(String, String), Track>,
    record: Record,
    /// A CA's public key (no comment) → the provider it belongs to.
    ca_keys: BTreeMap<String, String>,
    pub certificates_applied: u64,
    pub tokens_applied: u64,
    pub passwords_applied: u64,
    pub moves: u64,
    /// Certificates newly applied to needs naming several CAs, and how many of them were
    /// told apart by the CA that signed them (the home-period check).
    pub attributed: (u64, u64),
    pub polls: u64,
    pub longest: Longest,
    /// Passwords seen in consumers' files: searched for in trails and sealed state.
    pub passwords: BTreeSet<String>,
}

/// What one look at a need found.
struct Seen {
    bad: Option<String>,
    /// (id, what, since when): an expired, revoked or never-issued credential.
    hard: Vec<(String, &'static str, f64)>,
    credential: Option<String>,
    applied_at: f64,
    signer: Option<String>,
}

fn read(path: &Path) -> Option<String> {
    std::fs::read_to_string(path).ok()
}

fn mtime(path: &Path) -> f64 {
    std::fs::metadata(path)
        .and_then(|m| m.modified())
        .ok()
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .map_or(0.0, |d| d.as_secs_f64())
}

/// A short digest of a secret, to tell two apart in the figures without showing either.
fn digest(secret: &str) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in secret.bytes() {
        h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
    }
    format!("{:08x}", h >> 32)
}

fn key_without_comment(line: &str) -> Option<String> {
    let k = ssh_key::PublicKey::from_openssh(line.trim()).ok()?;
    ssh_key::PublicKey::new(k.key_data().clone(), "")
        .to_openssh()
        .ok()
}

/// Whether `ssh-keygen -Q` finds `cert` revoked in `krl` (None: it could not tell).
fn krl_revokes(krl: &Path, cert: &Path) -> Option<bool> {
    let out = Command::new("ssh-keygen")
        .args(["-Q", "-f"])
        .arg(krl)
        .arg(cert)
        .output()
        .ok()?;
    match out.status.code() {
        Some(0) => Some(false),
        Some(1) => Some(true),
        _ => None,
    }
}

impl Observer {
    /// One look at every consumer. Returns the hosts whose agent died on its own (the
    /// caller restarts them; agents are started from the runtime's threads only).
    pub fn poll(&mut self, w: &World) -> Vec<(String, String)> {
        self.polls += 1;
        let mut crashed = Vec::new();
        {
            let mut procs = w.procs.lock().expect("procs");
            procs.sample();
            let up: Vec<String> = procs
                .hosts
                .values()
                .filter(|h| h.state == State::Up)
                .map(|h| h.name.clone())
                .collect();
            for h in up {
                if let Some(why) = procs.exited(&h) {
                    crashed.push((h, why));
                }
            }
        }
        self.record.refresh(&w.fleet.dir.path().join("tok-record"));
        self.learn_ca_keys(w);
        for c in &w.layout.consumers {
            let up = w.procs.lock().expect("procs").is(&c.name, State::Up);
            let status = if up {
                util::admin(
                    &w.fleet.host_dir(&c.name).join("agent.sock"),
                    &json!({"cmd": "status"}),
                    std::time::Duration::from_secs(5),
                )
                .ok()
                .map(|mut v| v["status"].take())
            } else {
                None
            };
            let declared = w.declared(&c.name);
            let all = w.layout.needs_of(&c.name);
            for (need, providers) in &all {
                let key = (c.name.clone(), need.clone());
                if !declared.contains_key(need) {
                    self.tracks.remove(&key);
                    continue;
                }
                let row = status.as_ref().and_then(|s| {
                    s["needs"]["items"]
                        .as_array()?
                        .iter()
                        .find(|r| r["need"] == need.as_str())
                        .cloned()
                });
                let mut seen = self.look(w, &c.name, need, status.is_some(), row.as_ref());
                self.judge(w, &c.name, need, providers, &mut seen, row.as_ref());
            }
        }
        crashed
    }

    /// CA keys as the consumers keep them (KRL.d/<provider>.json, written by the trust
    /// handler from each provider's own callback).
    fn learn_ca_keys(&mut self, w: &World) {
        if self.ca_keys.len() >= w.layout.cas.len() {
            return;
        }
        for c in w.layout.consumers.iter().filter(|c| c.ssh_from.len() > 1) {
            let krl = Layout::run_dir(&w.fleet, &c.name).join("ssh/krl");
            let parts = fort_handlers::ssh_ca::trust::parts_dir(&krl);
            for p in &c.ssh_from {
                let Some(v) = read(&parts.join(format!("{p}.json")))
                    .and_then(|t| serde_json::from_str::<Value>(&t).ok())
                else {
                    continue;
                };
                if let Some(k) = v["ca_public_key"].as_str().and_then(key_without_comment) {
                    self.ca_keys.insert(k, p.clone());
                }
            }
        }
    }

    fn look(&mut self, w: &World, c: &str, need: &str, live: bool, row: Option<&Value>) -> Seen {
        let t = now();
        let mut seen = Seen {
            bad: None,
            hard: Vec::new(),
            credential: None,
            applied_at: 0.0,
            signer: None,
        };
        if live {
            match row {
                None => seen.bad = Some("not in its agent's status".into()),
                Some(r) => {
                    let state = r["state"].as_str().unwrap_or("?");
                    if state != "satisfied" && state != "expiring" {
                        seen.bad = Some(format!("{state}: {}", r["reason"].as_str().unwrap_or("")));
                    }
                }
            }
        }
        let run = Layout::run_dir(&w.fleet, c);
        let missing = |what: &str| Some(format!("no {what} in its files"));
        match need {
            HOST_CERT => {
                let path = run.join("ssh/host-cert.pub");
                let Some(cert) = read(&path)
                    .and_then(|text| ssh_key::Certificate::from_openssh(text.trim()).ok())
                else {
                    seen.bad = seen.bad.or_else(|| missing("certificate"));
                    return seen;
                };
                let signer = ssh_key::PublicKey::new(cert.signature_key().clone(), "")
                    .to_openssh()
                    .unwrap_or_default();
                let provider = self.ca_keys.get(&signer).cloned();
                let id = format!(
                    "certificate {} of {}",
                    cert.serial(),
                    provider.as_deref().unwrap_or("an unknown CA")
                );
                let end = cert.valid_before() as f64;
                if end < t {
                    seen.hard.push((id.clone(), "expired", end));
                    seen.bad = Some(format!("{id} expired {:.0}s ago", t - end));
                }
                seen.applied_at = mtime(&path);
                seen.signer = provider;
                seen.credential = Some(id);
            }
            DB => {
                let read_file = |n: &str| read(&run.join("pg").join(n));
                let (Some(user), Some(password), Some(db)) = (
                    read_file("user"),
                    read_file("password"),
                    read_file("dbname"),
                ) else {
                    seen.bad = seen.bad.or_else(|| missing("password"));
                    return seen;
                };
                self.passwords.insert(password.clone());
                seen.applied_at = mtime(&run.join("pg/password"));
                seen.credential = Some(format!("password {} of {user}", digest(&password)));
                let key = (c.to_owned(), need.to_owned());
                let track = self.tracks.entry(key).or_default();
                let changed = track.credential != seen.credential;
                if let Some(pg) = &w.pg {
                    if changed || t - track.checked_at > SLOW_CHECK_SECONDS {
                        track.checked_at = t;
                        track.refused = pg
                            .login(&user, &password, &db, "SELECT 1")
                            .err()
                            .map(|e| (seen.credential.clone().unwrap_or_default(), e));
                    }
                }
            }
            API | EXTRA => {
                let file = if need == API { "tok/api" } else { "tok/extra" };
                let Some(token) = read(&run.join(file)) else {
                    seen.bad = seen.bad.or_else(|| missing("token"));
                    return seen;
                };
                seen.applied_at = mtime(&run.join(file));
                let short = token.get(..token.len().min(24)).unwrap_or("").to_owned();
                if !self.record.issued.contains_key(&token) {
                    // Issued and delivered since the record was last read.
                    self.record.refresh(&w.fleet.dir.path().join("tok-record"));
                }
                match self.record.issued.get(&token) {
                    None => {
                        seen.hard.push((short.clone(), "never issued", t));
                        seen.bad = Some(format!("token {short}… the issuer never issued"));
                    }
                    Some(i) => {
                        if (i.expires_at as f64) < t {
                            seen.hard
                                .push((short.clone(), "expired", i.expires_at as f64));
                            seen.bad = Some(format!("token {short}… expired"));
                        }
                        if let Some(at) = self.record.revoked.get(&token) {
                            seen.hard.push((short.clone(), "revoked", *at as f64));
                            seen.bad = Some(format!("token {short}… revoked by the issuer"));
                        }
                    }
                }
                seen.credential = Some(short);
            }
            _ => {}
        }
        seen
    }

    fn judge(
        &mut self,
        w: &World,
        c: &str,
        need: &str,
        providers: &[String],
        seen: &mut Seen,
        row: Option<&Value>,
    ) {
        let t = now();
        let timing = w.layout.timing;
        let recovery = timing.recovery() as f64;
        let key = (c.to_owned(), need.to_owned());
        let krl = Layout::run_dir(&w.fleet, c).join("ssh/krl");
        let cert = Layout::run_dir(&w.fleet, c).join("ssh/host-cert.pub");
        let track = self.tracks.entry(key).or_default();
        let changed = seen.credential.is_some() && track.credential != seen.credential;
        // Slow checks: the KRL the consumer holds, and (above) a login with the password.
        if need == HOST_CERT
            && krl.exists()
            && (changed || t - track.checked_at > SLOW_CHECK_SECONDS)
        {
            track.checked_at = t;
            track.refused = match krl_revokes(&krl, &cert) {
                Some(true) => seen
                    .credential
                    .clone()
                    .map(|id| (id, "revoked in the KRL it holds".to_owned())),
                _ => None,
            };
        }
        if let Some((id, why)) = &track.refused {
            if seen.credential.as_ref() == Some(id) {
                seen.bad = Some(format!("{id}: {why}"));
            } else {
                track.refused = None;
            }
        }
        if changed && track.credential.is_some() {
            match need {
                HOST_CERT => self.certificates_applied += 1,
                DB => self.passwords_applied += 1,
                _ => self.tokens_applied += 1,
            }
        }
        let mut tl = w.timeline.lock().expect("timeline");
        // A credential that is expired, revoked or was never issued, with no fault
        // around: a violation at once.
        for (id, what, since) in seen.hard.drain(..) {
            if !track.hard.insert(format!("{what} {id}")) {
                continue;
            }
            let lead = if what == "expired" {
                timing.renew_before() as f64
            } else {
                recovery
            };
            if what == "never issued"
                || tl
                    .concerned_within(c, providers, since - lead, t, recovery)
                    .is_none()
            {
                tl.violate(
                    "no expired or revoked credential",
                    &[c.to_owned()],
                    Some(need),
                    format!("{id} is {what} ({:.0}s ago) in {c}'s files, and no fault concerned {need} then", t - since),
                );
            }
        }
        // Home periods (a need naming several CAs): applied only from the home.
        if need == HOST_CERT && providers.len() > 1 {
            if let Some(r) = row {
                let home = r["from"].as_str().unwrap_or("").to_owned();
                let since = r["home_since"].as_u64();
                let prev = track.home.clone();
                if let Some((_, before)) = &prev {
                    if since.is_some() && since != *before {
                        self.moves += 1;
                        if let (Some(b), Some(s)) = (before, since) {
                            if (s as f64) < *b as f64 + timing.failover_after as f64 - 1.0 {
                                tl.violate(
                                    "moves no more often than failover_after allows",
                                    &[c.to_owned()],
                                    Some(need),
                                    format!(
                                        "moved at {b} and again at {s}, less than {} s apart",
                                        timing.failover_after
                                    ),
                                );
                            }
                        }
                    }
                }
                if changed && track.credential.is_some() {
                    self.attributed.0 += 1;
                    self.attributed.1 += u64::from(seen.signer.is_some());
                    if let Some(p) = &seen.signer {
                        let old = prev.as_ref().map(|(h, _)| h.clone());
                        let late = since.is_some_and(|s| seen.applied_at > s as f64 + 2.0);
                        let from_elsewhere = *p != home && old.as_deref() != Some(p.as_str());
                        let from_old_home = *p != home && late;
                        if from_elsewhere || from_old_home {
                            tl.violate("applied only from the home", &[c.to_owned(), p.clone(), home.clone()], Some(need),
                                format!("a certificate of {p} was applied at {:.0} while {home} was the home (since {since:?}, before: {old:?})", seen.applied_at));
                        }
                    }
                }
                track.home = Some((home, since));
            }
        }
        if seen.credential.is_some() {
            track.credential = seen.credential.clone();
        }
        // Satisfied again in time.
        match (&seen.bad, track.bad.clone()) {
            (Some(why), None) => {
                track.bad = Some((t, why.clone()));
                track.reported = false;
            }
            (None, Some((since, why))) => {
                let cause = tl.cause(c, providers, t).map(|f: &Fault| f.describe(tl.t0));
                if t - since > self.longest.seconds {
                    self.longest = Longest {
                        seconds: t - since,
                        consumer: c.to_owned(),
                        need: need.to_owned(),
                        why,
                        cause: cause.unwrap_or_else(|| "none".into()),
                    };
                }
                track.bad = None;
            }
            _ => {}
        }
        if let Some((since, why)) = track.bad.clone() {
            if !track.reported {
                let last = tl.concerned_within(c, providers, since, t, 0.0);
                let base = last.map_or(since, |e| e.max(since));
                let allowed = recovery + w.slack;
                if base.is_finite() && t > base + allowed {
                    track.reported = true;
                    let cause = tl
                        .cause(c, providers, t)
                        .map_or("no fault concerned it".into(), |f| f.describe(tl.t0));
                    tl.violate("satisfied again within failover time + 2 nag intervals", &[c.to_owned()], Some(need),
                        format!("bad for {:.0}s ({why}); {:.0}s past the last fault that concerned it, {allowed:.0}s allowed; last fault: {cause}", t - since, t - base));
                }
            }
        }
    }

    /// At the end: intervals still open count toward the longest.
    pub fn close(&mut self, w: &World) {
        let t = now();
        let tl = w.timeline.lock().expect("timeline");
        for ((c, need), track) in &self.tracks {
            if let Some((since, why)) = &track.bad {
                if t - since > self.longest.seconds {
                    let providers = w.layout.needs_of(c).remove(need).unwrap_or_default();
                    self.longest = Longest {
                        seconds: t - since,
                        consumer: c.clone(),
                        need: need.clone(),
                        why: format!("{why} (still at the end)"),
                        cause: tl
                            .cause(c, &providers, t)
                            .map_or("none".into(), |f| f.describe(tl.t0)),
                    };
                }
            }
        }
    }

    /// Needs bad right now (for the end of the run: every need satisfied again).
    pub fn bad_now(&self) -> Vec<String> {
        self.tracks
            .iter()
            .filter_map(|((c, n), t)| t.bad.as_ref().map(|(_, why)| format!("{c} {n}: {why}")))
            .collect()
    }
}
