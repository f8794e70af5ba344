# Monitoring between hosts (`fort-handler scrape`, docs/handlers.md "scrape").
#   Provider: fort.host.capabilities.<name>.scrape = { ports."*" = [ "9100-9199" ]; };
#   — this host's Prometheus scrapes every entry's exporter, at its caller's own address
#   from the fleet registry, from a file_sd target file per caller.
#   Consumer: fort.host.exporters.<name> = { from = "mon"; port = 9100; };
#   — "scrape me": the need, one per exporter.
{
  config,
  lib,
  ...
}:
let
  inherit (lib)
    literalExpression
    mapAttrsToList
    mkIf
    mkOption
    types
    ;

  provider = import ./provider.nix (
    { shapes, ... }:
    {
      option = "scrape";
      handler = "scrape";
      description = ''
        Serve this capability with `fort-handler scrape`: this host's Prometheus
        scrapes every entry's exporter at its caller's own address from hosts.json (no
        request names an address), on a port `ports` allows that caller, with labels
        `labels` allows it, and with `fort_host` and `fort_need` naming who asked;
        delivered as `{target, job, path, labels}`. One `file_sd` file per caller in
        `targetsDir`.
      '';
      example = ''{ ports."*" = [ "9100-9199" ]; labels."*" = [ "env" ]; }'';
      settings = name: {
        targetsDir = mkOption {
          type = types.strMatching "/[A-Za-z0-9._+/-]*";
          default = "/var/lib/fort-scrape/${name}";
          defaultText = literalExpression ''"/var/lib/fort-scrape/<name>"'';
          description = "The directory of the target files (`<host>.json`), which Prometheus reads.";
        };
        ports = mkOption {
          type = types.attrsOf (types.listOf (types.strMatching "[0-9]{1,5}(-[0-9]{1,5})?"));
          default = { };
          example = literalExpression ''{ "*" = [ "9100-9199" ]; db = [ "9187" ]; }'';
          description = ''
            Ports a host's exporters may be scraped on, per host and `"*"`: a port or
            a range (`9100-9199`). A request for another port is refused.
          '';
        };
        labels = shapes.allow {
          example = ''{ "*" = [ "env" ]; ops = [ "team" ]; }'';
          description = ''
            Label names a host may set on its targets, per host and `"*"`. `job`,
            `instance`, names starting with `__`, `fort_host`, `fort_need` and
            `reservedLabels` never.
          '';
        };
        reservedLabels = mkOption {
          type = types.listOf (types.strMatching "[A-Za-z_][A-Za-z0-9_]{0,63}");
          default = [ ];
          description = "Label names nobody may set, besides those always reserved.";
        };
        scheme = mkOption {
          type = types.enum [
            "http"
            "https"
          ];
          default = "http";
          description = "The scheme Prometheus scrapes with.";
        };
        configurePrometheus = mkOption {
          type = types.bool;
          default = true;
          description = "Add a scrape job (`fort-<name>`) reading `<targetsDir>/*.json` to `services.prometheus.scrapeConfigs`.";
        };
        scrapeInterval = mkOption {
          type = types.nullOr types.str;
          default = null;
          example = "30s";
          description = "That job's `scrape_interval`. `null`: Prometheus' global one.";
        };
      };
      stateFile = {
        description = "The handler's record of each entry's exporter and the target files it wrote (mode 0600).";
        shared = ", and each would remove the other's target files";
      };
      configFile = _: s: {
        state_file = s.stateFile;
        targets_dir = s.targetsDir;
        hosts_file = "/etc/fort/hosts.json";
        inherit (s) ports labels scheme;
        reserved_labels = s.reservedLabels;
      };
      answers = [
        "target"
        "job"
        "path"
        "labels"
      ];
      policy = _: s: { inherit (s) ports labels reservedLabels; };
      defaults = _: _: {
        interface = ../interfaces/scrape.nix;
        description = "Prometheus targets";
      };
      async = "targets are entries the handler reconciles";
      paths = [ "targetsDir" ];
      patterns = [ "labels" ];
      extraConfig =
        served:
        let
          all = mapAttrsToList (name: c: c.scrape // { inherit name; }) served;
          dirs = map (s: s.targetsDir) all;
        in
        mkIf (served != { }) {
          services.fort-agent.readWritePaths = dirs;
          systemd.tmpfiles.rules = map (s: "d ${s.targetsDir} 0755 root root -") all;
          services.prometheus.scrapeConfigs = map (
            s:
            {
              job_name = "fort-${s.name}";
              file_sd_configs = [ { files = [ "${s.targetsDir}/*.json" ]; } ];
            }
            // lib.optionalAttrs (s.scrapeInterval != null) { scrape_interval = s.scrapeInterval; }
          ) (lib.filter (s: s.configurePrometheus) all);
          assertions = [
            {
              assertion = lib.length dirs == lib.length (lib.unique dirs);
              message = "fort.host.capabilities.<name>.scrape.targetsDir: two capabilities share one directory; give each its own.";
            }
          ];
        };
    }
  );

  exporters = config.fort.host.exporters;

  exporter = types.submodule {
    options = {
      from = mkOption {
        type = types.either types.str (types.nonEmptyListOf types.str);
        example = "mon";
        description = ''
          The host whose `scrape` capability scrapes it, or several in order of
          preference (one at a time: the need moves as any need does). For two monitors
          scraping at once, declare an exporter for each.
        '';
      };
      capability = mkOption {
        type = types.str;
        default = "scrape";
        description = "The capability's name at the provider (the need's type).";
      };
      port = mkOption {
        type = types.port;
        example = 9100;
        description = "The exporter's port on this host's address (hosts.json); the provider must allow it.";
      };
      path = mkOption {
        type = types.str;
        default = "/metrics";
        description = "The path scraped.";
      };
      job = mkOption {
        type = types.nullOr types.str;
        default = null;
        description = "The job of its series; their `job` label is `<host>:<job>`, the provider's. `null`: the exporter's name.";
      };
      labels = mkOption {
        type = types.attrsOf types.str;
        default = { };
        example = {
          env = "prod";
        };
        description = "More labels, names the provider allows this host.";
      };
    };
  };
in
{
  imports = [ provider ];

  options.fort.host.exporters = mkOption {
    type = types.attrsOf exporter;
    default = { };
    example = literalExpression ''
      { node = { from = "mon"; port = 9100; }; postgres = { from = "mon"; port = 9187; labels.env = "prod"; }; }
    '';
    description = ''
      Exporters of this host a `scrape` provider's Prometheus scrapes, one need each
      (`fort.host.needs.<capability>.<name>`), at this host's address from the fleet
      registry. The target it was given lands in `/run/fort/needs/<capability>/<name>/target`.
    '';
  };

  config = mkIf (exporters != { }) {
    fort.host.needs = lib.mkMerge (
      mapAttrsToList (name: e: {
        ${e.capability}.${name} = {
          inherit (e) from;
          request = {
            inherit (e) port path labels;
          }
          // lib.optionalAttrs (e.job != null) { inherit (e) job; };
          files.target = {
            pointer = "/target";
            mode = "0644";
          };
        };
      }) exporters
    );
  };
}
