# A listen address without a port: an assertion, not a failed string-to-int conversion.
{
  extra.forge = [ { services.fort-agent.listen = "0.0.0.0"; } ];
  expect = [ ''services.fort-agent.listen = "0.0.0.0" has no port (1-65535): write HOST:PORT, such as 0.0.0.0:7770 or [::]:7770.'' ];
}
