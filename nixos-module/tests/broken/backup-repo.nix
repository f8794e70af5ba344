# backup-repo mistakes: a provider whose agent is not root (it gives repositories to the
# borg account and writes sshd's keys), two capabilities on one authorized_keys
# directory, a consumer asking for full access the provider does not grant, pruning an
# append-only repository, and a backup whose repository nobody serves.
{
  extra.beacon = [ { fort.host.capabilities.vault.backupRepo.host = "beacon.example.org"; } ];
  extra.forge = [
    {
      fort.host.capabilities.borg2.backupRepo = {
        host = "forge.example.org";
        authorizedKeysDir = "/etc/ssh/fort-authorized-keys/borg";
      };
    }
  ];
  extra.app = [
    {
      fort.host.backups.home.appendOnly = false;
      fort.host.backups.logs = {
        from = "forge";
        capability = "borg";
        paths = [ "/var/log" ];
        prune.daily = 7;
      };
      fort.host.backups.elsewhere = {
        from = "beacon";
        capability = "borg";
        paths = [ "/srv" ];
      };
    }
  ];
  expect = [
    "fort.host.capabilities.vault.backupRepo: the agent gives repositories to borg and writes sshd's keys in /etc/ssh/fort-authorized-keys/vault, so it must run as root (services.fort-agent.user is fort)."
    "fort.host.capabilities.<name>.backupRepo: two capabilities share a repositoriesDir or an authorizedKeysDir; give each its own."
    "host app: fort.host.needs.borg.home.request.append_only: false asks for full access to repository home, which capability borg of forge grants app only to archive."
    "fort.host.backups.logs.prune: pruning deletes archives, which an append-only repository only pretends to"
    "fort.host.backups.elsewhere: the repository URL is not known here (fort.cluster.fleet has no capability borg of beacon)"
  ];
}
