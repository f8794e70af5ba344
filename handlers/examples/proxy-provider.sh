#!/bin/sh
# proxy-provider.sh: example side-effect-only async provider handler (docs/protocol.md §9).
# Every entry `<origin>:proxy/<id>` with request {"server_name": "wiki.example.org",
# "upstream": "http://10.0.0.7:3000"} (and optionally "sign_in_client": an OIDC client id
# users sign in through, typically a reference to the consumer's own oidc need, §11.5)
# becomes a vhost file
# $FORT_EXAMPLE_STATE/vhosts/<origin>@<id>.conf and the answer "OK" (a JSON string, so
# the consumer receives the two bytes OK and is satisfied without a handler of its own).
# A request with unsafe values gets a message instead, which the consumer logs.
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

# One line per entry: key, file name, server_name, upstream, sign-in client ("-" when
# unsafe or missing; a missing sign-in client is "none").
jq -r 'def ok(re): type == "string" and test(re);
  to_entries[] | .value.request as $r | "\(.key) \(.key | sub(":[^/]*/"; "@")).conf \(
    if ($r.server_name | ok("^[a-z0-9.-]+$")) and ($r.upstream | ok("^https?://[A-Za-z0-9.:_-]+/?$"))
      and ($r.sign_in_client == null or ($r.sign_in_client | ok("^[A-Za-z0-9._-]{1,128}$")))
    then "\($r.server_name) \($r.upstream) \($r.sign_in_client // "none")" else "- - -" end)"' "$tmp/in" > "$tmp/list"

: > "$tmp/keep"
while read -r key file name upstream client; do
  if [ "$name" = - ]; then
    jq -cn --arg k "$key" '{($k): "server_name must be a DNS name, upstream http(s)://host:port and sign_in_client a client id"}'
    continue
  fi
  {
    printf 'server {\n  server_name %s;\n' "$name"
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
