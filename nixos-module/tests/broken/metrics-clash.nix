# The metrics endpoint on the agent's own port (beacon listens on 7771 via settings.listen).
{
  extra.beacon = [
    {
      services.fort-agent.metrics = {
        enable = true;
        listen = "127.0.0.1:7771";
      };
    }
  ];
  expect = [
    ''services.fort-agent.metrics.listen = "127.0.0.1:7771" uses the port the agent already listens on (services.fort-agent.settings.listen = "[::]:7771"); give the metrics endpoint a port of its own (default 127.0.0.1:9770).''
  ];
}
