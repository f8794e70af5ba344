# Request of `ssh-ca` (fort-handler ssh-ca, docs/handlers.md): a certificate for one SSH
# public key, or (`kind = "ca"`) only what is to be trusted: the CA key and its KRL. The
# provider decides which principals the caller may have.
{ lib, ... }:
let
  inherit (lib) mkOption types;
in
{
  options = {
    kind = mkOption {
      type = types.enum [
        "host"
        "user"
        "ca"
      ];
      example = "host";
      description = "`host`: a host certificate for this host's own SSH host key; `user`: a user certificate; `ca`: no certificate, only the CA key, its `@cert-authority` line and its KRL (for a consumer that trusts several providers' CAs).";
    };
    public_key = mkOption {
      type = types.nullOr (types.strMatching "(ssh-ed25519|ecdsa-sha2-nistp(256|384|521)|ssh-rsa|sk-ssh-ed25519@openssh[.]com|sk-ecdsa-sha2-nistp256@openssh[.]com) [A-Za-z0-9+/]+=*( [ -~]*)?");
      default = null;
      example = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAID1AF8PoQ4lakrcKp00bfrycmCzPLsSWjMDNVfEq9GYM root@app";
      description = "The key to certify, as an OpenSSH public key line (the comment is ignored); required by `host` and `user`, unset for `ca`.";
    };
    principals = mkOption {
      type = types.nullOr (types.listOf (types.strMatching "([*][.])?[a-z0-9_][a-z0-9._@+:-]{0,250}"));
      default = null;
      example = [
        "app"
        "app.example.org"
      ];
      description = ''
        Host names (host certificates) or account names (user certificates) the
        certificate is valid for, lower case. `null`: for a host certificate, every exact
        name the provider allows the caller; a user certificate must name its accounts.
      '';
    };
    validity_seconds = mkOption {
      type = types.nullOr (types.ints.between 60 315360000);
      default = null;
      example = 3600;
      description = "Ask for a shorter validity than the provider's (a longer one is cut to it).";
    };
  };
}
