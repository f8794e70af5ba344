# The capability modules: provider options of the capabilities fort-handler serves
# (each on provider.nix) and consumer conveniences (certificates.nix, ssh-ca.nix's
# `fort.host.sshCertificate`). A new capability module is listed here once.
{
  imports = [
    ./acme.nix
    ./certificates.nix
    ./dns-record.nix
    ./oidc.nix
    ./postgres.nix
    ./proxy.nix
    ./ssh-ca.nix
  ];
}
