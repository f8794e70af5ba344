#!/usr/bin/env bash
# Benchmark of fort's share of NixOS evaluation as the fleet grows (tests/scale.nix: one
# provider, N consumers with two needs each, the real nixpkgs lib, stubbed NixOS). For
# each N it prints wall time, CPU time (Nix's own count, steadier than wall time on a
# busy machine), peak memory (max RSS) and thunks of:
#   fleet     every host's needs.json and the provider's capabilities.json;
#   system    every host as its system build forces fort (all of /etc/fort, the agent
#             unit, assertions, warnings): what `nix flake check` or the fleet check pays;
#   consumer  one consumer alone, as its system build forces it (a deploy of that host);
#   provider  the provider alone, likewise;
# and, for the whole-fleet columns, the growth per doubling of N from the previous row
# ((b/a)^(1/log2(N_b/N_a)): 2.0 is linear, 4.0 quadratic). A number, not a test:
# compare the ratios of one run. Thunks count the evaluation's work exactly; CPU time
# also counts Nix's garbage collector, which starts once the heap passes its initial
# size (GC_INITIAL_HEAP_SIZE, 384 MiB unless set in the environment) and so adds time
# at the N where that happens.
#
#   NIXPKGS_LIB=/path/to/nixpkgs bash nixos-module/tests/scale.sh [N ...]
#
# DECLARE: where the fleet is declared, one table each (tests/scale.nix `declare`):
#   "cluster" (mkFleet's cluster, needs in host modules), "inventory" (the needs as
#   instances, callersFromInventory) and "shared" (fort.cluster in every host's modules,
#   which grows with the square of the fleet: give it small N). Default:
#   "cluster inventory".
# CASES="fleet system consumer provider" picks columns.
# Exit status: 0 measured, 1 an evaluation failed, 77 skipped (no nixpkgs lib,
# nix-instantiate or jq).
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=nixpkgs-lib.sh
. "$here/nixpkgs-lib.sh"
[ -x /usr/bin/time ] || skip "/usr/bin/time not found (Debian: apt-get install time), needed for peak memory"

sizes=("$@")
[ ${#sizes[@]} -gt 0 ] || sizes=(40 160 320 640)
read -r -a cases <<<"${CASES:-fleet system consumer provider}"
read -r -a declares <<<"${DECLARE:-cluster inventory}"

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# measure N CASE DECLARE: prints "seconds cpu-seconds megabytes thunks".
measure() {
  local stats=$work/stats.json
  if ! NIX_SHOW_STATS=1 NIX_SHOW_STATS_PATH=$stats /usr/bin/time -f '%e %M' -o "$work/time" \
    nix-instantiate --eval --strict "$here/scale.nix" \
    --arg lib "import $(jq -n --arg p "$libdir" '$p')" \
    --arg consumers "$1" --argstr what "$2" --argstr declare "$3" >"$work/out" 2>"$work/err"; then
    echo "FAIL: $2 at N=$1 ($3) does not evaluate:" >&2
    tail -20 "$work/err" >&2
    exit 1
  fi
  read -r seconds kilobytes <"$work/time"
  printf '%s %.2f %d %s\n' "$seconds" "$(jq .cpuTime "$stats")" $((kilobytes / 1024)) "$(jq .nrThunks "$stats")"
}

# per_doubling N_A A N_B B: growth per doubling from A at N_A to B at N_B, "-" without A.
per_doubling() {
  if [ -z "$1" ]; then echo -; else
    awk -v na="$1" -v a="$2" -v nb="$3" -v b="$4" \
      'BEGIN { printf "%.2fx", (a > 0 && nb != na ? exp(log(b / a) * log(2) / log(nb / na)) : 0) }'
  fi
}

for where in "${declares[@]}"; do
  echo
  echo "fort evaluation scale, fleet declared as \"$where\" (nixpkgs lib: $libdir)"
  header="| hosts |"
  rule="|---|"
  for c in "${cases[@]}"; do
    header+=" $c s | $c cpu s | $c MB | $c thunks |"
    rule+="---|---|---|---|"
    case $c in fleet | system)
      header+=" $c cpu/doubling | $c thunks/doubling |"
      rule+="---|---|"
      ;;
    esac
  done
  echo "$header"
  echo "$rule"
  declare -A last_cpu=() last_thunks=()
  last_n=
  for n in "${sizes[@]}"; do
    row="| $((n + 1)) |"
    for c in "${cases[@]}"; do
      measured=$(measure "$n" "$c" "$where") || exit 1
      read -r seconds cpu megabytes thunks <<<"$measured"
      row+=" $seconds | $cpu | $megabytes | $thunks |"
      case $c in fleet | system)
        row+=" $(per_doubling "$last_n" "${last_cpu[$c]:-}" "$n" "$cpu")"
        row+=" | $(per_doubling "$last_n" "${last_thunks[$c]:-}" "$n" "$thunks") |"
        last_cpu[$c]=$cpu
        last_thunks[$c]=$thunks
        ;;
      esac
    done
    echo "$row"
    last_n=$n
  done
done
