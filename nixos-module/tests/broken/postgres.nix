# Mistakes in a postgres capability: the admin password file in the store, the cached
# responses turned off (every run would rotate every password), and a second capability
# keeping its roles in the first one's state file.
{
  extra.forge = [
    (
      { pkgs, ... }:
      {
        fort.host.capabilities.postgres = {
          cacheResponse = false;
          postgres.adminPasswordFile = "${pkgs.writeText "pg-admin" "secret"}";
        };
        fort.host.capabilities.postgres-other.postgres = {
          host = "db2.example.org";
          stateFile = "/var/lib/fort/handlers/postgres.json";
        };
      }
    )
  ];
  expect = [
    "fort.host.capabilities.postgres.postgres: the capability must be async with cacheResponse = true"
    "fort.host.capabilities.postgres.postgres.adminPasswordFile is in the Nix store"
    "fort.host.capabilities.<name>.postgres.stateFile: two capabilities share one state file, and each would disable or drop the other's roles"
  ];
}
