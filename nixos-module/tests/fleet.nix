# The three-host fleet of the evaluation test, as lib.mkFleet arguments.
#   forge:  provides oidc (async, cacheResponse, triggered by pocket-id-setup) and ssl-cert
#   beacon: provides proxy (async) and ping (rpc); consumes oidc (two instances) and
#           ssl-cert; runs as user "fort" under strictSandbox
#   app:    consumes oidc (instance wiki, by name and by tag), ssl-cert and proxy directly
# `extra.<host>` adds modules to a host (the broken fleets use it).
{
  extra ? { },
}:
let
  key = name: builtins.readFile (./keys + "/${name}.pub");
  trim = s: builtins.head (builtins.match "([^\n]*)\n*" s);
  pub = name: trim (key name);
  more = name: extra.${name} or [ ];
in
{
  shared = [
    {
      fort.cluster = {
        hosts = {
          forge = {
            address = "http://10.0.0.1:7770";
            publicKeys = [ (pub "forge") ];
            tags = [ "infra" ];
          };
          beacon = {
            address = "http://10.0.0.2:7770";
            publicKeys = [ (pub "beacon") ];
            tags = [
              "edge"
              "web"
            ];
          };
          app = {
            address = "http://10.0.0.3:7770";
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
      services.fort-agent.enable = true;
    }
  ];

  hosts = {
    forge.modules = [
      (
        { pkgs, ... }:
        {
          services.fort-agent = {
            openFirewall = true;
            metrics.enable = true;
          };
          fort.host.capabilities = {
            oidc = {
              handler = pkgs.writeShellScript "oidc-reconcile" "exit 0";
              cacheResponse = true;
              allowed = [ "ops" ];
              triggers.initialize = true;
              triggers.systemd = [ "pocket-id-setup.service" ];
              description = "OIDC clients in pocket-id";
            };
            ssl-cert = {
              handler = pkgs.writeShellScript "ssl-cert-issue" "exit 0";
              triggers.systemd = [ "pocket-id-setup.service" ];
            };
          };
        }
      )
    ] ++ more "forge";

    beacon.modules = [
      (
        { pkgs, ... }:
        {
          services.fort-agent = {
            listen = "[::]:7771";
            openFirewall = true;
            user = "fort";
            strictSandbox = true;
            readWritePaths = [ "/var/lib/nginx/vhosts" ];
            settings = {
              access.journal = [ "ops" ];
              gc.interval = "30m";
              handler_timeout = "120s";
            };
          };
          fort.host.capabilities = {
            proxy.handler = pkgs.writeShellScript "proxy-vhosts" "exit 0";
            ping = {
              handler = pkgs.writeShellScript "ping" "echo pong";
              mode = "rpc";
              allowed = [
                "ops"
                "forge"
              ];
            };
          };
          fort.host.needs.ssl-cert.beacon = {
            from = "forge";
            request.domains = [ "beacon.example.org" ];
            nag = "1h30m";
            neverSatisfied = true;
            handler = pkgs.writeShellScript "install-cert" "exit 0";
          };
        }
      )
    ] ++ more "beacon";

    app.modules = [
      (
        { pkgs, ... }:
        {
          services.fort-agent.hostKeyFile = "/var/lib/secrets/fort-key";
          fort.host.needs = {
            # Extends the instance's need: the handler is this host's business.
            oidc.wiki.handler = pkgs.writeShellScript "wiki-oidc" "exit 0";
            ssl-cert.app = {
              from = "forge";
              request.domains = [ "app.example.org" ];
              nag = "1h";
              handler = pkgs.writeShellScript "install-cert" "exit 0";
              check = pkgs.writeShellScript "cert-fresh" "exit 0";
            };
            # Side-effect only: satisfied when beacon answers OK.
            proxy.app = {
              from = "beacon";
              request = {
                hostname = "app.example.org";
                upstream = "http://10.0.0.3:3000";
              };
            };
          };
        }
      )
    ] ++ more "app";
  };
}
