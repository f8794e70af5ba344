# Option declarations: the agent service, the fleet (hosts, principals, inventory), and
# what this host needs and serves.
{
  config,
  lib,
  pkgs,
  ...
}:
let
  inherit (lib) mkOption mkEnableOption types;
  fortLib = import ./lib.nix { inherit lib; };
  settingsFormat = pkgs.formats.toml { };

  jsonObject = types.attrsOf types.anything;

  need = types.submodule (
    { options, ... }:
    {
      options = {
        from = mkOption {
          type = types.str;
          example = "forge";
          description = "The host (a name in `fort.cluster.hosts`) whose capability of this need's type serves it.";
        };
        request = mkOption {
          type = jsonObject;
          default = { };
          example = {
            client_name = "outline";
          };
          description = "JSON object sent to the provider as `request` (PROTOCOL.md §6.1).";
        };
        nag = mkOption {
          type = fortLib.durationType;
          default = "15m";
          example = "1h";
          description = "How often the need is asked for again while it is unsatisfied (shipped as `nag_seconds`).";
        };
        handler = mkOption {
          type = types.nullOr types.path;
          default = null;
          example = lib.literalExpression ''pkgs.writeShellScript "oidc-callback" "install -m 0400 /dev/stdin /var/lib/outline/oidc.json"'';
          description = ''
            Run with the provider's payload on stdin; exit 0 marks the need satisfied.
            `null`: a side-effect-only need, satisfied when the provider answers `OK`.
            Runs as the agent's user (`services.fort-agent.user`).
          '';
        };
        check = mkOption {
          type = types.nullOr types.path;
          default = null;
          description = "Freshness probe run for a satisfied need; non-zero exit marks it unsatisfied again.";
        };
        neverSatisfied = mkOption {
          type = types.bool;
          default = false;
          description = "Ask again every `nag` interval even when satisfied (for responses that must be refreshed).";
        };

        # Set by the inventory, read by the assertions: a need that an instance declares
        # may be extended here (handler, check, nag) but not declared a second time.
        fromInstance = mkOption {
          type = types.nullOr types.str;
          default = null;
          internal = true;
          description = "The fort.cluster.instances entry that declares this need, if any.";
        };
        fromDefinedIn = mkOption {
          type = types.listOf types.str;
          default = map toString options.from.files;
          internal = true;
          readOnly = true;
          description = "Files that define `from` (more than one for an instance need: a duplicate).";
        };
      };
    }
  );

  capability = types.submodule {
    options = {
      handler = mkOption {
        type = types.path;
        description = "Provider handler (PROTOCOL.md §9 for async mode, §6.2 for rpc). Runs as the agent's user.";
      };
      mode = mkOption {
        type = types.enum [
          "async"
          "rpc"
        ];
        default = "async";
        description = "`async`: durable entries, callbacks, GC. `rpc`: the handler's stdout is the response.";
      };
      cacheResponse = mkOption {
        type = types.bool;
        default = false;
        description = "Keep each entry's last response and hand it back to the handler (async only).";
      };
      allowed = mkOption {
        type = types.listOf types.str;
        default = [ ];
        example = [ "ops" ];
        description = ''
          Principals and hosts allowed to call this capability besides `callers`, which the
          module computes from every fleet host that declares a need of this type from here.
        '';
      };
      triggers = {
        initialize = mkOption {
          type = types.bool;
          default = false;
          description = "Run the handler over all entries when the agent starts (async only).";
        };
        systemd = mkOption {
          type = types.listOf types.str;
          default = [ ];
          example = [ "acme-example.org.service" ];
          description = ''
            Units whose successful completion runs the handler (async only): each gets
            `OnSuccess=fort-trigger-<capability>.service`. OnSuccess fires when a unit goes
            inactive after succeeding, so list oneshot units (a renewal, a setup job), not
            long-running daemons.
          '';
        };
      };
      description = mkOption {
        type = types.nullOr types.str;
        default = null;
        description = "Shown by operator tools.";
      };
    };
  };

  clusterHost = types.submodule {
    options = {
      address = mkOption {
        type = types.str;
        example = "http://10.0.0.5:7770";
        description = "Where the other agents reach this host's agent: `http://HOST:PORT`.";
      };
      publicKeys = mkOption {
        type = types.listOf types.str;
        example = [ "ssh-ed25519 AAAAC3Nza... root@forge" ];
        description = "ed25519 public keys (OpenSSH format) the host signs with; more than one during rotation.";
      };
      tags = mkOption {
        type = types.listOf types.str;
        default = [ ];
        example = [ "web" ];
        description = "Tags for `fort.cluster.instances.<name>.roles.consumer.tags` (not shipped to the agent).";
      };
    };
  };

  principal = types.submodule {
    options.publicKeys = mkOption {
      type = types.listOf types.str;
      description = "ed25519 public keys of an operator or CI identity.";
    };
  };

  settingsOf = description: mkOption {
    type = jsonObject;
    default = { };
    inherit description;
  };

  instance = types.submodule {
    options = {
      capability = mkOption {
        type = types.str;
        example = "oidc";
        description = "The capability the provider serves; consumers get a need of this type whose id is the instance name.";
      };
      settings = settingsOf "Request settings for every consumer (merged first).";
      roles.provider.machines = mkOption {
        type = types.attrsOf (types.submodule { });
        default = { };
        example = lib.literalExpression "{ forge = { }; }";
        description = "Exactly one host that serves the capability (it must declare it in `fort.host.capabilities`).";
      };
      roles.consumer.machines = mkOption {
        type = types.attrsOf (types.submodule { options.settings = settingsOf "Merged last."; });
        default = { };
        description = "Consumer hosts by name.";
      };
      roles.consumer.tags = mkOption {
        type = types.attrsOf (types.submodule { options.settings = settingsOf "Merged after the instance settings, tags in name order."; });
        default = { };
        description = "Every host in `fort.cluster.hosts` carrying one of these tags is a consumer.";
      };
    };
  };

  fleetEntry = types.submodule {
    options = {
      enable = mkOption { type = types.bool; };
      host = mkOption { type = types.str; };
      needs = mkOption {
        type = types.attrsOf (
          types.submodule {
            options = {
              type = mkOption { type = types.str; };
              id = mkOption { type = types.str; };
              from = mkOption { type = types.str; };
            };
          }
        );
        default = { };
      };
      capabilities = mkOption {
        type = types.attrsOf (types.submodule { options.mode = mkOption { type = types.str; }; });
        default = { };
      };
    };
  };
