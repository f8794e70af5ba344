# The options reference (docs/options.md) from the module's own declarations, rendered
# by the same code as the interfaces (interface.nix renderOptions). Only the option
# files are evaluated, so no host, no NixOS and no real package set are needed: `pkgs`
# only has to provide formats.toml (the type of `settings`), and the stubbed NixOS
# options stand in for what the capability modules set.
#
#   nix-instantiate --eval --strict --json nixos-module/docs.nix \
#     --arg lib 'import /path/to/nixpkgs/lib' | jq -r .
# (nixos-module/tests/options-doc.sh does this, and checks docs/options.md with --check.)
{
  lib,
  stubs ? import ./tests/stubs.nix { inherit lib; },
  pkgs ? stubs.pkgs,
}:
let
  inherit (import ./interface.nix { inherit lib; }) renderOptions;
  inherit
    (lib.evalModules {
      modules = [
        ./options.nix
        ./options-host.nix
        ./alerts.nix
        ./capabilities
        # The NixOS options the capability modules set (assertions, sshd's and nginx's config),
        # declared so the evaluation accepts their definitions; not rendered.
        stubs.module
      ];
      specialArgs = { inherit pkgs; };
    })
    options
    ;
  section = title: intro: tree: "## ${title}\n\n${intro}\n\n" + renderOptions 3 tree;
in
# One trailing newline (jq -r adds it), as an editor would save the file.
lib.strings.trim (
''
  <!-- Generated from nixos-module/options*.nix and capabilities/*.nix by nixos-module/tests/options-doc.sh; do not edit. -->
  # fort NixOS module options

  The options of fort's NixOS module (`nixosModules.default`), with their types,
  defaults and examples. Internal options (`fort.cluster.fleet`, `fort.cluster.facts`,
  `fort.host.exported`) are left out: lib.mkFleet and the module set them. The formats
  the module generates are in docs/protocol.md §10 and §11; `nixos-module/README.md`
  explains how the options fit together.

''
+ section "services.fort-agent" "The agent on this host." { services.fort-agent = options.services.fort-agent; }
+ section "fort.cluster" "The fleet, declared once: in lib.mkFleet's `cluster` modules, evaluated once for the fleet, or in a module every host imports." {
  fort.cluster = options.fort.cluster;
}
+ section "fort.host" "What this host needs and serves." { fort.host = options.fort.host; }
+ section "fort.lib" "Helpers for host modules." { fort.lib = options.fort.lib; }
)
