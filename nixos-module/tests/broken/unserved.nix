# A need from a real host that does not serve its type.
{
  extra.app = [ { fort.host.needs.backup.app.from = "forge"; } ];
  expect = [ ''fort.host.needs.backup.app: nobody serves this need: host "forge" declares no capability "backup"'' ];
}
