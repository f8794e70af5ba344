# The provider side of `fort-handler acme`: `fort.host.capabilities.<name>.acme` turns a
# capability (usually `ssl-cert`) into certificates from an ACME CA for CSRs the consumers
# make with their own keys (docs/handlers.md, "acme"). The handler's config is written to
# the store as JSON; it names the key files (TSIG, EAB), never the secrets.
import ./provider.nix (
  { lib, shapes, ... }:
  let
    inherit (lib) mkOption types;
  in
  {
    option = "acme";
    handler = "acme";
    description = ''
      Serve this capability with `fort-handler acme`: a certificate from the ACME CA
      per entry, for the CSR the consumer made with its own key (no private key
      crosses the wire), delivered as `{certificate, chain, fullchain, not_after}`.
      Orders are moved on across runs; an entry being issued keeps its certificate.
    '';
    example = ''
      {
        directory = "https://acme-v02.api.letsencrypt.org/directory";
        contact = [ "mailto:ops@example.org" ];
        webroot = "/var/lib/acme/acme-challenge";
        allow.app = [ "app.example.org" ];
      }
    '';
    settings = _: {
      directory = mkOption {
        type = types.strMatching "https://.+";
        example = "https://acme-v02.api.letsencrypt.org/directory";
        description = "The CA's ACME directory URL.";
      };
      contact = mkOption {
        type = types.listOf types.str;
        default = [ ];
        example = [ "mailto:ops@example.org" ];
        description = "Contact URIs of the ACME account.";
      };
      eab = mkOption {
        type = types.nullOr (
          types.submodule {
            options = {
              keyId = mkOption {
                type = types.str;
                description = "The External Account Binding key id the CA gave.";
              };
              hmacFile = mkOption {
                type = types.str;
                example = "/run/secrets/acme-eab";
                description = "A file holding the base64url HMAC key the CA gave (never a store path).";
              };
            };
          }
        );
        default = null;
        description = "External Account Binding, for CAs that require one. `null`: none.";
      };
      caRoot = mkOption {
        type = types.nullOr types.path;
        default = null;
        description = ''
          A PEM root certificate the directory's TLS certificate chains to (a private or
          test CA). `null`: the platform's trusted roots.
        '';
      };
      allow = shapes.allow {
        example = ''{ app = [ "app.example.org" "*.app.example.org" ]; "*" = [ "{origin}.hosts.example.org" ]; }'';
        description = ''
          Names each caller may get certificates for, per host or principal and `"*"`
          for everyone: an exact name, or `*.SUFFIX` for every name below SUFFIX (a
          wildcard name included); `{origin}` is the caller's name. A request for any
          other name is refused, with the reason in the consumer's need state.
        '';
      };
      webroot = mkOption {
        type = types.nullOr types.str;
        default = null;
        example = "/var/lib/acme/acme-challenge";
        description = ''
          HTTP-01: the directory a web server on this host serves at
          `http://NAME/.well-known/acme-challenge/` for every name it certifies (the
          handler writes the answers below `.well-known/acme-challenge`). `null`: no
          HTTP-01.
        '';
      };
      dns01 = mkOption {
        type = types.nullOr (
          types.submodule {
            options = {
              zone = mkOption {
                type = shapes.dnsName;
                example = "example.org";
                description = "The zone `_acme-challenge` records are made in.";
              };
              primary = mkOption {
                type = shapes.dnsServer;
                example = "10.0.0.53:53";
                description = "The zone's primary, `IP` (port 53) or `IP:PORT`.";
              };
              key = shapes.tsigKey {
                file.description = "A file holding the key's base64 secret (never a store path).";
              };
              ttl = mkOption {
                type = types.ints.between 1 86400;
                default = 60;
                description = "TTL of the challenge records.";
              };
            };
          }
        );
        default = null;
        description = ''
          DNS-01 through RFC 2136 updates signed with TSIG at the zone's primary; needed
          for wildcard names, and used for every name in the zone. `null`: no DNS-01.
        '';
      };
      revokeOnRelease = mkOption {
        type = types.bool;
        default = false;
        description = "Revoke a certificate at the CA when the consumer releases it.";
      };
      rerunSeconds = mkOption {
        type = types.ints.between 1 3600;
        default = 3;
        description = "How soon the handler runs again while orders are under way.";
      };
      backoffSeconds = mkOption {
        type = types.ints.between 1 86400;
        default = 60;
        description = "First wait after an order fails at the CA (doubled per failure, at most an hour).";
      };
      maxCertificatesPerWeek = mkOption {
        type = types.ints.between 1 10000;
        default = 5;
        description = ''
          Certificates issued in any 7 days for one entry, and for one set of names;
          past it the entry keeps its certificate and waits. A CA's rate limits are
          shared by every caller (Let's Encrypt: 5 a week for one set of names).
        '';
      };
      maxCertificatesPerCallerPerWeek = mkOption {
        type = types.nullOr (types.ints.between 1 100000);
        default = null;
        description = ''
          Certificates issued in any 7 days for all entries of one caller together,
          those it released included. `null`: 20. Without it a caller asking under new
          ids for new names could spend the CA's limit for a whole domain (Let's
          Encrypt: 50 a week for one registered domain), and every other caller's new
          certificates with it.
        '';
      };
      maxOrdersPerCallerPerHour = mkOption {
        type = types.nullOr (types.ints.between 1 100000);
        default = null;
        description = ''
          Orders placed in any hour for all entries of one caller together, whatever
          became of them. `null`: 30. A CA limits new orders per account (Let's
          Encrypt: 300 in 3 hours); without it a caller whose orders fail, or that asks
          again under new ids, could spend that limit for every caller.
        '';
      };
    };
    stateFile.description = ''
      The handler's state (mode 0600): the ACME account and its key, and per entry
      the certificate issued and the order under way. One per capability.
    '';
    configFile =
      _: s:
      {
        inherit (s) directory contact allow;
        revoke_on_release = s.revokeOnRelease;
        rerun_seconds = s.rerunSeconds;
        backoff_seconds = s.backoffSeconds;
        max_certificates_per_week = s.maxCertificatesPerWeek;
        state = s.stateFile;
      }
      // lib.optionalAttrs (s.eab != null) {
        eab = {
          key_id = s.eab.keyId;
          hmac_file = s.eab.hmacFile;
        };
      }
      // lib.optionalAttrs (s.maxCertificatesPerCallerPerWeek != null) {
        max_certificates_per_caller_per_week = s.maxCertificatesPerCallerPerWeek;
      }
      // lib.optionalAttrs (s.maxOrdersPerCallerPerHour != null) {
        max_orders_per_caller_per_hour = s.maxOrdersPerCallerPerHour;
      }
      // lib.optionalAttrs (s.caRoot != null) { ca_root = "${s.caRoot}"; }
      // lib.optionalAttrs (s.webroot != null) { http01.webroot = s.webroot; }
      // lib.optionalAttrs (s.dns01 != null) {
        dns01 = {
          inherit (s.dns01) zone primary ttl;
          key = {
            inherit (s.dns01.key) name algorithm file;
          };
        };
      };
    answers = [ "certificate" "chain" "fullchain" "not_after" "expires_at" ];
    policy = _: s: {
      inherit (s) allow;
      dns01 = s.dns01 != null;
    };
    defaults = _: s: {
      interface = ../interfaces/acme.nix;
      description = "certificates from ${s.directory}";
    };
    async = "orders take several runs";
    paths = [
      "stateFile"
      "webroot"
      "dns01.key.file"
    ];
    secrets = [
      "dns01.key.file"
      "eab.hmacFile"
    ];
    patterns = [ "allow" ];
    assertions =
      { at, settings, ... }:
      [
        {
          assertion = settings.webroot != null || settings.dns01 != null;
          message = "${at}: set webroot (HTTP-01) or dns01 (DNS-01), or no challenge can be answered.";
        }
      ];
    # The handler writes challenge answers into the webroot and its state file, also
    # under strictSandbox (the agent's own state directory is writable anyway). "-": a
    # webroot the web server has not made yet fails the orders that need it, not the agent.
    extraConfig = served: {
      services.fort-agent.readWritePaths = lib.unique (
        lib.concatLists (
          lib.mapAttrsToList (
            _: c:
            lib.optional (c.acme.webroot != null) "-${c.acme.webroot}"
            ++ lib.optional (!lib.hasPrefix "/var/lib/fort/" c.acme.stateFile) "-${dirOf c.acme.stateFile}"
          ) served
        )
      );
    };
  }
)
