# Hosts evaluated one by one, without lib.mkFleet: callers come only from the inventory
# and the host itself, and that is worth a warning.
{
  standalone = true;
  expect = [ "fort: fort.cluster.fleet is empty" ];
}
