#!/bin/sh
# audit-checkpoint.sh FILE LINE HOST "ssh-ed25519 AAAA…"
# Checks the checkpoint on line LINE of a file of a fort audit trail with ssh-keygen
# alone (docs/protocol.md §12): its signature covers the file's lines before it followed
# by the line `fort-audit-checkpoint HOST COUNT HEAD AT`. Exit 0: the host's key signed
# exactly these records; anything else: a record before it was changed, removed or
# moved, or another key signed it.
set -eu
FILE=$1 LINE=$2 HOST=$3 KEY=$4
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
record=$(sed -n "${LINE}p" "$FILE")
field() { printf '%s\n' "$record" | sed -n "s/.*\"$1\":\"\{0,1\}\([^\",}]*\).*/\1/p"; }
{
  head -n "$((LINE - 1))" "$FILE"
  printf 'fort-audit-checkpoint %s %s %s %s\n' "$HOST" "$(field count)" "$(field head)" "$(field at)"
} > "$tmp/signed"
printf -- '-----BEGIN SSH SIGNATURE-----\n%s\n-----END SSH SIGNATURE-----\n' "$(field signature)" > "$tmp/sig"
printf '%s namespaces="fort-audit" %s\n' "$HOST" "$KEY" > "$tmp/allowed"
ssh-keygen -Y verify -f "$tmp/allowed" -I "$HOST" -n fort-audit -s "$tmp/sig" < "$tmp/signed"
