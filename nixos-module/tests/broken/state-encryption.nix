# Not a mistake: the state key as a systemd encrypted credential. agent.toml names the
# credential, the unit loads it with LoadCredentialEncrypted=, and fort-state-key.service
# makes it (bound to the TPM2 here) before the agent's first start.
let
  sealed = {
    services.fort-agent.stateEncryption = {
      enable = true;
      withKey = "host+tpm2";
    };
  };
in
{
  extra.forge = [ sealed ];
  expect = [ ];
  agent.forge.state_key_file = "/run/credentials/fort-agent.service/state-key";
  service.forge = {
    fort-agent.serviceConfig.LoadCredentialEncrypted = [
      "state-key:/var/lib/fort-credentials/state-key.cred"
    ];
    fort-agent.wants = [ "fort-state-key.service" ];
    fort-state-key.unitConfig.ConditionPathExists = "!/var/lib/fort-credentials/state-key.cred";
  };
  script.forge = [ "systemd-creds encrypt --name=state-key --with-key=host+tpm2 - " ];
}
