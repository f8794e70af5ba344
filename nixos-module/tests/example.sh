#!/usr/bin/env bash
# Prints what the demo fleet shipped as NixOS configuration (examples/demo-fleet) asks
# for, evaluated through the flake's lib.mkFleet with the real nixpkgs lib and stubbed
# NixOS options: {"<host>": {"<need>": <request as shipped in needs.json>}}.
#
#   NIXPKGS_LIB=/path/to/nixpkgs bash nixos-module/tests/example.sh
#
# Exit status: 0 evaluated, 1 it does not evaluate, 77 skipped (no nixpkgs lib,
# nix-instantiate or jq).
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=nixpkgs-lib.sh
. "$here/nixpkgs-lib.sh"

nix-instantiate --eval --strict --json "$here/eval.nix" \
  --arg lib "import $(jq -n --arg p "$libdir" '$p')" --argstr mode example |
  jq -S '.hosts | map_values(.needs | map_values(.request))'
