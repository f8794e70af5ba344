# A request without an option the interface requires (no default).
{
  extra.beacon = [
    {
      fort.host.needs.oidc.dashboard = {
        from = "forge";
        request.scopes = [ "openid" ];
      };
    }
  ];
  expect = [
    "host beacon: fort.host.needs.oidc.dashboard.request.client_name: missing; the interface of capability \"oidc\" on provider host forge requires it (string matching the pattern [a-z0-9][a-z0-9-]{0,62}, no default)."
  ];
}
