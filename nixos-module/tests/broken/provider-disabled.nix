# The provider's agent is off: what it declares serves nobody.
{
  extra.beacon = [ ({ lib, ... }: { services.fort-agent.enable = lib.mkForce false; }) ];
  expect = [ ''fort.host.needs.proxy.app: nobody serves this need: host "beacon" declares no capability "proxy"'' ];
}
