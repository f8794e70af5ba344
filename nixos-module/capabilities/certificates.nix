# The consumer side of `fort-handler acme`, read like `security.acme.certs`:
#
#   fort.host.certificates.wiki = {
#     from = "forge";
#     domains = [ "wiki.example.org" ];
#     group = "nginx";
#     reloadUnits = [ "nginx.service" ];
#   };
#
# declares the need `ssl-cert/wiki` with a key this host makes (docs/protocol.md §11.10):
# the request carries only a CSR, and the key lands at `<directory>/key.pem` together with
# `cert.pem`, `chain.pem` and `fullchain.pem`, with one reload. Services read the paths
# from `config.fort.host.needs.ssl-cert.wiki.files.fullchain.path` and `.keys.key.path`.
{
  config,
  lib,
  ...
}:
let
  inherit (lib) mkOption types literalExpression;
  fortLib = import ../lib.nix { inherit lib; };

  certificate = types.submodule (
    { name, config, ... }:
    {
      options = {
        from = mkOption {
          type = types.either types.str (types.nonEmptyListOf types.str);
          example = "forge";
          description = ''
            The host whose `acme` capability issues the certificate, or several in order
            of preference: one of them at a time, each with its own ACME account (the
            need moves as any need does; docs/handlers.md, acme, "How it fails over").
          '';
        };
        capability = mkOption {
          type = types.str;
          default = "ssl-cert";
          description = "The capability's name at the provider (the need's type).";
        };
        domains = mkOption {
          type = types.nonEmptyListOf types.str;
          example = [
            "wiki.example.org"
            "*.wiki.example.org"
          ];
          description = "Names the certificate is for; the first is its common name. The provider must allow them for this host.";
        };
        keyType = mkOption {
          type = types.enum [
            "ecdsa-p256"
            "ed25519"
            "rsa-2048"
            "rsa-3072"
          ];
          default = "ecdsa-p256";
          description = "The key's algorithm (ACME CAs take ECDSA P-256).";
        };
        reuseKey = mkOption {
          type = types.bool;
          default = false;
          description = "Keep the key across renewals; by default each renewal makes a new one.";
        };
        directory = mkOption {
          type = types.str;
          default = "/var/lib/fort-certificates/${name}";
          defaultText = literalExpression ''"/var/lib/fort-certificates/<name>"'';
          description = ''
            Where `key.pem`, `cert.pem`, `chain.pem` and `fullchain.pem` land. On disk
            rather than in `/run`: a key lost to a reboot would be replaced by a new one,
            and every reboot would cost an order at the CA.
          '';
        };
        owner = mkOption {
          type = types.str;
          default = "root";
          description = "Owner of the key and certificate files.";
        };
        group = mkOption {
          type = types.str;
          default = "root";
          example = "nginx";
          description = "Group of the key and certificate files; the key is readable by it (0440).";
        };
        renewBefore = mkOption {
          type = fortLib.durationType;
          default = "30d";
          description = "Ask for a new certificate this long before the current one expires.";
        };
        reloadUnits = mkOption {
          type = types.listOf types.str;
          default = [ ];
          example = [ "nginx.service" ];
          description = "Units reloaded once each time a new key and certificate are in place.";
        };
        restartUnits = mkOption {
          type = types.listOf types.str;
          default = [ ];
          description = "Units restarted once each time a new key and certificate are in place.";
        };
      };
    }
  );

  certs = config.fort.host.certificates;
in
{
  options.fort.host.certificates = mkOption {
    type = types.attrsOf certificate;
    default = { };
    example = literalExpression ''
      {
        wiki = {
          from = "forge";
          domains = [ "wiki.example.org" ];
          group = "nginx";
          reloadUnits = [ "nginx.service" ];
        };
      }
    '';
    description = ''
      TLS certificates from an `acme` provider for keys this host makes and never sends,
      one need each (`fort.host.needs.<capability>.<name>`). Key and certificate land
      together, and a renewal swaps both at once.
    '';
  };

  config.fort.host.needs = lib.mkMerge (
    lib.mapAttrsToList (name: c: {
      ${c.capability}.${name} = {
        inherit (c)
          from
          renewBefore
          reloadUnits
          restartUnits
          ;
        nag = lib.mkDefault "1m";
        request.csr = fortLib.key "key" "csr";
        keys.key = {
          type = c.keyType;
          path = "${c.directory}/key.pem";
          inherit (c) owner group;
          mode = "0440";
          names = c.domains;
          reuse = c.reuseKey;
        };
        files =
          lib.genAttrs
            [
              "cert"
              "chain"
              "fullchain"
            ]
            (file: {
              path = "${c.directory}/${file}.pem";
              pointer = if file == "cert" then "/certificate" else "/${file}";
              inherit (c) owner group;
              mode = "0444";
            });
      };
    }) certs
  );
}
