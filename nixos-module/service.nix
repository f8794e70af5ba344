# What an enabled agent puts on the host: /etc/fort/{hosts,needs,capabilities}.json and
# agent.toml (validated by `fort-agent check` at build time), fort-agent.service, the
# trigger oneshots, the dry-activate plan, the firewall port, and the optional
# unprivileged user.
{
  config,
  lib,
  pkgs,
  ...
}:
let
  cfg = config.services.fort-agent;
  cluster = config.fort.cluster;
  inherit (config.fort.host) needs capabilities;
  fortLib = import ./lib.nix { inherit lib; };
  settingsFormat = pkgs.formats.toml { };

  etcDir = "/etc/fort";
  configPath = "${etcDir}/agent.toml";
  inherit (fortLib) credentialKeyPath stateKeyPath;

  callers = fortLib.callersOf {
    self = cfg.hostName;
    inherit (cluster) fleet;
    inherit (cluster.facts) inventory;
    inherit needs;
  };

  # The request as shipped: the provider's interface defaults filled in (the
  # assertions have checked it against the same interface).
  interfaceOf = fortLib.providerInterface {
    self = cfg.hostName;
    inherit (cluster) fleet interfaces;
    inherit capabilities;
  };
  requestOf =
    n:
    let
      iface = interfaceOf n;
    in
    if iface == null then
      n.request
    else
      fortLib.interface.fillDefaults (fortLib.interface.optionsOf iface) n.request;

  # The exact bytes installed, so that manifestSha256 is the hash the agent computes
  # over the files it loads (docs/protocol.md §11.7).
  needsJson = fortLib.needsJson {
    inherit needs requestOf;
    credentialKey = cfg.credentialEncryption.withKey;
  };
  capabilitiesJson = fortLib.capabilitiesJson { inherit capabilities callers; };
  # The same bytes on every host: derived once for the fleet under lib.mkFleet's `cluster`.
  inherit (cluster.facts) hostsText;
  # Files rendered from templates (§11.14), beside the needs; left out when there are
  # none, so needs.json is byte for byte what it was for such hosts.
  templatesJson = lib.mapAttrs (
    _: t:
    {
      inherit (t)
        template
        needs
        path
        owner
        group
        mode
        ;
      restart_units = t.restartUnits;
      reload_units = t.reloadUnits;
    }
    // lib.optionalAttrs (t.credentialFor != [ ]) { credential_for = t.credentialFor; }
    // lib.optionalAttrs t.encrypt { encrypt = cfg.credentialEncryption.withKey; }
  ) config.fort.host.templates;
  needsText = builtins.toJSON (
    needsJson // lib.optionalAttrs (templatesJson != { }) { "$templates" = templatesJson; }
  );
  unitGrants = fortLib.unitGrants (
    needsJson
    // lib.mapAttrs (_: t: {
      inherit (t) restart_units reload_units;
      files = [ { credential_for = t.credential_for or [ ]; } ];
    }) templatesJson
  );
  capabilitiesText = builtins.toJSON capabilitiesJson;
  hostsFile = pkgs.writeText "fort-hosts.json" hostsText;
  needsFile = pkgs.writeText "fort-needs.json" needsText;
  capabilitiesFile = pkgs.writeText "fort-capabilities.json" capabilitiesText;

  # The installed config names /etc/fort/*.json, so a switch that changes only those
  # files is a SIGHUP (reloadTriggers), not a restart.
  # Only what differs from the agent's defaults, so that agent.toml stays as it was on
  # hosts that leave the trail as it comes.
  auditSettings =
    lib.optionalAttrs (!cfg.audit.enable) { enable = false; }
    // lib.optionalAttrs cfg.audit.journal { journal = true; }
    // lib.optionalAttrs (cfg.audit.syslog != null) { inherit (cfg.audit) syslog; }
    // lib.optionalAttrs cfg.audit.refuseWhenUnwritable { required = true; };

  # `[access] audit` only when it grants someone: agent.toml stays as it was on hosts
  # that do not, and releases before the `audit` built-in refuse the key.
  settings = cfg.settings // {
    access = lib.filterAttrs (name: who: name != "audit" || who != [ ]) (cfg.settings.access or { });
  };
  configFile = settingsFormat.generate "fort-agent.toml" settings;
  # The same config naming the store copies, which exist inside the build sandbox.
  checkConfigFile = settingsFormat.generate "fort-agent-check.toml" (
    settings
    // {
      hosts = "${hostsFile}";
      needs = "${needsFile}";
      capabilities = "${capabilitiesFile}";
    }
  );
  # The check runs every handler path it is given through stat: store paths are in the
  # sandbox (the JSON files reference them), a path elsewhere (a string such as
  # "/usr/local/bin/x") is not, so then handlers are left to the agent.
  handlerPaths = lib.filter (p: p != null) (
    lib.concatMap (n: [
      n.handler
      n.check
    ]) (lib.attrValues needsJson)
    ++ map (c: c.handler) (lib.attrValues capabilitiesJson)
  );
  handlersInStore = lib.all (lib.hasPrefix "${builtins.storeDir}/") handlerPaths;
  # The file installed as agent.toml only builds when the check passes. --skip-key: the
  # host key is a runtime secret and is not in the sandbox.
  checkedConfigFile =
    if cfg.checkConfig then
      pkgs.runCommand "fort-agent-checked.toml"
        {
          nativeBuildInputs = [ cfg.package ];
          config = configFile;
          checkConfig = checkConfigFile;
          preferLocalBuild = true;
        }
        ''
          fort-agent check --config "$checkConfig" --skip-key${lib.optionalString (!handlersInStore) " --skip-handlers"}
          cp "$config" "$out"
        ''
    else
      configFile;

  triggered = lib.filterAttrs (_: c: c.triggers.systemd != [ ]) capabilities;
  unitBase = unit: lib.removeSuffix ".service" unit;

  # The port actually listened on: settings.listen wins over listen.
  listening = fortLib.parseListen cfg.settings.listen;

  # `nixos-rebuild dry-activate`: what loading the new generation's files would change
  # in the running agent (it asks the agent over its admin socket; nothing changes).
  # Store paths, not /etc/fort: during dry-activate /etc still holds the running
  # generation. Never fails activation.
  planScript = ''
    if [ "''${NIXOS_ACTION-}" = dry-activate ]; then
      fortPlan() {
        if ! ${config.systemd.package}/bin/systemctl is-active --quiet fort-agent.service; then
          echo "fort: the agent is not running; no plan to show"
          return 0
        fi
        echo "fort: what loading the new configuration would change:"
        ${cfg.package}/bin/fort-agent plan --config ${configPath} \
          --new-config ${checkedConfigFile} \
          --hosts ${hostsFile} \
          --needs ${needsFile} \
          --capabilities ${capabilitiesFile} ||
          echo "fort: fort-agent plan failed (exit $?); dry-activate goes on"
      }
      fortPlan || true
    fi
  '';
