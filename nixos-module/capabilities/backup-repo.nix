# Borg backups between hosts (`fort-handler backup-repo`, docs/handlers.md "backup-repo").
#   Provider: fort.host.capabilities.<name>.backupRepo = { host = "vault.example.org"; };
#   — a borg repository per entry, reached through this host's sshd with a key the
#   consumer made, restricted to `borg serve` on that repository alone.
#   Consumer: fort.host.backups.<name> = { from = "vault"; paths = [ "/home" ]; };
#   — the need, the key (made here, never sent), the server's host key, a passphrase
#   made and kept here, and `services.borgbackup.jobs.<name>` wired to all of them.
{
  config,
  lib,
  pkgs,
  ...
}:
let
  inherit (lib)
    literalExpression
    mapAttrsToList
    mkDefault
    mkIf
    mkOption
    types
    ;
  agent = config.services.fort-agent;
  fortLib = import ../lib.nix { inherit lib; };
  size = types.strMatching "[0-9]{1,20}((\\.[0-9]{1,3})?[KMGTP])?";

  provider = import ./provider.nix (
    { shapes, ... }:
    {
      option = "backupRepo";
      handler = "backup-repo";
      description = ''
        Serve this capability with `fort-handler backup-repo`: a borg repository per
        entry under `repositoriesDir`, reached through this host's sshd as `user` with
        the key the consumer's agent made, restricted to `borg serve` on that
        repository alone (append-only unless `fullAccess` grants more, under its
        quota), delivered as `{repo, known_hosts, public_key, …}`. A release takes the
        key away at once and keeps the data for `retention`.
      '';
      example = ''{ host = "vault.example.org"; quota = "200G"; }'';
      settings = name: {
        host = mkOption {
          type = types.strMatching "[A-Za-z0-9.:-]+";
          example = "vault.example.org";
          description = "The name or address consumers reach this host's sshd at, as every repository URL and known_hosts line names it.";
        };
        port = mkOption {
          type = types.port;
          default = 22;
          description = "sshd's port.";
        };
        user = mkOption {
          type = types.strMatching "[a-z_][a-z0-9_-]{0,31}";
          default = "borg";
          description = ''
            The account consumers log in as, which runs `borg serve` and owns the
            repositories. Its keys are the handler's alone: sshd reads them from
            `authorizedKeysDir` for this account only.
          '';
        };
        createUser = mkOption {
          type = types.bool;
          default = true;
          description = "Declare `user` (a system user with a shell, for the forced command) and its group.";
        };
        repositoriesDir = mkOption {
          type = types.strMatching "/[A-Za-z0-9._+/-]*";
          default = "/var/lib/fort-backup/${name}";
          defaultText = literalExpression ''"/var/lib/fort-backup/<name>"'';
          description = "Where repositories are made, one per entry at `<dir>/<host>/<need id>`.";
        };
        authorizedKeysDir = mkOption {
          type = types.strMatching "/[A-Za-z0-9._+/-]*";
          default = "/etc/ssh/fort-authorized-keys/${name}";
          defaultText = literalExpression ''"/etc/ssh/fort-authorized-keys/<name>"'';
          description = ''
            The directory of the `authorized_keys` file the handler writes, whole
            (`<dir>/<user>`); sshd reads `<dir>/%u` besides the usual files, so the
            keys reach `user` and no other account.
          '';
        };
        hostKeyFiles = mkOption {
          type = types.nonEmptyListOf types.str;
          default = [ "/etc/ssh/ssh_host_ed25519_key.pub" ];
          description = "This sshd's public host keys, for the consumers' known_hosts.";
        };
        quota = mkOption {
          type = size;
          default = "100G";
          description = "A repository's storage quota when its request names none (borg's sizes, powers of 1000; at least 10M).";
        };
        maxQuota = mkOption {
          type = types.nullOr size;
          default = null;
          description = "The largest quota a request may ask for one repository. `null`: `quota`.";
        };
        quotaPerCaller = mkOption {
          type = types.nullOr size;
          default = null;
          description = ''
            The quotas of one host's repositories together, its released ones still
            kept included (their data is on this disk); past it a new repository is
            refused. `null`: ten times `quota`.
          '';
        };
        fullAccess = shapes.allow {
          example = ''{ ops = [ "{origin}" ]; }'';
          description = ''
            Need ids whose repositories a host may have with full access (`appendOnly =
            false`: prune, delete, compact), per host or principal and `"*"`;
            `{origin}` is the caller's name. Every other repository is append-only:
            what its key deletes or prunes can be rolled back here.
          '';
        };
        retention = mkOption {
          type = fortLib.durationType;
          default = "30d";
          description = ''
            How long a released repository's data is kept (no key reaches it) before it
            is removed; asked for again within it, the host gets it back. Backups must
            outlive their client's declaration: make it longer than a host may be gone.
          '';
        };
        keyLifetime = mkOption {
          type = fortLib.durationType;
          default = "90d";
          description = "How long a key is authorized before its consumer is asked to rotate it (`expires_at`); it keeps working until replaced.";
        };
        configureSshd = mkOption {
          type = types.bool;
          default = true;
          description = "Add `<authorizedKeysDir>/%u` to `services.openssh.authorizedKeysFiles`.";
        };
      };
      stateFile = {
        description = "The handler's record of the repositories it made, their keys, and since when released ones are kept (mode 0600).";
        shared = ", and each would take the other's keys away";
      };
      configFile = _: s: {
        state_file = s.stateFile;
        repositories_dir = s.repositoriesDir;
        authorized_keys_file = "${s.authorizedKeysDir}/${s.user}";
        inherit (s) user host port quota;
        host_key_files = s.hostKeyFiles;
        borg = "${pkgs.borgbackup}/bin/borg";
        full_access = s.fullAccess;
        retention = "${toString (fortLib.durationSeconds s.retention)}s";
        key_lifetime = "${toString (fortLib.durationSeconds s.keyLifetime)}s";
      }
      // lib.optionalAttrs (s.maxQuota != null) { max_quota = s.maxQuota; }
      // lib.optionalAttrs (s.quotaPerCaller != null) { quota_per_caller = s.quotaPerCaller; };
      answers = [
        "repo"
        "path"
        "known_hosts"
        "public_key"
        "append_only"
        "quota"
        "retention_seconds"
        "expires_at"
      ];
      policy = _: s: {
        inherit (s) fullAccess;
        # What consumers' borg jobs connect to: `<repositories>/<host>/<need id>`.
        repositories = "ssh://${s.user}@${if lib.hasInfix ":" s.host then "[${s.host}]" else s.host}:${toString s.port}${s.repositoriesDir}";
        # As `fort-handler backup-repo --failover` says.
        failover = {
          kind = "one-provider";
          why = "a backup's archives are in the repository it wrote them to: a standby holds none of them; a second backup host is a second need, not a standby";
        };
      };
      defaults = _: s: {
        interface = ../interfaces/backup-repo.nix;
        description = "borg repositories on ${s.host}";
      };
      async = "repositories are entries the handler reconciles, and released ones it removes after the retention";
      paths = [
        "repositoriesDir"
        "authorizedKeysDir"
      ];
      patterns = [ "fullAccess" ];
      assertions =
        { at, settings, ... }:
        [
          {
            assertion = agent.user == "root";
            message = "${at}: the agent gives repositories to ${settings.user} and writes sshd's keys in ${settings.authorizedKeysDir}, so it must run as root (services.fort-agent.user is ${agent.user}).";
          }
          {
            assertion = builtins.all (lib.hasPrefix "/") settings.hostKeyFiles;
            message = "${at}.hostKeyFiles: absolute paths of public host keys.";
          }
        ];
      extraConfig =
        served:
        let
          all = mapAttrsToList (_: c: c.backupRepo) served;
          dirs = map (s: s.authorizedKeysDir) all ++ map (s: s.repositoriesDir) all;
        in
        mkIf (served != { }) {
          services.fort-agent.readWritePaths = dirs;
          systemd.tmpfiles.rules = lib.concatMap (s: [
            "d ${s.repositoriesDir} 0750 ${s.user} ${s.user} -"
            "d ${s.authorizedKeysDir} 0755 root root -"
          ]) all;
          services.openssh.authorizedKeysFiles = map (s: "${s.authorizedKeysDir}/%u") (
            lib.filter (s: s.configureSshd) all
          );
          users.users = lib.listToAttrs (
            map (s: {
              name = s.user;
              value = {
                isSystemUser = true;
                group = s.user;
                home = s.repositoriesDir;
                useDefaultShell = true;
              };
            }) (lib.filter (s: s.createUser) all)
          );
          users.groups = lib.listToAttrs (
            map (s: {
              name = s.user;
              value = { };
            }) (lib.filter (s: s.createUser) all)
          );
          assertions = [
            {
              assertion = lib.length dirs == lib.length (lib.unique dirs);
              message = "fort.host.capabilities.<name>.backupRepo: two capabilities share a repositoriesDir or an authorizedKeysDir; give each its own.";
            }
          ];
        };
    }
  );

  backups = config.fort.host.backups;
  self = agent.hostName;
  policyOf = fortLib.providerPolicy {
    inherit self;
    inherit (config.fort.host) capabilities;
    fleet = config.fort.cluster.fleet;
  };

  backup = types.submodule (
    { name, ... }:
    {
      options = {
        from = mkOption {
          type = types.str;
          example = "vault";
          description = ''
            The host whose `backup-repo` capability keeps the repository. One host: a
            second backup host is a second backup of its own (its own repository), not
            a standby.
          '';
        };
        capability = mkOption {
          type = types.str;
          default = "backup-repo";
          description = "The capability's name at the provider (the need's type).";
        };
        paths = mkOption {
          type = types.nonEmptyListOf types.str;
          example = [
            "/home"
            "/var/lib"
          ];
          description = "What is backed up.";
        };
        exclude = mkOption {
          type = types.listOf types.str;
          default = [ ];
          example = [ "/home/*/.cache" ];
          description = "Patterns left out (`borg help patterns`).";
        };
        startAt = mkOption {
          type = types.either types.str (types.listOf types.str);
          default = "daily";
          description = "When the backup runs (systemd calendar events).";
        };
        appendOnly = mkOption {
          type = types.bool;
          default = true;
          description = ''
            Ask for an append-only repository: this host can add archives, and what it
            deletes can be rolled back on the server. `false` only where the provider
            grants full access (`backupRepo.fullAccess`), and needed for `prune`.
          '';
        };
        quota = mkOption {
          type = types.nullOr size;
          default = null;
          example = "50G";
          description = "The repository's quota. `null`: the provider's.";
        };
        encryption = mkOption {
          type = types.enum [
            "repokey-blake2"
            "repokey"
            "keyfile-blake2"
            "keyfile"
          ];
          default = "repokey-blake2";
          description = "How `borg init` encrypts the repository, with the passphrase made on this host.";
        };
        compression = mkOption {
          type = types.str;
          default = "auto,zstd";
          description = "borg's compression.";
        };
        prune = mkOption {
          type = types.attrsOf (types.either types.int types.str);
          default = { };
          example = {
            daily = 7;
            weekly = 4;
          };
          description = "`borg prune --keep-<k> <v>` after each backup; needs `appendOnly = false`.";
        };
        directory = mkOption {
          type = types.str;
          default = "/var/lib/fort-backup-client/${name}";
          defaultText = literalExpression ''"/var/lib/fort-backup-client/<name>"'';
          description = ''
            Where the SSH key (`ssh_key`, made here, never sent), the server's
            `known_hosts`, the repository URL (`repo`) and the passphrase
            (`passphrase`, made here on the first run, never sent, never in the store)
            are kept. On disk: a lost passphrase is a lost backup; keep a copy
            somewhere else.
          '';
        };
        repo = mkOption {
          type = types.nullOr types.str;
          default = null;
          example = "ssh://borg@vault.example.org:22/var/lib/fort-backup/backup-repo/app/home";
          description = ''
            The repository's URL, for a provider whose configuration this host cannot
            read (no lib.mkFleet). `null`: from the provider's capability.
          '';
        };
        renewBefore = mkOption {
          type = fortLib.durationType;
          default = "14d";
          description = "Rotate the SSH key this long before the provider asks (its `keyLifetime`).";
        };
      };
    }
  );

  repoOf =
    name: b:
    if b.repo != null then
      b.repo
    else
      let
        policy = policyOf {
          inherit (b) from;
          type = b.capability;
        };
      in
      if policy != null && policy ? repositories then "${policy.repositories}/${self}/${name}" else null;
