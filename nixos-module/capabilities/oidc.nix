# The provider side of `fort-handler oidc`: `fort.host.capabilities.<name>.oidc` turns a
# capability into an OpenID Connect client per entry, registered at an OpenID provider by
# RFC 7591 dynamic registration and managed by RFC 7592 (docs/handlers.md, "oidc"). The
# handler's config is written to the store as JSON; it names the initial access token's
# file, never the token.
{
  config,
  lib,
  pkgs,
  ...
}:
let
  inherit (lib)
    filterAttrs
    literalExpression
    mapAttrsToList
    mkDefault
    mkIf
    mkOption
    types
    ;
  fortPackage = config.services.fort-agent.package;
  grantType = types.enum [
    "authorization_code"
    "refresh_token"
    "client_credentials"
  ];

  settings =
    name:
    types.submodule {
      options = {
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
        allow = mkOption {
          type = types.attrsOf (types.listOf types.str);
          default = { };
          example = literalExpression ''{ app = [ "wiki" ]; "*" = [ "{origin}" ]; }'';
          description = ''
            Client names a caller may register, per host or principal and `"*"` for
            everyone; `{origin}` is the caller's name. A request for any other name is
            refused with the reason.
          '';
        };
        allowRedirectUris = mkOption {
          type = types.attrsOf (types.listOf types.str);
          default = { };
          example = literalExpression ''{ "*" = [ "https://{origin}.example.org/" ]; }'';
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
        timeout = mkOption {
          type = types.str;
          default = "10s";
          description = "How long one request to the provider may take.";
        };
        runBudget = mkOption {
          type = types.str;
          default = "40s";
          description = "Provider work one handler run may do (the agent's `handler_timeout` is 60 s); the rest continues in the next run.";
        };
        stateFile = mkOption {
          type = types.str;
          default = "/var/lib/fort/handlers/${name}.json";
          defaultText = literalExpression ''"/var/lib/fort/handlers/<name>.json"'';
          description = "The handler's record of the clients it registered, their secrets and registration access tokens (mode 0600).";
        };
      };
    };

  configFile =
    name: s:
    pkgs.writeText "fort-oidc-${name}.json" (
      builtins.toJSON (
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
        // lib.optionalAttrs (s.caFile != null) { ca_file = "${s.caFile}"; }
      )
    );

  withOidc = filterAttrs (_: c: c.oidc != null) config.fort.host.capabilities;
in
{
  options.fort.host.capabilities = mkOption {
    type = types.attrsOf (
      types.submodule (
        { name, config, ... }:
        {
          options.oidc = mkOption {
            type = types.nullOr (settings name);
            default = null;
            example = literalExpression ''
              {
                issuer = "https://id.example.org";
                initialAccessTokenFile = "/run/secrets/oidc-initial-access-token";
                allow."*" = [ "{origin}" ];
                allowRedirectUris."*" = [ "https://{origin}.example.org/" ];
              }
            '';
            description = ''
              Serve this capability with `fort-handler oidc`: an OpenID Connect client per
              entry, registered at the OpenID provider by RFC 7591 and kept up to date by
              RFC 7592, delivered as `{client_id, client_secret, issuer}`.
            '';
          };
          config = mkIf (config.oidc != null) {
            handler = mkDefault "${fortPackage}/bin/fort-handler";
            args = [
              "oidc"
              "--config"
              "${configFile name config.oidc}"
            ];
            configFiles = [ (configFile name config.oidc) ];
            policy = {
              handler = "oidc";
              inherit (config.oidc) allow allowRedirectUris allowGrantTypes;
              response = [ "client_id" "client_secret" "issuer" ];
            };
            interface = mkDefault ../interfaces/oidc.nix;
            cacheResponse = mkDefault true;
            description = mkDefault "OpenID Connect clients at ${config.oidc.issuer}";
          };
        }
      )
    );
  };

  config.assertions = lib.concatLists (
    mapAttrsToList (name: c: [
      {
        assertion = c.mode == "async" && c.cacheResponse;
        message = "fort.host.capabilities.${name}.oidc: the capability must be async with cacheResponse = true (without the cached response every run would rotate every client secret).";
      }
      {
        assertion = !lib.hasPrefix builtins.storeDir (toString c.oidc.initialAccessTokenFile);
        message = "fort.host.capabilities.${name}.oidc.initialAccessTokenFile is in the Nix store, readable by every user; give a path outside it (a secret manager's file).";
      }
      {
        assertion = lib.hasPrefix "/" c.oidc.initialAccessTokenFile && lib.hasPrefix "/" c.oidc.stateFile;
        message = "fort.host.capabilities.${name}.oidc: initialAccessTokenFile and stateFile must be absolute paths.";
      }
      {
        assertion = builtins.all (d: builtins.match "[0-9]+(ms|s|m|h)" d != null) [
          c.oidc.timeout
          c.oidc.runBudget
        ];
        message = "fort.host.capabilities.${name}.oidc: timeout and runBudget are durations such as \"10s\" or \"500ms\".";
      }
    ]) withOidc
  );
}
