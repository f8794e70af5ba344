//! Named crash points on every path that writes state (docs/crash-points.md). Off unless
//! the process was started with `FAILPOINTS` naming one (the `fail` crate's syntax:
//! `FAILPOINTS='store.log.torn=return'`, or `=2*off->return` for the third pass); a point
//! whose action is `return` kills the process with SIGKILL there, as a power cut or the
//! OOM killer would, so the crash lane can prove that a kill at that instant leaves
//! nothing the next start refuses and loses nothing acknowledged. The other actions of
//! `fail` (`sleep(ms)`, `pause`, `print`) work as documented there, which lets the chaos
//! run widen a window.
//!
//! Every point is listed in [`POINTS`], and a test holds the sources to that list, so a
//! point added in code is one the lane kills at.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;

/// Whether `FAILPOINTS` named anything at start: the points cost one relaxed load when not.
static ARMED: AtomicBool = AtomicBool::new(false);
static SCENARIO: OnceLock<()> = OnceLock::new();

/// The environment variable the points are configured from (the `fail` crate's).
pub const ENV: &str = "FAILPOINTS";

/// Every crash point, with the write it interrupts. The crash lane kills at each.
pub const POINTS: &[(&str, &str)] = &[
    // Atomic replacement of a whole file (write_atomic): the temporary file written and
    // synced, not yet renamed; renamed, the directory not yet synced.
    (
        "store.snapshot.temp",
        "a state snapshot's temporary file, before its rename",
    ),
    (
        "store.snapshot.renamed",
        "a state snapshot renamed, before the directory sync",
    ),
    ("store.log.torn", "half of a state log record written"),
    (
        "store.log.appended",
        "a state log record written, before its fsync",
    ),
    (
        "store.fold.logs",
        "a fold's snapshot in place, the folded logs not yet removed",
    ),
    (
        "store.seal.temp",
        "plain state sealed in place: the sealed copy not yet renamed",
    ),
    (
        "state-key.rotate.snapshot",
        "provider-state.json under the new key, not yet renamed",
    ),
    (
        "state-key.rotate.temp",
        "a file sealed under the new key, not yet renamed",
    ),
    (
        "state-key.rotate.between",
        "one file rotated to the new key, the next not yet",
    ),
    (
        "handler.state.temp",
        "a handler's state: the temporary file before its rename",
    ),
    (
        "handler.state.renamed",
        "a handler's state renamed, before the directory sync",
    ),
    (
        "handler.file.temp",
        "a file a handler keeps for a server (authorized_keys, targets), before its rename",
    ),
    (
        "handler.ca-key.temp",
        "an SSH CA key the handler made, before its rename",
    ),
    ("audit.append.torn", "half of an audit record written"),
    (
        "audit.append.written",
        "audit records written, before their fsync",
    ),
    (
        "audit.checkpoint.written",
        "a checkpoint written, before its fsync",
    ),
    (
        "audit.index.appended",
        "a checkpoint synced, its index line half written",
    ),
    (
        "audit.rotate.created",
        "a new audit file begun, the oldest not yet removed",
    ),
    (
        "deliver.file.temp",
        "a delivered file's temporary, before the payload's swap",
    ),
    (
        "deliver.file.swapped",
        "some of a payload's files swapped in, not all",
    ),
    (
        "deliver.recorded",
        "a payload recorded in the consumer's state, not yet applied",
    ),
    (
        "keys.write.temp",
        "a key the consumer made, before its rename",
    ),
    (
        "nonce.journal.torn",
        "half of a nonce journal record written",
    ),
];

/// Reads `FAILPOINTS` once; a process that never calls this has every point off.
pub fn setup() {
    SCENARIO.get_or_init(|| {
        let Ok(spec) = std::env::var(ENV) else {
            return;
        };
        if spec.trim().is_empty() {
            return;
        }
        for part in spec.split(';').filter(|p| !p.trim().is_empty()) {
            let Some((name, actions)) = part.split_once('=') else {
                eprintln!("fort: {ENV}: {part:?} is not name=actions; ignored");
                continue;
            };
            let name = name.trim();
            if !POINTS.iter().any(|(p, _)| *p == name) {
                eprintln!("fort: {ENV}: no crash point {name:?}; ignored");
                continue;
            }
            if let Err(e) = fail::cfg(name, actions.trim()) {
                eprintln!("fort: {ENV}: {name}: {e}; ignored");
                continue;
            }
            ARMED.store(true, Ordering::Relaxed);
        }
    });
}

