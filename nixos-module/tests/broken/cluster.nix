# Mistakes in the fleet's declarations (mkFleet's `cluster`), found once for the fleet
# and reported by every host: an address that is no URL, a host without keys, a key
# listed for a host and a principal, an instance whose capability is no name and whose
# provider is no host, and a consumer tag no host carries.
{
  cluster = [
    {
      fort.cluster.hosts.ghost = {
        address = "10.0.0.9";
        publicKeys = [ ];
      };
      fort.cluster.principals.ci.publicKeys = [ (builtins.readFile ../keys/forge.pub) ];
      fort.cluster.instances.backup = {
        capability = "Back up";
        roles.provider.machines.nowhere = { };
      };
      fort.cluster.instances.grafana.roles.consumer.tags.nobody = { };
    }
  ];
  expect = [
    ''fort.cluster.hosts.ghost.address = "10.0.0.9" must look like https://HOST:PORT.''
    "fort.cluster.hosts.ghost.publicKeys is empty."
    "fort.cluster: duplicate key: one public key"
    "is listed for forge and ci"
    ''fort.cluster.instances.backup.capability = "Back up" must match''
    "fort.cluster.instances.backup.roles.provider.machines.nowhere: not a host in fort.cluster.hosts."
    "fort.cluster.instances.grafana.roles.consumer.tags.nobody: no host in fort.cluster.hosts carries this tag."
  ];
}
