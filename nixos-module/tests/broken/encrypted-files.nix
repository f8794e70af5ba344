# Not a mistake: a delivered secret stored as a systemd encrypted credential. needs.json
# carries the key setting as the file's `encrypt`, the file's default path moves to the
# agent's state directory (it survives a reboot), wiki loads it with
# LoadCredentialEncrypted= (a plain file beside it keeps LoadCredential=), and the agent
# has the host's credential secret made before it starts.
{
  extra.app = [
    {
      services.fort-agent.credentialEncryption.withKey = "host+tpm2";
      fort.host.needs.oidc.wiki.files.client_secret.encrypt = true;
      fort.host.needs.oidc.wiki.files.client_id.credentialFor = [ "wiki.service" ];
    }
  ];
  expect = [ ];
  service.app = {
    wiki.serviceConfig.LoadCredentialEncrypted = [
      "client_secret:/var/lib/fort/credentials/oidc/wiki/client_secret.cred"
    ];
    wiki.serviceConfig.LoadCredential = [ "client_id:/var/lib/wiki/oidc-client-id" ];
    wiki.unitConfig.ConditionPathExists = [
      "/var/lib/fort/credentials/oidc/wiki/client_secret.cred"
    ];
    fort-agent.serviceConfig.ExecStartPre = [ "systemd-creds setup" ];
  };
}
