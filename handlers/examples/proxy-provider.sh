#!/bin/sh
# proxy-provider.sh: example side-effect-only async provider handler (docs/protocol.md §9)
# for the `proxy` interface (nixos-module/interfaces/proxy.nix). Every entry
# `<origin>:proxy/<id>` with request {"server_names": ["wiki.example.org"], "port": 3000}
# (optionally "path", "upstream_host", and "sign_in_client": an OIDC client id users sign
# in through, typically a reference to the consumer's own oidc need, §11.5) becomes a
# vhost file $FORT_EXAMPLE_STATE/vhosts/<origin>@<id>.conf and the answer "OK" (a JSON
# string, so the consumer receives the two bytes OK and is satisfied without a handler of
# its own). A request with unsafe values gets a message instead, which the consumer logs.
# The example forwards to upstream_host or 127.0.0.1 and ignores "tls"; `fort-handler
# proxy` is the real one (the caller's address from hosts.json, nginx -t, reload).
#
# The handler always sees every active entry, so files of entries that are gone (released
# by their consumer, or collected by GC) are simply removed: that is the whole clean-up.
# A real proxy would reload nginx here when something changed.
#
# NixOS, on the proxy host (no cacheResponse: the files are the state):
#   services.fort-agent.path = [ pkgs.jq ];
#   fort.host.capabilities.proxy.handler =
#     pkgs.writeShellScript "proxy-provider" (builtins.readFile ./proxy-provider.sh);
# Env: FORT_EXAMPLE_STATE (default /var/lib/fort-examples/proxy).
set -eu
state=${FORT_EXAMPLE_STATE:-/var/lib/fort-examples/proxy}
mkdir -p "$state/vhosts"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cat > "$tmp/in"

# One line per entry: key, file name, server names (comma-separated), upstream, sign-in
# client ("-" when unsafe or missing; a missing sign-in client is "none").
jq -r 'def ok(re): type == "string" and test(re);
  def name: ok("^[a-z0-9.-]+$");
  to_entries[] | .value.request as $r | "\(.key) \(.key | sub(":[^/]*/"; "@")).conf \(
    if ($r.server_names | type == "array" and length > 0 and all(name))
      and ($r.port | type == "number" and . >= 1 and . <= 65535 and floor == .)
      and ($r.path == null or ($r.path | ok("^/[A-Za-z0-9._~/-]*$")))
      and ($r.upstream_host == null or ($r.upstream_host | ok("^[A-Za-z0-9.-]+$")))
      and ($r.sign_in_client == null or ($r.sign_in_client | ok("^[A-Za-z0-9._-]{1,128}$")))
    then "\($r.server_names | join(",")) http://\($r.upstream_host // "127.0.0.1"):\($r.port)\($r.path // "") \($r.sign_in_client // "none")"
    else "- - -" end)"' "$tmp/in" > "$tmp/list"

: > "$tmp/keep"
while read -r key file name upstream client; do
  if [ "$name" = - ]; then
    jq -cn --arg k "$key" '{($k): "server_names must be DNS names, port a port, path a plain path and sign_in_client a client id"}'
    continue
  fi
  {
    printf 'server {\n  server_name %s;\n' "$(echo "$name" | tr , ' ')"
    [ "$client" = none ] || printf '  # users sign in through OIDC client %s\n' "$client"
    printf '  location / { proxy_pass %s; }\n}\n' "$upstream"
  } > "$tmp/conf"
  # Rewrite only what changed, atomically, so a reader never sees half a file.
  if ! cmp -s "$tmp/conf" "$state/vhosts/$file"; then
    cp "$tmp/conf" "$state/vhosts/.$file.tmp"
    mv -f "$state/vhosts/.$file.tmp" "$state/vhosts/$file"
  fi
  echo "$file" >> "$tmp/keep"
  jq -cn --arg k "$key" '{($k): "OK"}'
done < "$tmp/list" > "$tmp/out"

# Entries no longer in the input: their vhost goes.
for f in "$state/vhosts"/*.conf; do
  [ -e "$f" ] || continue
  grep -qxF "${f##*/}" "$tmp/keep" || rm -f "$f"
done
jq -cs 'add // {}' "$tmp/out"
