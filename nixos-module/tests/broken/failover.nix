# Needs naming two providers of a capability fort ships: dns-record takes one provider;
# postgres providers must share one server and list each other as peers.
{
  extra.forge = [
    {
      fort.host.capabilities.dns-record.dnsRecord = {
        zone = "example.org";
        primary = "10.0.0.53";
        key = {
          name = "fort";
          file = "/run/secrets/fort-tsig";
        };
        allow."*" = [ "{origin}.example.org" ];
      };
    }
  ];
  extra.beacon = [
    {
      fort.host.capabilities.postgres.postgres = {
        host = "db2.example.org";
        adminRole = "fort";
        allow.app = [ "wiki" ];
      };
    }
  ];
  extra.app = [
    (
      { lib, ... }:
      {
        fort.host.needs.dns-record.www.from = lib.mkForce [
          "beacon"
          "forge"
        ];
        fort.host.needs.postgres.wiki.from = lib.mkForce [
          "forge"
          "beacon"
        ];
      }
    )
  ];
  expect = [
    "fort.host.needs.dns-record.www.from names 2 providers, but dns-record at beacon takes one: its providers would share one DNS primary"
    "fort.host.needs.dns-record.www.from names 2 providers, but dns-record at forge takes one"
    "fort.host.needs.postgres.wiki.from: beacon serves postgres on db2.example.org:5432 (fort_…), forge on db.example.org:5432 (fort_…): the providers of one need must share one backend"
    "fort.host.needs.postgres.wiki.from: forge does not list beacon among its postgres peers"
    "fort.host.needs.postgres.wiki.from: beacon does not list forge among its postgres peers"
  ];
}
