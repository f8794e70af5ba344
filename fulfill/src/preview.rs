//! What installing another set of needs would do, computed without doing any of it
//! (`fort-agent plan`). It reads the fulfilment state the way [`Fulfiller::reload`]
//! decides, through the same [`declaration_hash`], and writes nothing.

use std::collections::BTreeMap;

use fort_core::schema::{NeedSpec, Needs};
use serde::{Deserialize, Serialize};

use crate::reload::{declaration_hash, declared_files, declares_path};
use crate::Fulfiller;

/// One need that would be asked for, released, asked again, or updated in place.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct NeedChange {
    pub need: String,
    /// The provider it would be asked from (removed needs: the one it is released at).
    pub from: String,
    /// The provider it is held at now, when that changes (its entry there is released).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub was_from: Option<String>,
    /// The fields of its declaration that differ (`from`, `request` and `files` make
    /// it a new need; the others are applied in place).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub fields: Vec<String>,
}

/// A file path and the need it belongs to.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NeedFile {
    pub path: String,
    pub need: String,
}

/// What [`Fulfiller::reload`] would do with a new `needs.json`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct NeedsPreview {
    /// Not declared now: asked for at once.
    pub added: Vec<NeedChange>,
    /// No longer declared: released at their provider, then their files deleted.
    pub removed: Vec<NeedChange>,
    /// Declaration changed (provider, request or files): a new need, asked for again
    /// from scratch.
    pub changed: Vec<NeedChange>,
    /// Other fields changed (nag interval, handler, check, units, renewal, order):
    /// applied as they are, nothing asked again.
    pub updated: Vec<NeedChange>,
    /// Paths declared by needs that will be asked for, which no need has written yet:
    /// written when their payload arrives.
    pub files_written: Vec<NeedFile>,
    /// Paths written for removed or changed needs that their new declaration no
    /// longer names: deleted.
    pub files_removed: Vec<NeedFile>,
    /// Unit → the needs asked for again whose delivered files would restart it (when
    /// the delivered content differs from what is there).
    pub units_restarted: BTreeMap<String, Vec<String>>,
    /// The same for `reload_units`.
    pub units_reloaded: BTreeMap<String, Vec<String>>,
}

impl NeedsPreview {
    pub fn is_empty(&self) -> bool {
        self == &NeedsPreview::default()
    }
}

/// The units a need's files are credentials of.
fn credential_units(spec: &NeedSpec) -> Vec<&String> {
    spec.files.iter().flat_map(|f| &f.credential_for).collect()
}

/// The fields that differ between two declarations of a need.
fn differing(old: &NeedSpec, new: &NeedSpec) -> Vec<String> {
    [
        ("from", old.from != new.from),
        ("request", old.request != new.request),
        ("files", declared_files(old) != declared_files(new)),
        ("keys", old.keys != new.keys),
        ("nag_seconds", old.nag_seconds != new.nag_seconds),
        ("handler", old.handler != new.handler),
        ("check", old.check != new.check),
        (
            "never_satisfied",
            old.never_satisfied != new.never_satisfied,
        ),
        ("restart_units", old.restart_units != new.restart_units),
        (
            "credential_for",
            credential_units(old) != credential_units(new),
        ),
        ("reload_units", old.reload_units != new.reload_units),
        (
            "renew_before_seconds",
            old.renew_before_seconds != new.renew_before_seconds,
        ),
        ("after", old.after != new.after),
    ]
    .into_iter()
    .filter(|(_, differs)| *differs)
    .map(|(name, _)| name.to_owned())
    .collect()
}

