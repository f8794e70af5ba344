#!/usr/bin/env bash
# Parse every .nix file in the repository (target/ and .git/ excluded) with
# `nix-instantiate --parse`, which needs no store and no network (Debian: nix-bin).
# Exit status: 0 all parse, 1 some do not, 77 skipped (no nix-instantiate).
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../.." && pwd)
command -v nix-instantiate >/dev/null || {
  echo "SKIP: nix-instantiate not found (Debian: apt-get install nix-bin)"
  exit 77
}

cd "$root"
count=0
bad=0
while IFS= read -r -d '' file; do
  count=$((count + 1))
  if ! err=$(nix-instantiate --parse "$file" 2>&1 >/dev/null); then
    echo "FAIL: $file"
    printf '%s\n' "$err"
    bad=$((bad + 1))
  fi
done < <(find . \( -path ./target -o -path ./.git -o -name 'result*' \) -prune -o -name '*.nix' -type f -print0 | sort -z)

if [ "$bad" -gt 0 ]; then
  echo "$bad of $count .nix files do not parse"
  exit 1
fi
echo "parsed $count .nix files"