in
{
  options.services.fort-agent = {
    enable = mkEnableOption "the fort agent, which serves this host's capabilities and fulfils its needs";

    package = mkOption {
      type = types.package;
      default = pkgs.callPackage ./package.nix { };
      defaultText = lib.literalExpression "pkgs.callPackage <fort>/nixos-module/package.nix { }";
      description = "The fort package (provides `fort-agent` and `fort`).";
    };

    hostName = mkOption {
      type = types.str;
      default = config.networking.hostName;
      defaultText = lib.literalExpression "config.networking.hostName (lib.mkFleet sets the fleet attribute name)";
      description = "This host's name in `fort.cluster.hosts`.";
    };

    listen = mkOption {
      type = types.str;
      default = "0.0.0.0:7770";
      example = "[::]:7770";
      description = "Address and port the agent listens on.";
    };

    openFirewall = mkOption {
      type = types.bool;
      default = false;
      description = "Open the `listen` port in the firewall. Every request is signed; the port is safe to expose to the fleet.";
    };

    hostKeyFile = mkOption {
      type = types.path;
      default = "/etc/ssh/ssh_host_ed25519_key";
      description = ''
        ed25519 private key this host signs with (its public half goes in
        `fort.cluster.hosts.<name>.publicKeys`). Must not be in the Nix store (world
        readable); give it as a string, not a path literal, which Nix would copy there.
        systemd passes it to the agent with `LoadCredential=`.
      '';
    };

    user = mkOption {
      type = types.str;
      default = "root";
      description = ''
        User the agent and therefore every handler runs as. Handlers usually write other
        services' secrets or restart units, hence root. Set to `"fort"` (created by the
        module) when all handlers only talk to APIs or write paths that user may write.
      '';
    };

    group = mkOption {
      type = types.str;
      default = if config.services.fort-agent.user == "fort" then "fort" else "root";
      defaultText = lib.literalExpression ''if user == "fort" then "fort" else "root"'';
      description = "Group of the agent and its handlers.";
    };

    path = mkOption {
      type = types.listOf types.package;
      default = [ ];
      example = lib.literalExpression "[ pkgs.jq pkgs.curl ]";
      description = "Packages on the PATH of handlers.";
    };

    strictSandbox = mkOption {
      type = types.bool;
      default = false;
      description = ''
        Add the hardening that breaks handlers which act on the rest of the system:
        read-only file system except the agent's state and `readWritePaths`, no devices,
        no home directories, no privileged system calls, no writable-executable memory.
        Turn it on when the handlers only call APIs or write to `readWritePaths`.
      '';
    };

    readWritePaths = mkOption {
      type = types.listOf types.str;
      default = [ ];
      example = [ "/var/lib/outline/secrets" ];
      description = "Writable for handlers under `strictSandbox`.";
    };

    checkConfig = mkOption {
      type = types.bool;
      default = true;
      description = ''
        Validate the generated config and JSON files with `fort-agent check` at build
        time, so a mistake fails the build rather than the deploy. Turn off only when the
        build machine cannot run `package` (cross compilation).
      '';
    };

    metrics = {
      enable = mkEnableOption "the agent's metrics endpoint";
      listen = mkOption {
        type = types.str;
        default = "127.0.0.1:9770";
        description = "Address of the metrics endpoint (not opened in the firewall).";
      };
    };

    settings = mkOption {
      type = types.submodule { freeformType = settingsFormat.type; };
      default = { };
      example = lib.literalExpression ''
        {
          handler_timeout = "120s";
          access.journal = [ "ops" ];
          gc.interval = "30m";
        }
      '';
      description = ''
        Agent configuration (`/etc/fort/agent.toml`), merged over the module's values,
        which are all `mkDefault`. See the agent's config reference for every key.
      '';
    };
  };

  options.fort = {
    cluster = {
      hosts = mkOption {
        type = types.attrsOf clusterHost;
        default = { };
        description = "Every agent in the fleet. Declare it once, in a module every host imports.";
      };
      principals = mkOption {
        type = types.attrsOf principal;
        default = { };
        description = "Operators and CI identities. Names never equal a host name.";
      };
      instances = mkOption {
        type = types.attrsOf instance;
        default = { };
        description = "Service instances: one capability, one provider, consumers by name or tag.";
      };
      fleet = mkOption {
        type = types.attrsOf fleetEntry;
        default = { };
        internal = true;
        description = ''
          What every host in the fleet exports (`fort.host.exported`): its needs and
          capabilities. Set by `lib.mkFleet`; the source of `callers` and of the check
          that each need is served.
        '';
      };
    };

    host = {
      needs = mkOption {
        type = types.attrsOf (types.attrsOf need);
        default = { };
        example = lib.literalExpression ''
          { ssl-cert.app = { from = "forge"; request.domains = [ "app.example.org" ]; handler = installCert; }; }
        '';
        description = "Needs of this host: `<type>.<id>`; the type is the name of the provider's capability.";
      };
      capabilities = mkOption {
        type = types.attrsOf capability;
        default = { };
        description = "Capabilities this host serves.";
      };
      exported = mkOption {
        type = types.unspecified;
        internal = true;
        readOnly = true;
        description = "This host as the rest of the fleet sees it (read by lib.mkFleet).";
      };
    };
  };
}
