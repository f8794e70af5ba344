# A private key in the world-readable store (a path literal in a flake ends up there).
{
  extra.forge = [ { services.fort-agent.hostKeyFile = "${builtins.storeDir}/00000000000000000000000000000000-source/keys/forge"; } ];
  expect = [ "00000000000000000000000000000000-source/keys/forge is inside the Nix store" ];
}
