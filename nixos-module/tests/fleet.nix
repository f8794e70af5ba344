# The three-host fleet of the evaluation test, as lib.mkFleet arguments. Interfaces are
# the example set (nixos-module/interfaces), fleet-wide.
#   forge:  provides oidc (fort-handler oidc through its options, triggered by
#           pocket-id-setup), ssl-cert, tls (fort-handler acme through its options),
#           postgres (fort-handler postgres through its options), ssh-ca (fort-handler's
#           SSH CA), borg (fort-handler backup-repo through its options) and wan (a
#           WireGuard mesh, fort-handler mesh through its options), and
#           consumes its own sshd host certificate (fort.host.sshCertificate); handler
#           environment; metrics
#   beacon: provides proxy (fort-handler proxy through its options), ping (rpc, its
#           own interface), dns-record (fort-handler dns-record through its
#           options) and metrics (fort-handler scrape through its options); consumes oidc (two
#           instances, defaults filled in) and ssl-cert (a file outside /run/fort);
#           runs as user "fort" under strictSandbox; its port set through settings.listen
#   app:    consumes oidc (instance wiki, by name and by tag) with two payload files, one
#           a credential of the wiki service (which also reads the other's path);
#           ssl-cert with a file, renewal and restart; a certificate from forge's ACME
#           capability (tls) for a key it makes (fort.host.certificates); proxy with
#           beacon's certificate set, waiting for oidc; dns-record for its own address
#           under a name beacon allows it; postgres under a name forge allows it; a borg
#           backup to forge (fort.host.backups), an exporter beacon scrapes
#           (fort.host.exporters) and a WireGuard interface in forge's mesh
#           (fort.host.meshes)
# `extra.<host>` adds modules to a host (the broken fleets use it). The fleet's
# declarations are mkFleet's `cluster`, evaluated once for the fleet; clusterIn =
# "shared" puts the same module in `shared` instead, where every host evaluates it (the
# evaluation test checks that both build the same fleet).
{
  extra ? { },
  clusterIn ? "cluster",
}:
let
  key = name: builtins.readFile (./keys + "/${name}.pub");
  trim = s: builtins.head (builtins.match "([^\n]*)\n*" s);
  pub = name: trim (key name);
  more = name: extra.${name} or [ ];

  declarations = {
    fort.cluster = {
      hosts = {
        forge = {
          address = "https://10.0.0.1:7770";
          publicKeys = [ (pub "forge") ];
          tags = [ "infra" ];
        };
        beacon = {
          address = "https://10.0.0.2:7771";
          publicKeys = [ (pub "beacon") ];
          tags = [
            "edge"
            "web"
          ];
        };
        app = {
          address = "https://10.0.0.3:7770";
          publicKeys = [ (pub "app") ];
          tags = [ "web" ];
        };
      };
      principals.ops.publicKeys = [ (pub "ops") ];

      # One OIDC client per consumer of "wiki": app by name, app and beacon by tag.
      instances.wiki = {
        capability = "oidc";
        roles.provider.machines.forge = { };
        settings = {
          client_name = "wiki";
          scopes = [ "openid" ];
        };
        roles.consumer.tags.web.settings.scopes = [
          "openid"
          "email"
        ];
        roles.consumer.machines.app.settings = {
          redirect_uris = [ "https://wiki.example.org/oidc/callback" ];
        };
      };
      # A second instance of the same capability: its own need id, no collision.
      instances.grafana = {
        capability = "oidc";
        roles.provider.machines.forge = { };
        settings.client_name = "grafana";
        roles.consumer.machines.beacon = { };
      };
    };
  };
