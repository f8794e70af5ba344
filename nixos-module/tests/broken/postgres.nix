# Mistakes in a postgres capability: the admin password file in the store, and the cached
# responses turned off (every run would rotate every password).
{
  extra.forge = [
    (
      { pkgs, ... }:
      {
        fort.host.capabilities.postgres = {
          cacheResponse = false;
          postgres.adminPasswordFile = "${pkgs.writeText "pg-admin" "secret"}";
        };
      }
    )
  ];
  expect = [
    "fort.host.capabilities.postgres.postgres: the capability must be async with cacheResponse = true"
    "fort.host.capabilities.postgres.postgres.adminPasswordFile is in the Nix store"
  ];
}
