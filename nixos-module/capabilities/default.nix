# The capability modules: provider options of the capabilities fort-handler serves
# (each on provider.nix) and consumer conveniences (certificates.nix, ssh-ca.nix's
# `fort.host.sshCertificate`, backup-repo.nix's `fort.host.backups`, scrape.nix's
# `fort.host.exporters`, mesh.nix's `fort.host.meshes`). A new capability module is listed here once.
{
  imports = [
    ./acme.nix
    ./backup-repo.nix
    ./certificates.nix
    ./dns-record.nix
    ./mesh.nix
    ./oidc.nix
    ./postgres.nix
    ./proxy.nix
    ./scrape.nix
    ./ssh-ca.nix
  ];
}
