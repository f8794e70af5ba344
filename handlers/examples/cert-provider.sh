#!/bin/sh
# cert-provider.sh: example async provider handler (docs/protocol.md §9) issuing a
# self-signed TLS certificate per entry for `request.domain`. The response is a JSON
# string: the PEM certificate followed by its PEM private key, so the consumer receives
# one PEM file it can split or hand to a server as is.
#
# Run it with cacheResponse: an entry keeps its cached certificate, except
#  - when its consumer asks for a renewal (`"renew": true` on the entry, docs/protocol.md
#    §11.4: the consumer declared `renewBefore` and its certificate is about to expire);
#  - in a run triggered by `systemd` or `manual` (`fort-agent trigger ssl-cert --reason
#    systemd`), when the certificate expires within a week or when the marker file
#    $FORT_EXAMPLE_STATE/rotate/<domain> exists (removed once a new certificate for the
#    domain has been issued).
# Only the consumers of a renewed certificate are called back. Each renewal asked for by
# a consumer is logged to $FORT_EXAMPLE_STATE/renewals.log.
#
# A request may set `lifetime_seconds` (10 s to 398 days) instead of the default lifetime,
# for short-lived certificates.
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

# One line per entry: key, domain ("-" when missing or unsafe), whether a response is
# cached, whether a renewal was asked for, lifetime in seconds ("-": the default).
jq -r 'to_entries[] | .value.request.domain as $d | .value.request.lifetime_seconds as $l | "\(.key) \(
  if ($d | type) == "string" and ($d | test("^[a-z0-9]([a-z0-9.-]*[a-z0-9])?$")) then $d else "-" end
) \(.value.response != null) \(.value.renew == true) \(
  if ($l | type) == "number" and $l == ($l | floor) and $l >= 10 and $l <= 34387200 then $l else "-" end
)"' "$tmp/in" > "$tmp/list"

# A self-signed certificate valid from a minute ago for $2 seconds: `openssl req -x509`
# counts in days only, `openssl ca` takes exact dates.
issue_for_seconds() {
  openssl req -new -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -subj "/CN=$1" \
    -addext "subjectAltName=DNS:$1" -keyout "$tmp/key.pem" -out "$tmp/req.csr" 2>"$tmp/err" || return 1
  rm -rf "$tmp/ca" && mkdir "$tmp/ca" && : > "$tmp/ca/index.txt"
  openssl rand -hex 16 > "$tmp/ca/serial"
  cat > "$tmp/ca.cnf" <<EOF
[ca]
default_ca = example
[example]
database = $tmp/ca/index.txt
new_certs_dir = $tmp/ca
serial = $tmp/ca/serial
default_md = sha256
policy = any
copy_extensions = copy
unique_subject = no
[any]
commonName = supplied
EOF
  now=$(date +%s)
  openssl ca -batch -config "$tmp/ca.cnf" -selfsign -keyfile "$tmp/key.pem" -in "$tmp/req.csr" \
    -startdate "$(date -u -d "@$((now - 60))" +%Y%m%d%H%M%SZ)" \
    -enddate "$(date -u -d "@$((now + $2))" +%Y%m%d%H%M%SZ)" \
    -notext -out "$tmp/cert.pem" 2>"$tmp/err"
}

issued=""
while read -r key domain cached renew lifetime; do
  if [ "$domain" = - ]; then
    echo "cert-provider: $key: request.domain missing or not a DNS name; no certificate" >&2
    continue
  fi
  if [ "$cached" = true ]; then
    jq -j --arg k "$key" '.[$k].response' "$tmp/in" > "$tmp/old.pem"
    reissue=$renew
    case ${FORT_TRIGGER:-} in systemd | manual)
      if [ -e "$state/rotate/$domain" ]; then reissue=true; fi
      if ! openssl x509 -noout -checkend 604800 -in "$tmp/old.pem" >/dev/null 2>&1; then reissue=true; fi
      ;;
    esac
    if [ "$reissue" = false ]; then
      jq -c --arg k "$key" '{($k): .[$k].response}' "$tmp/in"
      continue
    fi
  fi
  if [ "$renew" = true ]; then
    echo "$(date -u +%Y-%m-%dT%H:%M:%SZ) $key renew" >> "$state/renewals.log"
  fi
  issued="$issued $domain"
  if [ "$lifetime" = - ]; then
    openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days "$days" \
      -subj "/CN=$domain" -addext "subjectAltName=DNS:$domain" \
      -keyout "$tmp/key.pem" -out "$tmp/cert.pem" 2>"$tmp/err" || { cat "$tmp/err" >&2; exit 1; }
  else
    issue_for_seconds "$domain" "$lifetime" || { cat "$tmp/err" >&2; exit 1; }
  fi
  cat "$tmp/cert.pem" "$tmp/key.pem" > "$tmp/new.pem"
  jq -cn --arg k "$key" --rawfile pem "$tmp/new.pem" '{($k): $pem}'
done < "$tmp/list" > "$tmp/out"

jq -cs 'add // {}' "$tmp/out"
for domain in $issued; do rm -f "$state/rotate/$domain"; done
