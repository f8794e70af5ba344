# As path-key.nix, with a nixpkgs lib that has no types.externalPath: the fallback type
# refuses the path literal with the same words.
{
  withoutExternalPath = true;
  extra.forge = [ { services.fort-agent.hostKeyFile = ../keys/forge; } ];
  evalError = true;
  expect = [ "services.fort-agent.hostKeyFile' is not of type `absolute path not in the Nix store'" ];
}
