# Extending a shipped interface as nixos-module/README.md shows: one more definition of
# fort.cluster.interfaces.proxy on the provider merges with lib.mkFleet's; app's request
# may then use the new field, and the provider's schema carries it.
{
  extra.beacon = [
    (
      { lib, ... }:
      {
        fort.cluster.interfaces.proxy = {
          options.websocket = lib.mkOption {
            type = lib.types.bool;
            default = false;
            description = "Forward WebSocket upgrades.";
          };
        };
      }
    )
  ];
  extra.app = [ { fort.host.needs.proxy.app.request.websocket = true; } ];
  expect = [ ];
  absent = [ "unknown field" ];
}
