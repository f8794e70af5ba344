# Request values of the wrong type: a list where the interface wants a string, and a
# list element outside an enum.
{
  extra.app = [
    (
      { lib, ... }:
      {
        fort.host.needs.ssl-cert.app.request.domain = lib.mkForce [ "app.example.org" ];
        fort.cluster.instances.wiki.roles.consumer.machines.app.settings.grant_types = [ "authorization_code" "implicit" ];
      }
    )
  ];
  expect = [
    ''host app: fort.host.needs.ssl-cert.app.request.domain: the interface of capability "ssl-cert" on provider host forge expects string matching the pattern [a-z0-9]([a-z0-9.-]*[a-z0-9])?, got [ "app.example.org" ].''
    ''host app: fort.host.needs.oidc.wiki.request.grant_types[1]: the interface of capability "oidc" on provider host forge expects one of "authorization_code", "refresh_token", "client_credentials", got "implicit" (the request merges fort.cluster.instances.wiki.settings and this host's definitions).''
  ];
}
