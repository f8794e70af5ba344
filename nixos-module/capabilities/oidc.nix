# The provider side of `fort-handler oidc`: `fort.host.capabilities.<name>.oidc` turns a
# capability into an OpenID Connect client per entry, registered at an OpenID provider by
# RFC 7591 dynamic registration and managed by RFC 7592 (docs/handlers.md, "oidc"). The
# handler's config is written to the store as JSON; it names the initial access token's
# file, never the token.
import ./provider.nix (
  { lib, shapes, ... }:
  let
    inherit (lib) literalExpression mkOption types;
    grantType = types.enum [
      "authorization_code"
      "refresh_token"
      "client_credentials"
    ];
  in
  {
    option = "oidc";
    handler = "oidc";
    description = ''
      Serve this capability with `fort-handler oidc`: an OpenID Connect client per
      entry, registered at the OpenID provider by RFC 7591 and kept up to date by
      RFC 7592, delivered as `{client_id, client_secret, issuer}`.
    '';
    example = ''
      {
        issuer = "https://id.example.org";
        initialAccessTokenFile = "/run/secrets/oidc-initial-access-token";
        allow."*" = [ "{origin}" ];
        allowRedirectUris."*" = [ "https://{origin}.example.org/" ];
      }
    '';
    settings = _: {
      issuer = mkOption {
        type = types.strMatching "https?://[!-~]+";
        example = "https://id.example.org";
        description = "The OpenID provider's issuer URL, as its discovery document states it; every credential carries it. https (http only on loopback).";
      };
      registrationEndpoint = mkOption {
        type = types.nullOr (types.strMatching "https?://[!-~]+");
        default = null;
        example = "https://id.example.org/reg";
        description = "The RFC 7591 registration endpoint. `null`: read from `<issuer>/.well-known/openid-configuration` when a run has work.";
      };
      initialAccessTokenFile = mkOption {
        type = types.str;
        example = "/run/secrets/oidc-initial-access-token";
        description = ''
          A file holding the initial access token the provider requires for
          registrations, readable by the agent's user. Read at every run that registers,
          never logged, never a store path.
        '';
      };
      caFile = mkOption {
        type = types.nullOr types.path;
        default = null;
        description = "PEM root certificates the provider's TLS certificate chains to (a private CA). `null`: the platform's trusted roots.";
      };
      allow = shapes.allow {
        example = ''{ app = [ "wiki" ]; "*" = [ "{origin}" ]; }'';
        description = ''
          Client names a caller may register, per host or principal and `"*"` for
          everyone; `{origin}` is the caller's name. A request for any other name is
          refused with the reason.
        '';
      };
      allowRedirectUris = shapes.allow {
        example = ''{ "*" = [ "https://{origin}.example.org/" ]; }'';
        description = ''
          Redirect URIs a caller may register, per host or principal and `"*"`: a URI
          ending in `/` allows every URI below it, any other exactly itself; `{origin}`
          is the caller's name. Each is an https URL in normal form (a bare host needs
          its trailing `/`).
        '';
      };
      allowGrantTypes = mkOption {
        type = types.attrsOf (types.listOf grantType);
        default = {
          "*" = [
            "authorization_code"
            "refresh_token"
          ];
        };
        example = literalExpression ''{ "*" = [ "authorization_code" "refresh_token" ]; ci = [ "client_credentials" ]; }'';
        description = "Grant types a caller may ask for, per host or principal and `\"*\"`; `client_credentials` only where granted by name.";
      };
      timeout = shapes.duration {
        default = "10s";
        description = "How long one request to the provider may take.";
      };
      runBudget = shapes.runBudget "Provider";
    };
    stateFile = {
      description = "The handler's record of the clients it registered, their secrets and registration access tokens (mode 0600).";
      shared = ", and each would delete the other's clients";
    };
    configFile =
      _: s:
      {
        inherit (s) issuer allow timeout;
        initial_access_token_file = s.initialAccessTokenFile;
        state_file = s.stateFile;
        allow_redirect_uris = s.allowRedirectUris;
        allow_grant_types = s.allowGrantTypes;
        run_budget = s.runBudget;
      }
      // lib.optionalAttrs (s.registrationEndpoint != null) {
        registration_endpoint = s.registrationEndpoint;
      }
      // lib.optionalAttrs (s.caFile != null) { ca_file = "${s.caFile}"; };
    answers = [ "client_id" "client_secret" "issuer" ];
    policy = _: s: { inherit (s) allow allowRedirectUris allowGrantTypes; };
    defaults = _: s: {
      interface = ../interfaces/oidc.nix;
      description = "OpenID Connect clients at ${s.issuer}";
    };
    async = "clients are entries the handler reconciles";
    keepsResponses = "without the cached response every run would rotate every client secret";
    paths = [ "initialAccessTokenFile" ];
    secrets = [ "initialAccessTokenFile" ];
    durations = [ "timeout" "runBudget" ];
  }
)
