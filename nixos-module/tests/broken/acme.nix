# Mistakes in an acme capability: no challenge configured, the TSIG key file in the
# store, a relative state file, a pattern that is neither a name nor *.SUFFIX, the
# capability in rpc mode, and a second capability writing the first one's state file.
{
  extra.beacon = [
    (
      { pkgs, ... }:
      {
        fort.host.capabilities.certs = {
          mode = "rpc";
          acme = {
            directory = "https://acme.example.org/dir";
            stateFile = "acme.json";
            allow.app = [ "a.*.example.org" ];
          };
        };
        fort.host.capabilities.certs-dns.acme = {
          directory = "https://acme.example.org/dir";
          dns01 = {
            zone = "example.org";
            primary = "10.0.0.53";
            key = {
              name = "fort";
              file = "${pkgs.writeText "tsig" "c2VjcmV0"}";
            };
          };
          stateFile = "acme.json";
        };
      }
    )
  ];
  expect = [
    "fort.host.capabilities.certs.acme: the capability must be async"
    "fort.host.capabilities.certs.acme: set webroot (HTTP-01) or dns01 (DNS-01)"
    "fort.host.capabilities.certs-dns.acme: dns01.key.file and eab.hmacFile must not be in the Nix store"
    "fort.host.capabilities.certs.acme: stateFile, webroot and dns01.key.file must be absolute paths"
    "fort.host.capabilities.certs.acme.allow: every pattern is an exact name or *.SUFFIX"
    "fort.host.capabilities.<name>.acme.stateFile: two capabilities share one state file"
  ];
}
