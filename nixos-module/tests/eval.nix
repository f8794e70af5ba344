# Evaluates the module with the real nixpkgs `lib` and tests/stubs.nix, through the same
# mkFleetWith that the flake's lib.mkFleet uses. Run by tests/run.sh:
#
#   nix-instantiate --eval --strict --json nixos-module/tests/eval.nix \
#     --arg lib 'import /path/to/nixpkgs/lib'
#
# mode = "fleet" (default): per host, the generated files and units, read back from the
#   stubs; fails if any assertion fails or a warning is emitted.
# mode = "flake": the same, but through flake.nix's lib.mkFleet, with a nixpkgs whose
#   nixosSystem is the stubbed evaluation (so the flake's wiring is tested too).
# mode = "broken", case = ./broken/<name>.nix: { expect; messages.<host> = [ failed
#   assertions and warnings ] } for a fleet with a mistake in it.
{
  lib ? import <nixpkgs-lib/lib>,
  mode ? "fleet",
  case ? null,
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
      throw "host ${name}: ${lib.concatStringsSep "\n" (problems config)}"
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
          check = {
            command = checked.buildCommand;
            config = checked.env.checkConfig.value;
          };
        };
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
    outputs.lib.mkFleet good;

  broken =
    let
      c = import case;
      fleet = import ./fleet.nix { extra = c.extra or { }; };
      # standalone = true: each host evaluated on its own, as without mkFleet.
      nodes =
        if c.standalone or false then
          lib.mapAttrs (
            name: host:
            evalHost {
              specialArgs = { };
              modules =
                [ ../default.nix ]
                ++ fleet.shared
                ++ host.modules
                ++ [ { services.fort-agent.hostName = name; } ];
            }
          ) fleet.hosts
        else
          mkFleet fleet;
    in
    {
      inherit (c) expect;
      messages = lib.mapAttrs (_: node: problems node.config) nodes;
    };
in
if mode == "fleet" then
  lib.mapAttrs render (mkFleet good)
else if mode == "flake" then
  lib.mapAttrs render flake
else if mode == "broken" then
  broken
else
  throw "eval.nix: unknown mode ${mode}"
