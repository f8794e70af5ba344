//! Other fort releases for the compatibility lane: the binaries of the release before the
//! tree (RELEASES' last line), built and cached by `scripts/previous-release.sh`.

use std::path::{Path, PathBuf};

/// The binaries of a release, built.
#[derive(Debug, Clone)]
pub struct Release {
    pub version: String,
    pub commit: String,
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

/// `(version, commit)` of each release in RELEASES, oldest first.
pub fn recorded() -> Vec<(String, String)> {
    let text = std::fs::read_to_string(workspace().join("RELEASES")).expect("RELEASES");
    text.lines()
        .filter(|l| !l.trim_start().starts_with('#'))
        .filter_map(|l| {
            let mut parts = l.split_whitespace();
            Some((parts.next()?.to_owned(), parts.next()?.to_owned()))
        })
        .collect()
}

/// The release before the tree, built: `Err` says why it is not (the lane's tests then
/// SKIP with it). `FORT_PREVIOUS_RELEASE` names a directory of its binaries instead.
pub fn previous() -> Result<Release, String> {
    let (version, commit) = recorded()
        .pop()
        .ok_or_else(|| "RELEASES lists no release".to_owned())?;
    built(version, commit, std::env::var_os("FORT_PREVIOUS_RELEASE"))
}

/// An older release of RELEASES (`back` lines before the last), if it was built
/// (`scripts/previous-release.sh COMMIT`; CI builds only the last).
pub fn older(back: usize) -> Result<Release, String> {
    let all = recorded();
    let (version, commit) = all
        .len()
        .checked_sub(back + 1)
        .and_then(|i| all.get(i).cloned())
        .ok_or_else(|| format!("RELEASES lists fewer than {} releases", back + 1))?;
    built(version, commit, None)
}

fn built(
    version: String,
    commit: String,
    dir: Option<std::ffi::OsString>,
) -> Result<Release, String> {
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
