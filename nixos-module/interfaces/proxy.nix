# Request of `proxy` (fort-handler proxy; also the example handler
# handlers/examples/proxy-provider.sh): a virtual host on the provider's nginx answering
# to `server_names` and forwarding to `port` (and `path`) on this host's own address from
# hosts.json. The payload is {server_names, upstream, tls} (the example handler: `OK`).
{ lib, ... }:
let
  inherit (lib) mkOption types;
  dnsName = "(\\*\\.)?([A-Za-z0-9_-]{1,63}\\.)*[A-Za-z0-9_-]{1,63}\\.?";
in
{
  options = {
    server_names = mkOption {
      type = types.nonEmptyListOf (types.strMatching dnsName);
      example = [ "wiki.example.org" ];
      description = ''
        The names the virtual host answers to (1 to 16 DNS names), each among the names
        the provider allows this host (`proxy.allow`). A name another consumer of the
        provider already has is refused.
      '';
    };
    port = mkOption {
      type = types.ints.between 1 65535;
      example = 3000;
      description = "The port of the upstream on this host's address.";
    };
    path = mkOption {
      type = types.nullOr (types.strMatching "/[A-Za-z0-9._~/-]{0,255}");
      default = null;
      example = "/wiki/";
      description = "The path requests are forwarded under. `null`: the path as it came.";
    };
    scheme = mkOption {
      type = types.enum [ "http" ];
      default = "http";
      description = "The upstream's scheme: plain HTTP (TLS ends at the proxy).";
    };
    upstream_host = mkOption {
      type = types.nullOr (types.strMatching "[A-Za-z0-9_.:-]{1,253}|[[][0-9A-Fa-f:.]{2,45}[]]");
      default = null;
      example = "10.0.0.9";
      description = ''
        Another host to forward to (an IP address or DNS name), which the provider must
        allow this host (`proxy.upstreamHosts`). `null`: this host's own address from
        hosts.json.
      '';
    };
    tls = mkOption {
      type = types.nullOr (types.strMatching "[A-Za-z0-9._-]{1,64}");
      default = null;
      example = "example-org";
      description = ''
        The provider's certificate set (`proxy.tls.<name>`) to serve HTTPS with; plain
        HTTP then redirects to HTTPS. `null`: plain HTTP only.
      '';
    };
    sign_in_client = mkOption {
      type = types.nullOr (types.strMatching "[A-Za-z0-9._-]{1,128}");
      default = null;
      example = lib.literalExpression ''config.fort.lib.ref "oidc/wiki" "/client_id"'';
      description = ''
        The OIDC client users sign in through before they reach the upstream, usually a
        reference to this host's own `oidc` need's `client_id`, resolved by its agent
        before sending. Only the example handler takes it (it names it in the virtual
        host); `fort-handler proxy` has no sign-in and refuses a request with one rather
        than serve the upstream without it. `null`: no sign-in.
      '';
    };
  };
}
