# Not a mistake: on an overlay network every host sets plaintext; an http:// address is
# then accepted, and agent.toml says `plaintext = true`.
let
  plaintext = { services.fort-agent.plaintext = true; };
in
{
  extra.forge = [
    plaintext
    ({ lib, ... }: { fort.cluster.hosts.forge.address = lib.mkForce "http://10.0.0.1:7770"; })
  ];
  extra.beacon = [ plaintext ];
  extra.app = [ plaintext ];
  expect = [ ];
  absent = [ "is plaintext HTTP" ];
  agent.forge.plaintext = true;
  agent.app.plaintext = true;
}
