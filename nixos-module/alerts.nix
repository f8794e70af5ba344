# fort's Prometheus alert rules (alerts/fort.rules.yml), for the host that runs
# Prometheus and scrapes the agents' metrics endpoints.
{
  config,
  lib,
  ...
}:
{
  options.services.fort-agent.metrics.alertRules = lib.mkOption {
    type = lib.types.bool;
    default = false;
    example = true;
    description = ''
      Add fort's alert rules to this host's Prometheus: a need expiring within a week and
      not being renewed, a provider its consumers cannot reach, a capability whose handler
      runs fail, and responses undelivered to their consumers (`alerts/fort.rules.yml` of
      the module, on the series each agent's metrics endpoint exports with
      `services.fort-agent.metrics.enable`). Set it where Prometheus runs; it needs no
      agent there. The file goes to `services.prometheus.ruleFiles`, which Prometheus
      checks with `promtool check rules` at build time, rather than to
      `services.prometheus.rules`, whose strings are joined into one YAML document where
      two `groups:` keys would clash.
    '';
  };

  config = lib.mkIf config.services.fort-agent.metrics.alertRules {
    services.prometheus.ruleFiles = [ ./alerts/fort.rules.yml ];
  };
}
