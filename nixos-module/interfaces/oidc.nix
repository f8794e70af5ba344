# Request of `oidc` (handlers/examples/oidc-provider.sh): one OIDC client per consumer.
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
      type = types.listOf (types.strMatching "https://[^[:space:]]+");
      default = [ ];
      example = [ "https://outline.example.org/auth/oidc.callback" ];
      description = "Where the identity provider may send the user back after login.";
    };
    scopes = mkOption {
      type = types.listOf (
        types.enum [
          "openid"
          "email"
          "profile"
          "groups"
        ]
      );
      default = [ "openid" ];
      example = [
        "openid"
        "email"
      ];
      description = "Scopes the client may request.";
    };
  };
}
