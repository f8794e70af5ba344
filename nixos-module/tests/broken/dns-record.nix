# Mistakes in a dns-record capability: the TSIG key file in the store, a relative state
# file, a default TTL above the maximum, a pattern that is neither a name nor *.SUFFIX,
# the capability in rpc mode, and a second capability writing the first one's state file.
{
  extra.beacon = [
    (
      { lib, pkgs, ... }:
      {
        fort.host.capabilities.dns-record = {
          mode = "rpc";
          dnsRecord = {
            key.file = lib.mkForce "${pkgs.writeText "tsig" "c2VjcmV0"}";
            stateFile = "dns.json";
            defaultTtl = lib.mkForce 7200;
            maxTtl = 3600;
            allow.app = [ "a.*.example.org" ];
          };
        };
        fort.host.capabilities.dns-other.dnsRecord = {
          zone = "other.example.org";
          primary = "10.0.0.54";
          key = {
            name = "fort";
            file = "/run/secrets/fort-tsig-other";
          };
          stateFile = "dns.json";
        };
      }
    )
  ];
  expect = [
    "fort.host.capabilities.dns-record.dnsRecord: the capability must be async"
    "fort.host.capabilities.dns-record.dnsRecord.key.file is in the Nix store"
    "fort.host.capabilities.dns-record.dnsRecord: key.file and stateFile must be absolute paths"
    "fort.host.capabilities.dns-record.dnsRecord: defaultTtl (7200) is above maxTtl (3600)"
    "fort.host.capabilities.dns-record.dnsRecord.allow: every pattern is an exact name or *.SUFFIX"
    "two capabilities share one state file"
  ];
}
