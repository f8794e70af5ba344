//! When nginx's test fails without any of a run's changes, the cause may be a vhost that
//! passed when it was added and fails now, alone, for a reason its caller controls (an
//! upstream host name that stopped resolving). That is its entry's failure, never the
//! run's: such vhosts are found and taken out, and every other caller is served. When
//! the configuration fails without any vhost of this provider too, the cause is someone
//! else's (an administrator's file), and the run fails as before.

use std::collections::BTreeSet;
use std::time::Instant;

use super::nginx::{self, Dir, Ran};
use super::reconcile::State;
use super::vhost;
use super::{test, Notes, BUDGET};
use crate::proxy::config::Config;

/// A vhost in place: its entry key, file and content.
pub struct InPlace {
    pub key: String,
    pub file: String,
    pub text: String,
}

/// Finds the vhosts of `in_place` that fail nginx's test with no other vhost of this
/// provider beside them, and leaves the directory without them (and with every other
/// one back). `Some`: those entries with nginx's reason (none found is `Some(empty)` only
/// when the configuration passes again without them). `None`: the configuration fails
/// without any vhost of this provider, or only some of them together, or the budget ran
/// out: everything is put back as it was, and the run must fail.
pub async fn broken_in_place(
    config: &Config,
    dir: &mut Dir,
    in_place: &[InPlace],
    started: Instant,
    notes: &mut Notes,
) -> anyhow::Result<Option<Vec<(String, String)>>> {
    let put_back = |dir: &mut Dir| -> anyhow::Result<()> {
        for v in in_place {
            dir.set(&v.file, Some(&v.text))?;
        }
        Ok(())
    };
    for v in in_place {
        dir.set(&v.file, None)?;
    }
    let found = search(config, dir, in_place, started, notes).await;
    match found {
        Ok(Some(broken)) => Ok(Some(broken)),
        Ok(None) => {
            put_back(dir)?;
            Ok(None)
        }
        Err(e) => {
            put_back(dir)?;
            Err(e)
        }
    }
}

/// The search itself, starting from a directory without any of `in_place`: groups are
/// added back on top of what passed so far and halved while they fail; one that fails
/// alone on top is tested with no other vhost of this provider at all.
async fn search(
    config: &Config,
    dir: &mut Dir,
    in_place: &[InPlace],
    started: Instant,
    notes: &mut Notes,
) -> anyhow::Result<Option<Vec<(String, String)>>> {
    if test(config, notes).await? != Ran::Passed {
        return Ok(None);
    }
    let mut accepted: Vec<usize> = Vec::new();
    let mut broken: Vec<(String, String)> = Vec::new();
    let mut stack: Vec<Vec<usize>> = vec![(0..in_place.len()).collect()];
    while let Some(group) = stack.pop() {
        if group.is_empty() {
            continue;
        }
        if started.elapsed() >= BUDGET {
            return Ok(None);
        }
        for &i in &group {
            dir.set(&in_place[i].file, Some(&in_place[i].text))?;
        }
        let Ran::Failed(out) = test(config, notes).await? else {
            accepted.extend(group);
            continue;
        };
        for &i in &group {
            dir.set(&in_place[i].file, None)?;
        }
        if let [i] = group[..] {
            // Alone: without the vhosts that passed so far.
            for &a in &accepted {
                dir.set(&in_place[a].file, None)?;
            }
            dir.set(&in_place[i].file, Some(&in_place[i].text))?;
            let alone = test(config, notes).await;
            dir.set(&in_place[i].file, None)?;
            for &a in &accepted {
                dir.set(&in_place[a].file, Some(&in_place[a].text))?;
            }
            match alone? {
                Ran::Failed(_) => broken.push((in_place[i].key.clone(), nginx::reason(&out))),
                // It only fails beside others: whose fault is not known.
                Ran::Passed => return Ok(None),
            }
        } else {
            let half = group.len() / 2;
            stack.push(group[half..].to_vec());
            stack.push(group[..half].to_vec());
        }
    }
    Ok(Some(broken))
}

/// The vhosts of the state in the directory now, with their content: what was in place
/// before this run, less its removals.
pub fn in_place(state: &State, removals: &[String], dir: &mut Dir) -> anyhow::Result<Vec<InPlace>> {
    let removed: BTreeSet<&String> = removals.iter().collect();
    let mut out = Vec::new();
    for (key, h) in &state.held {
        if removed.contains(&h.file) {
            continue;
        }
        if let Some(text) = dir.read(&h.file)? {
            if vhost::has_marker(&text, Some(key)) {
                out.push(InPlace {
                    key: key.clone(),
                    file: h.file.clone(),
                    text,
                });
            }
        }
    }
    Ok(out)
}
