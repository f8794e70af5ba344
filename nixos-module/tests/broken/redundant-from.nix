# A need naming several providers: each must be a host, and each only once.
{
  extra.app = [
    {
      fort.host.needs.oidc.extra.from = [
        "forge"
        "nowhere"
      ];
    }
    {
      fort.host.needs.oidc.twice.from = [
        "forge"
        "forge"
      ];
    }
  ];
  expect = [
    ''fort.host.needs.oidc.extra.from = "nowhere", which is not a host in fort.cluster.hosts''
    "fort.host.needs.oidc.twice.from names 2 providers: at most 8, each once"
  ];
}
