#!/bin/sh
# cert-provider.sh: example async provider handler (PROTOCOL.md §9) issuing a self-signed
# TLS certificate per entry for `request.domain`. The response is a JSON string: the PEM
# certificate followed by its PEM private key, so the consumer receives one PEM file it
# can split or hand to a server as is.
#
# Run it with cacheResponse: an entry keeps its cached certificate, except in a run
# triggered by `systemd` or `manual` (`fort-agent trigger ssl-cert --reason systemd`), which
# renews a certificate when it expires within a week or when the marker file
# $FORT_EXAMPLE_STATE/rotate/<domain> exists (removed once a new certificate for the
# domain has been issued). Only the consumers of a renewed certificate are called back.
#
# NixOS, on the provider host; a daily oneshot unit (a timer) whose success triggers a run:
#   services.fort-agent.path = [ pkgs.jq pkgs.openssl ];
#   fort.host.capabilities.ssl-cert = {
#     handler = pkgs.writeShellScript "cert-provider" (builtins.readFile ./cert-provider.sh);
#     cacheResponse = true;
#     triggers.systemd = [ "cert-rotate.service" ];
#   };
# Env: FORT_EXAMPLE_STATE (default /var/lib/fort-examples/cert), FORT_EXAMPLE_CERT_DAYS (30).
set -eu
state=${FORT_EXAMPLE_STATE:-/var/lib/fort-examples/cert}
days=${FORT_EXAMPLE_CERT_DAYS:-30}
mkdir -p "$state/rotate"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cat > "$tmp/in"

# One line per entry: key, domain ("-" when missing or unsafe), whether a response is cached.
jq -r 'to_entries[] | .value.request.domain as $d | "\(.key) \(
  if ($d | type) == "string" and ($d | test("^[a-z0-9]([a-z0-9.-]*[a-z0-9])?$")) then $d else "-" end
) \(.value.response != null)"' "$tmp/in" > "$tmp/list"

issued=""
while read -r key domain cached; do
  if [ "$domain" = - ]; then
    echo "cert-provider: $key: request.domain missing or not a DNS name; no certificate" >&2
    continue
  fi
  if [ "$cached" = true ]; then
    jq -j --arg k "$key" '.[$k].response' "$tmp/in" > "$tmp/old.pem"
    renew=no
    case ${FORT_TRIGGER:-} in systemd | manual)
      if [ -e "$state/rotate/$domain" ]; then renew=yes; fi
      if ! openssl x509 -noout -checkend 604800 -in "$tmp/old.pem" >/dev/null 2>&1; then renew=yes; fi
      ;;
    esac
    if [ "$renew" = no ]; then
      jq -c --arg k "$key" '{($k): .[$k].response}' "$tmp/in"
      continue
    fi
  fi
  issued="$issued $domain"
  openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days "$days" \
    -subj "/CN=$domain" -addext "subjectAltName=DNS:$domain" \
    -keyout "$tmp/key.pem" -out "$tmp/cert.pem" 2>"$tmp/err" || { cat "$tmp/err" >&2; exit 1; }
  cat "$tmp/cert.pem" "$tmp/key.pem" > "$tmp/new.pem"
  jq -cn --arg k "$key" --rawfile pem "$tmp/new.pem" '{($k): $pem}'
done < "$tmp/list" > "$tmp/out"

jq -cs 'add // {}' "$tmp/out"
for domain in $issued; do rm -f "$state/rotate/$domain"; done
