# Request of `mesh` (fort-handler mesh, docs/handlers.md): membership of a WireGuard mesh.
# Only the public half of a key the member's agent makes travels (`$fort_key`, type
# `wireguard`); the coordinator gives the tunnel address. The payload is {mesh, host,
# public_key, ipv4, ipv6, listen_port, role, peers}.
{ lib, ... }:
let
  inherit (lib) mkOption types;
in
{
  options = {
    public_key = mkOption {
      type = types.strMatching "[A-Za-z0-9+/]{43}=";
      example = lib.literalExpression ''{ "$fort_key" = "wg"; }'';
      description = ''
        The member's WireGuard public key, base64 as `wg pubkey` prints it; in a need,
        `{ "$fort_key" = "<key>"; }` names a `wireguard` key the agent makes, so the
        private key never leaves the host.
      '';
    };
    endpoint = mkOption {
      type = types.nullOr (types.strMatching "[A-Za-z0-9.:-]{1,253}");
      default = null;
      example = "wg.example.org";
      description = ''
        The host other members send to (an IP address or a DNS name), which the
        coordinator must allow this host (`mesh.endpoints`). `null`: this host's own
        address in hosts.json.
      '';
    };
    port = mkOption {
      type = types.nullOr (types.ints.between 1 65535);
      default = null;
      example = 51820;
      description = "The UDP port this host's interface listens on (and its endpoint's port). `null`: the coordinator's `defaultPort`.";
    };
  };
}
