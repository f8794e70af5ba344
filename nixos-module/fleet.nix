# lib.mkFleet: evaluate every host of a fleet so that each one sees what the others
# need and serve.
#
# Design: each host exports a small, plain projection of itself (`fort.host.exported`:
# its fort name, its needs as {type, id, from}, its capabilities' modes and request
# interfaces, and the hash of its generated files), and
# mkFleet indexes the projections of all hosts once (lib.nix fleetIndex: entries by host
# name, every provider's callers) and hands that one value to every host as the option
# `fort.cluster.fleet`. The hosts form a lazy fixpoint, as colmena's and NixOps' `nodes`
# do: what a host reads of the others' `exported` (needs, capabilities) depends only on
# their own needs and capabilities, never on `fort.cluster.fleet`, so there is no
# recursion, and each host forces of the others only the few attributes it reads. The
# one fleet-dependent attribute, manifestSha256, is read by tools (fleetManifest), never
# by a host.
#
# Cost: the index is plain data, built once and never type-checked again by the hosts
# (an option type checking every entry on every host made the fleet's evaluation grow
# with its square). A consumer reads the entries of the providers it names; a provider
# reads the callers index, which reads every host's needs once for the whole fleet.
#
# The fleet's own declarations (fort.cluster's hosts, principals and instances) can
# live in mkFleet's `cluster` modules, as Clan's inventory lives beside the machines:
# mkFleet evaluates them once, without any host (options-cluster.nix alone), derives
# hosts.json, their checks and the inventory's needs and callers once (cluster.nix), and
# hands that to every host in the index. Every host also imports the same modules, so
# `config.fort.cluster.*` reads as before; a host that adds definitions of its own to
# hosts, principals or instances derives the facts from its own values instead. The
# same declarations in `shared` work too, but then every host type-checks and derives
# the whole fleet's declarations itself.
#
# Why an option and not specialArgs (`nodes`): the module stays usable on its own (the
# option defaults to null and the module then computes callers from this host and the
# inventory, with a warning), the data crossing hosts is the projection rather than
# whole configurations, and the NixOS VM test and the evaluation test fill it the same
# way mkFleet does (`projection` below).
{ lib }:
let
  fortLib = import ./lib.nix { inherit lib; };
  inherit (import ./cluster.nix { inherit lib; }) clusterFacts;
