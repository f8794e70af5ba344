#!/usr/bin/env bash
# Module evaluation test: evaluates nixos-module/ with the real nixpkgs lib and stubbed
# NixOS options (tests/eval.nix), compares every host's generated files with
# tests/expected/<host>/ and the fleet manifest with tests/expected/manifest.json, checks
# each manifest hash against the installed bytes, evaluates the NixOS VM test's nodes
# (tests/vm.nix), renders the interfaces without any host (tests/expected/interfaces.md,
# schemas.json), and checks that broken fleets (tests/broken/*.nix) fail with the
# expected assertion messages.
#
#   NIXPKGS_LIB=/path/to/nixpkgs bash nixos-module/tests/run.sh
#
# NIXPKGS_LIB: a nixpkgs checkout (the directory holding lib/) or its lib/ itself.
# OUT_DIR:     if set, also write <host>/{hosts,needs,capabilities}.json (the bytes
#              installed), <host>/agent.toml naming them, and manifest.json.
# EXAMPLE_OUT_DIR: the same for examples/demo-fleet (without manifest.json).
# UPDATE_EXPECTED=1: rewrite tests/expected from the current output (then read the diff).
#
# Exit status: 0 pass, 1 failure, 77 skipped (no nixpkgs lib, nix-instantiate or jq).
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=nixpkgs-lib.sh
. "$here/nixpkgs-lib.sh"

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
hosts=$(jq -r '.hosts | keys[]' "$work/fleet.json")
if [ "${UPDATE_EXPECTED:-}" = 1 ]; then
  for host in $hosts; do
    rm -rf "$here/expected/$host"
    mkdir -p "$here/expected/$host"
    for f in $files; do
      jq -S --arg h "$host" --arg f "$f" '.hosts[$h][$f]' "$work/fleet.json" >"$here/expected/$host/$f.json"
    done
  done
  jq -S .manifest "$work/fleet.json" >"$here/expected/manifest.json"
  echo "updated $here/expected"
fi

expected_hosts=$(cd "$here/expected" && find . -mindepth 1 -maxdepth 1 -type d -printf '%f\n' | sort)
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
      <(jq -S . "$exp") <(jq -S --arg h "$host" --arg f "$f" '.hosts[$h][$f]' "$work/fleet.json"); then
      fail "$host: $f.json differs from expected"
      ok=0
    fi
  done
  [ "$ok" = 0 ] || echo "ok   fleet: $host (${files// /, })"
done

# docs/protocol.md §11.7: the agent hashes hosts.json, "\n", needs.json, "\n",
# capabilities.json as loaded. Hash the installed bytes here, independently of Nix.
for host in $hosts; do
  want=$(jq -r --arg h "$host" '.hosts[$h].system.manifestSha256' "$work/fleet.json")
  got=$(jq -j --arg h "$host" '.hosts[$h].texts | .hosts, "\n", .needs, "\n", .capabilities' "$work/fleet.json" |
    sha256sum | cut -d' ' -f1)
  [ "$want" = "$got" ] || fail "$host: fort.host.manifestSha256 $want, but the installed files hash to $got"
