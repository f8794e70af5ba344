//! Deciding per entry, before any message is sent: which record set each entry asks for
//! (or why it is refused), which entry holds a name when several ask for it, and what the
//! primary must be told — removals of records this handler created for entries that no
//! longer want them, then one update per entry that changed. Entries whose records are in
//! place as recorded need nothing.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::IpAddr;

use serde::{Deserialize, Serialize};

use crate::common::Entry;
use crate::dns::record::{SET_WIRE_MAX, VALUES_MAX};
use crate::dns::{DnsName, Kind, RecordSet, Update};

use super::request::Policy;

pub const STATE_VERSION: u32 = 1;

/// What the handler created, per entry: exactly the record set the primary accepted for it.
/// Nothing else in the zone is ever deleted.
#[derive(Debug, Default, Serialize, Deserialize)]
pub struct State {
    /// The zone the records are in.
    #[serde(default)]
    pub zone: Option<DnsName>,
    /// Entry key → the records created for it.
    #[serde(default)]
    pub held: BTreeMap<String, RecordSet>,
}

/// Every entry's fate before the primary is asked anything.
#[derive(Debug, Default)]
pub struct Plan {
    /// Entry key → the record set it will hold. A refused entry whose records in place
    /// the provider still allows is here too, with those records: a refused change never
    /// takes down what works (an allowance taken away does).
    pub wanted: BTreeMap<String, RecordSet>,
    /// Entry key → why it is refused.
    pub refused: BTreeMap<String, String>,
}

/// Resolves every entry's request and settles who holds a contested name. An entry that
/// already holds its name keeps it; among new claimants the first entry key wins.
pub fn plan(
    entries: &[Entry],
    held: &BTreeMap<String, RecordSet>,
    policy: &Policy,
    address_of: impl Fn(&str) -> Option<IpAddr>,
) -> Plan {
    let mut out = Plan::default();
    let mut candidates = Vec::with_capacity(entries.len());
    let mut names: HashMap<DnsName, BTreeSet<Kind>> = HashMap::new();
    for e in entries {
        match policy.resolve(&e.origin, address_of(&e.origin), &e.request) {
            Ok(set) => {
                let incumbent = held.get(&e.key).is_some_and(|h| h.same_slot(&set));
                candidates.push((!incumbent, e.key.as_str(), set));
            }
            Err(reason) => match held
                .get(&e.key)
                .filter(|h| policy.still_allows(&e.origin, h))
            {
                Some(h) => {
                    names.entry(h.name.clone()).or_default().insert(h.kind);
                    out.wanted.insert(e.key.clone(), h.clone());
                    out.refused.insert(
                        e.key.clone(),
                        format!("{reason}; the records it had stay in service"),
                    );
                }
                None => {
                    out.refused.insert(e.key.clone(), reason);
                }
            },
        }
    }
    // Incumbents first, then by key: the outcome does not depend on input order.
    candidates.sort_by(|a, b| (a.0, a.1).cmp(&(b.0, b.1)));
    // TXT values at one name are shared by every caller allowed it, and a primary holds a
    // bounded number of records per name and type (BIND: 100): one caller's entries
    // together hold no more there than one entry may. Records kept in service count.
    let origin_of: HashMap<&str, &str> = entries
        .iter()
        .map(|e| (e.key.as_str(), e.origin.as_str()))
        .collect();
    let mut txt_of_caller: HashMap<(DnsName, &str), BTreeSet<String>> = HashMap::new();
    for (key, set) in out.wanted.iter().filter(|(_, s)| s.kind == Kind::Txt) {
        txt_of_caller
            .entry((set.name.clone(), origin_of[key.as_str()]))
            .or_default()
            .extend(set.values.iter().cloned());
    }
    let fits = |values: &BTreeSet<String>| {
        let wire: usize = values.iter().map(|v| Kind::Txt.wire_len(v)).sum();
        (values.len() <= VALUES_MAX && wire <= SET_WIRE_MAX).then_some(wire)
    };
    for (_, key, set) in &candidates {
        if set.kind != Kind::Txt {
            continue;
        }
        let origin = origin_of[key];
        let share = txt_of_caller.entry((set.name.clone(), origin)).or_default();
        let together: BTreeSet<String> = share.union(&set.values).cloned().collect();
        if fits(&together).is_some() {
            *share = together;
            continue;
        }
        let wire: usize = together.iter().map(|v| Kind::Txt.wire_len(v)).sum();
        let reason = format!(
            "{origin}'s entries would hold {} TXT values ({wire} bytes of record data) at {}; \
             one caller holds at most {VALUES_MAX} values and {SET_WIRE_MAX} bytes at one \
             name, which other callers share",
            together.len(),
            set.name
        );
        // A change past the share keeps what the entry had, if that fits.
        let kept = held.get(*key).filter(|h| h.same_slot(set)).and_then(|h| {
            let with_held: BTreeSet<String> = share.union(&h.values).cloned().collect();
            fits(&with_held).map(|_| (h, with_held))
        });
        match kept {
            Some((h, with_held)) => {
                *share = with_held;
                names.entry(h.name.clone()).or_default().insert(h.kind);
                out.wanted.insert(key.to_string(), h.clone());
                out.refused.insert(
                    key.to_string(),
                    format!("{reason}; the records it had stay in service"),
                );
            }
            None => {
                out.refused.insert(key.to_string(), reason);
            }
        }
    }
    for (_, key, set) in candidates {
        if out.refused.contains_key(key) {
            continue;
        }
        let kinds = names.entry(set.name.clone()).or_default();
        let taken = kinds.contains(&Kind::Cname)
            || (set.kind == Kind::Cname && !kinds.is_empty())
            || (set.kind.exclusive() && kinds.contains(&set.kind));
        if taken {
            out.refused.insert(
                key.to_owned(),
                format!(
                    "{} {} is already held for another consumer of this provider",
                    set.name, set.kind
                ),
            );
            continue;
        }
        kinds.insert(set.kind);
        out.wanted.insert(key.to_owned(), set);
    }
    out
}

