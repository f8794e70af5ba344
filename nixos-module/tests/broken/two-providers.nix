# An instance with two providers (a need has exactly one `from`).
{
  extra.beacon = [ { fort.cluster.instances.wiki.roles.provider.machines.beacon = { }; } ];
  expect = [ "fort.cluster.instances.wiki.roles.provider.machines must name exactly one host (it names 2: beacon, forge)" ];
}
