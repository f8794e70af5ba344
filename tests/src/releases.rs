//! Other fort releases for the compatibility lane: the binaries of the release before the
//! tree (RELEASES' last line), built and cached by `scripts/previous-release.sh`.

use std::path::{Path, PathBuf};

/// The binaries of a release, built.
#[derive(Debug, Clone)]
pub struct Release {
    pub version: String,
    pub commit: String,
    /// The protocol it speaks, as RELEASES records it (`1.1` before `X-Fort-Protocol`).
    pub protocol: String,
    pub dir: PathBuf,
}

impl Release {
    pub fn agent(&self) -> PathBuf {
        self.dir.join("fort-agent")
    }
    pub fn handler(&self) -> PathBuf {
        self.dir.join("fort-handler")
    }
    pub fn cli(&self) -> PathBuf {
        self.dir.join("fort")
    }
}

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// A release as RELEASES lists it: version, commit, protocol.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Recorded {
    pub version: String,
    pub commit: String,
    pub protocol: String,
}

/// Each release in RELEASES, oldest first.
pub fn recorded() -> Vec<Recorded> {
    let text = std::fs::read_to_string(workspace().join("RELEASES")).expect("RELEASES");
    text.lines()
        .filter(|l| !l.trim_start().starts_with('#'))
        .filter_map(|l| {
            let parts: Vec<&str> = l.split_whitespace().collect();
            Some(Recorded {
                version: parts.first()?.to_string(),
                commit: parts.get(1)?.to_string(),
                protocol: parts.get(3)?.to_string(),
            })
        })
        .collect()
}

/// The release before the tree, built: `Err` says why it is not (the lane's tests then
/// SKIP with it). `FORT_PREVIOUS_RELEASE` names a directory of its binaries instead.
pub fn previous() -> Result<Release, String> {
    let last = recorded()
        .pop()
        .ok_or_else(|| "RELEASES lists no release".to_owned())?;
    built(last, std::env::var_os("FORT_PREVIOUS_RELEASE"))
}

/// The release of RELEASES made from the commit starting with `commit`, if it was built
/// (`scripts/previous-release.sh COMMIT`; CI builds only the last).
pub fn made_from(commit: &str) -> Result<Release, String> {
    let release = recorded()
        .into_iter()
        .find(|r| r.commit.starts_with(commit))
        .ok_or_else(|| format!("RELEASES lists no release made from {commit}"))?;
    built(release, None)
}

fn built(recorded: Recorded, dir: Option<std::ffi::OsString>) -> Result<Release, String> {
    let Recorded {
        version,
        commit,
        protocol,
    } = recorded;
    let dir = match dir {
        Some(d) => PathBuf::from(d),
        None => {
            let cache = std::env::var_os("FORT_RELEASE_CACHE")
                .map(PathBuf::from)
                .or_else(|| {
                    std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/fort/releases"))
                })
                .ok_or_else(|| "no HOME for the release cache".to_owned())?;
            let out = cache.join(&commit);
            if let Ok(why) = std::fs::read_to_string(out.join("unavailable")) {
                return Err(format!(
                    "fort {version} ({commit}) could not be built: {}",
                    why.trim()
                ));
            }
            out.join("bin")
        }
    };
    let release = Release {
        version,
        commit: commit.clone(),
        protocol,
        dir,
    };
    // fort-handler only from 3833b22 on: the tests that run it check for it.
    for b in [release.agent(), release.cli()] {
        if !b.exists() {
            return Err(format!(
                "{} is not built; run scripts/previous-release.sh {commit} (scripts/test.sh and .ci/run build the last release only)",
                b.display()
            ));
        }
    }
    Ok(release)
}
