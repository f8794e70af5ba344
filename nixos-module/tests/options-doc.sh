#!/usr/bin/env bash
# The options reference, docs/options.md, generated from the module's declarations
# (nixos-module/docs.nix).
#
#   NIXPKGS_LIB=/path/to/nixpkgs bash nixos-module/tests/options-doc.sh > docs/options.md
#   NIXPKGS_LIB=/path/to/nixpkgs bash nixos-module/tests/options-doc.sh --check
#
# --check: exit 1 when docs/options.md differs from what the options say now.
# Exit status: 0 printed or current, 1 stale or failed, 77 skipped (no nixpkgs lib,
# nix-instantiate or jq).
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../.." && pwd)
# shellcheck source=nixpkgs-lib.sh
. "$here/nixpkgs-lib.sh"

render() {
  nix-instantiate --eval --strict --json "$root/nixos-module/docs.nix" \
    --arg lib "import $(jq -n --arg p "$libdir" '$p')" | jq -r .
}

case "${1:-}" in
"") render ;;
--check)
  generated=$(mktemp)
  trap 'rm -f "$generated"' EXIT
  if ! render >"$generated"; then
    echo "FAIL: nixos-module/docs.nix does not evaluate"
    exit 1
  fi
  if ! diff -u --label docs/options.md --label "options now" "$root/docs/options.md" "$generated"; then
    echo "FAIL: docs/options.md is stale (or missing); regenerate it with:"
    echo "  NIXPKGS_LIB=$NIXPKGS_LIB bash nixos-module/tests/options-doc.sh > docs/options.md"
    exit 1
  fi
  echo "ok   docs/options.md matches the options"
  ;;
*)
  echo "usage: $0 [--check]" >&2
  exit 2
  ;;
esac
