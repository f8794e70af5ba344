#!/usr/bin/env bash
# Module evaluation test: evaluates nixos-module/ with the real nixpkgs lib and stubbed
# NixOS options (tests/eval.nix), compares every host's generated files with
# tests/expected/<host>/, and checks that broken fleets (tests/broken/*.nix) fail with
# the expected assertion messages.
#
#   NIXPKGS_LIB=/path/to/nixpkgs bash nixos-module/tests/run.sh
#
# NIXPKGS_LIB: a nixpkgs checkout (the directory holding lib/) or its lib/ itself.
# OUT_DIR:     if set, also write <host>/{hosts,needs,capabilities}.json and
#              <host>/agent.toml naming them, for `fort-agent check --skip-key`.
# UPDATE_EXPECTED=1: rewrite tests/expected from the current output (then read the diff).
#
# Exit status: 0 pass, 1 failure, 77 skipped (no nixpkgs lib, nix-instantiate or jq).
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
skip() {
  echo "SKIP: $*"
  exit 77
}

libdir=
if [ -n "${NIXPKGS_LIB:-}" ]; then
  if [ -f "$NIXPKGS_LIB/lib/default.nix" ]; then
    libdir=$NIXPKGS_LIB/lib
  elif [ -f "$NIXPKGS_LIB/default.nix" ] && [ -f "$NIXPKGS_LIB/modules.nix" ]; then
    libdir=$NIXPKGS_LIB
  fi
fi
[ -n "$libdir" ] || skip "nixpkgs lib not found; set NIXPKGS_LIB=/path/to/nixpkgs (the directory holding lib/)"
command -v nix-instantiate >/dev/null || skip "nix-instantiate not found (Debian: apt-get install nix-bin)"
command -v jq >/dev/null || skip "jq not found"

libdir=$(cd "$libdir" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

evaluate() {
  nix-instantiate --eval --strict --json "$here/eval.nix" \
    --arg lib "import $(jq -n --arg p "$libdir" '$p')" "$@"
}

failures=0
fail() {
  echo "FAIL: $*"
  failures=$((failures + 1))
}

# ------------------------------------------------------------------ the fleet
if ! evaluate >"$work/fleet.json" 2>"$work/fleet.err"; then
  cat "$work/fleet.err"
  echo "FAIL: the test fleet does not evaluate"
  exit 1
fi

files="hosts needs capabilities agent system"
hosts=$(jq -r 'keys[]' "$work/fleet.json")
if [ "${UPDATE_EXPECTED:-}" = 1 ]; then
  rm -rf "$here/expected"
  for host in $hosts; do
    mkdir -p "$here/expected/$host"
    for f in $files; do
      jq -S --arg h "$host" --arg f "$f" '.[$h][$f]' "$work/fleet.json" >"$here/expected/$host/$f.json"
    done
  done
  echo "updated $here/expected"
fi

expected_hosts=$(cd "$here/expected" && ls)
[ "$(echo $hosts)" = "$(echo $expected_hosts)" ] ||
  fail "hosts evaluated ($(echo $hosts)) differ from tests/expected ($(echo $expected_hosts))"
for host in $hosts; do
  ok=1
  for f in $files; do
    exp=$here/expected/$host/$f.json
    if [ ! -f "$exp" ]; then
      fail "$host: missing expected/$host/$f.json"
      ok=0
      continue
    fi
    if ! diff -u --label "expected/$host/$f.json" --label "generated $host $f" \
      <(jq -S . "$exp") <(jq -S --arg h "$host" --arg f "$f" '.[$h][$f]' "$work/fleet.json"); then
      fail "$host: $f.json differs from expected"
      ok=0
    fi
  done
  [ "$ok" = 0 ] || echo "ok   fleet: $host (${files// /, })"
done

# flake.nix's lib.mkFleet must build the same fleet as the mkFleetWith above.
if ! evaluate --argstr mode flake >"$work/flake.json" 2>"$work/flake.err"; then
  cat "$work/flake.err"
  fail "flake.nix lib.mkFleet does not evaluate"
elif ! diff -q <(jq -S . "$work/fleet.json") <(jq -S . "$work/flake.json") >/dev/null; then
  diff -u <(jq -S . "$work/fleet.json") <(jq -S . "$work/flake.json") | head -40
  fail "flake.nix lib.mkFleet builds a different fleet"
else
  echo "ok   flake.nix lib.mkFleet builds the same fleet"
fi

# Files for `fort-agent check`: the generated JSON, and an agent.toml naming it.
# TOML from the agent settings' JSON: scalars first, then one [table] per object.
toml='
  def key: if test("^[A-Za-z0-9_-]+$") then . else tojson end;
  def scalars: to_entries[] | select(.value != null and (.value | type) != "object")
    | "\(.key | key) = \(.value | tojson)";
  def tables($prefix): to_entries[] | select((.value | type) == "object")
    | ($prefix + (.key | key)) as $p | "", "[\($p)]", (.value | scalars), (.value | tables($p + "."));
  scalars, tables("")'
if [ -n "${OUT_DIR:-}" ]; then
  for host in $hosts; do
    dir=$(mkdir -p "$OUT_DIR/$host" && cd "$OUT_DIR/$host" && pwd)
    for f in hosts needs capabilities; do
      jq -S --arg h "$host" --arg f "$f" '.[$h][$f]' "$work/fleet.json" >"$dir/$f.json"
    done
    jq -r --arg h "$host" --arg d "$dir" '.[$h].agent
      | .hosts = "\($d)/hosts.json" | .needs = "\($d)/needs.json"
      | .capabilities = "\($d)/capabilities.json" | .host_key = "\($d)/host_key"
      | .state_dir = "\($d)/state" | .admin_socket = "\($d)/agent.sock"
      | '"$toml" "$work/fleet.json" >"$dir/agent.toml"
  done
  echo "ok   wrote $(echo $hosts | wc -w) hosts' files to $OUT_DIR"
fi

# ------------------------------------------------------------ broken fleets
for case in "$here"/broken/*.nix; do
  name=$(basename "$case" .nix)
  if ! evaluate --argstr mode broken --arg case "$case" >"$work/$name.json" 2>"$work/$name.err"; then
    cat "$work/$name.err"
    fail "broken/$name: evaluation failed instead of reporting assertions"
    continue
  fi
  missing=$(jq -r '[.messages[][]] as $m | .expect[] | select(. as $e | $m | any(contains($e)) | not)' "$work/$name.json")
  if [ -n "$missing" ]; then
    fail "broken/$name: no assertion or warning says:"
    printf '       %s\n' "$missing"
    echo "     got:"
    jq -r '.messages | to_entries[] | .key as $h | .value[] | "       \($h): \(.)"' "$work/$name.json"
  else
    echo "ok   broken: $name"
  fi
done

if [ "$failures" -gt 0 ]; then
  echo "$failures failure(s)"
  exit 1
fi
echo "module evaluation test passed"
