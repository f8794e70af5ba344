# Option declarations: the agent service, and what this host receives of the fleet
# (fort.cluster.fleet, fort.cluster.facts). The fleet's own declarations (hosts,
# principals, inventory, interfaces): options-cluster.nix. What this host needs and
# serves: options-host.nix.
{
  config,
  lib,
  pkgs,
  ...
}:
let
  inherit (lib) mkOption mkEnableOption types;
  settingsFormat = pkgs.formats.toml { };

  # services.fort-agent.settings.access.<built-in>: principals allowed it.
  accessList =
    what:
    mkOption {
      type = types.listOf types.str;
      default = [ ];
      example = [ "ops" ];
      description = "Principals (names in `fort.cluster.principals`) allowed ${what}. Hosts never are.";
    };

  # fort.cluster.fleet: lib.nix's fleetIndex over every host's `fort.host.exported`, as
  # lib.mkFleet passes it in. Built once for the fleet and read as it is: its entries
  # are fort's own exports of typed options, so checking their types again on every
  # host (the fleet's every entry, once per host) would only cost the square of the
  # fleet. Internal: set by mkFleet (or a NixOS test through lib's projection).
  fleetIndex = lib.mkOptionType {
    name = "fortFleetIndex";
    description = "fort fleet index (lib.mkFleet's projection of every host)";
    # Its own keys, without forcing a host: a stray value fails here, not deep in a host.
    check = v: builtins.isAttrs v && v ? exports && v ? entry && v ? callers;
    merge = lib.mergeOneOption;
  };
