# Stand-ins for the parts of NixOS and nixpkgs the module touches, so the module can be
# evaluated with nothing but nixpkgs `lib`. Each "derivation" is a plain attribute set
# with an `outPath` (so interpolation yields a store-like path) that keeps its input
# (`text`, `value`, `buildCommand`) for the test to read back.
{ lib }:
let
  inherit (lib) mkOption types;

  # The "hash" covers the inputs, so files that differ between hosts get different paths.
  drv =
    name: attrs:
    attrs
    // {
      inherit name;
      type = "derivation";
      outPath = "/nix/store/${builtins.substring 0 32 (builtins.hashString "sha256" (name + builtins.toJSON attrs))}-${name}";
    };

  # As nixpkgs' pkgs.formats.toml's type (pkgs/pkgs-lib/formats.nix).
  tomlValue =
    types.oneOf [
      types.bool
      types.int
      types.float
      types.str
      types.path
      (types.attrsOf tomlValue)
      (types.listOf tomlValue)
    ]
    // {
      description = "TOML value";
    };

  list = mkOption {
    type = types.listOf types.raw;
    default = [ ];
  };
  freeform = types.submodule { freeformType = types.lazyAttrsOf types.raw; };

  # As NixOS's systemd unit options (nixos/lib/systemd-unit-options.nix): definitions of
  # one key concatenate when any is a list (LoadCredential=, ReadWritePaths=, Condition*=
  # from several modules), and must agree otherwise.
  unitOption = lib.mkOptionType {
    name = "systemd option";
    check = _: true;
    merge =
      loc: defs:
      if lib.any (d: builtins.isList d.value) defs then
        lib.concatMap (d: lib.toList d.value) defs
      else
        lib.mergeEqualOption loc defs;
  };
  unitSection = mkOption {
    type = types.attrsOf unitOption;
    default = { };
  };
in
{
  pkgs = rec {
    writeText = name: text: drv name { inherit text; };
    writeShellScript = name: text: writeText name text;
    runCommand = name: env: buildCommand: drv name { inherit env buildCommand; };
    formats.toml = { }: {
      type = tomlValue;
      generate = name: value: drv name { inherit value; };
    };
    coreutils = drv "coreutils-9.5" { };
    findutils = drv "findutils-4.10.0" { };
    gnugrep = drv "gnugrep-3.11" { };
    gnused = drv "gnused-4.9" { };
    jq = drv "jq-1.7.1" { };
    openssl = drv "openssl-3.4.0" { };
    borgbackup = drv "borgbackup-1.4.0" { };
    iproute2 = drv "iproute2-6.11.0" { };
    wireguard-tools = drv "wireguard-tools-1.0.20210914" { };
    systemd = drv "systemd-257" { };
    fort = drv "fort-0.1.0" { };
    callPackage = _: _: fort;
  };

  module = {
    options = {
      assertions = mkOption {
        type = types.listOf types.unspecified;
        default = [ ];
      };
      warnings = mkOption {
        type = types.listOf types.str;
        default = [ ];
      };
      networking.hostName = mkOption {
        type = types.str;
        default = "nixos";
      };
      networking.firewall.allowedTCPPorts = mkOption {
        type = types.listOf types.port;
        default = [ ];
      };
      networking.firewall.allowedUDPPorts = mkOption {
        type = types.listOf types.port;
        default = [ ];
      };
      environment.etc = mkOption {
        type = types.attrsOf (
          types.submodule {
            options.source = mkOption { type = types.raw; };
            options.mode = mkOption {
              type = types.str;
              default = "symlink";
            };
          }
        );
        default = { };
      };
      environment.systemPackages = list;
      systemd.package = mkOption {
        type = types.raw;
        default = drv "systemd-257" { };
      };
      systemd.services = mkOption {
        default = { };
        type = types.attrsOf (
          types.submodule {
            options = {
              description = mkOption {
                type = types.str;
                default = "";
              };
              wantedBy = list;
              wants = list;
              after = list;
              before = list;
              onSuccess = list;
              restartTriggers = list;
              reloadTriggers = list;
              path = list;
              environment = mkOption {
                type = types.attrsOf types.str;
                default = { };
              };
              script = mkOption {
                type = types.lines;
                default = "";
              };
              serviceConfig = unitSection;
              unitConfig = unitSection;
            };
          }
        );
      };
      systemd.paths = mkOption {
        default = { };
        type = types.attrsOf (
          types.submodule {
            options = {
              description = mkOption {
                type = types.str;
                default = "";
              };
              wantedBy = list;
              pathConfig = unitSection;
              unitConfig = unitSection;
            };
          }
        );
      };
      # As NixOS's (nixos/modules/system/activation/activation-script.nix), without the
      # plain-string form.
      system.activationScripts = mkOption {
        default = { };
        type = types.attrsOf (
          types.submodule {
            options = {
              deps = list;
              text = mkOption { type = types.lines; };
              supportsDryActivation = mkOption {
                type = types.bool;
                default = false;
              };
            };
          }
        );
      };
      systemd.tmpfiles.rules = mkOption {
        type = types.listOf types.str;
        default = [ ];
      };
      # As NixOS's (nixos/modules/services/web-servers/nginx), the part the proxy
      # capability sets.
      services.nginx.package = mkOption {
        type = types.raw;
        default = drv "nginx-1.26.2" { };
      };
      services.nginx.enableReload = mkOption {
        type = types.bool;
        default = false;
      };
      services.nginx.appendHttpConfig = mkOption {
        type = types.lines;
        default = "";
      };
      services.nginx.serverNamesHashBucketSize = mkOption {
        type = types.nullOr types.ints.positive;
        default = null;
      };
      # As NixOS's (nixos/modules/services/monitoring/prometheus): rule files, each
      # checked with promtool at build time.
      services.prometheus.ruleFiles = mkOption {
        type = types.listOf types.path;
        default = [ ];
      };
      # The scrape jobs the scrape capability adds.
      services.prometheus.scrapeConfigs = mkOption {
        type = types.listOf types.raw;
        default = [ ];
      };
      services.openssh.extraConfig = mkOption {
        type = types.lines;
        default = "";
      };
      services.openssh.authorizedKeysFiles = mkOption {
        type = types.listOf types.str;
        default = [ ];
      };
      # As NixOS's (nixos/modules/services/backup/borgbackup.nix), the jobs the backups
      # of fort.host.backups run.
      services.borgbackup.jobs = mkOption {
        type = types.attrsOf freeform;
        default = { };
      };
      users.users = mkOption {
        type = types.attrsOf freeform;
        default = { };
      };
      users.groups = mkOption {
        type = types.attrsOf freeform;
        default = { };
      };
      # As NixOS's (nixos/modules/security/polkit.nix): off unless something needs it.
      security.polkit.enable = mkOption {
        type = types.bool;
        default = false;
      };
      security.polkit.extraConfig = mkOption {
        type = types.lines;
        default = "";
      };
    };
  };
}
