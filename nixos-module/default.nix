# The fort NixOS module: declare the fleet, the needs and the capabilities in Nix; get
# /etc/fort/*.json (checked at build time), the agent config, and systemd units.
#
# Files: options.nix (declarations), lib.nix (pure generation), assertions.nix (what a
# user can get wrong), service.nix (files, systemd, firewall, users), fleet.nix (mkFleet).
{
  config,
  lib,
  ...
}:
let
  cfg = config.services.fort-agent;
  cluster = config.fort.cluster;
  fortLib = import ./lib.nix { inherit lib; };
in
{
  imports = [
    ./options.nix
    ./assertions.nix
    ./service.nix
  ];

  config = {
    # The inventory's needs join the hand-written ones, so a consumer can extend an
    # instance's need (handler, check, nag) under the same `fort.host.needs.<type>.<id>`.
    fort.host.needs = lib.mkMerge (
      map (n: {
        ${n.type}.${n.id} = {
          inherit (n) from request;
          fromInstance = n.instance;
        };
      }) (
        fortLib.inventoryNeedsFor {
          inherit (cluster) instances hosts;
          self = cfg.hostName;
        }
      )
    );

    fort.host.exported = fortLib.exportedOf {
      inherit (cfg) enable hostName;
      inherit (config.fort.host) needs capabilities;
    };
  };
}
