# A small fleet for nixos-module/check-fleet.sh's test: edge serves vhosts, DNS records
# and databases with fort-handler; app asks for one of each. `wrong = true` makes app ask
# for names outside what edge allows it.
{
  fort,
  wrong ? false,
}:
let
  key = name: "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAID1AF8PoQ4lakrcKp00bfrycmCzPLsSWjMDNVfEq9GY${name}";
in
{
  interfaces = fort.lib.interfaces;
  cluster = [
    {
      fort.cluster.hosts = {
        edge = {
          address = "https://10.0.0.1:7770";
          publicKeys = [ (key "M") ];
        };
        app = {
          address = "https://10.0.0.2:7770";
          publicKeys = [ (key "N") ];
        };
      };
    }
  ];
  shared = [ { services.fort-agent.enable = true; } ];
  hosts.edge.modules = [
    {
      fort.host.capabilities = {
        proxy.proxy.allow."*" = [ "*.{origin}.example.org" ];
        dns-record.dnsRecord = {
          zone = "example.org";
          primary = "10.0.0.53";
          key = {
            name = "fort";
            file = "/run/secrets/tsig";
          };
          allow."*" = [ "{origin}.example.org" ];
        };
        postgres.postgres = {
          host = "db.example.org";
          allow.app = [ "wiki" ];
        };
      };
    }
  ];
  hosts.app.modules = [
    {
      fort.host.needs = {
        proxy.wiki = {
          from = "edge";
          request = {
            server_names = [ (if wrong then "wiki.edge.example.org" else "wiki.app.example.org") ];
            port = 3000;
          };
          files."vhost.json" = { };
        };
        dns-record.www = {
          from = "edge";
          request.name = if wrong then "edge.example.org" else "app.example.org";
          files."record.json" = { };
        };
        postgres.wiki = {
          from = "edge";
          request.name = "wiki";
          files.password.pointer = "/password";
        };
      };
    }
  ];
}
