# Request of `postgres` (fort-handler postgres): a database and a login role on the
# provider's PostgreSQL. The payload is {host, port, dbname, user, password, uri}.
{ lib, ... }:
let
  inherit (lib) mkOption types;
in
{
  options = {
    rotate = mkOption {
      type = types.ints.unsigned;
      default = 0;
      example = 1;
      description = ''
        Raise it to get a new password: the old one stops working as the new one is
        delivered.
      '';
    };
    name = mkOption {
      type = types.nullOr (types.strMatching "[a-z][a-z0-9_-]{0,62}");
      default = null;
      example = "gitea";
      description = ''
        A name of its own for the role and the database, which the provider must allow
        this host (`postgres.allow`). `null`: `<prefix>_<host>_<need id>`, which no
        other host can get.
      '';
    };
  };
}
