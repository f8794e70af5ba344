# The fleet of the booted-systemd lane, as lib.mkFleet arguments: two hosts that share
# one loopback, each in its own container.
#   forge: provides `secret` (async) under strictSandbox, triggered at start
#          (initialize) and by lane-source.service (triggers.systemd)
#   app:   needs secret/wiki (a credential of the DynamicUser service wiki) and
#          secret/multi-{a,b,c} (three needs that restart multi.service and reload
#          reloader.service); generation 2 adds secret/later
# The consumer services themselves (wiki, multi, reloader, lane-source) are the lane's
# own units, as a package would ship them; the fleet only adds to them, as a NixOS host
# adds to a package's units.
#
# appUser: the user app's agent runs as ("root", or "fort" for the unprivileged agent).
# generation: 2 is the next deployment of the same fleet (one more need).
# certificates: forge also serves `ssl-cert` from the ACME CA the lane runs on the shared
# loopback (pebble at 127.0.0.1:14000, its TLS root installed at /etc/lane/pebble-root.pem),
# and app asks it for a certificate for a key it makes (fort.host.certificates.web),
# reloading reloader.service when it lands.
# records: forge also serves `dns-record` from the zone lane.test at the primary the lane
# runs on the shared loopback (127.0.0.1:5300, its TSIG secret installed at
# /etc/lane/tsig), and app asks for www.lane.test, an A record of its own address.
# clients: forge also serves `oidc` from the OpenID provider the lane runs on the shared
# loopback (https://127.0.0.1:7443, its TLS root at /etc/lane/oidc-ca.pem, the initial
# access token at /etc/lane/oidc-token), and app asks for a client_credentials client.
# sshCertificates: forge also serves `ssh-ca` (its CA key made on the first run), and app
# asks for a host certificate for its own host key.
# databases: forge also serves `postgres` from the server the lane runs (its socket in
# /run/lane-postgresql, port 25432, the admin role fort_admin by peer authentication),
# and app asks for a database.
# encrypted: app also needs secret/keeper, its token stored as a systemd encrypted
# credential (encrypt = true) of the DynamicUser service keeper.
# atRest: forge seals its state (stateEncryption, its state key made by fort-state-key
# at the first boot), and app keeps the database's credentials and the OIDC client secret
# as systemd encrypted credentials of the DynamicUser service holder; with certificates,
# records, clients, sshCertificates and databases, everything a provider keeps.
# monitoring: forge also serves `metrics` (fort-handler scrape) into its target files,
# which its Prometheus would read (configurePrometheus off: the lane has none), and app
# declares its node exporter on port 9100 (fort.host.exporters.node).
# backups: forge also serves `borg` (fort-handler backup-repo: a repository per entry
# under /var/lib/fort-backup/borg, sshd's keys in /etc/ssh/fort-authorized-keys, the
# host key the lane installs at /etc/lane/ssh_host_ed25519_key.pub), and app backs up
# /etc there (fort.host.backups.etc) with a key its agent makes.
# failover: a third host, spare (127.0.0.3), and both forge and spare serve `lease`, a
# token that names its issuer and lives 30 s; app needs lease/renter from [ forge spare ]
# (renewed 20 s before it expires, moved after 4 s of failure) as a credential of the
# DynamicUser service renter.
{
  appUser ? "root",
  generation ? 1,
  certificates ? false,
  records ? false,
  clients ? false,
  sshCertificates ? false,
  databases ? false,
  encrypted ? false,
  failover ? false,
  atRest ? false,
  monitoring ? false,
  backups ? false,
}:
let
  keys = ../keys;
  pub = name: builtins.head (builtins.match "([^\n]*)\n*" (builtins.readFile (keys + "/${name}.pub")));
  # Files given to the agent's own user when it is not root (it cannot chown).
  owned = if appUser == "root" then { } else { owner = appUser; group = appUser; };
  token = {
    pointer = "/token";
  } // owned;
  # A secret file of app's under atRest: a systemd encrypted credential of holder.
  sealedFor =
    if atRest then
      {
        encrypt = true;
        credentialFor = [ "holder.service" ];
      }
    else
      { };
  # `lease` on a provider: every entry gets {"token": "<issuer> <entry key> <unix time>",
  # "expires_at": <unix time + 30>}, renewed whenever the consumer asks.
  lease =
    { pkgs, ... }:
    {
      fort.host.capabilities.lease = {
        handler = pkgs.writeShellScript "lane-lease" ''
          now=$(date +%s)
          exec ${pkgs.jq}/bin/jq -c --arg h "$FORT_HOST" --argjson now "$now" \
            'with_entries(.value = {token: "\($h) \(.key) \($now)", expires_at: ($now + 30)})'
        '';
        triggers.initialize = true;
        description = "Short-lived tokens, from either provider";
      };
    };
