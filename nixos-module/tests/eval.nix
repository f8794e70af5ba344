# Evaluates the module with the real nixpkgs `lib` and tests/stubs.nix, through the same
# mkFleetWith that the flake's lib.mkFleet uses. Run by tests/run.sh:
#
#   nix-instantiate --eval --strict --json nixos-module/tests/eval.nix \
#     --arg lib 'import /path/to/nixpkgs/lib'
#
# mode = "fleet" (default): { hosts.<host> = the generated files and units, read back
#   from the stubs; manifest = lib.fleetManifest }; fails if any assertion fails or a
#   warning is emitted.
# mode = "shared": the same fleet with its declarations in `shared` instead of mkFleet's
#   `cluster`, so every host derives the fleet's facts itself.
# mode = "flake": the same, but through flake.nix's lib.mkFleet, with a nixpkgs whose
#   nixosSystem is the stubbed evaluation (so the flake's wiring is tested too).
# mode = "example": the demo fleet shipped as NixOS configuration
#   (examples/demo-fleet/fleet.nix) through flake.nix's lib.mkFleet, as "fleet" renders.
# mode = "vm": the NixOS VM test's nodes (tests/vm.nix), wired as the test framework
#   wires them (`nodes` as a module argument, fort.cluster.fleet from lib's projection),
#   as "fleet" renders.
# mode = "lib": the flake's lib without any host: the example interfaces rendered as
#   Markdown and as JSON Schema, a schema covering every mapped option type, and refs.
# mode = "broken", case = ./broken/<name>.nix: { expect; messages.<host> = [ failed
#   assertions and warnings ]; agent.<host> = settings; check.<host> = the build-time
#   check's command } for a fleet with a mistake (or an unusual setting) in it.
{
  lib ? import <nixpkgs-lib/lib>,
  mode ? "fleet",
  case ? null,
  # mode = "check": a file `{ fort }: <lib.mkFleet's arguments>` (examples/demo-fleet/
  # fleet.nix is one), checked by nixos-module/check-fleet.sh.
  fleetFile ? null,
}:
let
  stubs = import ./stubs.nix { inherit lib; };
  fleetLib = import ../fleet.nix { inherit lib; };

  evalHost =
    { modules, specialArgs, ... }:
    lib.evalModules {
      modules = [ stubs.module ] ++ modules;
      specialArgs = {
        inherit (stubs) pkgs;
      } // specialArgs;
    };
  mkFleet = fleetLib.mkFleetWith {
    module = ../default.nix;
    inherit evalHost;
  };

  failedAssertions = config: map (a: a.message) (lib.filter (a: !a.assertion) config.assertions);
  problems = config: failedAssertions config ++ config.warnings;

  render =
    name: node:
    let
      config = node.config;
      etc = config.environment.etc;
      json = file: builtins.fromJSON etc."fort/${file}".source.text;
      checked = etc."fort/agent.toml".source;
    in
    if problems config != [ ] then
      # One line per problem, each naming its host once (many messages name it already).
      throw (
        lib.concatMapStringsSep "\n" (
          m: if lib.hasPrefix "host ${name}: " m then m else "host ${name}: ${m}"
        ) (problems config)
      )
    else
      {
        hosts = json "hosts.json";
        needs = json "needs.json";
        capabilities = json "capabilities.json";
        agent = checked.env.config.value;
        system = {
          etc = lib.attrNames etc;
          firewall = config.networking.firewall.allowedTCPPorts;
          users = lib.attrNames config.users.users;
          services = config.systemd.services;
          paths = config.systemd.paths;
          polkit = config.security.polkit;
          activation = config.system.activationScripts;
          inherit (config.fort.host) manifestSha256;
          check = {
            command = checked.buildCommand;
            config = checked.env.checkConfig.value;
          };
        }
        // lib.optionalAttrs (config.services.prometheus.ruleFiles != [ ]) {
          prometheusRuleFiles = map baseNameOf config.services.prometheus.ruleFiles;
        }
        # What the backup-repo and scrape capabilities wire into other services.
        // lib.optionalAttrs (config.services.prometheus.scrapeConfigs != [ ]) {
          prometheusScrapeConfigs = config.services.prometheus.scrapeConfigs;
        }
        // lib.optionalAttrs (config.services.openssh.authorizedKeysFiles != [ ]) {
          sshAuthorizedKeysFiles = config.services.openssh.authorizedKeysFiles;
        }
        // lib.optionalAttrs (config.services.borgbackup.jobs != { }) {
          borgbackupJobs = config.services.borgbackup.jobs;
        }
        # The WireGuard port a mesh member opens.
        // lib.optionalAttrs (config.networking.firewall.allowedUDPPorts != [ ]) {
          firewallUdp = config.networking.firewall.allowedUDPPorts;
        };
        # The installed bytes, for run.sh to hash on its own.
        texts = lib.genAttrs [ "hosts" "needs" "capabilities" ] (f: etc."fort/${f}.json".source.text);
      };
  renderFleet = nodes: {
    hosts = lib.mapAttrs render nodes;
    manifest = fleetLib.fleetManifest nodes;
    # What lib.fleetCheck would build and run.
    fleetCheck = (fleetLib.fleetCheck {
      inherit (stubs) pkgs;
      inherit nodes;
    }).buildCommand;
  };

  good = import ./fleet.nix { };

  flake =
    let
      nixpkgs = {
        lib = lib // {
          nixosSystem = { modules, specialArgs, ... }: evalHost { inherit modules specialArgs; };
        };
      };
      outputs = (import ../../flake.nix).outputs { self = outputs; inherit nixpkgs; };
    in
    outputs;

  # The fort flake as a consumer's flake sees it: its lib, and its source as outPath
  # (a path: read in place, never copied to the store).
  example = import ../../examples/demo-fleet/fleet.nix {
    fort = flake // {
      outPath = ../..;
    };
  };

  # The VM test's nodes as the NixOS test framework evaluates them: `defaults` and the
  # node's module, the node's name as its host name, and every node's config as `nodes`.
  vmNodes =
    let
      test = import ./vm.nix {
        fortModule = ../default.nix;
        inherit lib;
      };
      nodes = lib.mapAttrs (
        name: node:
        evalHost {
          specialArgs.nodes = lib.mapAttrs (_: n: n.config) nodes;
          modules = [
            test.defaults
            node
            { networking.hostName = name; }
          ];
        }
      ) test.nodes;
    in
    nodes;

  # No host is evaluated here: interfaces are rendered from their modules alone.
  libOutputs = {
      markdown = flake.lib.renderInterfaces flake.lib.interfaces;
      schemas = lib.mapAttrs (_: flake.lib.requestSchema) (
        flake.lib.interfaces // { types = ./interfaces/types.nix; }
      );
      refs = [
        (flake.lib.ref "ssl-cert/outline" "/fingerprint")
        (flake.lib.ref "ssl-cert/outline" "")
      ];
    };

  broken =
    let
      c = import case;
      # cluster = [ modules ]: added to mkFleet's `cluster`, the fleet's declarations;
      # callersFromInventory: passed to mkFleet.
      # withoutExternalPath = true: a nixpkgs lib older than types.externalPath, as the
      # modules see it, for the hostKeyFile type's fallback.
      declared = import ./fleet.nix { extra = c.extra or { }; };
      fleet = declared // {
        cluster = declared.cluster ++ c.cluster or [ ];
      } // lib.optionalAttrs (c ? callersFromInventory) {
        inherit (c) callersFromInventory;
      } // lib.optionalAttrs (c.withoutExternalPath or false) {
        specialArgs.lib = lib // {
          types = removeAttrs lib.types [ "externalPath" ];
        };
      };
      # standalone = true: each host evaluated on its own, as without mkFleet.
      nodes =
        if c.standalone or false then
          lib.mapAttrs (
            name: host:
            evalHost {
              specialArgs = { };
              modules =
                [ ../default.nix ]
                ++ fleet.cluster
                ++ fleet.shared
                ++ host.modules
                ++ [
                  {
                    services.fort-agent.hostName = name;
                    fort.cluster.interfaces = fleet.interfaces;
                  }
                ];
            }
          ) fleet.hosts
        else
          mkFleet fleet;
    in
    {
      inherit (c) expect;
      # As system.build.toplevel: failed assertions stop the build; without any, every
      # file and unit is evaluated, and a type error there fails evaluation.
      messages = lib.mapAttrs (
        name: node:
        let
          p = problems node.config;
        in
        if p == [ ] && node.config.services.fort-agent.enable then builtins.deepSeq (render name node) [ ] else p
      ) nodes;
      agent = lib.mapAttrs (_: node: node.config.services.fort-agent.settings) nodes;
      # The settings a case names (`service.<host>.<unit>`) of the fort units and of the
      # units that load delivered files as credentials, and the fort units' scripts.
      service = lib.mapAttrs (
        _: node:
        lib.mapAttrs (_: u: { inherit (u) serviceConfig unitConfig wants after; }) (
          lib.filterAttrs (
            n: u:
            lib.hasPrefix "fort-" n
            || u.serviceConfig ? LoadCredential
            || u.serviceConfig ? LoadCredentialEncrypted
          ) node.config.systemd.services
        )
      ) nodes;
      script = lib.mapAttrs (
        _: node:
        lib.concatMapStrings (u: u.script) (
          lib.attrValues (lib.filterAttrs (n: _: lib.hasPrefix "fort-" n) node.config.systemd.services)
        )
      ) nodes;
      # The command that checks the generated files at build time.
      check = lib.mapAttrs (
        _: node: node.config.environment.etc."fort/agent.toml".source.buildCommand or ""
      ) nodes;
    };
in
if mode == "fleet" then
  renderFleet (mkFleet good)
else if mode == "shared" then
  renderFleet (mkFleet (import ./fleet.nix { clusterIn = "shared"; }))
else if mode == "flake" then
  renderFleet (flake.lib.mkFleet good)
else if mode == "example" then
  renderFleet (flake.lib.mkFleet example)
else if mode == "vm" then
  renderFleet vmNodes
else if mode == "check" then
  let
    nodes = flake.lib.mkFleet (import fleetFile {
      fort = flake // {
        outPath = ../..;
      };
    });
  in
  renderFleet nodes
  // {
    # The handlers' config files each capability names, as their text: a check
    # without a store writes them where the capabilities can be pointed at them.
    configs = lib.mapAttrs (
      _: node:
      lib.concatMap (
        c:
        map (f: {
          path = toString f;
          inherit (f) text;
        }) c.configFiles
      ) (lib.attrValues node.config.fort.host.capabilities)
    ) nodes;
  }
else if mode == "lib" then
  libOutputs
else if mode == "broken" then
  broken
else
  throw "eval.nix: unknown mode ${mode}"
