# A need declared both by an inventory instance and by hand (extending it is fine; the
# fleet does that with a handler, and it is no error).
{
  extra.app = [ { fort.host.needs.oidc.wiki.from = "forge"; } ];
  expect = [ "fort.host.needs.oidc.wiki: duplicate need key oidc/wiki: fort.cluster.instances.wiki declares it" ];
}
