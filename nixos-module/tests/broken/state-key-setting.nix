# With stateEncryption, agent.toml must name the credential systemd decrypts, not a file
# of its own.
{
  extra.forge = [
    {
      services.fort-agent.stateEncryption.enable = true;
      services.fort-agent.settings.state_key_file = "/etc/fort/state-key";
    }
  ];
  expect = [
    "services.fort-agent.settings.state_key_file = \"/etc/fort/state-key\": with stateEncryption the agent reads its state key from the credential"
  ];
}