/// TXT values at `name` that entries other than `key` hold and keep wanting: shared, so
/// never deleted on `key`'s behalf. (A value another entry only wants is deleted and added
/// again by that entry: were its addition refused, nobody would hold it.)
fn shared_txt(
    key: &str,
    name: &DnsName,
    held: &BTreeMap<String, RecordSet>,
    wanted: &BTreeMap<String, RecordSet>,
) -> BTreeSet<String> {
    held.iter()
        .filter(|(k, s)| k.as_str() != key && s.kind == Kind::Txt && s.name == *name)
        .filter_map(|(k, s)| {
            let w = wanted.get(k).filter(|w| w.same_slot(s))?;
            Some(
                s.values
                    .intersection(&w.values)
                    .cloned()
                    .collect::<Vec<_>>(),
            )
        })
        .flatten()
        .collect()
}

/// Removal of `key`'s records (it is gone, refused, or moved to another name or type):
/// exactly the values created for it, less TXT values another entry shares. `None` when
/// nothing is left to delete.
pub fn removal(
    key: &str,
    holding: &RecordSet,
    held: &BTreeMap<String, RecordSet>,
    wanted: &BTreeMap<String, RecordSet>,
) -> Option<Update> {
    let mut values = holding.values.clone();
    if holding.kind == Kind::Txt {
        let shared = shared_txt(key, &holding.name, held, wanted);
        values.retain(|v| !shared.contains(v));
    }
    if values.is_empty() {
        return None;
    }
    let mut update = Update::new();
    update.delete(&holding.name, holding.kind, &values);
    Some(update)
}

/// Prerequisites of claiming a name and type no entry held: nothing someone else made may
/// be there (a record of that type where one holder excludes others, a CNAME, or for a
/// CNAME anything at all). A primary that finds otherwise changes nothing.
fn claim(update: &mut Update, set: &RecordSet) {
    match set.kind {
        Kind::Cname => {
            update.require_unused(&set.name);
        }
        Kind::A | Kind::Aaaa => {
            update
                .require_absent(&set.name, set.kind)
                .require_absent(&set.name, Kind::Cname);
        }
        Kind::Txt => {
            update.require_absent(&set.name, Kind::Cname);
        }
    }
}

