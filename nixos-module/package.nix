# The fort binaries: `fort-agent` (daemon, check, trigger) and `fort` (operator CLI).
{ lib, rustPlatform }:
let
  fs = lib.fileset;
  cargoToml = lib.importTOML ../Cargo.toml;
in
rustPlatform.buildRustPackage {
  pname = "fort";
  inherit (cargoToml.workspace.package) version;

  # Only what cargo reads: the workspace manifest, the lock file and the member crates,
  # taken from Cargo.toml so a new crate needs no edit here, and a change to the Nix
  # files or docs does not rebuild the binaries.
  src = fs.toSource {
    root = ../.;
    fileset = fs.unions (
      [
        ../Cargo.toml
        ../Cargo.lock
        (fs.maybeMissing ../.cargo)
      ]
      ++ map (member: ../. + "/${member}") cargoToml.workspace.members
    );
  };
  cargoLock.lockFile = ../Cargo.lock;

  # `fort-agent` and `fort` live in the fort-agent crate; `fort-handler` (the capability
  # handlers) in fort-handlers.
  cargoBuildFlags = [
    "--package"
    "fort-agent"
    "--package"
    "fort-handlers"
  ];
  # The test suite starts agents on loopback and runs the module evaluation test; it runs
  # in CI (`cargo test`), not in every package build.
  doCheck = false;

  meta = {
    description = "Control plane for NixOS fleets: hosts declare needs, providers fulfil them";
    license = with lib.licenses; [
      mit
      asl20
    ];
    mainProgram = "fort-agent";
    platforms = lib.platforms.linux;
  };
}
