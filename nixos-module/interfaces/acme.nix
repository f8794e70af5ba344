# Request of a capability served by `fort-handler acme` (`ssl-cert` in most fleets): a
# certificate from the provider's ACME CA for a CSR the consumer made with its own key.
# Only the CSR travels; the payload is {certificate, chain, fullchain, not_after}.
{ lib, ... }:
let
  inherit (lib) mkOption types;
in
{
  options = {
    csr = mkOption {
      type = types.str;
      example = "-----BEGIN CERTIFICATE REQUEST-----\n...";
      description = ''
        The PKCS#10 certificate signing request, PEM, signed by the consumer's key. Its
        subjectAltName DNS names are the names the certificate is for.
      '';
    };
    names = mkOption {
      type = types.nullOr (
        types.listOf (types.strMatching "(\\*\\.)?([A-Za-z0-9_-]{1,63}\\.)+[A-Za-z0-9_-]{1,63}")
      );
      default = null;
      example = [
        "wiki.example.org"
        "*.wiki.example.org"
      ];
      description = ''
        The names asked for; they must be exactly the CSR's DNS names, and among the
        names the provider allows this host (`acme.allow`). `null`: the CSR's names.
      '';
    };
  };
}
