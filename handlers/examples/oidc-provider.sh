#!/bin/sh
# oidc-provider.sh: example async provider handler (docs/protocol.md §9) for an OIDC-like
# credential. Every entry `<origin>:oidc/<id>` gets {"client_id": ..., "client_secret": ...}.
# Run it with cacheResponse: an entry that already has a response keeps it, so a consumer
# asking again (nag, restart, re-request) gets the same secret; only
# `fort-agent trigger oidc --force` (no cached responses) issues new clients for everyone.
# A real provider would also register the client with the identity provider here.
#
# NixOS, on the provider host (needs jq; openssl is optional):
#   services.fort-agent.path = [ pkgs.jq pkgs.openssl ];
#   fort.host.capabilities.oidc = {
#     handler = pkgs.writeShellScript "oidc-provider" (builtins.readFile ./oidc-provider.sh);
#     mode = "async";
#     cacheResponse = true;
#   };
set -eu

# 16 random bytes as hex: openssl if present, the kernel's generator otherwise.
rand_hex() {
  openssl rand -hex 16 2>/dev/null || od -An -N16 -tx1 /dev/urandom | tr -d ' \n'
}

input=$(cat)

# A fresh client for each entry without a cached response: {"<entry key>": {"id": "<6 hex>",
# "secret": "<32 hex>"}}.
fresh=$(printf '%s' "$input" | jq -r 'to_entries[] | select(.value.response == null) | .key' |
  while read -r key; do
    jq -cn --arg k "$key" --arg s "$(rand_hex)" --arg i "$(rand_hex | cut -c1-6)" \
      '{($k): {id: $i, secret: $s}}'
  done | jq -cs 'add // {}')
# The cached response if there is one, else a new client named after the entry with a
# suffix of its own, as identity providers issue a new client id for each registration
# (app:oidc/wiki → app-oidc-wiki-3f9a2c). A missing secret fails the run: nothing changes.
printf '%s' "$input" | jq -c --argjson fresh "$fresh" 'with_entries(.value = (.value.response // {
  client_id: ((.key | gsub("[:/]"; "-")) + "-" + ($fresh[.key].id // error("no client for \(.key)"))),
  client_secret: ($fresh[.key].secret // error("no secret for \(.key)"))
}))'
