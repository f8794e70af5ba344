# Sourced by the test scripts: sets $libdir to the nixpkgs lib/ named by NIXPKGS_LIB (a
# nixpkgs checkout, the directory holding lib/, or that lib/ itself), or exits 77
# (skipped) with a message when it, nix-instantiate or jq is missing.
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