in
{
  shared = [
    {
      fort.cluster.hosts = {
        forge = {
          address = "https://127.0.0.1:7770";
          publicKeys = [ (pub "forge") ];
        };
        app = {
          address = "https://127.0.0.2:7770";
          publicKeys = [ (pub "app") ];
        };
      }
      // (
        if failover then
          {
            spare = {
              address = "https://127.0.0.3:7770";
              publicKeys = [ (pub "spare") ];
            };
          }
        else
          { }
      );
      services.fort-agent = {
        enable = true;
        # Installed by the lane (mode 0400, root): the agent reads it through
        # LoadCredential=, also when it runs as another user.
        hostKeyFile = "/etc/lane/host_key";
      };
    }
  ];

  hosts = {
    forge.modules = [
      (
        { pkgs, lib, ... }:
        {
          services.fort-agent = {
            listen = "127.0.0.1:7770";
            strictSandbox = true;
            readWritePaths = [ "/var/lib/lane-provider" ];
            stateEncryption.enable = atRest;
          };
          # Shipped by the lane as a unit of its own; fort adds OnSuccess= to it.
          systemd.services.lane-source.description = "lane: a oneshot whose success triggers secret";
          fort.host.capabilities.secret = {
            # Every entry gets {"token": "<generation> <entry key>"}, the generation being
            # what /etc/lane/generation holds ("1" without it). Each run notes its trigger
            # and tries to write inside readWritePaths and outside of it.
            handler = pkgs.writeShellScript "lane-secret" ''
              set -u
              dir=/var/lib/lane-provider
              echo "$FORT_TRIGGER" >>"$dir/triggers"
              for probe in "$dir/probe" /var/lib/lane-outside/probe /etc/lane-probe; do
                if { echo written >"$probe"; } 2>>"$dir/probes"; then echo "$probe: written" >>"$dir/probes"; fi
              done
              generation=$(cat /etc/lane/generation 2>/dev/null || echo 1)
              exec ${pkgs.jq}/bin/jq -c --arg g "$generation" 'with_entries(.value = {token: "\($g) \(.key)"})'
            '';
            triggers.initialize = true;
            triggers.systemd = [ "lane-source.service" ];
            description = "Tokens for the lane's consumer";
          };
          fort.host.capabilities.ssl-cert = lib.mkIf certificates {
            acme = {
              directory = "https://127.0.0.1:14000/dir";
              caRoot = "/etc/lane/pebble-root.pem";
              # Under strictSandbox: writable because the capability says so, not the lane.
              webroot = "/var/lib/lane-acme-webroot";
              allow.app = [ "app.example.test" ];
              revokeOnRelease = true;
              rerunSeconds = 1;
            };
          };
          # Under strictSandbox: the target directory is writable because the capability
          # says so (ReadWritePaths), not the lane.
          fort.host.capabilities.borg = lib.mkIf backups {
            backupRepo = {
              host = "forge.lane.test";
              hostKeyFiles = [ "/etc/lane/ssh_host_ed25519_key.pub" ];
              quota = "1G";
            };
          };
          fort.host.capabilities.metrics = lib.mkIf monitoring {
            scrape = {
              ports."*" = [ "9100" ];
              labels."*" = [ "env" ];
              configurePrometheus = false;
            };
          };
          fort.host.capabilities.dns-record = lib.mkIf records {
            dnsRecord = {
              zone = "lane.test";
              primary = "127.0.0.1:5300";
              key = {
                name = "fort-test";
                file = "/etc/lane/tsig";
              };
              allow.app = [ "*.lane.test" ];
            };
          };
          fort.host.capabilities.oidc = lib.mkIf clients {
            oidc = {
              issuer = "https://127.0.0.1:7443";
              initialAccessTokenFile = "/etc/lane/oidc-token";
              caFile = "/etc/lane/oidc-ca.pem";
              allow.app = [ "lane" ];
              allowGrantTypes.app = [ "client_credentials" ];
            };
          };
          fort.host.capabilities.postgres = lib.mkIf databases {
            postgres = {
              host = "127.0.0.1";
              socketDir = "/run/lane-postgresql";
              port = 25432;
              adminRole = "fort_admin";
              allow.app = [ "wiki" ];
            };
          };
          fort.host.capabilities.ssh-ca = lib.mkIf sshCertificates {
            sshCa.hostPrincipals."*" = [
              "{origin}"
              "{origin}.lane.test"
            ];
          };
        }
      )
    ]
    ++ (if failover then [ lease ] else [ ]);

    app.modules = [
      (
        { lib, ... }:
        {
          services.fort-agent = {
            listen = "127.0.0.2:7770";
            user = appUser;
          };
          fort.host.needs.secret =
            {
              wiki.from = "forge";
              wiki.files.token = token // {
                credentialFor = [ "wiki.service" ];
              };
            }
            // builtins.listToAttrs (
              map (id: {
                name = "multi-${id}";
                value = {
                  from = "forge";
                  files.token = token;
                  restartUnits = [ "multi.service" ];
                  reloadUnits = [ "reloader.service" ];
                };
              }) [ "a" "b" "c" ]
            )
            // lib.optionalAttrs encrypted {
              keeper.from = "forge";
              keeper.files.token = token // {
                encrypt = true;
                credentialFor = [ "keeper.service" ];
              };
            }
            // (
              if generation >= 2 then
                {
                  later.from = "forge";
                  later.files.token = token;
                }
              else
                { }
            );
          # The lane's own units; started at boot (wiki is skipped until its credential is
          # there).
          systemd.services = {
            wiki.wantedBy = [ "multi-user.target" ];
            multi.wantedBy = [ "multi-user.target" ];
            reloader.wantedBy = [ "multi-user.target" ];
            keeper = lib.mkIf encrypted { wantedBy = [ "multi-user.target" ]; };
          };
          users.groups = lib.mkIf certificates { lane-web = { }; };
          fort.host.backups = lib.mkIf backups {
            etc = {
              from = "forge";
              capability = "borg";
              paths = [ "/etc" ];
            };
          };
          fort.host.exporters = lib.mkIf monitoring {
            node = {
              from = "forge";
              capability = "metrics";
              port = 9100;
              labels.env = "lane";
            };
          };
          fort.host.needs.dns-record = lib.mkIf records {
            www = {
              from = "forge";
              request.name = "www.lane.test";
              # The record set as the primary holds it, kept as a file.
              files."record.json" = { };
            };
          };
          # The host key the agent signs with is the one certified (its public half is known).
          fort.host.sshCertificate = lib.mkIf sshCertificates {
            from = "forge";
            hostKey = "/etc/lane/host_key";
          };
          fort.host.needs.postgres = lib.mkIf databases {
            wiki = {
              from = "forge";
              request.name = "wiki";
              files.password = {
                pointer = "/password";
              }
              // sealedFor;
              files."connection.json" = sealedFor;
            };
          };
          fort.host.needs.oidc = lib.mkIf clients {
            lane = {
              from = "forge";
              request = {
                client_name = "lane";
                grant_types = [ "client_credentials" ];
              };
              files.client_id.pointer = "/client_id";
              files.client_secret = {
                pointer = "/client_secret";
              }
              // sealedFor;
            };
          };
          fort.host.certificates = lib.mkIf certificates {
            web = {
              from = "forge";
              domains = [ "app.example.test" ];
              group = "lane-web";
              reloadUnits = [ "reloader.service" ];
            };
          };
          fort.host.needs.lease = lib.mkIf failover {
            renter = {
              from = [
                "forge"
                "spare"
              ];
              nag = "2s";
              failoverAfter = "4s";
              renewBefore = "20s";
              files.token = token // {
                credentialFor = [ "renter.service" ];
              };
            };
          };
          systemd.services.renter = lib.mkIf failover { wantedBy = [ "multi-user.target" ]; };
          systemd.services.holder = lib.mkIf atRest { wantedBy = [ "multi-user.target" ]; };
        }
      )
    ];
  }
  // (
    if failover then
      {
        # The standby: only what every lane host has, and `lease`.
        spare.modules = [
          { services.fort-agent.listen = "127.0.0.3:7770"; }
          lease
        ];
      }
    else
      { }
  );
}
