# scrape mistakes: an exporter on a port the provider does not scrape, with a label it
# reserves and one it does not allow; two capabilities writing one target directory.
{
  extra.beacon = [
    {
      fort.host.capabilities.metrics2.scrape.targetsDir = "/var/lib/fort-scrape/metrics";
    }
  ];
  extra.app = [
    {
      fort.host.exporters.db = {
        from = "beacon";
        capability = "metrics";
        port = 5432;
        labels = {
          instance = "db.example.org:9187";
          team = "data";
        };
      };
    }
  ];
  expect = [
    "host app: fort.host.needs.metrics.db.request.port: 5432 is not a port capability metrics of beacon scrapes app on (allowed: 9100-9199)."
    "host app: fort.host.needs.metrics.db.request.labels.instance: the label instance is reserved"
    "host app: fort.host.needs.metrics.db.request.labels.team: team is not a label capability metrics of beacon lets app set (allowed: env)."
    "fort.host.capabilities.<name>.scrape.targetsDir: two capabilities share one directory; give each its own."
  ];
}