in
rec {
  # The fleet index every host reads as fort.cluster.fleet (lib.nix fleetIndex), from
  # evaluated configs (`nodes` in a NixOS test, or the `.config` of each mkFleet result).
  # Build it once and give every host the same value: built per host, its grouping
  # would be done once per host.
  projection = configs: fortLib.fleetIndex { exports = lib.mapAttrs (_: config: config.fort.host.exported) configs; };

  # The fort.cluster options that clusterFacts derives from.
  clusterParts = [
    "hosts"
    "principals"
    "instances"
  ];

  # The facts of `cluster` modules (a module importing those that define
  # fort.cluster.*), evaluated once without any host and with the fleet's specialArgs,
  # with the files that define each part (a host whose definitions come from exactly
  # these files has the same values).
  fleetClusterFacts =
    {
      clusterModule,
      specialArgs ? { },
    }:
    let
      evaluated = lib.evalModules {
        inherit specialArgs;
        modules = [
          ./options-cluster.nix
          clusterModule
        ];
      };
      declared = evaluated.config.fort.cluster;
    in
    clusterFacts { inherit (declared) hosts principals instances; }
    // {
      files = lib.genAttrs clusterParts (part: evaluated.options.fort.cluster.${part}.files);
    };

  # mkFleetWith { module, evalHost } { hosts, shared ? [ ], specialArgs ? { },
  #   interfaces ? { }, cluster ? [ ], callersFromInventory ? false }
  #   module:   the fort NixOS module, added to every host;
  #   evalHost: { name, host, modules, specialArgs } -> an evaluated system with `.config`
  #             (nixpkgs.lib.nixosSystem in the flake; lib.evalModules in the tests);
  #   hosts.<name> = { modules = [ ... ]; system ? ...; specialArgs ? { }; }
  #   interfaces.<capability> = <module>: fort.cluster.interfaces in every host (the
  #             same set lib.renderInterfaces renders without any host);
  #   cluster:  modules that declare the fleet (fort.cluster.hosts, principals,
  #             instances) and nothing else, evaluated once for the fleet (with
  #             `specialArgs`, not a host's own) and imported by every host; they see
  #             only fort.cluster's options, never a host's;
  #   callersFromInventory: every need on another host is an instance in the
  #             inventory, so providers take their callers from it and no host's
  #             evaluation reads the others' needs (a consumer declaring one in its own
  #             modules fails its evaluation, saying so);
  # Returns the evaluated hosts by name: `nixosConfigurations`.
  mkFleetWith =
    { module, evalHost }:
    {
      hosts,
      shared ? [ ],
      specialArgs ? { },
      interfaces ? { },
      cluster ? [ ],
      callersFromInventory ? false,
    }:
    let
      # One file name for the anonymous ones among them, the same in the fleet's
      # evaluation and in every host's, so the two can be compared.
      clusterModule = {
        _file = "fort lib.mkFleet cluster";
        imports = cluster;
      };
      # One index for the whole fleet, shared by every host.
      fleet = fortLib.fleetIndex {
        exports = lib.mapAttrs (_: node: node.config.fort.host.exported) nodes;
        cluster = if cluster == [ ] then null else fleetClusterFacts { inherit clusterModule specialArgs; };
        inherit callersFromInventory;
      };
      nodes = lib.mapAttrs (
        name: host:
        evalHost {
          inherit name host;
          specialArgs = specialArgs // (host.specialArgs or { });
          modules =
            [
              module
              clusterModule
            ]
            ++ shared
            ++ (host.modules or [ ])
            ++ [
              {
                _file = "fort lib.mkFleet (host ${name})";
                networking.hostName = lib.mkDefault name;
                services.fort-agent.hostName = lib.mkDefault name;
                fort.cluster.interfaces = interfaces;
                fort.cluster.fleet = fleet;
              }
            ];
        }
      ) hosts;
    in
    nodes;

  # fleetCheck { pkgs, nodes, package ? <the hosts' fort package> }: a derivation that
  # checks every fort host's generated files together, building no system: each host's
  # files as its own build checks them, one registry for all, and every consumer's
  # requests against each provider's request schemas and callers
  # (`fort-agent check --fleet`). Its output is the report. In a flake:
  #   checks.x86_64-linux.fort-fleet = fort.lib.fleetCheck {
  #     pkgs = nixpkgs.legacyPackages.x86_64-linux; nodes = self.nixosConfigurations; };
  fleetCheck =
    {
      pkgs,
      nodes,
      package ? null,
    }:
    let
      fortHosts = lib.filter (c: c.services.fort-agent.enable or false) (
        lib.attrValues (lib.mapAttrs (_: n: n.config or n) nodes)
      );
      fort =
        if package != null then
          package
        else if fortHosts != [ ] then
          (lib.head fortHosts).services.fort-agent.package
        else
          throw "lib.fleetCheck: no host in nodes runs fort (services.fort-agent.enable)";
      skipHandlers = lib.any (c: c.fort.host.files.skipHandlers) fortHosts;
      copyHost =
        c:
        let
          name = c.services.fort-agent.hostName;
          f = c.fort.host.files;
        in
        ''
          mkdir fleet/${name}
          cp ${f.hosts} fleet/${name}/hosts.json
          cp ${f.needs} fleet/${name}/needs.json
          cp ${f.capabilities} fleet/${name}/capabilities.json
          cp ${f.checkConfig} fleet/${name}/agent.toml
        '';
    in
    pkgs.runCommand "fort-fleet-check"
      {
        nativeBuildInputs = [ fort ];
        preferLocalBuild = true;
      }
      ''
        mkdir fleet
        ${lib.concatMapStrings copyHost fortHosts}
        fort-agent check --fleet fleet${lib.optionalString skipHandlers " --skip-handlers"} | tee $out
      '';

  # { <fort host name> = <manifest sha256>; } for every host that runs an agent, from
  # evaluated hosts (`nixosConfigurations`, or a NixOS test's `nodes`): what each
  # agent should report as manifest_sha256 once it runs this configuration. Written out
  # with builtins.toJSON, it is the file `fort fleet --expect FILE` compares against.
  fleetManifest =
    configs:
    lib.listToAttrs (
      map (e: lib.nameValuePair e.host e.manifestSha256) (
        lib.filter (e: e.enable) (lib.attrValues (projection (lib.mapAttrs (_: c: c.config or c) configs)).exports)
      )
    );
}
