# A need whose provider is not a host.
{
  extra.app = [
    { fort.host.needs.oidc.extra.from = "nowhere"; }
    { fort.host.needs.oidc.typo.from = "froge"; }
  ];
  expect = [
    ''fort.host.needs.oidc.extra.from = "nowhere", which is not a host in fort.cluster.hosts''
    ''fort.host.needs.oidc.typo.from = "froge", which is not a host in fort.cluster.hosts (hosts: app, beacon, forge). Did you mean forge?''
  ];
}