/// Whether this process was started with crash points (`FAILPOINTS`): a write path that
/// splits a write only so a point can sit between its halves does so only then.
#[inline]
pub fn armed() -> bool {
    ARMED.load(Ordering::Relaxed)
}

/// The crash point `name`: kills the process here when `FAILPOINTS` says so.
#[inline]
pub fn point(name: &'static str) {
    if ARMED.load(Ordering::Relaxed) && fail::eval(name, |_| ()).is_some() {
        die(name);
    }
}

/// The two points of an atomic replacement (a temporary file, fsync, rename, fsync of
/// the directory): after the temporary file is synced, and after the rename.
#[derive(Debug, Clone, Copy)]
pub struct Replace {
    pub temp: &'static str,
    pub renamed: Option<&'static str>,
}

/// [`Replace`] at `temp` and `renamed`.
pub const fn replace(temp: &'static str, renamed: &'static str) -> Replace {
    Replace {
        temp,
        renamed: Some(renamed),
    }
}

/// [`Replace`] at `temp` alone.
pub const fn replace_temp(temp: &'static str) -> Replace {
    Replace {
        temp,
        renamed: None,
    }
}

/// `FAILPOINTS` as this process got it, for the handlers it runs (whose environment is
/// otherwise cleared): a point in a handler's own writes is armed the same way.
pub fn env_for_children() -> Option<(String, String)> {
    ARMED
        .load(Ordering::Relaxed)
        .then(|| std::env::var(ENV).ok().map(|v| (ENV.to_owned(), v)))
        .flatten()
}

/// SIGKILL to this process: nothing after the point runs, no destructor, no flush.
fn die(name: &str) -> ! {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "fort: crash point {name}: killed");
    let _ = rustix::process::kill_process(rustix::process::getpid(), rustix::process::Signal::KILL);
    // SIGKILL cannot be caught; should it somehow not be delivered, still never go on.
    std::process::abort()
}

#[cfg(test)]
mod tests {
    use super::POINTS;

    /// Every `crash::point("…")` in the sources is listed, and every listed point is
    /// somewhere in the sources: the lane covers what the code has.
    #[test]
    fn the_list_is_the_points_in_the_sources() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        let mut found = std::collections::BTreeSet::new();
        let mut todo: Vec<std::path::PathBuf> = ["core", "agent", "fulfill", "handlers"]
            .iter()
            .map(|d| root.join(d).join("src"))
            .collect();
        while let Some(dir) = todo.pop() {
            for e in std::fs::read_dir(&dir).unwrap().flatten() {
                let path = e.path();
                if path.is_dir() {
                    todo.push(path);
                } else if path.extension().is_some_and(|x| x == "rs") && !path.ends_with("crash.rs")
                {
                    let text = std::fs::read_to_string(&path).unwrap();
                    for call in ["crash::point(", "crash::replace(", "crash::replace_temp("] {
                        for part in text.split(call).skip(1) {
                            let args = part.split(')').next().unwrap();
                            found.extend(args.split('"').skip(1).step_by(2).map(str::to_owned));
                        }
                    }
                }
            }
        }
        let listed: std::collections::BTreeSet<String> =
            POINTS.iter().map(|(p, _)| (*p).to_owned()).collect();
        let unlisted: Vec<_> = found.difference(&listed).collect();
        let unused: Vec<_> = listed.difference(&found).collect();
        assert!(
            unlisted.is_empty(),
            "points in code, not in POINTS: {unlisted:?}"
        );
        assert!(
            unused.is_empty(),
            "points in POINTS, not in code: {unused:?}"
        );
    }
}
