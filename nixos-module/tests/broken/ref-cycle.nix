# proxy/app waits for oidc/wiki (`after`, tests/fleet.nix); a reference from oidc/wiki to
# proxy/app (with a JSON pointer, inside a list) closes a cycle.
{
  extra.app = [
    (
      { config, lib, ... }:
      {
        fort.host.needs.oidc.wiki.request.redirect_uris = lib.mkForce [ (config.fort.lib.ref "proxy/app" "/uri") ];
      }
    )
  ];
  expect = [
    "fort.host.needs on app: references ($fort_ref) and after form a cycle: oidc/wiki -> proxy/app -> oidc/wiki. A need cannot wait for itself."
  ];
}
