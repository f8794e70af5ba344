# Request interfaces of the capabilities the example handlers serve
# (handlers/examples/*-provider.sh) and of fort-handler's capabilities (dns-record,
# postgres, acme, ssh-ca, backup-repo, scrape, mesh), as the flake's `lib.interfaces`. Pass them to lib.mkFleet's
# `interfaces`, or use them as a starting point for your own.
{
  oidc = ./oidc.nix;
  ssl-cert = ./ssl-cert.nix;
  proxy = ./proxy.nix;
  dns-record = ./dns-record.nix;
  postgres = ./postgres.nix;
  acme = ./acme.nix;
  ssh-ca = ./ssh-ca.nix;
  backup-repo = ./backup-repo.nix;
  scrape = ./scrape.nix;
  mesh = ./mesh.nix;
}
