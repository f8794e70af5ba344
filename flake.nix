{
  description = "fort: a control plane for NixOS fleets";

  # No flake.lock is committed: `nix flake lock` (or the first `nix build`) pins nixpkgs.
  inputs.nixpkgs.url = "github:NixOS/nixpkgs/nixos-unstable";

  outputs =
    inputs@{ self, nixpkgs }:
    let
      inherit (nixpkgs) lib;
      systems = [
        "x86_64-linux"
        "aarch64-linux"
      ];
      forAllSystems = f: lib.genAttrs systems (system: f system nixpkgs.legacyPackages.${system});
      fleetLib = import ./nixos-module/fleet.nix { inherit lib; };
      fortLib = import ./nixos-module/lib.nix { inherit lib; };
    in
    {
      packages = forAllSystems (
        _: pkgs: {
          default = pkgs.callPackage ./nixos-module/package.nix { };
          # The example interfaces (lib.interfaces) as Markdown; a deployment renders its
          # own the same way: pkgs.writeText "interfaces.md" (fort.lib.renderInterfaces ifs).
          interface-docs = pkgs.writeText "interfaces.md" (self.lib.renderInterfaces self.lib.interfaces);
        }
      );

      nixosModules.default = {
        imports = [ ./nixos-module ];
      };

      lib = {
        # nixosConfigurations = fort.lib.mkFleet {
        #   nixpkgs = nixpkgs;                       # optional: your nixpkgs input
        #   cluster = [ ./fleet.nix ];               # fort.cluster.*, evaluated once
        #   shared = [ ./common.nix ];               # NixOS modules for every host
        #   interfaces.oidc = ./interfaces/oidc.nix; # request interfaces, fleet-wide
        #   hosts.forge.modules = [ ./forge.nix ];   # system: set nixpkgs.hostPlatform
        #   hosts.app = { modules = [ ./app.nix ]; specialArgs = { }; };
        #   callersFromInventory = true;             # optional: see below
        # };
        # Every host gets fort's module, the cluster modules, `shared`, its own modules,
        # the interfaces, and the index of every host's needs and capabilities, built
        # once for the fleet with what the cluster modules declare (nixos-module/fleet.nix
        # says how and why). With callersFromInventory, needs on other hosts are
        # instances of fort.cluster.instances only, and no host's evaluation reads the
        # other hosts' needs: a provider's callers come from the inventory.
        mkFleet =
          {
            nixpkgs ? inputs.nixpkgs,
            hosts,
            shared ? [ ],
            specialArgs ? { },
            interfaces ? { },
            cluster ? [ ],
            callersFromInventory ? false,
          }:
          fleetLib.mkFleetWith
            {
              module = self.nixosModules.default;
              evalHost =
                {
                  host,
                  modules,
                  specialArgs,
                  ...
                }:
                nixpkgs.lib.nixosSystem (
                  {
                    inherit modules specialArgs;
                  }
                  // lib.optionalAttrs (host ? system) { inherit (host) system; }
                );
            }
            {
              inherit
                hosts
                shared
                specialArgs
                interfaces
                cluster
                callersFromInventory
                ;
            };

        # A request value the consumer's agent replaces with another need's payload:
        # ref "ssl-cert/outline" "/fingerprint", or "" for the whole payload. In host
        # modules the same function is config.fort.lib.ref.
        inherit (fortLib) ref;

        # Markdown for { <capability> = <interface module>; }, evaluating no host:
        #   packages.<system>.interface-docs = pkgs.writeText "interfaces.md"
        #     (fort.lib.renderInterfaces { oidc = ./interfaces/oidc.nix; });
        renderInterfaces = fortLib.interface.renderInterfaces;

        # The JSON Schema (draft 2020-12) an interface module becomes, as shipped in
        # capabilities.json `request_schema`.
        requestSchema = m: fortLib.interface.requestSchema (fortLib.interface.optionsOf m);

        # { <host> = <manifest sha256>; } for the hosts that run an agent:
        #   builtins.toJSON (fort.lib.fleetManifest self.nixosConfigurations)
        # is the file for `fort fleet --expect FILE` (hosts running something else).
        inherit (fleetLib) fleetManifest;

        # A check of the whole fleet's generated files, building no system: each host's
        # files as its own build checks them, one registry for all, every consumer's
        # requests against its providers' schemas and callers (fort-agent check --fleet):
        #   checks.x86_64-linux.fort-fleet = fort.lib.fleetCheck {
        #     pkgs = nixpkgs.legacyPackages.x86_64-linux; nodes = self.nixosConfigurations; };
        inherit (fleetLib) fleetCheck;

        # Interfaces of the capabilities the example handlers (handlers/examples) serve:
        # oidc, ssl-cert, proxy.
        interfaces = import ./nixos-module/interfaces;
      };

      checks = forAllSystems (
        system: pkgs:
        let
          src = ./.;
        in
        {
          package = self.packages.${system}.default;

          # Same scripts CI runs, inside the sandbox: nix-instantiate needs a private
          # store and state directory there (as nixpkgs' own lib tests do).
          nix-module = pkgs.runCommand "fort-nix-module-tests" {
            nativeBuildInputs = [
              pkgs.nix
              pkgs.jq
            ];
          } ''
            export HOME=$TMPDIR
            export NIX_STATE_DIR=$TMPDIR/nix/var/nix NIX_LOG_DIR=$TMPDIR/nix/var/log/nix
            export NIX_LOCALSTATE_DIR=$TMPDIR/nix/var NIX_CONF_DIR=$TMPDIR/nix/etc
            export NIX_STORE_DIR=$TMPDIR/nix/store
            nix-store --init
            cp -r ${src} src && chmod -R u+w src
            bash src/nixos-module/tests/parse-all.sh
            NIXPKGS_LIB=${nixpkgs} bash src/nixos-module/tests/run.sh
            NIXPKGS_LIB=${nixpkgs} bash src/nixos-module/tests/options-doc.sh --check
            touch $out
          '';

          vm = pkgs.testers.runNixOSTest (
            import ./nixos-module/tests/vm.nix {
              fortModule = self.nixosModules.default;
              inherit lib;
            }
          );
        }
      );

      devShells = forAllSystems (system: pkgs: {
        default = pkgs.mkShell {
          inputsFrom = [ self.packages.${system}.default ];
          packages = with pkgs; [
            cargo
            rustc
            clippy
            rustfmt
            rust-analyzer
            cargo-nextest
            openssh # ssh-keygen -Y sign, for protocol compatibility tests
            jq
            nix # nix-instantiate, for nixos-module/tests
          ];
          # nixos-module/tests/run.sh evaluates the module with this nixpkgs' lib.
          NIXPKGS_LIB = "${nixpkgs}";
        };
      });
    };
}
