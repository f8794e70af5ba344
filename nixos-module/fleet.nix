# lib.mkFleet: evaluate every host of a fleet so that each one sees what the others
# need and serve.
#
# Design: each host exports a small, plain projection of itself (`fort.host.exported`:
# its fort name, its needs as {type, id, from}, its capability names and modes), and
# mkFleet feeds the projections of all hosts back into every host as the option
# `fort.cluster.fleet`. The hosts form a lazy fixpoint, as colmena's and NixOps' `nodes`
# do: a host's `exported` depends only on its own needs and capabilities, never on
# `fort.cluster.fleet`, so there is no recursion, and each host forces of the others only
# the few attributes it reads.
#
# Why an option and not specialArgs (`nodes`): the module stays usable on its own (the
# option defaults to {} and the module then computes callers from this host and the
# inventory, with a warning), the fleet has a declared, checked type, the data crossing
# hosts is the projection rather than whole configurations, and the NixOS VM test and the
# evaluation test fill it the same way mkFleet does (`projection` below).
{ lib }:
rec {
  # fleet entry per host, from evaluated configs (`nodes` in a NixOS test, or the
  # `.config` of each mkFleet result).
  projection = configs: lib.mapAttrs (_: config: config.fort.host.exported) configs;

  # mkFleetWith { module, evalHost } { hosts, shared ? [ ], specialArgs ? { } }
  #   module:   the fort NixOS module, added to every host;
  #   evalHost: { name, host, modules, specialArgs } -> an evaluated system with `.config`
  #             (nixpkgs.lib.nixosSystem in the flake; lib.evalModules in the tests);
  #   hosts.<name> = { modules = [ ... ]; system ? ...; specialArgs ? { }; }
  # Returns the evaluated hosts by name: `nixosConfigurations`.
  mkFleetWith =
    { module, evalHost }:
    {
      hosts,
      shared ? [ ],
      specialArgs ? { },
    }:
    let
      nodes = lib.mapAttrs (
        name: host:
        evalHost {
          inherit name host;
          specialArgs = specialArgs // (host.specialArgs or { });
          modules =
            [ module ]
            ++ shared
            ++ (host.modules or [ ])
            ++ [
              {
                _file = "fort lib.mkFleet (host ${name})";
                networking.hostName = lib.mkDefault name;
                services.fort-agent.hostName = lib.mkDefault name;
                fort.cluster.fleet = projection (lib.mapAttrs (_: node: node.config) nodes);
              }
            ];
        }
      ) hosts;
    in
    nodes;
}