in
{
  interfaces = import ../interfaces;

  cluster = if clusterIn == "cluster" then [ declarations ] else [ ];
  shared = [
    { services.fort-agent.enable = true; }
  ]
  ++ (if clusterIn == "shared" then [ declarations ] else [ ]);

  hosts = {
    forge.modules = [
      (
        { pkgs, ... }:
        {
          services.fort-agent = {
            openFirewall = true;
            metrics.enable = true;
            metrics.alertRules = true;
            handlerEnvironment.FORT_EXAMPLE_STATE = "/var/lib/fort-examples";
          };
          # The unit both capabilities' triggers watch (defined, so OnSuccess= lands in a
          # real unit).
          systemd.services.pocket-id-setup = {
            description = "pocket-id clients";
            script = "true";
            serviceConfig.Type = "oneshot";
          };
          fort.host.capabilities = {
            # fort's OIDC client registration: handler, args, interface and config file
            # come from the module.
            oidc = {
              oidc = {
                issuer = "https://id.example.org";
                initialAccessTokenFile = "/run/secrets/oidc-initial-access-token";
                allow."*" = [
                  "wiki"
                  "grafana"
                ];
                allowRedirectUris.app = [ "https://wiki.example.org/" ];
              };
              allowed = [ "ops" ];
              triggers.initialize = true;
              triggers.systemd = [ "pocket-id-setup.service" ];
              description = "OIDC clients in pocket-id";
            };
            # Certificates from an ACME CA for keys the consumers make.
            tls.acme = {
              directory = "https://acme-v02.api.letsencrypt.org/directory";
              webroot = "/var/lib/acme/acme-challenge";
              allow.app = [ "app.example.org" ];
            };
            ssl-cert = {
              handler = pkgs.writeShellScript "ssl-cert-issue" "exit 0";
              triggers.systemd = [ "pocket-id-setup.service" ];
            };
            postgres.postgres = {
              host = "db.example.org";
              adminRole = "fort";
              connectionLimit = 20;
              allow.app = [ "wiki" ];
            };
            # fort's SSH CA: handler, args, interface and config file come from the
            # module.
            ssh-ca.sshCa = {
              hostPrincipals."*" = [
                "{origin}"
                "{origin}.example.org"
              ];
              userPrincipals.ops = [ "root" ];
              userValidity = "1h";
            };
            # Borg repositories behind forge's sshd: handler, args, interface and config
            # file come from the module.
            borg.backupRepo = {
              host = "forge.example.org";
              quota = "50G";
              fullAccess.app = [ "archive" ];
            };
            # The fleet's WireGuard mesh: tunnel addresses and peers for its members.
            wan.mesh = {
              name = "wan";
              ipv4 = "10.77.0.0/16";
              ipv6 = "fd77:77::/64";
              persistentKeepalive = 25;
            };
          };
          # Its own sshd's host certificate from its own CA, or beacon's when forge's
          # fails; sshd trusts both CAs and both KRLs (the agent's key is the sshd host
          # key, so the request needs nothing else).
          fort.host.sshCertificate.from = [
            "forge"
            "beacon"
          ];
        }
      )
    ] ++ more "forge";

    beacon.modules = [
      (
        { pkgs, ... }:
        {
          services.fort-agent = {
            # The firewall opens the port in effect, 7771, not listen's default 7770.
            settings.listen = "[::]:7771";
            openFirewall = true;
            user = "fort";
            strictSandbox = true;
            readWritePaths = [ "/var/lib/nginx/vhosts" ];
            # The audit trail also goes to the journal; a key set by hand keeps it.
            audit.journal = true;
            audit.syslog = "tcp://logs.example.org:601";
            settings = {
              audit.max_files = 4;
              access.journal = [ "ops" ];
              access.audit = [ "ops" ];
              gc.interval = "30m";
              handler_timeout = "120s";
            };
          };
          fort.host.capabilities = {
            # fort-handler proxy through its options: vhosts in the default include
            # directory, one certificate set.
            proxy.proxy = {
              allow."*" = [ "{origin}.example.org" "*.{origin}.example.org" ];
              tls.example-org = {
                certificate = "/var/lib/nginx/certs/beacon.pem";
                key = "/var/lib/nginx/certs/beacon.pem";
              };
              upstreamHosts.app = [ "10.0.0.9" ];
            };
            # A second SSH CA, with a CA key of its own: forge's standby.
            ssh-ca.sshCa.hostPrincipals."*" = [ "{origin}" ];
            dns-record.dnsRecord = {
              zone = "example.org";
              primary = "10.0.0.53";
              key = {
                name = "fort";
                file = "/run/secrets/fort-tsig";
              };
              allow."*" = [ "{origin}.example.org" "*.{origin}.example.org" ];
              defaultTtl = 600;
            };
            # Its Prometheus scrapes what the fleet declares, at each host's own address.
            metrics.scrape = {
              ports."*" = [ "9100-9199" ];
              labels."*" = [ "env" ];
            };
            ping = {
              handler = pkgs.writeShellScript "ping" "echo pong";
              mode = "rpc";
              allowed = [
                "ops"
                "forge"
              ];
              # A host's own interface, for a capability the fleet declares none for.
              interface =
                { lib, ... }:
                {
                  options.count = lib.mkOption {
                    type = lib.types.ints.between 1 10;
                    default = 1;
                    description = "Pongs to answer with.";
                  };
                };
            };
          };
          fort.host.needs.ssl-cert.beacon = {
            from = "forge";
            request.domain = "beacon.example.org";
            # Outside /run/fort under strictSandbox: its directory becomes writable for
            # the agent. The agent runs as "fort", so the file is fort's.
            files."beacon.pem" = {
              path = "/var/lib/nginx/certs/beacon.pem";
              owner = "fort";
              group = "fort";
            };
            nag = "1h30m";
            neverSatisfied = true;
            handler = pkgs.writeShellScript "install-cert" "exit 0";
          };
        }
      )
    ] ++ more "beacon";

    app.modules = [
      (
        { config, pkgs, ... }:
        let
          oidc = config.fort.host.needs.oidc.wiki;
        in
        {
          services.fort-agent.hostKeyFile = "/var/lib/secrets/fort-key";
          # A TLS key made here and never sent, with its certificate from forge's CA.
          fort.host.certificates.web = {
            from = "forge";
            capability = "tls";
            domains = [ "app.example.org" ];
            reloadUnits = [ "nginx.service" ];
          };
          fort.host.needs = {
            # Extends the instance's need: the handler and the files are this host's
            # business.
            oidc.wiki = {
              handler = pkgs.writeShellScript "wiki-oidc" "exit 0";
              files.client_secret = {
                pointer = "/client_secret";
                credentialFor = [ "wiki.service" ];
              };
              files.client_id = {
                pointer = "/client_id";
                path = "/var/lib/wiki/oidc-client-id";
                mode = "0444";
              };
            };
            ssl-cert.app = {
              from = "forge";
              request.domain = "app.example.org";
              nag = "1h";
              renewBefore = "7d";
              files."app.pem" = { };
              restartUnits = [ "wiki.service" ];
              reloadUnits = [ "nginx.service" ];
              handler = pkgs.writeShellScript "install-cert" "exit 0";
              check = pkgs.writeShellScript "cert-fresh" "exit 0";
            };
            # A record at app's own address (hosts.json), the record set kept as a file.
            dns-record.www = {
              from = "beacon";
              request.name = "www.app.example.org";
              files."record.json" = { };
            };
            # The wiki's database, its password a credential of the service.
            postgres.wiki = {
              from = "forge";
              request.name = "wiki";
              files.password = {
                pointer = "/password";
                credentialFor = [ "wiki.service" ];
              };
            };
            # A vhost on beacon forwarding to app's own address, served with beacon's
            # certificate set; sent after the OIDC client exists.
            proxy.app = {
              from = "beacon";
              request = {
                server_names = [ "app.example.org" "www.app.example.org" ];
                port = 3000;
                tls = "example-org";
              };
              # fort-handler proxy answers {server_names, upstream, tls}, kept as a file.
              files."vhost.json" = { };
              after = [ "oidc/wiki" ];
            };
          };
          # A borg backup to forge with a key made here, and an exporter beacon scrapes.
          fort.host.backups.home = {
            from = "forge";
            capability = "borg";
            paths = [ "/home" ];
          };
          # A member of forge's mesh: its key made here, its interface kept in step.
          fort.host.meshes.wg0 = {
            from = "forge";
            capability = "wan";
          };
          fort.host.exporters.node = {
            from = "beacon";
            capability = "metrics";
            port = 9100;
            labels.env = "prod";
          };
          # A DynamicUser service: the secret arrives as a credential, the client id is
          # read from the delivered file's path (as another module reads a sops secret).
          systemd.services.wiki = {
            description = "wiki";
            wantedBy = [ "multi-user.target" ];
            environment.OIDC_CLIENT_ID_FILE = oidc.files.client_id.path;
            serviceConfig = {
              ExecStart = "${pkgs.writeShellScript "wiki" "exec sleep infinity"}";
              DynamicUser = true;
            };
          };
        }
      )
    ] ++ more "app";
  };
}
