#!/usr/bin/env bash
# Checks a fleet before it is deployed with only the nixpkgs lib: no nixpkgs checkout,
# no Nix build, as fort's own tests check theirs. FLEET is a file
# `{ fort }: <lib.mkFleet's arguments>` (examples/demo-fleet/fleet.nix is one; a flake
# passes the same set to fort.lib.mkFleet). Each host is evaluated with fort's module and
# stand-ins for the NixOS options it touches (tests/stubs.nix): every assertion fort
# makes at evaluation runs, and then `fort-agent check --fleet` over the files each host
# would install, with the capabilities of fort-handler pointed at their configs and the
# fort-handler found here, so each consumer's requests are also held against its
# providers' allow lists.
#
#   NIXPKGS_LIB=/path/to/nixpkgs.lib bash nixos-module/check-fleet.sh path/to/fleet.nix
#   ... check-fleet.sh path/to/fleet.nix --out DIR [--handler /usr/local/bin/fort-handler]
#
# --out DIR: once the fleet passes, writes what each host would install, one directory
# per host, for hosts that do not run NixOS: DIR/<host>/etc/fort/{hosts,needs,
# capabilities}.json and agent.toml (the files a NixOS host gets in /etc/fort), and each
# capability's handler config in DIR/<host>/etc/fort/handlers/, with fort-handler's
# capabilities pointed at --handler and at those configs. What the rendered files still
# name in the Nix store (a need's own handler, a capability's own program) is listed in
# DIR/<host>/store-paths.txt: put those programs on the host and change the paths.
#
# NIXPKGS_LIB: a nixpkgs or nixpkgs.lib checkout (`git clone --depth 1
# https://github.com/nix-community/nixpkgs.lib`). fort-agent and fort-handler: on PATH,
# or FORT_AGENT / FORT_HANDLER. What it cannot see: options of NixOS modules other than
# fort's that the fleet's host modules read (those need the real NixOS, `nix flake
# check`).
#
# Exit status: 0 the fleet passes, 1 it does not (the reasons are printed), 77 skipped
# (no nixpkgs lib, nix-instantiate or jq).
set -euo pipefail

usage="usage: $0 FLEET.nix [--out DIR] [--handler PATH]"
[ $# -ge 1 ] || { echo "$usage" >&2; exit 2; }
fleet=$(cd "$(dirname "$1")" && pwd)/$(basename "$1")
shift
out="" installed_handler=/usr/local/bin/fort-handler
while [ $# -gt 0 ]; do
  case "$1" in
    --out) out=${2:?$usage}; shift 2 ;;
    --handler) installed_handler=${2:?$usage}; shift 2 ;;
    *) echo "$usage" >&2; exit 2 ;;
  esac
done
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=tests/nixpkgs-lib.sh
. "$here/tests/nixpkgs-lib.sh"
# shellcheck source=tests/write-hosts.sh
. "$here/tests/write-hosts.sh"
agent=${FORT_AGENT:-$(command -v fort-agent || true)}
handler=${FORT_HANDLER:-$(command -v fort-handler || true)}
[ -n "$agent" ] || { echo "fort-agent not found: put it on PATH or set FORT_AGENT" >&2; exit 1; }

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

if ! nix-instantiate --eval --strict --json "$here/tests/eval.nix" \
  --arg lib "import $(jq -n --arg p "$libdir" '$p')" --argstr mode check \
  --arg fleetFile "$fleet" >"$work/fleet.json" 2>"$work/eval.err"; then
  echo "the fleet does not evaluate, or an assertion fails:"
  # An error line is printed once (`t` ends the line's commands after it); the lines
  # of a multi-line message that name a host, once each.
  sed -n -e 's/^error: *//p' -e t -e 's/^ *host /host /p' "$work/eval.err" | grep -v '^ *…' | sed 's/^/  /'
  exit 1
fi
write_hosts "$work/fleet.json" "$work/fleet"

# The handlers' configs, written where the capabilities are pointed at them.
mkdir -p "$work/configs"
jq -c '.configs[][]' "$work/fleet.json" | while IFS= read -r c; do
  path=$(jq -r .path <<<"$c")
  jq -j .text <<<"$c" >"$work/configs/$(basename "$path")"
done
if [ -n "$handler" ]; then
  for caps in "$work"/fleet/*/capabilities.json; do
    jq --arg h "$handler" --arg d "$work/configs" '
      map_values(
        if (.args // [] | length) >= 3 and (.handler | endswith("/fort-handler")) and .args[1] == "--config"
        then .handler = $h | .args[2] = ($d + "/" + (.args[2] | split("/") | last)) else . end)' \
      "$caps" >"$caps.new"
    mv "$caps.new" "$caps"
  done
else
  echo "fort-handler not found (PATH or FORT_HANDLER): requests are not held against allow lists"
fi
# The hosts' own handlers and checks are store paths this machine does not have.
"$agent" check --skip-handlers --fleet "$work/fleet"

[ -n "$out" ] || exit 0
# What each host installs, from the fleet that was just checked.
for host in $(jq -r '.hosts | keys[]' "$work/fleet.json"); do
  etc="$out/$host/etc/fort"
  mkdir -p "$etc/handlers"
  for f in hosts needs; do
    jq -j --arg h "$host" --arg f "$f" '.hosts[$h].texts[$f]' "$work/fleet.json" >"$etc/$f.json"
  done
  jq -c --arg h "$host" '.configs[$h][]?' "$work/fleet.json" | while IFS= read -r c; do
    jq -j .text <<<"$c" >"$etc/handlers/$(basename "$(jq -r .path <<<"$c")")"
  done
  jq -j --arg h "$host" '.hosts[$h].texts.capabilities' "$work/fleet.json" |
    jq --arg h "$installed_handler" --arg d "/etc/fort/handlers" '
      map_values(
        if (.args // [] | length) >= 3 and (.handler | endswith("/fort-handler")) and .args[1] == "--config"
        then .handler = $h | .args[2] = ($d + "/" + (.args[2] | split("/") | last)) else . end)' \
      >"$etc/capabilities.json"
  # agent.toml as the module writes it, the files at their /etc/fort paths and the host
  # key where sshd keeps it (the module loads it as a systemd credential).
  jq -r --arg h "$host" '.hosts[$h].agent
    | .hosts = "/etc/fort/hosts.json" | .needs = "/etc/fort/needs.json"
    | .capabilities = "/etc/fort/capabilities.json"
    | if (.host_key // "" | startswith("/run/credentials/")) then .host_key = "/etc/ssh/ssh_host_ed25519_key" else . end
    | if (.state_key_file // "" | startswith("/run/credentials/")) then .state_key_file = "/etc/fort/state-key" else . end
    | '"$toml" "$work/fleet.json" >"$etc/agent.toml"
  grep -rhoE '/nix/store/[^" ]+' "$etc" | sort -u >"$out/$host/store-paths.txt" || true
  if [ -s "$out/$host/store-paths.txt" ]; then
    echo "$host: $(wc -l <"$out/$host/store-paths.txt") Nix store path(s) to provide on the host: $out/$host/store-paths.txt"
  fi
done
echo "wrote each host's /etc/fort files under $out/<host>/etc/fort"
