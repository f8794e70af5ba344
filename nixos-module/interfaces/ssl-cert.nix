# Request of `ssl-cert` (handlers/examples/cert-provider.sh): a certificate for one name.
# The payload is PEM: the certificate, then its private key.
{ lib, ... }:
{
  options.domain = lib.mkOption {
    type = lib.types.strMatching "[a-z0-9]([a-z0-9.-]*[a-z0-9])?";
    example = "wiki.example.org";
    description = "DNS name the certificate is issued for.";
  };
  options.lifetime_seconds = lib.mkOption {
    type = lib.types.nullOr (lib.types.ints.between 10 34387200);
    default = null;
    example = 3600;
    description = "How long the certificate lives, 10 s to 398 days. `null`: the handler's default (30 days).";
  };
}
