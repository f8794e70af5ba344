# Not a mistake: a handler given as a path outside the store. The build sandbox holds
# only store paths, so the build-time check leaves handlers to the agent.
{
  extra.forge = [ { fort.host.capabilities.ping.handler = "/usr/local/bin/fort-ping"; } ];
  expect = [ ];
  check.forge = [ "fort-agent check --config \"$checkConfig\" --skip-key --skip-handlers" ];
}
