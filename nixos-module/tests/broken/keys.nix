# Mistakes with keys made by the consumer: a $fort_key naming a key the need does not
# declare, a CSR asked of a key without names, a form the agent does not make, OpenSSH's
# format for a P-256 key, and a key on the path of one of the need's files.
{
  extra.app = [
    (
      { config, ... }:
      {
        fort.host.needs.tls.mistakes = {
          from = "forge";
          request = {
            csr = config.fort.lib.key "tsl" "csr";
          };
          keys.tls.path = "/run/fort/needs/tls/mistakes/cert";
          files.cert.pointer = "/certificate";
        };
        fort.host.needs.tls.nameless = {
          from = "forge";
          request.csr = config.fort.lib.key "tls" "csr";
          keys.tls.format = "openssh";
        };
        fort.host.needs.tls.der = {
          from = "forge";
          request.csr = config.fort.lib.key "tls" "der";
          keys.tls.names = [ "app.example.org" ];
        };
      }
    )
  ];
  expect = [
    "fort.host.needs.tls.mistakes.request.csr: $fort_key \"tsl\" names no key of this need"
    "fort.host.needs.tls.nameless.request.csr: $fort_key \"tls\" asks for a CSR, but fort.host.needs.tls.nameless.keys.tls.names is empty"
    "fort.host.needs.tls.nameless.keys.tls: format \"openssh\" is for ed25519 keys"
    "fort.host.needs.tls.der.request.csr: $fort_key \"tls\": as must be \"csr\", \"public\" or \"openssh\", not \"der\""
    "fort.host.needs.tls.mistakes.files.cert and fort.host.needs.tls.mistakes.keys.tls write the same file /run/fort/needs/tls/mistakes/cert"
  ];
}
