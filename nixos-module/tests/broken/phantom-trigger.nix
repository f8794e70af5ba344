# A trigger on a unit nothing defines (the ACME unit is named after the certificate).
{
  extra.forge = [ { fort.host.capabilities.ssl-cert.triggers.systemd = [ "acme-renew.service" ]; } ];
  expect = [
    ''fort.host.capabilities.ssl-cert.triggers.systemd: no module on forge defines the unit "acme-renew.service" (systemd.services.acme-renew), so its OnSuccess= would sit in an empty unit that never runs. Name a unit this host defines; an ACME renewal is acme-<certificate name>.service (security.acme.certs.<name>)''
  ];
}
