# A reference and an `after` naming needs this host does not declare.
{
  extra.app = [
    (
      { config, lib, ... }:
      {
        fort.host.needs.proxy.app = {
          request.certificate = lib.mkForce (config.fort.lib.ref "ssl-cert/www" "");
          after = [ "oidc/grafana" ];
        };
      }
    )
  ];
  expect = [
    ''fort.host.needs.proxy.app.request.certificate: $fort_ref "ssl-cert/www" names the need ssl-cert/www, which host app does not declare (fort.host.needs.ssl-cert.www); a reference names a need of the same host.''
    ''fort.host.needs.proxy.app.after: "oidc/grafana" is not a need host app declares (fort.host.needs.oidc.grafana)''
  ];
}
