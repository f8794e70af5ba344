# Option declarations of the fleet: hosts, principals, the inventory and interfaces
# (fort.cluster). Every host imports them (options.nix), and lib.mkFleet evaluates them
# once more on their own, without any host, for its `cluster` modules: so this file
# needs nothing but `lib`.
{ lib, ... }:
let
  inherit (lib) mkOption types literalExpression;

  jsonObject = types.attrsOf types.anything;

  clusterHost = types.submodule {
    options = {
      address = mkOption {
        type = types.str;
        example = "https://10.0.0.5:7770";
        description = ''
          Where the other agents reach this host's agent: `https://HOST:PORT` (TLS 1.3,
          pinned to the host's key in `publicKeys`). `http://HOST:PORT` only when every
          host sets `services.fort-agent.plaintext`.
        '';
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

in
{
  options.fort.cluster = {
    hosts = mkOption {
      type = types.attrsOf clusterHost;
      default = { };
      description = "Every agent in the fleet. Declare it once: in lib.mkFleet's `cluster`, or in a module every host imports.";
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
    interfaces = mkOption {
      type = types.attrsOf types.deferredModule;
      default = { };
      example = literalExpression "{ oidc = ./interfaces/oidc.nix; }";
      description = ''
        Request interfaces by capability name, declared once for the fleet (lib.mkFleet's
        `interfaces` sets this on every host). A provider's
        `fort.host.capabilities.<name>.interface` defaults to the entry here, and
        `lib.renderInterfaces` renders the same set as Markdown without any host.
      '';
    };
  };
}
