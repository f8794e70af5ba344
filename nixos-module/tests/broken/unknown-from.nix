# A need whose provider is not a host.
{
  extra.app = [ { fort.host.needs.oidc.extra.from = "nowhere"; } ];
  expect = [ ''fort.host.needs.oidc.extra.from = "nowhere", which is not a host in fort.cluster.hosts'' ];
}