in
{
  config = lib.mkIf cfg.enable (
    lib.mkMerge [
      {
        # Each key a default of its own: settings.audit.max_files set by hand keeps them.
        services.fort-agent.settings.audit = lib.mkIf (auditSettings != { }) (
          lib.mapAttrs (_: lib.mkDefault) auditSettings
        );
      }
      {
        services.fort-agent.settings = lib.mapAttrs (_: lib.mkDefault) (
          {
            host = cfg.hostName;
            inherit (cfg) listen;
            host_key = credentialKeyPath;
            hosts = "${etcDir}/hosts.json";
            needs = "${etcDir}/needs.json";
            capabilities = "${etcDir}/capabilities.json";
            state_dir = "/var/lib/fort";
            admin_socket = "/run/fort/agent.sock";
          }
          // lib.optionalAttrs cfg.metrics.enable { metrics_listen = cfg.metrics.listen; }
          # Only when on, so that a host without them ships the agent's defaults.
          // lib.optionalAttrs cfg.plaintext { plaintext = true; }
          // lib.optionalAttrs cfg.stateEncryption.enable { state_key_file = stateKeyPath; }
          // lib.optionalAttrs (cfg.handlerEnvironment != { }) {
            handler_environment = cfg.handlerEnvironment;
          }
        );

        fort.host.manifestSha256 = fortLib.manifestSha256 { inherit hostsText needsText capabilitiesText; };
        fort.host.files = {
          hosts = hostsFile;
          needs = needsFile;
          capabilities = capabilitiesFile;
          checkConfig = checkConfigFile;
          skipHandlers = !handlersInStore;
        };

        environment.etc = {
          "fort/hosts.json".source = hostsFile;
          "fort/needs.json".source = needsFile;
          "fort/capabilities.json".source = capabilitiesFile;
          "fort/agent.toml".source = checkedConfigFile;
        };

        # `fort` for operators, `fort-agent trigger` for scripts.
        environment.systemPackages = [ cfg.package ];

        # The effective port (settings.listen may override listen); an address without
        # a port is an assertion, not a firewall rule.
        networking.firewall.allowedTCPPorts = lib.mkIf (cfg.openFirewall && listening != null) [
          listening.port
        ];

        system.activationScripts.fort-plan = {
          supportsDryActivation = true;
          text = planScript;
        };

        systemd.services.fort-agent = {
          description = "fort agent";
          wantedBy = [ "multi-user.target" ];
          wants = [ "network-online.target" ];
          # The default key is the SSH host key, created on first boot by sshd's units.
          after = [
            "network-online.target"
            "sshd-keygen.service"
            "sshd.service"
          ];
          # ExecStart names the package, so a new binary restarts the agent; so does a
          # new agent.toml. New JSON files only reload it: SIGHUP re-reads them, and new
          # needs are asked for at once.
          restartTriggers = [
            cfg.package
            checkedConfigFile
          ];
          reloadTriggers = [
            hostsFile
            needsFile
            capabilitiesFile
          ];
          # systemctl, for the restart_units and reload_units of delivered files.
          path = cfg.path ++ [ config.systemd.package ];

          serviceConfig = {
            Type = "notify";
            NotifyAccess = "main";
            ExecStart = "${cfg.package}/bin/fort-agent serve --config ${configPath}";
            ExecReload = "${pkgs.coreutils}/bin/kill -HUP $MAINPID";
            Restart = "on-failure";
            RestartSec = "5s";

            User = cfg.user;
            Group = cfg.group;
            LoadCredential = [ "host-key:${toString cfg.hostKeyFile}" ];
            StateDirectory = "fort";
            StateDirectoryMode = "0700";
            # /run/fort holds the admin socket (protected by its own mode) and, under
            # needs/, the delivered files other services read: it must be traversable
            # by their users (0755), and it must outlive an agent restart, or every
            # restart would delete credentials that services are using.
            RuntimeDirectory = "fort";
            RuntimeDirectoryMode = "0755";
            RuntimeDirectoryPreserve = "yes";
            UMask = "0077";
            # One descriptor per connection (pooled to every peer, and accepted) and
            # three pipes per running handler; the default soft limit of 1024 is
            # reached by a provider under a burst.
            LimitNOFILE = 65536;

            # Hardening, always on. Handlers run inside this unit as `user`, usually root,
            # and legitimately write other services' files and restart units over D-Bus;
            # nothing below takes that away. What it takes: kernel tunables, modules, logs
            # and clock, cgroup writes, setuid escalation, exotic sockets and personalities.
            NoNewPrivileges = true;
            PrivateTmp = true;
            ProtectKernelTunables = true;
            ProtectKernelModules = true;
            ProtectKernelLogs = true;
            ProtectControlGroups = true;
            ProtectClock = true;
            ProtectHostname = true;
            LockPersonality = true;
            RestrictRealtime = true;
            RestrictSUIDSGID = true;
            SystemCallArchitectures = "native";
            RestrictAddressFamilies = [
              "AF_UNIX"
              "AF_INET"
              "AF_INET6"
              "AF_NETLINK"
            ];
          }
          // lib.optionalAttrs cfg.stateEncryption.enable {
            # The state key, decrypted by systemd into the unit's private credentials
            # directory only; a credential that cannot be decrypted fails the start.
            LoadCredentialEncrypted = [ "state-key:${cfg.stateEncryption.credentialFile}" ];
          }
          // lib.optionalAttrs cfg.strictSandbox {
            # Hardening that breaks handlers acting on the rest of the system; opt-in
            # (services.fort-agent.strictSandbox). The state and runtime directories stay
            # writable; anything else a handler writes goes in readWritePaths.
            ProtectSystem = "strict";
            ReadWritePaths = cfg.readWritePaths;
            ProtectHome = true;
            PrivateDevices = true;
            ProtectProc = "invisible";
            RestrictNamespaces = true;
            MemoryDenyWriteExecute = true;
            SystemCallFilter = [ "@system-service" ];
            SystemCallErrorNumber = "EPERM";
            # Enough for a root handler to place a file owned by another service in
            # readWritePaths; nothing else. An unprivileged `user` has none anyway.
            CapabilityBoundingSet = [
              "CAP_CHOWN"
              "CAP_DAC_OVERRIDE"
              "CAP_FOWNER"
            ];
          };
        };
      }

      (lib.mkIf cfg.stateEncryption.enable {
        # The state key is made once, before the agent's first start with it: 32 random
        # bytes straight into `systemd-creds encrypt`, never on disk in plaintext. An
        # existing credential is never replaced (the sealed state needs it).
        # Wants=, not Requires=: should making it fail, the agent's own start still fails
        # (LoadCredentialEncrypted= of a missing file), with systemd saying which.
        systemd.services.fort-agent = {
          wants = [ "fort-state-key.service" ];
          after = [ "fort-state-key.service" ];
        };
        systemd.services.fort-state-key = {
          description = "fort agent state key";
          unitConfig.ConditionPathExists = "!${cfg.stateEncryption.credentialFile}";
          serviceConfig = {
            Type = "oneshot";
            UMask = "0077";
          };
          path = [
            config.systemd.package
            pkgs.coreutils
          ];
          script = ''
            cred=${lib.escapeShellArg cfg.stateEncryption.credentialFile}
            mkdir -p -m 0700 "$(dirname "$cred")"
            head -c 32 /dev/urandom |
              systemd-creds encrypt --name=state-key --with-key=${cfg.stateEncryption.withKey} - "$cred.new"
            mv "$cred.new" "$cred"
          '';
        };
      })

      {
        # triggers.systemd: one oneshot per capability, started by OnSuccess= of every
        # unit that capability watches. Ordered after the agent so a trigger at boot
        # waits for it; not Wants= it, so a stopped agent stays stopped (the trigger then
        # fails, and triggers.initialize covers the next start).
        systemd.services = lib.mkMerge (
          lib.mapAttrsToList (
            name: cap:
            {
              "fort-trigger-${name}" = {
                description = "Run fort capability ${name} after ${lib.concatStringsSep ", " cap.triggers.systemd}";
                after = [ "fort-agent.service" ];
                serviceConfig = {
                  Type = "oneshot";
                  ExecStart = "${cfg.package}/bin/fort-agent trigger ${name} --reason systemd --config ${configPath}";
                };
              };
            }
            // lib.genAttrs (map unitBase cap.triggers.systemd) (_: {
              onSuccess = [ "fort-trigger-${name}.service" ];
            })
          ) triggered
        );
      }

      # An agent that is not root restarts and reloads units through systemd's D-Bus
      # API, which asks polkit: granted exactly the units and verbs its needs name.
      (lib.mkIf (cfg.user != "root" && (unitGrants.restart != [ ] || unitGrants.reload != [ ])) {
        security.polkit.enable = true;
        security.polkit.extraConfig = fortLib.polkitUnitRule {
          inherit (cfg) user;
          grants = unitGrants;
        };
      })

      (lib.mkIf (cfg.user == "fort") {
        users.users.fort = {
          isSystemUser = true;
          inherit (cfg) group;
          description = "fort agent";
        };
      })
      (lib.mkIf (cfg.group == "fort") { users.groups.fort = { }; })
    ]
  );
}
