# Request of `proxy` (handlers/examples/proxy-provider.sh): a virtual host on the proxy
# forwarding to the consumer. The payload is `OK` once the virtual host is in place.
{ lib, ... }:
let
  inherit (lib) mkOption types;
in
{
  options = {
    server_name = mkOption {
      type = types.strMatching "[a-z0-9.-]+";
      example = "wiki.example.org";
      description = "Name the virtual host answers to.";
    };
    upstream = mkOption {
      type = types.strMatching "https?://[A-Za-z0-9.:_-]+/?";
      example = "http://10.0.0.7:3000";
      description = "Where requests are forwarded.";
    };
    sign_in_client = mkOption {
      type = types.nullOr (types.strMatching "[A-Za-z0-9._-]{1,128}");
      default = null;
      example = lib.literalExpression ''config.fort.lib.ref "oidc/wiki" "/client_id"'';
      description = ''
        The OIDC client users sign in through before they reach the upstream, usually a
        reference to the consumer's own `oidc` need's `client_id`, resolved by its agent
        before sending (and sent again when it changes). `null`: no sign-in. (The
        example handler names it in the virtual host.)
      '';
    };
    certificate = mkOption {
      type = types.nullOr types.str;
      default = null;
      example = lib.literalExpression ''config.fort.lib.ref "ssl-cert/wiki" ""'';
      description = ''
        PEM certificate and private key to serve TLS with, usually a reference to the
        consumer's own `ssl-cert` need, resolved by its agent before sending. `null`:
        plain HTTP only. (The example handler writes plain HTTP virtual hosts and
        ignores it.)
      '';
    };
  };
}