impl Fulfiller {
    /// What installing `needs` would do: read-only, however often it is called.
    pub fn preview(&self, needs: &Needs) -> NeedsPreview {
        let current = self.inner.view.lock().needs.clone();
        let mut out = NeedsPreview::default();
        self.inner.store.read(|states| {
            for (key, st) in states {
                let declared =
                    fort_core::names::NeedKey::parse(key).is_some_and(|k| needs.contains_key(&k));
                if !declared {
                    out.removed.push(NeedChange {
                        need: key.clone(),
                        from: st.from.clone(),
                        ..Default::default()
                    });
                    out.files_removed
                        .extend(st.files.keys().map(|path| NeedFile {
                            path: path.clone(),
                            need: key.clone(),
                        }));
                }
            }
            // Paths written for any need now: a path that moves from one need to another
            // is not new on disk.
            let written: std::collections::BTreeSet<&String> =
                states.values().flat_map(|s| s.files.keys()).collect();
            for (key, spec) in needs {
                let need = key.to_string();
                let old = current.get(key);
                let asked_again = match states.get(key.as_str()) {
                    None => {
                        out.added.push(NeedChange {
                            need: need.clone(),
                            from: spec.from.to_string(),
                            ..Default::default()
                        });
                        true
                    }
                    Some(st)
                        if st.request_hash
                            != declaration_hash(spec, crate::home::home_of(spec, st))
                            || st.from != crate::home::home_of(spec, st) =>
                    {
                        let home = crate::home::home_of(spec, st);
                        out.changed.push(NeedChange {
                            need: need.clone(),
                            from: home.to_owned(),
                            was_from: (st.from != home).then(|| st.from.clone()),
                            fields: old.map_or_else(
                                || vec!["declaration".to_owned()],
                                |o| differing(o, spec),
                            ),
                        });
                        out.files_removed.extend(
                            st.files
                                .keys()
                                .filter(|p| !declares_path(spec, p))
                                .map(|path| NeedFile {
                                    path: path.clone(),
                                    need: need.clone(),
                                }),
                        );
                        true
                    }
                    Some(_) => {
                        let fields = old.map(|o| differing(o, spec)).unwrap_or_default();
                        if !fields.is_empty() {
                            out.updated.push(NeedChange {
                                need: need.clone(),
                                from: spec.from.to_string(),
                                fields,
                                ..Default::default()
                            });
                        }
                        false
                    }
                };
                if !asked_again || spec.files.is_empty() {
                    // Units act on changed delivered files only.
                    continue;
                }
                // As delivery decides (files::Written::restarts): credential units of
                // files already there restart when they change; those of new files are
                // started by their path units (§11.3).
                let mut restarted = spec.restart_units.clone();
                let mut created = Vec::new();
                for f in &spec.files {
                    let path = f.path.to_string_lossy().into_owned();
                    if written.contains(&path) {
                        restarted.extend(f.credential_for.iter().cloned());
                    } else {
                        created.extend(f.credential_for.iter().cloned());
                        out.files_written.push(NeedFile {
                            path,
                            need: need.clone(),
                        });
                    }
                }
                restarted.retain(|u| !created.contains(u));
                restarted.sort();
                restarted.dedup();
                for (units, into) in [
                    (&restarted, &mut out.units_restarted),
                    (&spec.reload_units, &mut out.units_reloaded),
                ] {
                    for u in units {
                        into.entry(u.clone()).or_default().push(need.clone());
                    }
                }
            }
        });
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(credential_for: &[&str], restart_units: &[&str]) -> NeedSpec {
        serde_json::from_value(serde_json::json!({
            "from": "forge",
            "request": {},
            "nag_seconds": 60,
            "files": [{"path": "/run/fort/needs/secret/wiki/token", "pointer": "/token",
                       "credential_for": credential_for}],
            "restart_units": restart_units,
        }))
        .unwrap()
    }

    #[test]
    fn credential_units_change_in_place() {
        // As declared before files had credential_for, and after: the need is not asked
        // again from scratch when an agent that knows the field reads it.
        let before = spec(&[], &["wiki.service"]);
        let after = spec(&["wiki.service"], &[]);
        assert_eq!(
            declaration_hash(&before, "forge"),
            declaration_hash(&after, "forge")
        );
        assert!(!serde_json::to_string(&before.files)
            .unwrap()
            .contains("credential_for"));
        assert_eq!(
            differing(&before, &after),
            ["restart_units", "credential_for"]
        );
    }
}
