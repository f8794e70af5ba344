#!/bin/sh
# store-payload.sh: example consumer handler (docs/protocol.md §7). Stores the payload of the
# need $FORT_NEED (`<type>/<id>`) in $FORT_EXAMPLE_STATE/<type>_<id>, mode 0600, replacing
# the previous one atomically (temporary file + rename), so a service reading it never
# sees half a secret. Exit 0 tells the agent the need is satisfied. A real handler would
# then restart or reload the service that uses the file.
#
# NixOS, on the consumer host:
#   fort.host.needs.oidc.wiki = {
#     from = "forge";
#     request.client_name = "wiki";
#     handler = pkgs.writeShellScript "store-payload" ''
#       export FORT_EXAMPLE_STATE=/var/lib/wiki/secrets
#       ${builtins.readFile ./store-payload.sh}
#     '';
#   };
# Env: FORT_EXAMPLE_STATE (default /var/lib/fort-examples/payloads).
set -eu
dir=${FORT_EXAMPLE_STATE:-/var/lib/fort-examples/payloads}
need=${FORT_NEED:?FORT_NEED is not set}
name=$(printf '%s' "$need" | tr / _)
mkdir -p "$dir"
umask 077
tmp=$(mktemp "$dir/.$name.XXXXXX")
trap 'rm -f "$tmp"' EXIT
cat > "$tmp"
chmod 600 "$tmp"
mv -f "$tmp" "$dir/$name"
