# Mistakes in an oidc capability: the initial access token in the store, cached responses
# turned off (every run would rotate every client secret), and a duration without a unit.
{
  extra.forge = [
    (
      { lib, pkgs, ... }:
      {
        fort.host.capabilities.oidc = {
          cacheResponse = false;
          oidc.initialAccessTokenFile = lib.mkForce "${pkgs.writeText "iat" "secret"}";
          oidc.timeout = "10";
        };
      }
    )
  ];
  expect = [
    "fort.host.capabilities.oidc.oidc: the capability must be async with cacheResponse = true"
    "fort.host.capabilities.oidc.oidc.initialAccessTokenFile is in the Nix store"
    "fort.host.capabilities.oidc.oidc: timeout and runBudget are durations"
  ];
}
