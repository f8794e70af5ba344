#!/bin/sh
# A signed fort request with nothing but ssh-keygen, openssl, sha256sum and curl
# (PROTOCOL.md §3). Usage:
#   fort-curl.sh KEY ORIGIN TARGET URL PATH [BODY]
#   fort-curl.sh ~/.ssh/id_ed25519 ops forge http://10.0.0.1:7770 /agent/capabilities/status '{}'
set -eu
KEY=$1 ORIGIN=$2 TARGET=$3 URL=$4 REQ_PATH=$5 BODY=${6:-'{}'}
TS=$(date +%s)
NONCE=$(openssl rand -hex 16)
HASH=$(printf '%s' "$BODY" | sha256sum | cut -d' ' -f1)
# Piped, not captured in a variable: $(...) would drop the eighth line's newline.
SIG=$(printf 'fort-agent-v1\nPOST\n%s\n%s\n%s\n%s\n%s\n%s\n' \
        "$TARGET" "$REQ_PATH" "$ORIGIN" "$TS" "$NONCE" "$HASH" |
      ssh-keygen -q -Y sign -n fort-agent -f "$KEY" | grep -v -- '-----' | tr -d '\n')
exec curl -sS -X POST "$URL$REQ_PATH" \
  -H "X-Fort-Origin: $ORIGIN" -H "X-Fort-Timestamp: $TS" \
  -H "X-Fort-Nonce: $NONCE" -H "X-Fort-Signature: $SIG" \
  -H 'Content-Type: application/json' --data-binary "$BODY"
