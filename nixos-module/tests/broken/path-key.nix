# A path literal: LoadCredential= would name the build machine's file (and anything
# interpolated from it would land in the store). hostKeyFile's type refuses it.
{
  extra.forge = [ { services.fort-agent.hostKeyFile = ../keys/forge; } ];
  evalError = true;
  expect = [ "services.fort-agent.hostKeyFile' is not of type `absolute path not in the Nix store'" ];
}
