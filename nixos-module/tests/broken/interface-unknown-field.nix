# A misspelt request field, on a need the inventory declares: the consumer's evaluation
# names the host, the need's option, the field and the provider.
{
  extra.app = [ { fort.host.needs.oidc.wiki.request.client_nmae = "wiki"; } ];
  expect = [
    "host app: fort.host.needs.oidc.wiki.request.client_nmae: unknown field; the interface of capability \"oidc\" on provider host forge declares client_name, grant_types, redirect_uris, rotate, scopes (the request merges fort.cluster.instances.wiki.settings and this host's definitions). Did you mean client_name?"
  ];
}