/// The update that takes `key` from what it holds at this name and type (`None`: nothing
/// yet) to `want`. One message, so the primary applies all of it or none.
pub fn change(
    key: &str,
    holding: Option<&RecordSet>,
    want: &RecordSet,
    held: &BTreeMap<String, RecordSet>,
    wanted: &BTreeMap<String, RecordSet>,
) -> Update {
    let mut update = Update::new();
    match holding {
        None => {
            claim(&mut update, want);
            update.add(&want.name, want.kind, want.ttl, &want.values);
        }
        Some(old) => {
            // A new TTL: every value is deleted and added again with it, in one message.
            let ttl_changed = old.ttl != want.ttl;
            let mut gone: BTreeSet<String> = if ttl_changed {
                old.values.clone()
            } else {
                old.values.difference(&want.values).cloned().collect()
            };
            if old.kind == Kind::Txt {
                let shared = shared_txt(key, &old.name, held, wanted);
                gone.retain(|v| !shared.contains(v) || want.values.contains(v));
            }
            let new: BTreeSet<String> = if ttl_changed {
                want.values.clone()
            } else {
                want.values.difference(&old.values).cloned().collect()
            };
            update
                .delete(&old.name, old.kind, &gone)
                .add(&want.name, want.kind, want.ttl, &new);
        }
    }
    update
}

/// After a drift check: what to do when values this handler created are missing at the
/// primary (`present` is what it answers at the name and type).
pub enum Drift {
    /// Everything is there.
    InPlace,
    /// Put the missing values back with this update.
    Restore(Update),
    /// Records someone else made now share a name and type only one holder may have:
    /// ours are given up (this update deletes what is left of them) and the entry refused.
    Yield(Option<Update>, String),
}