done
# nixos-rebuild dry-activate: the plan runs for dry activation only, with the new
# generation's store files (the same ones `fort-agent check` validated).
for host in $hosts; do
  plan=$(jq -r --arg h "$host" '.hosts[$h].system as $s | $s.activation["fort-plan"] |
    select(.supportsDryActivation) | .text as $t |
    ["NIXOS_ACTION-}\" = dry-activate", "fort-agent plan --config /etc/fort/agent.toml",
     "--new-config \($s.services["fort-agent"].restartTriggers[1])",
     "--hosts \($s.check.config.hosts)", "--needs \($s.check.config.needs)",
     "--capabilities \($s.check.config.capabilities)", "fortPlan || true"]
    | map(select(. as $w | $t | contains($w) | not)) | join(", ")' "$work/fleet.json")
  [ -z "$plan" ] || fail "$host: system.activationScripts.fort-plan lacks: $plan"
done

if diff -u --label expected/manifest.json --label "generated fleetManifest" \
  <(jq -S . "$here/expected/manifest.json") <(jq -S .manifest "$work/fleet.json"); then
  echo "ok   manifest hashes match the installed bytes and expected/manifest.json; dry-activate plan wired"
else
  fail "lib.fleetManifest differs from expected/manifest.json"
fi

# ------------------------------------------------------ the NixOS VM test's nodes
# tests/vm.nix runs only under `nix flake check`; its nodes are evaluated here as the
# test framework wires them, and forge's callers must be what the test greps for.
if ! evaluate --argstr mode vm >"$work/vm.json" 2>"$work/vm.err"; then
  cat "$work/vm.err"
  fail "the VM test's nodes (tests/vm.nix) do not evaluate"
elif ! jq -e '.hosts.forge.capabilities.greeting.callers == {"app": ["app"]}
    and (.hosts.app.needs | keys == ["greeting/app"])' "$work/vm.json" >/dev/null; then
  jq '.hosts | map_values({callers: (.capabilities | map_values(.callers)), needs: (.needs | keys)})' "$work/vm.json"
  fail "the VM test's nodes: forge's greeting callers are not {app: [app]}, or app does not need greeting/app"
else
  echo "ok   the VM test's nodes evaluate: forge serves greeting to app"
fi

# ------------------------------------------------- the flake's lib, no host at all
if ! evaluate --argstr mode lib >"$work/lib.json" 2>"$work/lib.err"; then
  cat "$work/lib.err"
  fail "flake.nix lib (renderInterfaces, requestSchema, ref) does not evaluate"
else
  if [ "${UPDATE_EXPECTED:-}" = 1 ]; then
    jq -r .markdown "$work/lib.json" >"$here/expected/interfaces.md"
    jq -S '{schemas, refs}' "$work/lib.json" >"$here/expected/schemas.json"
  fi
  if diff -u --label expected/interfaces.md --label "lib.renderInterfaces" \
    "$here/expected/interfaces.md" <(jq -r .markdown "$work/lib.json") &&
    diff -u --label expected/schemas.json --label "lib.requestSchema, lib.ref" \
      <(jq -S . "$here/expected/schemas.json") <(jq -S '{schemas, refs}' "$work/lib.json"); then
    echo "ok   interfaces rendered without a host (Markdown, JSON Schema), lib.ref"
  else
    fail "the flake's lib output differs from expected/interfaces.md or expected/schemas.json"
  fi
fi

# The fleet's declarations in `shared`, where every host derives the fleet's facts
# itself, must build the same fleet as in mkFleet's `cluster`, where they are derived
# once for the fleet.
if ! evaluate --argstr mode shared >"$work/shared.json" 2>"$work/shared.err"; then
  cat "$work/shared.err"
  fail "the fleet with its declarations in shared does not evaluate"
elif ! diff -q <(jq -S . "$work/fleet.json") <(jq -S . "$work/shared.json") >/dev/null; then
  diff -u <(jq -S . "$work/fleet.json") <(jq -S . "$work/shared.json") | head -40
  fail "the fleet's declarations in shared build a different fleet than in cluster"
else
  echo "ok   the fleet's declarations in cluster (derived once) or in shared (per host) build the same fleet"
fi

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

# Files for `fort-agent check` and for agents under test: the generated JSON as the
# exact bytes installed (so an agent loading them reports the built manifest hash), an
# agent.toml naming them, and manifest.json (lib.fleetManifest).
# shellcheck source=write-hosts.sh
. "$here/write-hosts.sh"
if [ -n "${OUT_DIR:-}" ]; then
  write_hosts "$work/fleet.json" "$OUT_DIR"
  jq -S .manifest "$work/fleet.json" >"$OUT_DIR/manifest.json"
  echo "ok   wrote $(echo $hosts | wc -w) hosts' files and manifest.json to $OUT_DIR"
fi

# lib.fleetCheck: one `fort-agent check --fleet` over every host's files, as built.
missing=$(jq -r '.fleetCheck as $c | (.hosts | keys[]) as $h
  | ["mkdir fleet/\($h)", "fleet/\($h)/needs.json", "fleet/\($h)/agent.toml"][]
  | select(. as $w | $c | contains($w) | not)' "$work/fleet.json")
if [ -n "$missing" ] || ! jq -e '.fleetCheck | contains("fort-agent check --fleet fleet")' "$work/fleet.json" >/dev/null; then
  fail "lib.fleetCheck does not copy every host's files and run fort-agent check --fleet:${missing:+ lacks $missing}"
else
  echo "ok   lib.fleetCheck runs fort-agent check --fleet over every host's files"
fi

# ------------------------------------------- the demo fleet as NixOS configuration
# examples/demo-fleet: what `fort-agent demo` runs, through flake.nix's lib.mkFleet; no
# assertion may fail and no warning show. EXAMPLE_OUT_DIR/<host>/ gets its files for
# `fort-agent check --fleet` (tests/nixos_module.rs); example.sh prints its requests.
if ! evaluate --argstr mode example >"$work/example.json" 2>"$work/example.err"; then
  cat "$work/example.err"
  fail "examples/demo-fleet does not evaluate"
else
  echo "ok   examples/demo-fleet evaluates: $(jq -r '.hosts | keys | join(", ")' "$work/example.json")"
  [ -z "${EXAMPLE_OUT_DIR:-}" ] || write_hosts "$work/example.json" "$EXAMPLE_OUT_DIR"

fi

# ------------------------------------------------------------ broken fleets
# A case says what must appear: `expect`, strings each found in some host's failed
# assertions or warnings, or with `evalError = true` in the evaluation's error output
# (type errors, which the module system reports before any assertion); `absent`,
# strings no message may contain; `agent.<host>`, settings that host's agent.toml must
# contain; `check.<host>`, strings the command checking that host's files at build time
# must contain; `service.<host>.<unit>`, unit settings it must have; `script.<host>`,
# strings the fort units' scripts must contain.
for case in "$here"/broken/*.nix; do
  name=$(basename "$case" .nix)
  evaluate --argstr mode broken --arg case "$case" >"$work/$name.json" 2>"$work/$name.err" && status=0 || status=$?
  if [ "$(nix-instantiate --eval --strict --json -E "(import $case).evalError or false")" = true ]; then
    if [ "$status" = 0 ]; then
      fail "broken/$name: evaluated, but an evaluation error was expected"
      continue
    fi
    missing=$(nix-instantiate --eval --strict --json -E "(import $case).expect" | jq -r '.[]' |
      while IFS= read -r e; do grep -qF -- "$e" "$work/$name.err" || printf '%s\n' "$e"; done)
    if [ -n "$missing" ]; then
      fail "broken/$name: the evaluation error does not say:"
      printf '       %s\n' "$missing"
      echo "     got:"
      sed 's/^/       /' "$work/$name.err"
    else
      echo "ok   broken: $name (evaluation error)"
    fi
    continue
  fi
  if [ "$status" != 0 ]; then
    cat "$work/$name.err"
    fail "broken/$name: evaluation failed instead of reporting assertions"
    continue
  fi
  missing=$(jq -r '[.messages[][]] as $m | .expect[] | select(. as $e | $m | any(contains($e)) | not)' "$work/$name.json")
  present=$(nix-instantiate --eval --strict --json -E "(import $case).absent or [ ]" |
    jq -r --slurpfile got "$work/$name.json" '[$got[0].messages[][]] as $m | .[] | . as $a | $m[] | select(contains($a))')
  settings=$(nix-instantiate --eval --strict --json -E "(import $case).agent or { }" |
    jq -r --slurpfile got "$work/$name.json" 'to_entries[] | .key as $h | .value as $v | select(($got[0].agent[$h] | contains($v)) | not) | "agent.toml of \($h) lacks \($v | tojson)"')
  units=$(nix-instantiate --eval --strict --json -E "(import $case).service or { }" |
    jq -r --slurpfile got "$work/$name.json" 'to_entries[] | .key as $h | .value as $v | select(($got[0].service[$h] | contains($v)) | not) | "the units of \($h) lack \($v | tojson)"')
  scripts=$(nix-instantiate --eval --strict --json -E "(import $case).script or { }" |
    jq -r --slurpfile got "$work/$name.json" 'to_entries[] | .key as $h | .value[] | . as $w | select($got[0].script[$h] | contains($w) | not) | "the scripts of \($h) lack \($w | tojson)"')
  checks=$(nix-instantiate --eval --strict --json -E "(import $case).check or { }" |
    jq -r --slurpfile got "$work/$name.json" 'to_entries[] | .key as $h | .value[] | . as $w | select($got[0].check[$h] | contains($w) | not) | "the build-time check of \($h) lacks \($w | tojson)"')
  if [ -n "$missing$settings$present$checks$units$scripts" ]; then
    fail "broken/$name: no assertion or warning says (or one says what it must not):"
    [ -z "$missing" ] || printf '       %s\n' "$missing"
    [ -z "$settings" ] || printf '       %s\n' "$settings"
    [ -z "$present" ] || printf '       unexpected: %s\n' "$present"
    [ -z "$checks" ] || printf '       %s\n' "$checks"
    [ -z "$units" ] || printf '       %s\n' "$units"
    [ -z "$scripts" ] || printf '       %s\n' "$scripts"
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