in
{
  imports = [ ./options-cluster.nix ];

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
      description = ''
        Address and port the agent listens on (`HOST:PORT`). `settings.listen`, if set,
        wins, and `openFirewall` opens its port.
      '';
    };

    openFirewall = mkOption {
      type = types.bool;
      default = false;
      description = ''
        Open the port the agent listens on (`settings.listen`, which defaults to
        `listen`) in the firewall. Every request is signed; the port is safe to expose
        to the fleet.
      '';
    };

    plaintext = mkOption {
      type = types.bool;
      default = false;
      description = ''
        Accept `http://` addresses in `fort.cluster.hosts` (no TLS between agents). Only
        for an overlay network that already encrypts, such as WireGuard; requests stay
        signed either way. The agent warns at start when this is on.
      '';
    };

    handlerEnvironment = mkOption {
      type = types.attrsOf types.str;
      default = { };
      example = {
        FORT_EXAMPLE_STATE = "/var/lib/fort-examples";
      };
      description = "Environment variables every handler gets (`handler_environment` in agent.toml).";
    };

    hostKeyFile = mkOption {
      # A string, never a path literal: `./key` would name the build machine's file, and
      # anything turned into a store path is world readable. types.externalPath (nixpkgs
      # 25.05 and later) refuses both; the fallback does the same for an older lib.
      type =
        if types ? externalPath then
          types.externalPath
        else
          types.addCheck types.str (
            x: lib.hasPrefix "/" x && !lib.hasPrefix "${builtins.storeDir}/" x
          )
          // {
            description = "absolute path not in the Nix store";
          };
      default = "/etc/ssh/ssh_host_ed25519_key";
      description = ''
        ed25519 private key this host signs with and whose public half is its TLS
        identity (it goes in `fort.cluster.hosts.<name>.publicKeys`). A string naming a
        file on the host, outside the Nix store (world readable); a path literal is
        refused, since Nix would copy it there. systemd passes it to the agent with
        `LoadCredential=`; set this rather than `settings.host_key`.
      '';
    };

    user = mkOption {
      type = types.str;
      default = "root";
      description = ''
        User the agent and therefore every handler runs as. Handlers usually write other
        services' secrets or restart units, hence root. Set to `"fort"` (created by the
        module) when all handlers only talk to APIs or write paths that user may write.
        Another user restarts and reloads units through systemd's D-Bus API, which asks
        polkit: the module then enables polkit (`security.polkit.enable`) and adds a rule
        (`security.polkit.extraConfig`) that lets this user restart exactly the units of
        the needs' `restartUnits` and `credentialFor` and reload exactly those of their
        `reloadUnits`; any other unit or verb is refused to it.
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
      description = "Packages on the PATH of handlers (systemd's `systemctl` is always there, for restarting units).";
    };

    stateEncryption = {
      enable = mkOption {
        type = types.bool;
        default = false;
        description = ''
          Seal the state that holds secrets (the SSH CA key, the ACME account key,
          postgres passwords, OIDC registration tokens) with a state key, so that a copy of
          `/var/lib/fort` (a backup, a snapshot) gives none of them away. The key is a
          systemd encrypted credential (`credentialFile`), made on first start with
          `systemd-creds encrypt` and given to the agent with `LoadCredentialEncrypted=`;
          when it cannot be decrypted the agent does not start (never a fallback to
          plaintext). What this protects and what not: docs/at-rest.md.
        '';
      };
      credentialFile = mkOption {
        type = types.addCheck types.str (
          x: lib.hasPrefix "/" x && !lib.hasPrefix "${builtins.storeDir}/" x
        ) // {
          description = "absolute path not in the Nix store";
        };
        default = "/var/lib/fort-credentials/state-key.cred";
        description = ''
          The encrypted credential holding the state key (`systemd-creds encrypt
          --name=state-key`). Made by `fort-state-key.service` when missing; outside
          `/var/lib/fort`, so that a copy of the state directory alone never carries it.
          Losing it loses the sealed state: the provider then issues again.
        '';
      };
      withKey = mkOption {
        type = types.enum [
          "auto"
          "host"
          "tpm2"
          "host+tpm2"
        ];
        default = "auto";
        description = ''
          What the credential is encrypted with when it is made (`systemd-creds encrypt
          --with-key=`): `auto` is the host's credential secret and the TPM2 when the
          machine has one, else the host's secret alone. With the host's secret alone, a
          copy of the whole of `/var/lib` opens it; with a TPM2 only this machine can.
        '';
      };
    };

    credentialEncryption.withKey = mkOption {
      type = types.enum [
        "auto"
        "host"
        "tpm2"
        "host+tpm2"
      ];
      default = "auto";
      description = ''
        What the files delivered with `encrypt = true` are encrypted with
        (`systemd-creds encrypt --with-key=`, written into needs.json as the file's
        `encrypt`): `auto` is the host's credential secret and the TPM2 when the machine
        has one, else the host's secret alone. With the host's secret alone, a copy of
        the whole of `/var/lib` opens them; with a TPM2 only this machine can. `tpm2` and
        `host+tpm2` make a delivery fail (with the reason) on a machine without a TPM2.
      '';
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
      description = "Writable for handlers under `strictSandbox` (`ReadWritePaths=`: a path that starts with `-` may be missing at start).";
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
        description = "Address of the metrics endpoint (not opened in the firewall); must not share the agent's port.";
      };
    };

    audit = {
      enable = mkOption {
        type = types.bool;
        default = true;
        description = ''
          Keep the signed audit trail in `/var/lib/fort/audit`: what this host accepted,
          issued, refused, released and collected, what it applied, and every operator
          call, as hash-chained JSON lines whose checkpoints the host key signs
          (`ssh-keygen -Y verify`, namespace `fort-audit`; docs/protocol.md §12).
          `fort-agent audit show` and `fort-agent audit verify` read it. Sizes and the
          checkpoint interval are `settings.audit.*`.
        '';
      };
      journal = mkOption {
        type = types.bool;
        default = false;
        description = ''
          Also send each record to the journal (one line of JSON, target `fort_audit`),
          from where journald's forwarding or a syslog daemon can ship it to a remote
          log host, out of reach of this host's root.
        '';
      };
      syslog = mkOption {
        type = types.nullOr (
          types.addCheck (types.strMatching "(udp|tcp)://[^/]+:[1-9][0-9]{0,4}") (
            s: lib.toInt (lib.last (lib.splitString ":" s)) <= 65535
          )
          // {
            description = "udp://HOST:PORT or tcp://HOST:PORT, the port 1 to 65535";
          }
        );
        default = null;
        example = "tcp://logs.example.org:601";
        description = ''
          Also send each record to this syslog server, `udp://HOST:PORT` or
          `tcp://HOST:PORT` (RFC 5424, facility authpriv, program `fort-agent`, message
          id `audit`, the record's JSON line as the message), out of reach of this host's
          root. A copy: the trail's files stay the record, and a server that cannot be
          reached costs only the copy (logged, and counted when it answers again). For
          TLS to the log host, use `journal` and a forwarder that speaks it.
        '';
      };
      refuseWhenUnwritable = mkOption {
        type = types.bool;
        default = false;
        description = ''
          While the audit trail cannot be written (disk full, directory gone), issue
          nothing: requests are answered 503 with Retry-After and handler runs wait.
          Off: the host keeps issuing and logs that the trail is not written.
        '';
      };
    };

    settings = mkOption {
      type = types.submodule {
        freeformType = settingsFormat.type;
        # Typed, so that they are documented here and checked against the principals.
        options.access = {
          journal = accessList "`journal`: a unit's journal (`fort journal HOST UNIT`)";
          systemd = accessList "`systemd`: a unit's status, restart, start and stop (`fort call HOST systemd`)";
          trigger = accessList (
            "`trigger`: run one of this host's capabilities for every entry or one, with or "
            + "without cached responses (`fort trigger HOST CAP --entry KEY --force`), and `resend`: "
            + "have this host send one need's request again now (`fort resend HOST NEED`); and to see this "
            + "host's provider entries in `fort status HOST`"
          );
          audit = accessList (
            "`audit`: this host's audit trail, read from where their copy ends (`fort audit pull HOST --out DIR`); "
            + "written to agent.toml only when set"
          );
        };
      };
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

  options.fort.cluster = {
    fleet = mkOption {
      type = types.nullOr fleetIndex;
      default = null;
      internal = true;
      description = ''
        What every host in the fleet exports (`fort.host.exported`: its needs and
        capabilities), indexed once for the fleet. Set by `lib.mkFleet`; the source of
        `callers`, of the check that each need is served, and of the interfaces requests
        are checked against. `null`: this host is evaluated alone.
      '';
    };
    facts = mkOption {
      type = types.raw;
      internal = true;
      readOnly = true;
      description = ''
        What fort derives from fort.cluster's hosts, principals and instances (lib.nix
        clusterFacts: hosts.json, the problems found in them, the inventory's needs and
        callers): the fleet's own, computed once by lib.mkFleet from its `cluster`
        modules, when this host adds nothing to them; else this host's own.
      '';
    };
  };
}
