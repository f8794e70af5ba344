# A need served by an rpc capability (needs take callbacks; rpc has none).
{
  extra.app = [ { fort.host.needs.ping.app.from = "beacon"; } ];
  expect = [ ''fort.host.needs.ping.app: capability "ping" on "beacon" is rpc mode'' ];
}
