#!/usr/bin/env bash
# Every test of the workspace (cargo nextest run --workspace --locked, plus any arguments
# given here), against the previous release too (scripts/previous-release.sh builds it
# once), then what did not run and why. A test that cannot reach what it needs (a
# server, a tool, the nixpkgs lib) passes the rest of itself and writes the part it
# skipped to target/fort-skipped.txt; without this list such a run looks complete.
#
#   scripts/test.sh                      # everything
#   scripts/test.sh -E 'test(rotate)'    # a filter, as nextest takes it
#
# Exit status: nextest's. The README gives this command and .ci/run runs it.
set -uo pipefail
cd "$(dirname "$0")/.."

# Where tests write what they skipped (tests/src/lib.rs, fort_tests::skip).
export FORT_SKIPPED=${FORT_SKIPPED:-$PWD/target/fort-skipped.txt}
skipped=$FORT_SKIPPED
mkdir -p "$(dirname "$skipped")"
rm -f "$skipped"
# What the lanes covered (the crash lane's points and kills, the chaos run's figures):
# tests write it through fort_tests::figure, and it is printed at the end.
export FORT_FIGURES=${FORT_FIGURES:-$PWD/target/fort-figures.txt}
rm -f "$FORT_FIGURES"
# The compatibility lane's previous release (tests/compat.rs): built once, then cached;
# when it cannot be built, the lane's tests say SKIP and why. The tree's binaries first,
# so that its build finds the dependencies compiled.
cargo build --locked --workspace --bins -q &&
  scripts/previous-release.sh >/dev/null
cargo nextest run --workspace --locked "$@"
status=$?

echo
if [ -s "$FORT_FIGURES" ]; then
  echo "Figures of the lanes:"
  sed 's/^/  /' "$FORT_FIGURES"
  echo
fi
if [ -s "$skipped" ]; then
  echo "Skipped: $(sort -u "$skipped" | wc -l) part(s) of tests did not run here (the rest of each test passed):"
  sort -u "$skipped" | sed 's/^/  SKIP /'
  if [ -z "${NIXPKGS_LIB:-}" ]; then
    echo "  (NIXPKGS_LIB is not set: the NixOS module tests need a nixpkgs checkout, e.g."
    echo "   git clone --depth 1 https://github.com/nix-community/nixpkgs.lib ../nixpkgs-lib &&"
    echo "   NIXPKGS_LIB=../nixpkgs-lib scripts/test.sh)"
  fi
else
  echo "Skipped: none (every test ran in full)"
fi
exit "$status"
