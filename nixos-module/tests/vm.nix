# NixOS VM test (flake check `vm`): forge serves `greeting`, app needs it, and the need
# becomes satisfied over TLS: app's agent writes the payload forge's handler made to a
# file, hands it to a DynamicUser service as a credential, and runs app's handler. Also:
# a SIGHUP reload keeps the agent up, and OnSuccess of a watched unit runs the provider
# handler.
#
# The nodes are wired as lib.mkFleet wires hosts: `fort.cluster.fleet` is the projection
# of the test's `nodes`, the same fixpoint (tests/eval.nix tests mkFleet itself).
{ fortModule, lib }:
let
  fleetLib = import ../fleet.nix { inherit lib; };
  pub = name: lib.strings.trim (builtins.readFile (./keys + "/${name}.pub"));
in
{
  name = "fort-need-satisfied";

  defaults =
    { config, nodes, ... }:
    {
      imports = [ fortModule ];
      fort.cluster = {
        hosts = {
          forge = {
            address = "https://forge:7770";
            publicKeys = [ (pub "forge") ];
          };
          app = {
            address = "https://app:7770";
            publicKeys = [ (pub "app") ];
          };
        };
        fleet = fleetLib.projection nodes;
      };
      services.fort-agent = {
        enable = true;
        openFirewall = true;
        hostKeyFile = "/etc/fort-test/host_key";
      };
      # Test keys only (tests/keys): copied out of the store (mode), as a secret
      # deployment tool would place them, so hostKeyFile is not a store path.
      environment.etc."fort-test/host_key" = {
        source = ./keys + "/${config.networking.hostName}";
        mode = "0400";
      };
      systemd.tmpfiles.rules = [ "d /var/lib/fort-test 0755 root root -" ];
    };

  nodes.forge =
    { pkgs, ... }:
    {
      fort.host.capabilities.greeting = {
        # docs/protocol.md §9: every entry in, a response per entry out. The trigger is noted
        # so the test can see the systemd trigger arrive.
        handler = pkgs.writeShellScript "greeting" ''
          echo "$FORT_TRIGGER" >> /var/lib/fort-test/triggers
          ${pkgs.jq}/bin/jq -c 'with_entries(.value = "hello \(.value.request.name)")'
        '';
        triggers.systemd = [ "greeting-source.service" ];
        description = "Greets whoever asks";
      };
      systemd.services.greeting-source = {
        serviceConfig.Type = "oneshot";
        script = "true";
      };
    };

  nodes.app =
    { pkgs, ... }:
    {
      fort.host.needs.greeting.app = {
        from = "forge";
        request.name = "app";
        # Short, so a request sent before forge listens is repeated within the test.
        nag = "5s";
        # Written to /run/fort/needs/greeting/app/message, then a credential of the
        # reader below, which starts once it is there.
        files.message.credentialFor = [ "greeting-reader.service" ];
        handler = pkgs.writeShellScript "store-greeting" ''
          cat > /var/lib/fort-test/greeting
        '';
      };
      systemd.services.greeting-reader = {
        wantedBy = [ "multi-user.target" ];
        serviceConfig = {
          DynamicUser = true;
          RuntimeDirectory = "greeting-reader";
        };
        script = ''
          cat "$CREDENTIALS_DIRECTORY/message" > /run/greeting-reader/message
          exec sleep infinity
        '';
      };
    };

  testScript = ''
    start_all()
    forge.wait_for_unit("fort-agent.service")
    app.wait_for_unit("fort-agent.service")

    with subtest("generated files are in place"):
        app.succeed("test -s /etc/fort/agent.toml")
        forge.succeed("grep -qF '\"callers\":{\"app\":[\"app\"]}' /etc/fort/capabilities.json")
        app.succeed("grep -qF https://forge:7770 /etc/fort/hosts.json")

    with subtest("the need becomes satisfied"):
        app.wait_until_succeeds("grep -qx 'hello app' /var/lib/fort-test/greeting", timeout=120)

    with subtest("the payload file becomes a service's credential"):
        app.succeed("grep -qx 'hello app' /run/fort/needs/greeting/app/message")
        app.wait_until_succeeds("grep -qx 'hello app' /run/greeting-reader/message", timeout=60)

    with subtest("SIGHUP reload keeps the agent up"):
        app.succeed("systemctl reload fort-agent.service")
        app.succeed("systemctl is-active fort-agent.service")

    with subtest("OnSuccess of a watched unit runs the provider handler"):
        forge.succeed("systemctl start greeting-source.service")
        forge.wait_until_succeeds("grep -qx systemd /var/lib/fort-test/triggers", timeout=60)
  '';
}
