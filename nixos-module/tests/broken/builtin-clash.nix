# A capability named like a built-in one.
{
  extra.forge = [ { fort.host.capabilities.status.handler = "/nix/store/00000000000000000000000000000000-status"; } ];
  expect = [ ''fort.host.capabilities.status: "status" clashes with a built-in capability'' ];
}
