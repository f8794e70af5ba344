# The fort NixOS module: declare the fleet, the needs and the capabilities in Nix; get
# /etc/fort/*.json (checked at build time), the agent config, and systemd units.
#
# Files: options.nix, options-cluster.nix and options-host.nix (declarations), lib.nix,
# cluster.nix and interface.nix (pure generation), assertions.nix and
# assertions-needs.nix (what a user can get wrong), service.nix (files, agent unit,
# firewall, users, dry-activate plan), delivery.nix (payload files as other services'
# credentials), alerts.nix (Prometheus alert rules), fleet.nix (mkFleet), capabilities/
# (provider options and consumer conveniences of the capabilities fort-handler serves).
{
  config,
  options,
  lib,
  ...
}:
let
  cfg = config.services.fort-agent;
  cluster = config.fort.cluster;
  fortLib = import ./lib.nix { inherit lib; };
  inherit (import ./cluster.nix { inherit lib; }) clusterFacts;

  # lib.mkFleet's facts of the fleet's `cluster` modules hold on this host when its
  # hosts, principals and instances are defined by exactly those modules; a definition
  # of its own (or none of mkFleet's) makes it derive them from its own values.
  fleetFacts = if cluster.fleet == null then null else cluster.fleet.cluster;
  sameAsFleet =
    fleetFacts != null
    && lib.all (part: options.fort.cluster.${part}.files == fleetFacts.files.${part}) [
      "hosts"
      "principals"
      "instances"
    ];
in
{
  imports = [
    ./options.nix
    ./options-host.nix
    ./assertions.nix
    ./assertions-needs.nix
    ./service.nix
    ./delivery.nix
    ./alerts.nix
    ./capabilities
  ];

  config = {
    # The inventory's needs join the hand-written ones, so a consumer can extend an
    # instance's need (handler, files, nag, ...) under the same
    # `fort.host.needs.<type>.<id>`.
    fort.cluster.facts =
      if sameAsFleet then
        fleetFacts
      else
        clusterFacts { inherit (cluster) hosts principals instances; };

    fort.host.needs = lib.mkMerge (
      map (n: {
        ${n.type}.${n.id} = {
          inherit (n) from request;
          fromInstance = n.instance;
        };
      }) (cluster.facts.inventory.needsOf.${cfg.hostName} or [ ])
    );

    fort.host.exported = fortLib.exportedOf {
      inherit (cfg) enable hostName;
      inherit (config.fort.host) needs capabilities manifestSha256;
    };
  };
}
