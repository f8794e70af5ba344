# A WireGuard mesh coordinated by fort (`fort-handler mesh`, docs/handlers.md "mesh").
#   Coordinator: fort.host.capabilities.<name>.mesh = { name = "corp"; ipv4 = "10.77.0.0/16"; };
#   — gives every member a tunnel address derived from the mesh and its host name, and
#   answers each with every peer it should have (full mesh or hub-and-spoke).
#   Member: fort.host.meshes.<interface> = { from = "coord"; };
#   — the need, the WireGuard key (made here, only its public half sent), and the
#   interface kept in step with every answer by `fort-handler mesh-wg` (`wg syncconf`:
#   peers that did not change keep their tunnels), also after a reboot.
{
  config,
  lib,
  pkgs,
  ...
}:
let
  inherit (lib)
    literalExpression
    mapAttrsToList
    mkIf
    mkOption
    types
    ;
  agent = config.services.fort-agent;
  fortLib = import ../lib.nix { inherit lib; };
  hostName = types.strMatching "[a-z0-9][a-z0-9-]{0,62}";

  provider = import ./provider.nix (
    { shapes, ... }:
    {
      option = "mesh";
      handler = "mesh";
      description = ''
        Serve this capability with `fort-handler mesh`: coordinate the WireGuard mesh
        `name`. Each member asks with the public half of a key its own agent made; it
        is given stable tunnel addresses from `ipv4`/`ipv6` (derived from the mesh and
        its host name, so a standby coordinator gives the same ones), and an answer
        listing every peer it should have, delivered as `{mesh, host, public_key, ipv4,
        ipv6, listen_port, role, peers}`. A join, a new key or a leave calls every
        other member back from one run.
      '';
      example = ''{ name = "corp"; ipv4 = "10.77.0.0/16"; ipv6 = "fd77:77::/64"; }'';
      settings = _: {
        name = mkOption {
          type = types.strMatching "[A-Za-z0-9_-]{1,63}";
          example = "corp";
          description = "The mesh's name. Every member's address is derived from it, so its coordinators must name it alike.";
        };
        ipv4 = mkOption {
          type = types.nullOr (types.strMatching "[0-9.]+/[0-9]{1,2}");
          default = null;
          example = "10.77.0.0/16";
          description = "The IPv4 prefix of the tunnel addresses (four addresses per member of `maxMembers`). `null`: no IPv4 in the tunnel.";
        };
        ipv6 = mkOption {
          type = types.nullOr (types.strMatching "[0-9A-Fa-f:]+/[0-9]{1,3}");
          default = null;
          example = "fd77:77::/64";
          description = "The IPv6 prefix of the tunnel addresses. `null`: no IPv6 in the tunnel.";
        };
        topology = mkOption {
          type = types.enum [
            "mesh"
            "hub-and-spoke"
          ];
          default = "mesh";
          description = "`mesh`: every member is every other's peer. `hub-and-spoke`: a spoke's only peers are the `hubs`.";
        };
        hubs = mkOption {
          type = types.listOf hostName;
          default = [ ];
          example = [ "gw1" ];
          description = "The hubs of a hub-and-spoke mesh, in order of preference (required with it, refused without).";
        };
        persistentKeepalive = mkOption {
          type = types.nullOr (types.ints.between 1 65535);
          default = null;
          example = 25;
          description = "`PersistentKeepalive` of every peer, in seconds, for members behind NAT. `null`: none.";
        };
        defaultPort = mkOption {
          type = types.port;
          default = 51820;
          description = "The UDP port of a member whose request names none.";
        };
        endpoints = shapes.allow {
          example = ''{ "*" = [ "{origin}.example.org" ]; }'';
          description = ''
            Endpoint hosts a member may claim instead of its own address from
            hosts.json, per host and `"*"` (`{origin}` is the member). Unset: none.
          '';
        };
        addresses = mkOption {
          type = types.attrsOf (
            types.submodule {
              options = {
                ipv4 = mkOption {
                  type = types.nullOr types.str;
                  default = null;
                };
                ipv6 = mkOption {
                  type = types.nullOr types.str;
                  default = null;
                };
              };
            }
          );
          default = { };
          example = literalExpression ''{ gw = { ipv4 = "10.77.0.1"; }; }'';
          description = "Tunnel addresses given to members by host name instead of derived ones; each in its prefix and given to one host only.";
        };
        maxMembers = mkOption {
          type = types.nullOr (types.ints.between 1 400);
          default = null;
          description = "The most members (each answer lists every peer). `null`: 250, or fewer when the IPv4 prefix has room for fewer.";
        };
        maxChangesPerMemberPerHour = mkOption {
          type = types.ints.between 1 1000;
          default = 10;
          description = "Changes one member may make in an hour (a join, a new key, a new endpoint): each changes every other member's answer.";
        };
        keyLifetime = mkOption {
          type = types.nullOr fortLib.durationType;
          default = null;
          example = "30d";
          description = "How long a member's key serves before its answer expires and its agent makes a new one. `null`: until the member replaces it.";
        };
        peers = mkOption {
          type = types.listOf hostName;
          default = [ ];
          example = [ "coord2" ];
          description = ''
            The other coordinators of this mesh, for members whose need names several
            (`from = [ "coord1" "coord2" ]`). They must have the same name, prefixes,
            topology, hubs and addresses, so every coordinator gives every member the
            same tunnel addresses.
          '';
        };
      };
      stateFile = {
        description = "The handler's record of the members: their keys, endpoints and tunnel addresses (mode 0600).";
        shared = ", and each would give the other's members away";
      };
      configFile =
        _: s:
        {
          state_file = s.stateFile;
          hosts_file = "/etc/fort/hosts.json";
          inherit (s) name topology hubs endpoints peers;
          default_port = s.defaultPort;
          max_changes_per_member_per_hour = s.maxChangesPerMemberPerHour;
          addresses = lib.mapAttrs (_: a: lib.filterAttrs (_: v: v != null) a) s.addresses;
        }
        // lib.optionalAttrs (s.ipv4 != null) { inherit (s) ipv4; }
        // lib.optionalAttrs (s.ipv6 != null) { inherit (s) ipv6; }
        // lib.optionalAttrs (s.persistentKeepalive != null) {
          persistent_keepalive = s.persistentKeepalive;
        }
        // lib.optionalAttrs (s.maxMembers != null) { max_members = s.maxMembers; }
        // lib.optionalAttrs (s.keyLifetime != null) {
          key_lifetime = "${toString (fortLib.durationSeconds s.keyLifetime)}s";
        };
      answers = [
        "mesh"
        "host"
        "public_key"
        "ipv4"
        "ipv6"
        "listen_port"
        "role"
        "peers"
        "expires_at"
      ];
      # As `fort-handler mesh --failover` says: coordinators of one need derive every
      # address from one plan (name, prefixes, shape, pins) and list each other.
      policy = _: s: {
        inherit (s) endpoints;
        failover = {
          kind = "shared-backend";
          backend = "mesh ${s.name} ${if s.ipv4 == null then "-" else s.ipv4} ${
            if s.ipv6 == null then "-" else s.ipv6
          } ${s.topology}${lib.optionalString (s.hubs != [ ]) " hubs ${lib.concatStringsSep "," s.hubs}"}${
            lib.optionalString (s.addresses != { }) " pins ${builtins.toJSON s.addresses}"
          }";
          inherit (s) peers;
        };
      };
      defaults = _: s: {
        interface = ../interfaces/mesh.nix;
        description = "the WireGuard mesh ${s.name}";
      };
      async = "members are entries the handler reconciles, and one member's change calls the others back";
      patterns = [ "endpoints" ];
      assertions =
        { at, settings, ... }:
        [
          {
            assertion = settings.ipv4 != null || settings.ipv6 != null;
            message = "${at}: set ipv4 or ipv6 (or both): the prefix tunnel addresses come from.";
          }
          {
            assertion = (settings.topology == "hub-and-spoke") == (settings.hubs != [ ]);
            message = "${at}.hubs: a hub-and-spoke mesh names its hubs, and only it does (topology is ${settings.topology}).";
          }
        ];
    }
  );

  meshes = config.fort.host.meshes;

  member = types.submodule (
    { name, ... }:
    {
      options = {
        from = mkOption {
          type = types.either types.str (types.nonEmptyListOf types.str);
          example = [
            "coord1"
            "coord2"
          ];
          description = "The coordinator, or several in order of preference (they must list each other as `peers`).";
        };
        capability = mkOption {
          type = types.str;
          default = "mesh";
          description = "The capability's name at the coordinator (the need's type).";
        };
        endpoint = mkOption {
          type = types.nullOr (types.strMatching "[A-Za-z0-9.:-]{1,253}");
          default = null;
          description = "Where other members send to, when not this host's address in hosts.json; the coordinator must allow it (`mesh.endpoints`).";
        };
        port = mkOption {
          type = types.port;
          default = 51820;
          description = "The UDP port the interface listens on (opened in the firewall).";
        };
        directory = mkOption {
          type = types.str;
          default = "/var/lib/fort-mesh/${name}";
          defaultText = literalExpression ''"/var/lib/fort-mesh/<interface>"'';
          description = "Where the private key (mode 0400, root's) and the last answer are kept.";
        };
        openFirewall = mkOption {
          type = types.bool;
          default = true;
          description = "Open `port` (UDP) in `networking.firewall`.";
        };
      };
    }
  );

  # Applies an answer (on stdin, or the saved one) to the interface: wg syncconf changes
  # only the peers that differ, so tunnels that did not change are not reset.
  apply =
    name: m: extra:
    "${agent.package}/bin/fort-handler mesh-wg --interface ${name} --private-key ${m.directory}/private.key --wg ${pkgs.wireguard-tools}/bin/wg --ip ${pkgs.iproute2}/bin/ip${extra}";
