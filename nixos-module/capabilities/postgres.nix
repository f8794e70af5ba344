# The provider side of `fort-handler postgres`: `fort.host.capabilities.<name>.postgres`
# turns a capability into a database and a login role per entry on this host's
# PostgreSQL (docs/handlers.md, "postgres"). The handler's config is written to the store
# as JSON; it names the admin password file, never the password.
{
  config,
  lib,
  pkgs,
  ...
}:
let
  inherit (lib)
    filterAttrs
    literalExpression
    mapAttrsToList
    mkDefault
    mkIf
    mkOption
    types
    ;
  fortPackage = config.services.fort-agent.package;

  settings =
    name:
    types.submodule {
      options = {
        host = mkOption {
          type = types.strMatching "[A-Za-z0-9.:-]+";
          example = "db.example.org";
          description = "The host name or address consumers connect to, as every credential names it.";
        };
        socketDir = mkOption {
          type = types.str;
          default = "/run/postgresql";
          description = "Directory of the server's Unix socket, where the handler connects as `adminRole`.";
        };
        port = mkOption {
          type = types.port;
          default = 5432;
          description = "The server's port (it also names the socket file, `.s.PGSQL.<port>`).";
        };
        publicPort = mkOption {
          type = types.nullOr types.port;
          default = null;
          description = "The port in credentials, when consumers come through another one (a pooler). `null`: `port`.";
        };
        adminRole = mkOption {
          type = types.str;
          default = "postgres";
          example = "fort";
          description = ''
            The role the handler connects as, with `CREATEROLE` and `CREATEDB` (or a
            superuser). It runs as the agent's user (`services.fort-agent.user`), so
            with peer authentication map that user to this role (`identMap`).
          '';
        };
        adminPasswordFile = mkOption {
          type = types.nullOr types.str;
          default = null;
          example = "/run/secrets/fort-postgres-admin";
          description = "A file holding `adminRole`'s password, when the socket asks for one. Never a store path.";
        };
        adminDatabase = mkOption {
          type = types.str;
          default = "postgres";
          description = "The database the admin connection opens.";
        };
        namePrefix = mkOption {
          type = types.strMatching "[a-z][a-z0-9]{0,15}";
          default = "fort";
          description = "First part of every derived name (`<prefix>_<host>_<need id>`); capabilities sharing a server need different ones.";
        };
        onRelease = mkOption {
          type = types.enum [
            "disable"
            "drop"
          ];
          default = "disable";
          description = ''
            What a released entry's role and database become. `disable`: the role loses
            `LOGIN` and its password, its sessions end, the data stays (asked for again,
            the entry gets it back with a new password). `drop`: the database and the
            role are dropped, with every role this capability had disabled before.
          '';
        };
        connectionLimit = mkOption {
          type = types.nullOr (types.ints.between 1 100000);
          default = null;
          description = ''
            The most `CONNECTION LIMIT` of any one role. `null`: none beyond its part of
            its caller's share (`connectionsPerCaller`).
          '';
        };
        connectionsPerCaller = mkOption {
          type = types.nullOr (types.ints.between 1 100000);
          default = null;
          description = ''
            Connections one caller's roles share: each role's `CONNECTION LIMIT` is its
            part (at least 1), set again as the caller's databases come and go. `null`:
            20. The server's connections are shared by every caller (and by the
            handler's own role, unless it is a superuser), so one caller with many
            databases must not take them all; keep the callers' shares together under
            `max_connections`, as the handler's run notes say when they are not.
          '';
        };
        allow = mkOption {
          type = types.attrsOf (types.listOf types.str);
          default = { };
          example = literalExpression ''{ app = [ "gitea" ]; "*" = [ "{origin}" ]; }'';
          description = ''
            Names a caller may ask for itself (`name` in its request) instead of the
            derived one, per host or principal and `"*"` for everyone; `{origin}` is the
            caller's name. Names already on the server that the handler did not make
            are refused all the same.
          '';
        };
        peers = mkOption {
          type = types.listOf (types.strMatching "[a-z0-9][a-z0-9-]{0,62}");
          default = [ ];
          example = [ "db2" ];
          description = ''
            The other fort hosts whose `postgres` capability serves this same server, for
            needs that name them all (`from = [ "db1" "db2" ]`): a role and database one of
            them made for an entry is taken over, with a new password, when the entry
            moves here, and its release there leaves them alone. Every provider of such a
            need lists the others, with the same `host`, port and `namePrefix`.
          '';
        };
        runBudget = mkOption {
          type = types.str;
          default = "40s";
          description = "Server work one handler run may do (the agent's `handler_timeout` is 60 s); the rest continues in the next run.";
        };
        stateFile = mkOption {
          type = types.str;
          default = "/var/lib/fort/handlers/${name}.json";
          defaultText = literalExpression ''"/var/lib/fort/handlers/<name>.json"'';
          description = "The handler's record of the roles it made and their passwords (mode 0600).";
        };
      };
    };

  configFile =
    name: s:
    pkgs.writeText "fort-postgres-${name}.json" (
      builtins.toJSON (
        {
          state_file = s.stateFile;
          inherit (s) host port allow;
          socket_dir = s.socketDir;
          admin_role = s.adminRole;
          admin_database = s.adminDatabase;
          name_prefix = s.namePrefix;
          on_release = s.onRelease;
          run_budget = s.runBudget;
        }
        // lib.optionalAttrs (s.peers != [ ]) { inherit (s) peers; }
        // lib.optionalAttrs (s.publicPort != null) { public_port = s.publicPort; }
        // lib.optionalAttrs (s.adminPasswordFile != null) { admin_password_file = s.adminPasswordFile; }
        // lib.optionalAttrs (s.connectionLimit != null) { connection_limit = s.connectionLimit; }
        // lib.optionalAttrs (s.connectionsPerCaller != null) {
          connections_per_caller = s.connectionsPerCaller;
        }
      )
    );

  withPostgres = filterAttrs (_: c: c.postgres != null) config.fort.host.capabilities;