pub fn drift(
    holding: &RecordSet,
    present: &BTreeSet<String>,
    held: &BTreeMap<String, RecordSet>,
) -> Drift {
    let missing: BTreeSet<&String> = holding.values.difference(present).collect();
    if missing.is_empty() {
        return Drift::InPlace;
    }
    let ours: BTreeSet<&String> = held
        .iter()
        .filter(|(_, s)| s.same_slot(holding))
        .flat_map(|(_, s)| s.values.iter())
        .collect();
    let foreign = present.iter().any(|v| !ours.contains(v));
    if holding.kind.exclusive() && foreign {
        let left: BTreeSet<String> = holding.values.intersection(present).cloned().collect();
        let update = (!left.is_empty()).then(|| {
            let mut u = Update::new();
            u.delete(&holding.name, holding.kind, &left);
            u
        });
        return Drift::Yield(
            update,
            format!(
                "{} {} now holds records fort did not make; remove them to have this one back",
                holding.name, holding.kind
            ),
        );
    }
    let mut update = Update::new();
    if present.is_empty() {
        claim(&mut update, holding);
    }
    update.add(&holding.name, holding.kind, holding.ttl, missing);
    Drift::Restore(update)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::common::{parse_input, Allowances};
    use serde_json::json;

    fn set(name: &str, kind: Kind, values: &[&str]) -> RecordSet {
        RecordSet {
            name: DnsName::parse(name).unwrap(),
            kind,
            ttl: 300,
            values: values.iter().map(|v| v.to_string()).collect(),
        }
    }

    fn run_plan(input: serde_json::Value, held: &BTreeMap<String, RecordSet>) -> Plan {
        let entries = parse_input(input.to_string().as_bytes()).unwrap();
        let zone = DnsName::parse("example.org").unwrap();
        let allow: Allowances = serde_json::from_value(json!({"*": ["*.example.org"]})).unwrap();
        let policy = Policy {
            zone: &zone,
            allow: &allow,
            default_ttl: 300,
            max_ttl: 3600,
        };
        plan(&entries, held, &policy, |_| {
            Some("10.0.0.9".parse().unwrap())
        })
    }

    #[test]
    fn one_holder_per_address_name_and_cname_alone() {
        let held = BTreeMap::from([(
            "b:dns-record/x".to_owned(),
            set("a.example.org", Kind::A, &["10.0.0.9"]),
        )]);
        let p = run_plan(
            json!({
                "a:dns-record/x": {"request": {"name": "a.example.org"}},
                "b:dns-record/x": {"request": {"name": "a.example.org"}},
                "c:dns-record/t": {"request": {"name": "a.example.org", "type": "TXT", "values": ["x"]}},
                "d:dns-record/t": {"request": {"name": "a.example.org", "type": "TXT", "values": ["y"]}},
                "e:dns-record/c": {"request": {"name": "a.example.org", "type": "CNAME", "values": ["z.org"]}},
                "f:dns-record/c": {"request": {"name": "c.example.org", "type": "CNAME", "values": ["z.org"]}},
                "g:dns-record/c": {"request": {"name": "c.example.org", "type": "TXT", "values": ["z"]}},
            }),
            &held,
        );
        // b held it before a asked: b keeps it though a sorts first.
        assert!(p.wanted.contains_key("b:dns-record/x"));
        assert!(p.refused["a:dns-record/x"].contains("already held"));
        assert!(p.wanted.contains_key("c:dns-record/t") && p.wanted.contains_key("d:dns-record/t"));
        assert!(p.refused.contains_key("e:dns-record/c"));
        assert!(p.wanted.contains_key("f:dns-record/c"));
        assert!(p.refused.contains_key("g:dns-record/c"));
    }

    #[test]
    fn one_caller_holds_at_most_one_sets_worth_of_txt_values_at_a_name() {
        let values =
            |tag: &str, n: usize| -> Vec<String> { (0..n).map(|i| format!("{tag}{i}")).collect() };
        let txt = |v: Vec<String>| json!({"name": "t.example.org", "type": "TXT", "values": v});
        let p = run_plan(
            json!({
                "a:dns-record/1": {"request": txt(values("a", 10))},
                // Values it shares with its own first entry count once.
                "a:dns-record/2": {"request": txt(values("a", 14))},
                "a:dns-record/3": {"request": txt(values("b", 3))},
                "b:dns-record/1": {"request": txt(values("c", 16))},
            }),
            &BTreeMap::new(),
        );
        assert!(p.wanted.contains_key("a:dns-record/1"));
        assert!(p.wanted.contains_key("a:dns-record/2"));
        let why = &p.refused["a:dns-record/3"];
        assert!(why.contains("would hold 17 TXT values"), "{why}");
        assert!(
            p.wanted.contains_key("b:dns-record/1"),
            "another caller's own share"
        );

        // A change past the share keeps the records the entry had, which fit.
        let had = |tag: &str| RecordSet {
            values: values(tag, 8).into_iter().collect(),
            ..set("t.example.org", Kind::Txt, &[])
        };
        let held = BTreeMap::from([
            ("a:dns-record/1".to_owned(), had("h")),
            ("a:dns-record/2".to_owned(), had("x")),
        ]);
        let p = run_plan(
            json!({
                "a:dns-record/1": {"request": txt(values("h", 8))},
                "a:dns-record/2": {"request": txt(values("x", 12))},
            }),
            &held,
        );
        assert_eq!(p.wanted["a:dns-record/1"], had("h"));
        assert_eq!(p.wanted["a:dns-record/2"], had("x"));
        assert!(p.refused["a:dns-record/2"].contains("stay in service"));
    }

    #[test]
    fn shared_txt_values_are_not_deleted_for_one_entry() {
        let mine = set("t.example.org", Kind::Txt, &["a", "b"]);
        let held = BTreeMap::from([
            ("x".to_owned(), mine.clone()),
            ("y".to_owned(), set("t.example.org", Kind::Txt, &["b"])),
        ]);
        let staying = BTreeMap::from([("y".to_owned(), set("t.example.org", Kind::Txt, &["b"]))]);
        let u = removal("x", &mine, &held, &staying).unwrap();
        assert_eq!(u.len(), 1);
        let only_shared = set("t.example.org", Kind::Txt, &["b"]);
        assert!(removal("x", &only_shared, &held, &staying).is_none());
        // Both released at once: the shared value goes with them.
        let u = removal("x", &mine, &held, &BTreeMap::new()).unwrap();
        assert_eq!(u.len(), 2);
    }

    #[test]
    fn drift_restores_or_yields() {
        let mine = set("a.example.org", Kind::A, &["10.0.0.9"]);
        let held = BTreeMap::from([("x".to_owned(), mine.clone())]);
        let present = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<BTreeSet<_>>();
        assert!(matches!(
            drift(&mine, &present(&["10.0.0.9"]), &held),
            Drift::InPlace
        ));
        assert!(matches!(
            drift(&mine, &present(&[]), &held),
            Drift::Restore(_)
        ));
        assert!(matches!(
            drift(&mine, &present(&["192.0.2.1"]), &held),
            Drift::Yield(None, _)
        ));
        let txt = set("t.example.org", Kind::Txt, &["a"]);
        assert!(matches!(
            drift(&txt, &present(&["admin"]), &held),
            Drift::Restore(_)
        ));
    }
}
