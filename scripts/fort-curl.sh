#!/bin/sh
# A signed fort request with nothing but ssh-keygen, openssl, sha256sum and curl
# (docs/protocol.md §3, §11.1). Usage:
#   fort-curl.sh KEY ORIGIN TARGET URL PIN PATH [BODY]
#   fort-curl.sh ~/.ssh/id_ed25519 ops forge https://10.0.0.1:7770 "$(fort pin forge)" \
#     /agent/capabilities/status '{}'
# PIN is the target's key as curl pins it (`fort pin TARGET` prints it). The agent's
# certificate is self-signed: no CA vouches for it, so -k skips the chain check and
# --pinnedpubkey is what makes curl talk only to the key hosts.json lists for TARGET.
set -eu
KEY=$1 ORIGIN=$2 TARGET=$3 URL=$4 PIN=$5 REQ_PATH=$6 BODY=${7:-'{}'}
TS=$(date +%s)
NONCE=$(openssl rand -hex 16)
HASH=$(printf '%s' "$BODY" | sha256sum | cut -d' ' -f1)
# Piped, not captured in a variable: $(...) would drop the eighth line's newline.
SIG=$(printf 'fort-agent-v1\nPOST\n%s\n%s\n%s\n%s\n%s\n%s\n' \
        "$TARGET" "$REQ_PATH" "$ORIGIN" "$TS" "$NONCE" "$HASH" |
      ssh-keygen -q -Y sign -n fort-agent -f "$KEY" | grep -v -- '-----' | tr -d '\n')
exec curl -sS --fail-with-body --tlsv1.3 -k --pinnedpubkey "$PIN" -X POST "$URL$REQ_PATH" \
  -H "X-Fort-Origin: $ORIGIN" -H "X-Fort-Timestamp: $TS" \
  -H "X-Fort-Nonce: $NONCE" -H "X-Fort-Signature: $SIG" \
  -H 'Content-Type: application/json' --data-binary "$BODY"
