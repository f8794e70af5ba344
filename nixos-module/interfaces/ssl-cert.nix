# Request of `ssl-cert` (handlers/examples/cert-provider.sh): a certificate for one name.
# The payload is PEM: the certificate, then its private key.
{ lib, ... }:
{
  options.domain = lib.mkOption {
    type = lib.types.strMatching "[a-z0-9]([a-z0-9.-]*[a-z0-9])?";
    example = "wiki.example.org";
    description = "DNS name the certificate is issued for.";
  };
}
