# A private key in the world-readable store (a path literal in a flake ends up there):
# hostKeyFile's type refuses it.
{
  extra.forge = [ { services.fort-agent.hostKeyFile = "${builtins.storeDir}/00000000000000000000000000000000-source/keys/forge"; } ];
  evalError = true;
  expect = [
    "services.fort-agent.hostKeyFile' is not of type `absolute path not in the Nix store'"
    "00000000000000000000000000000000-source/keys/forge"
  ];
}