in
{
  imports = [ provider ];

  options.fort.host.backups = mkOption {
    type = types.attrsOf backup;
    default = { };
    example = literalExpression ''
      { home = { from = "vault"; paths = [ "/home" "/var/lib" ]; exclude = [ "/home/*/.cache" ]; }; }
    '';
    description = ''
      Borg backups to a `backup-repo` provider, one need each
      (`fort.host.needs.<capability>.<name>`): the SSH key is made on this host and only
      its public half is sent; the server's host key and the repository arrive with
      the answer; the repository's passphrase is made here on the first backup and
      never leaves; `services.borgbackup.jobs.<name>` runs them.
    '';
  };

  config = mkIf (backups != { }) {
    fort.host.needs = lib.mkMerge (
      mapAttrsToList (name: b: {
        ${b.capability}.${name} = {
          inherit (b) from renewBefore;
          request = {
            public_key = fortLib.key "ssh" "openssh";
            append_only = b.appendOnly;
          }
          // lib.optionalAttrs (b.quota != null) { inherit (b) quota; };
          keys.ssh = {
            type = "ed25519";
            format = "openssh";
            path = "${b.directory}/ssh_key";
            mode = "0400";
            certificate = "/public_key";
            authorized = true;
          };
          files = {
            known_hosts = {
              path = "${b.directory}/known_hosts";
              pointer = "/known_hosts";
              mode = "0644";
            };
            repo = {
              path = "${b.directory}/repo";
              pointer = "/repo";
              mode = "0644";
            };
          };
        };
      }) backups
    );

    services.borgbackup.jobs = lib.mapAttrs (name: b: {
      inherit (b) paths exclude startAt compression;
      repo = mkDefault (repoOf name b);
      doInit = true;
      encryption = {
        mode = b.encryption;
        passCommand = "${pkgs.coreutils}/bin/cat ${b.directory}/passphrase";
      };
      environment.BORG_RSH = "ssh -i ${b.directory}/ssh_key -o IdentitiesOnly=yes -o UserKnownHostsFile=${b.directory}/known_hosts -o StrictHostKeyChecking=yes -o BatchMode=yes";
      # The repository's passphrase, made here before the first `borg init` and kept
      # only here (never in a request, never in the store).
      preHook = ''
        if [ ! -s ${b.directory}/passphrase ]; then
          (umask 077 && ${pkgs.openssl}/bin/openssl rand -base64 32 > ${b.directory}/passphrase.new)
          mv ${b.directory}/passphrase.new ${b.directory}/passphrase
        fi
      '';
      readWritePaths = [ b.directory ];
      prune.keep = b.prune;
    }) backups;

    systemd.tmpfiles.rules = mapAttrsToList (_: b: "d ${b.directory} 0700 root root -") backups;

    assertions = lib.concatLists (
      mapAttrsToList (name: b: [
        {
          assertion = b.prune == { } || !b.appendOnly;
          message = "fort.host.backups.${name}.prune: pruning deletes archives, which an append-only repository only pretends to; set appendOnly = false (the provider must grant it, backupRepo.fullAccess), or leave pruning to the provider.";
        }
        {
          assertion = repoOf name b != null;
          message = "fort.host.backups.${name}: the repository URL is not known here (fort.cluster.fleet has no capability ${b.capability} of ${b.from}); build the hosts with lib.mkFleet, or set repo.";
        }
        {
          assertion = lib.hasPrefix "/" b.directory;
          message = "fort.host.backups.${name}.directory must be an absolute path.";
        }
      ]) backups
    );
  };
}
