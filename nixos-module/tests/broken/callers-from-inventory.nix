# Under callersFromInventory, providers take their callers from the inventory alone: a
# need on another host declared in a host's modules would never reach its provider's
# callers, so the consumer's evaluation refuses it. The inventory's needs (oidc/wiki,
# oidc/grafana) and a host's need on itself (forge's ssh-ca/host) are not refused.
{
  callersFromInventory = true;
  expect = [
    "fort.host.needs.ssl-cert.app: lib.mkFleet's callersFromInventory is set, so providers learn their callers from fort.cluster.instances alone and \"forge\" would never hear of this need. Declare it as an instance (fort.cluster.instances.app: capability \"ssl-cert\", roles.provider.machines.forge, roles.consumer.machines.app)"
    "fort.host.needs.proxy.app: lib.mkFleet's callersFromInventory is set"
    "fort.host.needs.ssl-cert.beacon: lib.mkFleet's callersFromInventory is set"
  ];
  absent = [
    "fort.host.needs.oidc.wiki: lib.mkFleet's callersFromInventory"
    "fort.host.needs.oidc.grafana: lib.mkFleet's callersFromInventory"
    "fort.host.needs.ssh-ca.host: lib.mkFleet's callersFromInventory"
  ];
}
