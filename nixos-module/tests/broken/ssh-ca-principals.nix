# SSH CA mistakes: a CA key in the world-readable store, principal patterns the handler
# would refuse on every run, a host certificate for a key whose public half the module
# cannot know (app's agent signs with another key), and one on a host whose agent is
# not root (beacon's runs as fort), two CAs on one state file and an rpc CA.
{
  extra.forge = [
    {
      fort.host.capabilities.ssh-ca.sshCa = {
        caKeyFile = "/nix/store/0000000000000000000000000000000-ca";
        userPrincipals.app = [ "Root" "a b" ];
      };
      # A second CA on the first one's state file, and as an rpc capability.
      fort.host.capabilities.ssh-ca-rpc = {
        mode = "rpc";
        sshCa.stateFile = "/var/lib/fort/handlers/ssh-ca/state.json";
      };
    }
  ];
  extra.app = [ { fort.host.sshCertificate.from = "forge"; } ];
  extra.beacon = [ { fort.host.sshCertificate.from = "forge"; } ];
  expect = [
    "fort.host.capabilities.<name>.sshCa.stateFile: two capabilities share one state file, and each would revoke the other's certificates; give each its own."
    "fort.host.capabilities.ssh-ca-rpc.sshCa: the capability must be async (certificates are entries the handler reconciles and revokes)."
    "fort.host.capabilities.ssh-ca.sshCa.caKeyFile = /nix/store/0000000000000000000000000000000-ca: the Nix store is world readable; name a file on the host (the default is made on the first run)."
    ''fort.host.capabilities.ssh-ca.sshCa: principal patterns must be lower-case names, {origin} templates or *.SUFFIX; not "Root", "a b".''
    "fort.host.sshCertificate: the agent installs sshd's files in /etc/ssh and reloads sshd, so it must run as root (services.fort-agent.user is fort)."
    "fort.host.sshCertificate.publicKey: set the public key of /etc/ssh/ssh_host_ed25519_key; it is known without asking only when services.fort-agent.hostKeyFile is that key (it is /var/lib/secrets/fort-key)."
  ];
}
