# write_hosts FLEET_JSON DIR: DIR/<host>/{hosts,needs,capabilities}.json (the exact bytes
# installed) and an agent.toml naming them, for every host of a fleet eval.nix rendered.
# Sourced by run.sh and ../check-fleet.sh.

# TOML from the agent settings' JSON: scalars first, then one [table] per object.
toml='
  def key: if test("^[A-Za-z0-9_-]+$") then . else tojson end;
  def scalars: to_entries[] | select(.value != null and (.value | type) != "object")
    | "\(.key | key) = \(.value | tojson)";
  def tables($prefix): to_entries[] | select((.value | type) == "object")
    | ($prefix + (.key | key)) as $p | "", "[\($p)]", (.value | scalars), (.value | tables($p + "."));
  scalars, tables("")'
write_hosts() {
  local host dir f
  for host in $(jq -r '.hosts | keys[]' "$1"); do
    dir=$(mkdir -p "$2/$host" && cd "$2/$host" && pwd)
    for f in hosts needs capabilities; do
      jq -j --arg h "$host" --arg f "$f" '.hosts[$h].texts[$f]' "$1" >"$dir/$f.json"
    done
    jq -r --arg h "$host" --arg d "$dir" '.hosts[$h].agent
      | .hosts = "\($d)/hosts.json" | .needs = "\($d)/needs.json"
      | .capabilities = "\($d)/capabilities.json" | .host_key = "\($d)/host_key"
      | .state_dir = "\($d)/state" | .admin_socket = "\($d)/agent.sock"
      | '"$toml" "$1" >"$dir/agent.toml"
  done
}
