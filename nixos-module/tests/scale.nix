# The fleet tests/scale.sh measures: one provider `forge` serving `tok`, and `consumers`
# hosts c1 … cN that each need tok/a and tok/b from it, evaluated with the real nixpkgs
# `lib` and tests/stubs.nix through mkFleetWith as the flake's lib.mkFleet uses it (no
# NixOS module but fort's, so what is measured is fort's share of an evaluation).
#
#   nix-instantiate --eval --strict scale.nix --arg lib 'import <nixpkgs/lib>' \
#     --arg consumers 640 --argstr what fleet
#
# what = "fleet":    every host's needs.json and forge's capabilities.json;
#        "system":   every host as its system build forces fort: all of /etc/fort, the
#                    build-time check's config, the agent unit, assertions and warnings;
#        "consumer": c1 alone, as "system" forces it (a deploy of one consumer);
#        "provider": forge alone, likewise.
# declare = "cluster":   fort.cluster in mkFleet's `cluster` (evaluated once for the
#                        fleet), the needs in each consumer's own modules;
#           "shared":    fort.cluster in `shared` instead, so every host evaluates the
#                        fleet's declarations itself (as before mkFleet had `cluster`);
#           "inventory": fort.cluster in `cluster`, the needs as two fleet-level
#                        instances (fort.cluster.instances) rather than in host modules,
#                        and mkFleet's callersFromInventory, so that no host's
#                        evaluation reads the other hosts' needs.
# The result is a small summary (hosts forced, bytes of JSON), so that printing it costs
# nothing; an evaluation that fails an assertion or warns throws instead.
{
  lib ? import <nixpkgs-lib/lib>,
  consumers ? 40,
  what ? "fleet",
  declare ? "cluster",
}:
assert lib.elem declare [
  "cluster"
  "shared"
  "inventory"
];
let
  stubs = import ./stubs.nix { inherit lib; };
  fleetLib = import ../fleet.nix { inherit lib; };
  mkFleet = fleetLib.mkFleetWith {
    module = ../default.nix;
    evalHost =
      { modules, specialArgs, ... }:
      lib.evalModules {
        modules = [ stubs.module ] ++ modules;
        specialArgs = {
          inherit (stubs) pkgs;
        } // specialArgs;
      };
  };

  consumerNames = map (i: "c${toString i}") (lib.range 1 consumers);
  names = [ "forge" ] ++ consumerNames;
  # Distinct, well-formed ed25519 lines: the fleet's duplicate-key check compares them.
  publicKey =
    name: "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAA${builtins.substring 0 43 (builtins.hashString "sha256" name)} root@${name}";

  cluster = {
    fort.cluster = {
      hosts = lib.genAttrs names (name: {
        address = "https://${name}.example.org:7770";
        publicKeys = [ (publicKey name) ];
        tags = lib.optional (name != "forge") "consumer";
      });
      principals.ops.publicKeys = [ (publicKey "ops") ];
    }
    // lib.optionalAttrs (declare == "inventory") {
      instances = lib.genAttrs [ "a" "b" ] (_: {
        capability = "tok";
        roles.provider.machines.forge = { };
        roles.consumer.tags.consumer = { };
      });
    };
  };

  provider =
    { pkgs, ... }:
    {
      fort.host.capabilities.tok = {
        handler = pkgs.writeShellScript "tok" "exit 0";
        allowed = [ "ops" ];
      };
    };
  directNeeds = {
    fort.host.needs.tok = {
      a.from = "forge";
      b.from = "forge";
    };
  };

  nodes = mkFleet {
    shared = [ { services.fort-agent.enable = true; } ] ++ lib.optional (declare == "shared") cluster;
    cluster = lib.optional (declare != "shared") cluster;
    callersFromInventory = declare == "inventory";
    hosts = lib.genAttrs names (name: {
      modules =
        if name == "forge" then
          [ provider ]
        else
          lib.optional (declare != "inventory") directNeeds;
    });
  };

  configOf = name: nodes.${name}.config;
  text = name: file: (configOf name).environment.etc."fort/${file}".source.text;

  # What a system build forces of fort on one host; throws on a failed assertion or a
  # warning, as the build would stop (or tell) there.
  system =
    name:
    let
      config = configOf name;
      failed = map (a: a.message) (lib.filter (a: !a.assertion) config.assertions) ++ config.warnings;
      checked = config.environment.etc."fort/agent.toml".source;
      forced = [
        (text name "hosts.json")
        (text name "needs.json")
        (text name "capabilities.json")
        (builtins.toJSON checked.env.checkConfig.value)
        (builtins.toJSON config.systemd.services.fort-agent)
        config.fort.host.manifestSha256
      ];
    in
    if failed != [ ] then
      throw "host ${name}: ${lib.concatStringsSep "\n" failed}"
    else
      forced;

  summary = forced: {
    hosts = builtins.length forced;
    bytes = lib.foldl' (n: strings: n + lib.foldl' (m: s: m + builtins.stringLength s) 0 strings) 0 forced;
  };
in
summary (
  if what == "fleet" then
    [ [ (text "forge" "capabilities.json") ] ] ++ map (name: [ (text name "needs.json") ]) names
  else if what == "system" then
    map system names
  else if what == "consumer" then
    [ (system "c1") ]
  else if what == "provider" then
    [ (system "forge") ]
  else
    throw "scale.nix: unknown what ${what}"
)
