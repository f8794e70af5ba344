# Request of `oidc` (fort-handler oidc, docs/handlers.md): one OpenID Connect client per
# consumer need, registered at the provider's OpenID provider. The payload is
# {client_id, client_secret, issuer}. The provider decides which names, redirect URIs and
# grant types each caller may have.
{ lib, ... }:
let
  inherit (lib) mkOption types;
in
{
  options = {
    client_name = mkOption {
      type = types.strMatching "[a-z0-9][a-z0-9-]{0,62}";
      example = "outline";
      description = "Name of the client at the identity provider, shown on its consent screen.";
    };
    redirect_uris = mkOption {
      type = types.listOf (types.strMatching "https://[!-~]+");
      default = [ ];
      example = [ "https://outline.example.org/auth/oidc.callback" ];
      description = ''
        Where the identity provider may send the user back after login (https, in normal
        form, without fragment; at most 16). Needed for `authorization_code`.
      '';
    };
    scopes = mkOption {
      type = types.listOf (types.strMatching "[A-Za-z0-9_.:/-]{1,64}");
      default = [ "openid" ];
      example = [
        "openid"
        "email"
      ];
      description = "Scopes the client may request (the identity provider must know them).";
    };
    grant_types = mkOption {
      type = types.listOf (
        types.enum [
          "authorization_code"
          "refresh_token"
          "client_credentials"
        ]
      );
      default = [ "authorization_code" ];
      example = [ "client_credentials" ];
      description = ''
        How the client gets tokens: `authorization_code` (users sign in), `refresh_token`,
        `client_credentials` (a service for itself). The provider allows each per caller.
      '';
    };
    rotate = mkOption {
      type = types.ints.unsigned;
      default = 0;
      example = 1;
      description = ''
        Raise it to get a new client secret: the old one stops working as the new one is
        delivered (where the identity provider cannot change a secret, the new secret
        comes with a new client id).
      '';
    };
  };
}
