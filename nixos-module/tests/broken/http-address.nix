# A plaintext address without plaintext: every host's agent would refuse it.
{
  extra.forge = [ ({ lib, ... }: { fort.cluster.hosts.forge.address = lib.mkForce "http://10.0.0.1:7770"; }) ];
  expect = [
    "fort.cluster.hosts.forge.address = \"http://10.0.0.1:7770\" is plaintext HTTP, which the agent on forge refuses: use https://HOST:PORT (TLS pinned to forge's host key), or, where an overlay network such as WireGuard already encrypts, set services.fort-agent.plaintext = true on every host."
  ];
}
