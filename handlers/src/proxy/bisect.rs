//! Finding, among a run's changed vhosts, the ones nginx's test refuses: groups added on
//! top of what passed and halved while they fail, and an entry that fails alone tested
//! once more without the provider's other vhosts, to tell one nginx refuses from one
//! that only clashes with another.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Instant;

use super::config::Config;
use super::nginx::{self, Dir, Ran};
use super::reconcile::Want;
use super::{test, Notes, BUDGET};

/// What bisection found.
pub(super) struct Found {
    pub accepted: Vec<String>,
    /// Entries that fail on their own: refused, and remembered until they change.
    pub culprits: Vec<(String, String)>,
    /// Entries that pass without any other vhost of this provider but fail beside them:
    /// not their fault alone, so held (not refused, not remembered) and tried again.
    pub conflicts: Vec<(String, String)>,
    /// Not tested within the budget: taken back, tried next run.
    pub untested: BTreeSet<String>,
}

/// Finds the changed entries that make the test fail (`first_failure`: how the test with
/// all of them failed, if that was on the configuration they are now added to). The
/// directory holds the run's removals and none of `changes`; groups are added on top of
/// what passed so far and halved while they fail, so the directory always ends holding a
/// tested configuration.
/// An entry that fails alone on top of that is tested once more with no other vhost of
/// this provider (`held` files and this run's accepted ones), to tell a vhost nginx
/// refuses from one that only clashes with another: the first is refused, the second
/// held, so a caller whose vhost breaks the set can never have an innocent one refused.
#[allow(clippy::too_many_arguments)]
pub(super) async fn bisect(
    config: &Config,
    dir: &mut Dir,
    wanted: &BTreeMap<String, Want>,
    changes: &[String],
    previous: &BTreeMap<String, Option<String>>,
    held: &[String],
    first_failure: Option<String>,
    started: Instant,
    notes: &mut Notes,
) -> anyhow::Result<Found> {
    let mut found = Found {
        accepted: Vec::new(),
        culprits: Vec::new(),
        conflicts: Vec::new(),
        untested: BTreeSet::new(),
    };
    let (mut stack, mut single) = match first_failure {
        // The configuration under the changes is not the one that failed (vhosts were
        // taken out since): all of them are tested again first.
        None => (vec![changes.to_vec()], None),
        Some(failure) if changes.len() == 1 => (Vec::new(), Some((changes[0].clone(), failure))),
        Some(_) => {
            let half = changes.len() / 2;
            (
                vec![changes[half..].to_vec(), changes[..half].to_vec()],
                None,
            )
        }
    };
    loop {
        if let Some((key, failure)) = single.take() {
            let others: Vec<String> = held
                .iter()
                .chain(found.accepted.iter().map(|k| &wanted[k].file))
                .filter(|f| **f != wanted[&key].file)
                .cloned()
                .collect();
            match alone(config, dir, &wanted[&key], &others, notes).await? {
                Ran::Passed => found.conflicts.push((
                    key,
                    format!(
                        "it clashes with another vhost of this provider, so it waits: {}",
                        nginx::reason(&failure)
                    ),
                )),
                Ran::Failed(_) => found.culprits.push((key, nginx::reason(&failure))),
            }
            continue;
        }
        let Some(group) = stack.pop() else { break };
        if started.elapsed() >= BUDGET {
            found.untested.extend(group);
            continue;
        }
        for key in &group {
            dir.set(&wanted[key].file, Some(&wanted[key].text))?;
        }
        let ran = test(config, notes).await?;
        let Ran::Failed(out) = ran else {
            found.accepted.extend(group);
            continue;
        };
        for key in &group {
            dir.set(&wanted[key].file, previous[&wanted[key].file].as_deref())?;
        }
        if group.len() == 1 {
            single = Some((group[0].clone(), out));
        } else {
            let half = group.len() / 2;
            stack.push(group[half..].to_vec());
            stack.push(group[..half].to_vec());
        }
    }
    Ok(found)
}

/// Tests `want` with none of `others` (files of this provider's other vhosts) in the
/// directory, then puts them back as they were, whatever the test did.
async fn alone(
    config: &Config,
    dir: &mut Dir,
    want: &Want,
    others: &[String],
    notes: &mut Notes,
) -> anyhow::Result<Ran> {
    let mut aside: Vec<(String, Option<String>)> = Vec::with_capacity(others.len());
    for f in others {
        aside.push((f.clone(), dir.read(f)?));
    }
    let tested = async {
        for (f, _) in &aside {
            dir.set(f, None)?;
        }
        dir.set(&want.file, Some(&want.text))?;
        test(config, notes).await
    }
    .await;
    for (f, text) in &aside {
        dir.set(f, text.as_deref())?;
    }
    dir.set(&want.file, None)?;
    tested
}