in
{
  imports = [ provider ];

  options.fort.host.meshes = mkOption {
    type = types.attrsOf member;
    default = { };
    example = literalExpression ''{ wg0 = { from = [ "coord1" "coord2" ]; }; }'';
    description = ''
      WireGuard interfaces this host joins a `mesh` with, by interface name, one need
      each (`fort.host.needs.<capability>.<interface>`): the key pair is made here and
      only its public half is sent; the answer (tunnel addresses and peers) is applied
      to the interface with `wg syncconf` on every change, and again at boot from the
      last one kept (`fort-mesh-<interface>.service`).
    '';
  };

  config = mkIf (meshes != { }) {
    fort.host.needs = lib.mkMerge (
      mapAttrsToList (name: m: {
        ${m.capability}.${name} = {
          inherit (m) from;
          request = {
            public_key = fortLib.key "wg" "public";
            inherit (m) port;
          }
          // lib.optionalAttrs (m.endpoint != null) { inherit (m) endpoint; };
          keys.wg = {
            type = "wireguard";
            path = "${m.directory}/private.key";
            mode = "0400";
            certificate = "/public_key";
          };
          files.answer = {
            path = "${m.directory}/answer.json";
            pointer = "";
            mode = "0600";
          };
          handler = pkgs.writeShellScript "fort-mesh-${name}" "exec ${apply name m ""}";
          # The answer changes whenever the mesh does: keep asking, so a member that
          # missed a callback still follows within one nag interval.
          neverSatisfied = true;
        };
      }) meshes
    );

    # After a reboot the interface is gone but the key and the last answer are kept.
    systemd.services = lib.mapAttrs' (
      name: m:
      lib.nameValuePair "fort-mesh-${name}" {
        description = "WireGuard interface ${name} from the mesh's last answer";
        wantedBy = [ "multi-user.target" ];
        after = [ "network-pre.target" ];
        before = [ "fort-agent.service" ];
        serviceConfig = {
          Type = "oneshot";
          RemainAfterExit = true;
          ExecStart = apply name m " --answer ${m.directory}/answer.json";
        };
      }
    ) meshes;

    systemd.tmpfiles.rules = mapAttrsToList (_: m: "d ${m.directory} 0700 root root -") meshes;

    networking.firewall.allowedUDPPorts = lib.concatLists (
      mapAttrsToList (_: m: lib.optional m.openFirewall m.port) meshes
    );

    assertions = [
      {
        assertion = agent.user == "root";
        message = "fort.host.meshes: the agent configures WireGuard interfaces (wg, ip) when an answer arrives, so it must run as root (services.fort-agent.user is ${agent.user}).";
      }
    ]
    ++ mapAttrsToList (name: m: {
      assertion = lib.hasPrefix "/" m.directory;
      message = "fort.host.meshes.${name}.directory must be an absolute path.";
    }) meshes;
  };
}
