# A syslog target whose port no socket can have: refused at evaluation, as the agent
# would refuse it at start.
{
  extra.forge = [ { services.fort-agent.audit.syslog = "tcp://logs.example.org:70000"; } ];
  evalError = true;
  expect = [
    "services.fort-agent.audit.syslog' is not of type `null or udp://HOST:PORT or tcp://HOST:PORT, the port 1 to 65535'"
  ];
}
