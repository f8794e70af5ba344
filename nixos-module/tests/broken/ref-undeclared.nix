# A reference and an `after` naming needs this host does not declare.
{
  extra.app = [
    (
      { config, lib, ... }:
      {
        fort.host.needs.proxy.app = {
          request.sign_in_client = lib.mkForce (config.fort.lib.ref "oidc/www" "/client_id");
          after = [ "oidc/grafana" ];
        };
      }
    )
  ];
  expect = [
    ''fort.host.needs.proxy.app.request.sign_in_client: $fort_ref "oidc/www#/client_id" names the need oidc/www, which host app does not declare (fort.host.needs.oidc.www); a reference names a need of the same host.''
    ''fort.host.needs.proxy.app.after: "oidc/grafana" is not a need host app declares (fort.host.needs.oidc.grafana)''
  ];
}
