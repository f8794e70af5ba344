# Requests outside what each provider allows, and a file pointer naming a member the
# response never has: every one fails app's evaluation, naming the need, the value and
# what app is allowed.
{
  extra.app = [
    {
      fort.host.certificates.evil = {
        from = "forge";
        capability = "tls";
        domains = [ "evil.example.net" ];
      };
      fort.host.needs = {
        dns-record.elsewhere = {
          from = "beacon";
          request.name = "www.beacon.example.org";
        };
        proxy.stolen = {
          from = "beacon";
          request = {
            server_names = [ "beacon.example.org" ];
            port = 80;
          };
        };
        postgres.other = {
          from = "forge";
          request.name = "billing";
        };
        oidc.grafana = {
          from = "forge";
          request = {
            client_name = "grafana";
            redirect_uris = [ "https://evil.example.net/cb" ];
          };
        };
        ssh-ca.host = {
          from = "forge";
          request = {
            kind = "host";
            public_key = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAID1AF8PoQ4lakrcKp00bfrycmCzPLsSWjMDNVfEq9GYM";
            principals = [ "forge.example.org" ];
          };
        };
        postgres.wiki.files.host.pointer = "/hostname";
      };
    }
  ];
  expect = [
    "host app: fort.host.needs.tls.evil.request.csr: evil.example.net is not one capability tls of forge allows app (allowed: app.example.org)."
    "host app: fort.host.needs.dns-record.elsewhere.request.name: www.beacon.example.org is not one capability dns-record of beacon allows app (allowed: app.example.org, *.app.example.org)."
    "host app: fort.host.needs.proxy.stolen.request.server_names: beacon.example.org is not one capability proxy of beacon allows app (allowed: app.example.org, *.app.example.org)."
    "host app: fort.host.needs.postgres.other.request.name: billing is not one capability postgres of forge allows app (allowed: wiki)."
    "host app: fort.host.needs.oidc.grafana.request.redirect_uris: https://evil.example.net/cb is not a redirect URI capability oidc of forge allows app (allowed: https://wiki.example.org/)."
    "host app: fort.host.needs.ssh-ca.host.request.principals: forge.example.org is not one capability ssh-ca of forge allows app (allowed: app, app.example.org)."
    "host app: fort.host.needs.postgres.wiki.files.host.pointer: /hostname names no member of what capability postgres of forge answers (host, port, dbname, user, password, uri)."
  ];
}
