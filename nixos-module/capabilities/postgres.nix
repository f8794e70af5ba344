# The provider side of `fort-handler postgres`: `fort.host.capabilities.<name>.postgres`
# turns a capability into a database and a login role per entry on this host's
# PostgreSQL (docs/handlers.md, "postgres"). The handler's config is written to the store
# as JSON; it names the admin password file, never the password.
import ./provider.nix (
  { lib, shapes, ... }:
  let
    inherit (lib) mkOption types;
  in
  {
    option = "postgres";
    handler = "postgres";
    description = ''
      Serve this capability with `fort-handler postgres`: a database and a login
      role per entry on this host's PostgreSQL, delivered as
      `{host, port, dbname, user, password, uri}`.
    '';
    example = ''{ host = "db.example.org"; adminRole = "fort"; }'';
    settings = name: {
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
      allow = shapes.allow {
        example = ''{ app = [ "gitea" ]; "*" = [ "{origin}" ]; }'';
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
      runBudget = shapes.runBudget "Server";
    };
    stateFile = {
      description = "The handler's record of the roles it made and their passwords (mode 0600).";
      shared = ", and each would disable or drop the other's roles";
    };
    configFile =
      _: s:
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
      };
    answers = [ "host" "port" "dbname" "user" "password" "uri" ];
    # As `fort-handler postgres --failover --config …` says: providers of one need must
    # name one server and list each other.
    policy = _: s: {
      inherit (s) allow;
      failover = {
        kind = "shared-backend";
        backend = "${s.host}:${
          toString (if s.publicPort != null then s.publicPort else s.port)
        } (${s.namePrefix}_…)";
        inherit (s) peers;
      };
    };
    defaults = _: s: {
      interface = ../interfaces/postgres.nix;
      description = "PostgreSQL databases and roles on ${s.host}";
    };
    async = "databases are entries the handler reconciles";
    keepsResponses = "without the cached response every run would rotate every password";
    paths = [ "socketDir" ];
    secrets = [ "adminPasswordFile" ];
    durations = [ "runBudget" ];
    assertions =
      { at, settings, ... }:
      [
        {
          assertion = settings.peers == [ ] || settings.onRelease != "drop";
          message = "${at}: onRelease = \"drop\" cannot go with peers (a need that moved to a peer is released here, maybe before the peer took its database over); use \"disable\".";
        }
      ];
  }
)
