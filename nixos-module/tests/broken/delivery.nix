# Delivery mistakes: a credential for a service nothing defines, two credentials of one
# service with the same name, two files on one path, a bad pointer, and a file given away
# by an agent that does not run as root (beacon runs as "fort"), or encrypted by it.
{
  extra.app = [
    (
      { lib, ... }:
      {
        fort.host.needs.ssl-cert.app.files = {
          client_secret = {
            credentialFor = [ "wiki.service" "wikki.service" ];
            path = "/var/lib/wiki/oidc-client-id";
            pointer = "client_secret";
          };
        };
      }
    )
  ];
  extra.beacon = [
    {
      fort.host.needs.ssl-cert.beacon.files."key.pem".owner = "nginx";
      fort.host.needs.ssl-cert.beacon.files.secret = {
        encrypt = true;
        owner = "fort";
      };
    }
  ];
  expect = [
    ''fort.host.needs.ssl-cert.app.files.client_secret.credentialFor: no module on app defines "wikki.service" (systemd.services.wikki), so its LoadCredential= would sit in an empty unit that never runs. Name a service this host defines.''
    "fort.host.needs.oidc.wiki.files.client_secret and fort.host.needs.ssl-cert.app.files.client_secret are both credentials named client_secret of wiki.service; rename one (the file name is the credential name)."
    "fort.host.needs.oidc.wiki.files.client_id and fort.host.needs.ssl-cert.app.files.client_secret write the same file /var/lib/wiki/oidc-client-id; give each its own path."
    ''fort.host.needs.ssl-cert.app.files.client_secret.pointer = "client_secret" must be "" (the whole payload) or a JSON pointer starting with /.''
    ''fort.host.needs.ssl-cert.beacon.files."key.pem".owner = "nginx": the agent runs as fort and cannot give files to another user; set owner = "fort" or run the agent as root.''
    ''fort.host.needs.ssl-cert.beacon.files.secret.encrypt: the agent runs as fort, and systemd-creds encrypts only for root (it reads the host's credential secret); run the agent as root (services.fort-agent.user = "root") or deliver the file unencrypted.''
  ];
}
