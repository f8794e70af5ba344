# Request of `scrape` (fort-handler scrape): the provider's Prometheus scrapes an
# exporter on this host's own address from hosts.json (never an address of the
# request's). The payload is {target, job, path, labels}.
{ lib, ... }:
let
  inherit (lib) mkOption types;
in
{
  options = {
    port = mkOption {
      type = types.ints.between 1 65535;
      example = 9100;
      description = "The exporter's port on this host's address, one the provider allows this host (`scrape.ports`).";
    };
    path = mkOption {
      type = types.strMatching "/[A-Za-z0-9._~/-]{0,255}";
      default = "/metrics";
      description = "The path Prometheus scrapes.";
    };
    job = mkOption {
      type = types.nullOr (types.strMatching "[A-Za-z_][A-Za-z0-9_-]{0,63}");
      default = null;
      example = "node";
      description = "The job of its series; their `job` label is `<host>:<job>`, the provider's. `null`: the need's id.";
    };
    labels = mkOption {
      type = types.attrsOf (types.strMatching "[ -~]{0,128}");
      default = { };
      example = {
        env = "prod";
      };
      description = ''
        More labels of its series (at most 8), each a name the provider allows this
        host (`scrape.labels`). `job`, `instance`, names starting with `__` and the
        provider's own (`fort_host`, `fort_need`) are refused.
      '';
    };
  };
}
