# settings.host_key pointing elsewhere than the credential loaded from hostKeyFile.
{
  extra.app = [ { services.fort-agent.settings.host_key = "/var/lib/secrets/other-key"; } ];
  expect = [
    ''services.fort-agent.settings.host_key = "/var/lib/secrets/other-key": the agent reads its key from the credential systemd loads from services.fort-agent.hostKeyFile (/var/lib/secrets/fort-key). Set hostKeyFile = "/var/lib/secrets/other-key" instead and leave settings.host_key unset.''
  ];
}
