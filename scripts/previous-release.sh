#!/usr/bin/env bash
# Builds the previous release (the last line of RELEASES) once and caches its binaries,
# for the compatibility lane (tests/compat.rs):
#
#   $FORT_RELEASE_CACHE/<commit>/bin/{fort-agent,fort,fort-handler (from 3833b22 on)}
#
# (default cache: ~/.cache/fort/releases). A second run finds them and does nothing. When
# the release cannot be built here (its commit is not in this clone and cannot be fetched,
# or cargo fails), <commit>/unavailable says why and the lane's tests say SKIP with it.
# Prints the directory of the binaries. Exit status 0 either way: the tests decide.
#
#   scripts/previous-release.sh             # the release before the tree
#   scripts/previous-release.sh COMMIT      # another one (e.g. the one before that)
set -uo pipefail
cd "$(dirname "$0")/.."
root=$PWD

commit=${1:-$(grep -v '^#' RELEASES | awk 'NF { c = $2 } END { print c }')}
cache=${FORT_RELEASE_CACHE:-$HOME/.cache/fort/releases}
out=$cache/$commit
bin=$out/bin
if [ -x "$bin/fort-agent" ] && [ -x "$bin/fort" ]; then
  echo "$bin"
  exit 0
fi
mkdir -p "$out"
rm -f "$out/unavailable"
unavailable() {
  echo "$*" > "$out/unavailable"
  echo "previous release $commit: not built: $*" >&2
  echo "$bin"
  exit 0
}

if ! git cat-file -e "$commit^{commit}" 2>/dev/null; then
  # A shallow clone: fetch just that commit.
  git fetch -q --depth=1 origin "$commit" 2>/dev/null ||
    unavailable "commit $commit is not in this clone and cannot be fetched (git fetch origin $commit)"
fi

src=$out/src
rm -rf "$src"
mkdir -p "$src"
git archive "$commit" | tar -x -C "$src" || unavailable "git archive $commit failed"

# Registry dependencies the tree already compiled are reused, not compiled again: the
# previous release's Cargo.lock is nearly the tree's, and cargo keys them by version and
# features, never by the workspace's path (workspace crates are rebuilt, as they must be).
target=$out/target
if [ ! -d "$target/debug" ] && [ -d "$root/target/debug/deps" ]; then
  mkdir -p "$target/debug"
  for d in deps build .fingerprint; do
    cp -a "$root/target/debug/$d" "$target/debug/" 2>/dev/null || true
  done
fi

started=$(date +%s)
if ! (cd "$src" && CARGO_TARGET_DIR=$target nice -n 10 cargo build --locked -q \
      -p fort-agent -p fort-handlers --bins) >"$out/build.log" 2>&1; then
  unavailable "cargo build of $commit failed (see $out/build.log)"
fi
mkdir -p "$bin"
for b in fort-agent fort; do
  cp "$target/debug/$b" "$bin/$b" || unavailable "the build of $commit made no $b"
done
# Releases before the capability handlers (3829ed3) have no fort-handler.
if [ -x "$target/debug/fort-handler" ]; then cp "$target/debug/fort-handler" "$bin/"; fi
echo "$commit" > "$bin/COMMIT"
# Only the binaries are kept: the sources and the build are gigabytes.
rm -rf "$src" "$target"
echo "previous release $commit built in $(( $(date +%s) - started )) s" >&2
echo "$bin"
