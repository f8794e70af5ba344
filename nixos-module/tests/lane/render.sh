#!/usr/bin/env bash
# Renders what the booted-systemd lane installs (render.nix: units, drop-ins, /etc/fort,
# the store files they name) from the module's evaluation with the real nixpkgs lib, and
# compares it with the committed trees in expected/, which the lane installs (so it runs
# where there is no nixpkgs lib).
#
#   NIXPKGS_LIB=/path/to/nixpkgs bash nixos-module/tests/lane/render.sh
#
# UPDATE_EXPECTED=1: rewrite expected/ from the current rendering (then read the diff).
# Exit status: 0 same, 1 different, 77 skipped (no nixpkgs lib, nix-instantiate or jq).
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=../nixpkgs-lib.sh
. "$here/../nixpkgs-lib.sh"

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

if ! nix-instantiate --eval --strict --json "$here/render.nix" \
  --arg lib "import $(jq -n --arg p "$libdir" '$p')" >"$work/trees.json" 2>"$work/err"; then
  cat "$work/err"
  echo "FAIL: the lane's fleet does not render"
  exit 1
fi

# One directory per tree: its files (text with mode, or symlinks), packages.json and
# dry-activate.sh.
out=$work/out
for tree in $(jq -r 'keys[]' "$work/trees.json"); do
  dir=$out/$tree
  mkdir -p "$dir"
  jq -S --arg t "$tree" '.[$t].packages' "$work/trees.json" >"$dir/packages.json"
  jq -j --arg t "$tree" '.[$t].dryActivate' "$work/trees.json" >"$dir/dry-activate.sh"
  # "-" for an empty field: read merges runs of tabs.
  jq -r --arg t "$tree" '.[$t].files | to_entries[] | [.key, .value.symlink // "-", .value.mode // "-"] | @tsv' \
    "$work/trees.json" |
    while IFS=$'\t' read -r path link mode; do
      mkdir -p "$(dirname "$dir/$path")"
      if [ "$link" != - ]; then
        ln -s "$link" "$dir/$path"
      else
        jq -j --arg t "$tree" --arg p "$path" '.[$t].files[$p].text' "$work/trees.json" >"$dir/$path"
        chmod "$mode" "$dir/$path"
      fi
    done
done

if [ "${UPDATE_EXPECTED:-}" = 1 ]; then
  rm -rf "$here/expected"
  cp -a "$out" "$here/expected"
  echo "updated $here/expected"
fi

if diff -r --no-dereference "$here/expected" "$out"; then
  # Modes too: git keeps the executable bit, and the lane installs these files as they are.
  modes() { (cd "$1" && find . -type f -printf '%p %m\n' | sort); }
  if ! diff <(modes "$here/expected") <(modes "$out"); then
    echo "FAIL: file modes in expected/ differ from the rendering"
    exit 1
  fi
  echo "ok   the lane's units and files are what the module renders ($(find "$out" -type f -o -type l | wc -l) files)"
else
  echo "FAIL: expected/ differs from what the module renders (UPDATE_EXPECTED=1 rewrites it)"
  exit 1
fi
