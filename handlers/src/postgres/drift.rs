//! What a run finds on the server under its kept entries' roles: intact, changed by hand
//! (put back with the same password), or taken over by a peer sharing the server (left
//! to the peer).

use super::config::Config;
use super::names;
use super::reconcile::{Plan, State, Why, Work};
use super::server::{Failure, Server};
use crate::common::Entry;

/// One query over the kept entries' roles; whatever the server no longer holds as the
/// state says is redone with the same password, except a role a peer took over for the
/// same entry: the need moved there, and the peer's password is the one in use.
pub(super) async fn find_drift(
    config: &Config,
    provider: &str,
    state: &State,
    entries: &[Entry],
    server: &Server,
    plan: &mut Plan,
) -> anyhow::Result<()> {
    let names: Vec<String> = plan.keep.iter().map(|(_, n)| n.clone()).collect();
    let seen = match server.survey(&names).await {
        Ok(s) => s,
        Err(Failure::Refused(r) | Failure::Waited(r)) => {
            anyhow::bail!("cannot read the roles: {r}")
        }
        Err(Failure::Down(e)) => return Err(e),
    };
    let mut keep = Vec::with_capacity(plan.keep.len());
    for (i, name) in std::mem::take(&mut plan.keep) {
        let key = &entries[i].key;
        let marker = names::marker(provider, key);
        let comment = seen.get(&name).and_then(|s| s.comment.as_deref());
        let taken_by = config
            .peers
            .iter()
            .find(|peer| comment == Some(names::marker(peer, key).as_str()));
        if let Some(peer) = taken_by {
            tracing::info!("{name}: {peer} took it over for {key}; left to it");
            plan.taken.push((i, peer.clone()));
            continue;
        }
        let intact = seen.get(&name).is_some_and(|s| {
            s.can_login
                && s.database
                && Some(&s.connection_limit) == plan.limits.get(&name)
                && s.comment.as_deref() == Some(marker.as_str())
        });
        if intact {
            keep.push((i, name));
        } else {
            tracing::info!("{name}: not as this handler left it; set up again");
            let rotate = state.roles.get(&name).map_or(0, |m| m.rotate);
            plan.work.push(Work {
                entry: i,
                name,
                rotate,
                why: Why::Repair,
                refused: false,
            });
        }
    }
    plan.keep = keep;
    Ok(())
}
