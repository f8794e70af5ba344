# The demo fleet (fleet.nix) as a flake of your own: copy this directory, point
# `inputs.fort` at your checkout of fort, replace the hosts' addresses and keys in
# fleet.nix, and give each host its own configuration (hardware, file systems) in
# place of the container settings below.
#
#   nix flake check                  # every host's files checked together (checks.*.fort-fleet)
#   nix build .#checks.x86_64-linux.fort-fleet && cat result      # the report
#   nixos-rebuild switch --flake .#forge --target-host root@10.0.0.1
#   fort fleet --expect $(nix build --print-out-paths .#fleet-manifest)
{
  inputs.nixpkgs.url = "github:NixOS/nixpkgs/nixos-unstable";
  # git+file: takes the files git tracks; path: would copy the whole directory,
  # build outputs (target/) included, into the store.
  inputs.fort.url = "git+file:///src/fort";
  inputs.fort.inputs.nixpkgs.follows = "nixpkgs";

  outputs =
    {
      self,
      nixpkgs,
      fort,
    }:
    let
      system = "x86_64-linux";
      pkgs = nixpkgs.legacyPackages.${system};
      fleet = import ./fleet.nix { inherit fort; };
    in
    {
      nixosConfigurations = fort.lib.mkFleet (
        fleet
        // {
          inherit nixpkgs;
          shared = fleet.shared ++ [
            {
              # Stand-ins for each host's own configuration.
              nixpkgs.hostPlatform = system;
              boot.isContainer = true;
              system.stateVersion = "25.05";
            }
          ];
        }
      );

      # `nix flake check`: the fleet's generated files, checked together before any
      # host is built or deployed.
      checks.${system}.fort-fleet = fort.lib.fleetCheck {
        inherit pkgs;
        nodes = self.nixosConfigurations;
      };

      # What each agent should report once deployed (`fort fleet --expect`).
      packages.${system}.fleet-manifest = pkgs.writeText "fleet-manifest.json" (
        builtins.toJSON (fort.lib.fleetManifest self.nixosConfigurations)
      );
    };
}
