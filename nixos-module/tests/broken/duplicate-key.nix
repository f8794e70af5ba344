# One public key for two hosts, and a principal named like a host.
{
  extra.beacon = [
    {
      fort.cluster.hosts.beacon.publicKeys = [ (builtins.readFile ../keys/forge.pub) ];
      fort.cluster.principals.forge.publicKeys = [ (builtins.readFile ../keys/ops.pub) ];
    }
  ];
  expect = [
    "fort.cluster: duplicate key: one public key"
    "is listed for beacon and forge"
    "fort.cluster.principals.forge: principal names must match"
  ];
}
