# A file mode that is not octal: the option's type refuses it.
{
  extra.app = [ { fort.host.needs.ssl-cert.app.files."app.pem".mode = "644x"; } ];
  evalError = true;
  expect = [ "fort.host.needs.ssl-cert.app.files.\"app.pem\".mode' is not of type `string matching the pattern [0-7]{3,4}'" ];
}
