# The fleet `fort-agent demo` runs on loopback, as NixOS configuration: lib.mkFleet's
# arguments (flake.nix beside this file passes them on). Three hosts:
#   forge   serves oidc (an OIDC client per consumer need) and ssl-cert (a certificate
#           per domain), with the example handlers of handlers/examples;
#   beacon  serves proxy (a reverse-proxy vhost per consumer need);
#   app     needs all of them: an OIDC client whose id and secret land as files (wiki
#           restarted when they change), certificates (nginx reloaded), one certificate
#           kept by a handler of its own, a vhost whose sign-in client is built from the
#           OIDC need's response, and a certificate living seconds, renewed before it ends.
# `ops` is the operator: it may read journals, restart units and rotate credentials.
#
# fort's tests evaluate this file (nixos-module/tests/run.sh) and run
# `fort-agent check --fleet` over what it generates, so it stays what the demo runs.
#
# `fort`: the fort flake (its lib and its source, for the example handlers).
{ fort }:
let
  # One of fort's example handlers as a store script (docs/handlers.md).
  example =
    pkgs: name:
    pkgs.writeShellScript name (builtins.readFile (fort.outPath + "/handlers/examples/${name}.sh"));
in
{
  # Each capability's request, type-checked on every consumer at evaluation and shipped
  # to the provider's agent as JSON Schema.
  interfaces = fort.lib.interfaces;

  # The fleet's declarations, evaluated once for the whole fleet (and imported by every
  # host): only fort.cluster may be set here.
  cluster = [
    {
      fort.cluster = {
        # Replace the addresses and keys with your hosts': `ssh-keyscan -t ed25519 HOST`.
        hosts = {
          forge = {
            address = "https://10.0.0.1:7770";
            publicKeys = [
              "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAICct65jyIlhXO0AHctwV9ceHpyR55DoiyGNOfTUF3o1S root@forge"
            ];
          };
          beacon = {
            address = "https://10.0.0.2:7770";
            publicKeys = [
              "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIBtCU3wzlR0y+L3yAvx3i7Y38BaKUWJ/0HNBtKvTVgNY root@beacon"
            ];
          };
          app = {
            address = "https://10.0.0.3:7770";
            publicKeys = [
              "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAINFzwmnqJzVllc32i843dqwnHXrBOgFLIOkNWEaOZjdZ root@app"
            ];
          };
        };
        principals.ops.publicKeys = [
          "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIBJY+9ftFeczRutdE6rkNXb1zJCQl6lbmZHSi33br/+8 ops"
        ];
      };
    }
  ];

  shared = [
    {
      services.fort-agent = {
        enable = true;
        openFirewall = true;
        settings.access = {
          journal = [ "ops" ];
          systemd = [ "ops" ];
          trigger = [ "ops" ];
        };
      };
    }
  ];

  hosts.forge.modules = [
    (
      { pkgs, ... }:
      {
        services.fort-agent = {
          path = [
            pkgs.jq
            pkgs.openssl
          ];
          handlerEnvironment.FORT_EXAMPLE_STATE = "/var/lib/fort-examples";
        };
        fort.host.capabilities = {
          oidc = {
            handler = example pkgs "oidc-provider";
            cacheResponse = true;
            triggers.initialize = true;
            description = "OIDC client id and secret per consumer need";
          };
          ssl-cert = {
            handler = example pkgs "cert-provider";
            cacheResponse = true;
            triggers.initialize = true;
            description = "self-signed certificate per requested domain";
          };
        };
      }
    )
  ];

  hosts.beacon.modules = [
    (
      { pkgs, ... }:
      {
        services.fort-agent = {
          path = [ pkgs.jq ];
          handlerEnvironment.FORT_EXAMPLE_STATE = "/var/lib/fort-examples";
        };
        fort.host.capabilities.proxy = {
          handler = example pkgs "proxy-provider";
          triggers.initialize = true;
          description = "reverse-proxy vhost file; answers OK";
        };
      }
    )
  ];

  hosts.app.modules = [
    (
      { config, pkgs, ... }:
      {
        services.fort-agent.handlerEnvironment.FORT_EXAMPLE_STATE = "/var/lib/fort-examples";
        fort.host.needs = {
          # Two files cut from the JSON payload; wiki restarted once when they change.
          # The secret is kept as a systemd encrypted credential (docs/at-rest.md).
          oidc.wiki = {
            from = "forge";
            request = {
              client_name = "wiki";
              redirect_uris = [ "https://wiki.demo.test/oauth/callback" ];
            };
            files.client_id = {
              pointer = "/client_id";
              mode = "0444";
            };
            files.client_secret = {
              pointer = "/client_secret";
              encrypt = true;
            };
            restartUnits = [ "wiki.service" ];
          };
          ssl-cert.wiki = {
            from = "forge";
            request.domain = "wiki.demo.test";
            files."bundle.pem" = { };
            reloadUnits = [ "nginx.service" ];
          };
          # Delivered by a handler of its own instead of files.
          ssl-cert.api = {
            from = "forge";
            request.domain = "api.demo.test";
            handler = example pkgs "store-payload";
          };
          # Built from another need's response: users sign in through the wiki's own
          # OIDC client, whatever id forge issued it; sent again when it changes.
          proxy.wiki = {
            from = "beacon";
            request = {
              server_names = [ "wiki.demo.test" ];
              port = 3000;
              sign_in_client = config.fort.lib.ref "oidc/wiki" "/client_id";
            };
          };
          # A certificate living seconds, asked for again before it expires.
          ssl-cert.short = {
            from = "forge";
            request = {
              domain = "short.demo.test";
              lifetime_seconds = 15;
            };
            renewBefore = "10s";
            files."bundle.pem" = { };
            reloadUnits = [ "nginx.service" ];
          };
        };
      }
    )
  ];
}