in
{
  options.fort.host.capabilities = mkOption {
    type = types.attrsOf (
      types.submodule (
        { name, config, ... }:
        {
          options.postgres = mkOption {
            type = types.nullOr (settings name);
            default = null;
            example = literalExpression ''{ host = "db.example.org"; adminRole = "fort"; }'';
            description = ''
              Serve this capability with `fort-handler postgres`: a database and a login
              role per entry on this host's PostgreSQL, delivered as
              `{host, port, dbname, user, password, uri}`.
            '';
          };
          config = mkIf (config.postgres != null) {
            handler = mkDefault "${fortPackage}/bin/fort-handler";
            args = [
              "postgres"
              "--config"
              "${configFile name config.postgres}"
            ];
            configFiles = [ (configFile name config.postgres) ];
            policy = {
              handler = "postgres";
              inherit (config.postgres) allow;
              # As `fort-handler postgres --failover --config …` says: providers of one
              # need must name one server and list each other.
              failover = {
                kind = "shared-backend";
                backend = "${config.postgres.host}:${
                  toString (if config.postgres.publicPort != null then config.postgres.publicPort else config.postgres.port)
                } (${config.postgres.namePrefix}_…)";
                inherit (config.postgres) peers;
              };
              response = [ "host" "port" "dbname" "user" "password" "uri" ];
            };
            interface = mkDefault ../interfaces/postgres.nix;
            cacheResponse = mkDefault true;
            description = mkDefault "PostgreSQL databases and roles on ${config.postgres.host}";
          };
        }
      )
    );
  };

  config.assertions = lib.concatLists (
    mapAttrsToList (name: c: [
      {
        assertion = c.mode == "async" && c.cacheResponse;
        message = "fort.host.capabilities.${name}.postgres: the capability must be async with cacheResponse = true (without the cached response every run would rotate every password).";
      }
      {
        assertion =
          c.postgres.adminPasswordFile == null
          || !lib.hasPrefix builtins.storeDir (toString c.postgres.adminPasswordFile);
        message = "fort.host.capabilities.${name}.postgres.adminPasswordFile is in the Nix store, readable by every user; give a path outside it (a secret manager's file).";
      }
      {
        assertion = lib.hasPrefix "/" c.postgres.socketDir && lib.hasPrefix "/" c.postgres.stateFile;
        message = "fort.host.capabilities.${name}.postgres: socketDir and stateFile must be absolute paths.";
      }
      {
        assertion = c.postgres.peers == [ ] || c.postgres.onRelease != "drop";
        message = "fort.host.capabilities.${name}.postgres: onRelease = \"drop\" cannot go with peers (a need that moved to a peer is released here, maybe before the peer took its database over); use \"disable\".";
      }
      {
        assertion = builtins.match "[0-9]+(ms|s|m|h)" c.postgres.runBudget != null;
        message = "fort.host.capabilities.${name}.postgres.runBudget: a duration such as \"40s\" or \"500ms\".";
      }
    ]) withPostgres
  );
}
