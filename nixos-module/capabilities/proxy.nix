# The provider side of `fort-handler proxy`: `fort.host.capabilities.<name>.proxy` turns a
# capability into nginx virtual hosts, one file per entry in a directory this host's
# nginx includes, each change checked with `nginx -t` before one reload
# (docs/handlers.md, "proxy"). The handler's config is written to the store as JSON; it
# names the certificate and key files, never their contents.
import ./provider.nix (
  { config, lib, shapes, ... }:
  let
    inherit (lib)
      filterAttrs
      literalExpression
      mapAttrs
      mapAttrsToList
      mkDefault
      mkIf
      mkOption
      types
      ;
    nginxCfg = config.services.nginx;
    self = config.services.fort-agent.hostName;
    # This host's own acme capabilities, and the certificates this host gets from them: the
    # vhosts answer HTTP-01 for the first's webroot, and each such certificate is a TLS set
    # of its name (its key is made on this host), so nobody wires paths by hand.
    acmeHere = filterAttrs (_: c: (c.acme or null) != null) config.fort.host.capabilities;
    acmeWebroots = lib.filter (w: w != null) (mapAttrsToList (_: c: c.acme.webroot) acmeHere);
    ownCertificates = filterAttrs (
      _: c: c.from == self && acmeHere ? ${c.capability}
    ) config.fort.host.certificates;
    clusterInterfaces = config.fort.cluster.interfaces;
    # What nginx reads without quoting (the handler checks the same).
    configPath = types.strMatching "/[A-Za-z0-9._+@/-]*";
    listen = types.strMatching "[0-9]{1,5}|[0-9.]+:[0-9]{1,5}|[[][0-9A-Fa-f:.]+[]]:[0-9]{1,5}";

    reloadCommand =
      s:
      if s.reloadCommand != null then
        s.reloadCommand
      else
        [
          "${config.systemd.package}/bin/systemctl"
          "reload"
          "--"
          s.reloadUnit
        ];
  in
  {
    option = "proxy";
    handler = "proxy";
    description = ''
      Serve this capability with `fort-handler proxy`: one nginx virtual host per
      entry, forwarding the entry's server names to the consumer's own address,
      delivered as `{server_names, upstream, tls}`. Every change is checked with
      `testCommand` before one reload; an entry whose virtual host fails the
      check is refused with nginx's reason and the others keep serving.
    '';
    example = ''
      {
        allow."*" = [ "{origin}.example.org" "*.{origin}.example.org" ];
        tls.example-org = {
          certificate = "/var/lib/acme/example.org/fullchain.pem";
          key = "/var/lib/acme/example.org/key.pem";
        };
      }
    '';
    settings = name: {
      includeDir = mkOption {
        type = configPath;
        default = "/var/lib/fort/nginx/${name}";
        defaultText = literalExpression ''"/var/lib/fort/nginx/<name>"'';
        description = ''
          The directory of the virtual host files, included in `services.nginx`'s
          `http` block (`configureNginx`). The handler writes only `fort.*.conf` files
          marked as its own there, and never touches anything else in it.
        '';
      };
      configureNginx = mkOption {
        type = types.bool;
        default = true;
        description = ''
          Add `include <includeDir>/*.conf;` to `services.nginx.appendHttpConfig`,
          create the directory, and turn on `services.nginx.enableReload` (so the
          configuration nginx runs is `/etc/nginx/nginx.conf`, which the default
          `testCommand` checks). Off: include the directory yourself.
        '';
      };
      testCommand = mkOption {
        type = types.nonEmptyListOf types.str;
        default = [
          "${nginxCfg.package}/bin/nginx"
          "-t"
          "-q"
          "-c"
          "/etc/nginx/nginx.conf"
        ];
        defaultText = literalExpression ''[ "''${config.services.nginx.package}/bin/nginx" "-t" "-q" "-c" "/etc/nginx/nginx.conf" ]'';
        description = ''
          The command that checks the whole configuration with the handler's files in
          it, as an argument vector (no shell). It must read what nginx reads
          (certificates and keys included), so it runs as the agent's user.
        '';
      };
      reloadUnit = mkOption {
        type = types.str;
        default = "nginx.service";
        description = "The unit `systemctl reload` reloads after a change (unless `reloadCommand` is set).";
      };
      reloadCommand = mkOption {
        type = types.nullOr (types.nonEmptyListOf types.str);
        default = null;
        example = [
          "/run/current-system/sw/bin/nginx"
          "-s"
          "reload"
        ];
        description = "The command that makes nginx load the configuration, as an argument vector. `null`: `systemctl reload <reloadUnit>`.";
      };
      commandTimeoutSeconds = mkOption {
        type = types.ints.between 1 55;
        default = 20;
        description = "How long one test or reload may take before it is killed.";
      };
      listen = mkOption {
        type = types.nonEmptyListOf listen;
        default = [
          "80"
          "[::]:80"
        ];
        description = "Where plain-HTTP virtual hosts listen: `PORT`, `IPv4:PORT` or `[IPv6]:PORT`.";
      };
      serverNamesHashBucketSize = mkOption {
        type = types.ints.between 32 4096;
        default =
          if nginxCfg.serverNamesHashBucketSize != null then nginxCfg.serverNamesHashBucketSize else 64;
        defaultText = literalExpression "config.services.nginx.serverNamesHashBucketSize, else 64";
        description = ''
          nginx's `server_names_hash_bucket_size`, as the provider's nginx runs with it.
          A server name longer than one bucket holds is refused (46 characters with 64,
          110 with 128): nginx takes such a name while its virtual host is alone on its
          address, and then refuses every other one added there. With `configureNginx`
          the module sets `services.nginx.serverNamesHashBucketSize` to 128 by default.
        '';
      };
      listenTls = mkOption {
        type = types.nonEmptyListOf listen;
        default = [
          "443"
          "[::]:443"
        ];
        description = "Where TLS virtual hosts listen (`listen … ssl`).";
      };
      tls = mkOption {
        type = types.attrsOf (
          types.submodule {
            options = {
              certificate = mkOption {
                type = configPath;
                description = "The PEM certificate chain nginx serves.";
              };
              key = mkOption {
                type = configPath;
                description = "Its PEM private key, readable by nginx (never by a consumer).";
              };
            };
          }
        );
        default = { };
        example = literalExpression ''{ example-org = { certificate = "/var/lib/acme/example.org/fullchain.pem"; key = "/var/lib/acme/example.org/key.pem"; }; }'';
        description = ''
          Certificate sets a request may name in `tls`, by name (`[A-Za-z0-9._-]`, at
          most 64). A request names a set, never a file. Every
          `fort.host.certificates.<name>` this host gets from its own `acme`
          capability is a set of that name as well (its `fullchain.pem` and
          `key.pem`); a set declared here of the same name wins. A vhost whose set has
          no certificate yet is served over plain HTTP until it has one.
        '';
      };
      acmeWebroot = mkOption {
        type = types.nullOr configPath;
        default = if acmeWebroots == [ ] then null else lib.head acmeWebroots;
        defaultText = literalExpression "the webroot of this host's acme capability, if it has one";
        description = ''
          Serve `/.well-known/acme-challenge/` of every virtual host from this
          directory (a path with no file there still goes to the upstream), so the
          CA validates by HTTP-01 the names this host proxies, for certificates this
          host's `acme` capability orders, whoever asked for them.
        '';
      };
      allow = shapes.allow {
        example = ''{ app = [ "wiki.example.org" "*.app.example.org" ]; "*" = [ "{origin}.hosts.example.org" ]; }'';
        description = ''
          Server names each caller may have, per host or principal and `"*"` for
          everyone: an exact name, or `*.SUFFIX` for every name below SUFFIX;
          `{origin}` is the caller's name. A request for any other name is refused,
          with the reason in the consumer's need state.
        '';
      };
      upstreamHosts = shapes.allow {
        example = ''{ ops = [ "10.0.0.9" "*.lan" ]; }'';
        description = ''
          Hosts other than its own address that a caller may forward to
          (`upstream_host`), per caller and `"*"`: exact names or addresses, or
          `*.SUFFIX`. Unset: every virtual host forwards to its caller's address from
          hosts.json.
        '';
      };
    };
    stateFile.description = ''
      The handler's record of the files it wrote (mode 0600): only these are ever
      replaced or removed. One per capability.
    '';
    configFile =
      _: s:
      {
        include_dir = s.includeDir;
        state_file = s.stateFile;
        hosts = "/etc/fort/hosts.json";
        test_command = s.testCommand;
        reload_command = reloadCommand s;
        command_timeout_seconds = s.commandTimeoutSeconds;
        inherit (s) listen allow;
        listen_tls = s.listenTls;
        tls =
          mapAttrs (_: c: {
            certificate = "${c.directory}/fullchain.pem";
            key = "${c.directory}/key.pem";
          }) ownCertificates
          // mapAttrs (_: t: { inherit (t) certificate key; }) s.tls;
        upstream_hosts = s.upstreamHosts;
        server_names_hash_bucket_size = s.serverNamesHashBucketSize;
      }
      // lib.optionalAttrs (s.acmeWebroot != null) { acme_webroot = s.acmeWebroot; };
    answers = [ "server_names" "upstream" "tls" ];
    policy = _: s: {
      inherit (s) allow;
      # As `fort-handler proxy --failover` says.
      failover = {
        kind = "one-provider";
        why = "two edges serving the same names would each hold the vhost, and a standby does not adopt what another edge made";
      };
    };
    defaults = name: _: {
      # The fleet's interface of this name when it declares one (it may extend the
      # shipped one, as the example handler's users do), else the shipped one.
      interface = clusterInterfaces.${name} or ../interfaces/proxy.nix;
      triggers.initialize = true;
      description = "nginx virtual hosts";
    };
    async = "virtual hosts are entries the handler reconciles";
    patterns = [
      "allow"
      "upstreamHosts"
    ];
    assertions =
      { at, settings, ... }:
      [
        {
          assertion = builtins.all (n: builtins.match "[A-Za-z0-9._-]{1,64}" n != null) (
            builtins.attrNames settings.tls
          );
          message = "${at}.tls: set names are 1 to 64 of A-Z a-z 0-9 . _ -.";
        }
      ];
    extraConfig =
      withProxy:
      let
        configured = filterAttrs (_: c: c.proxy.configureNginx) withProxy;
        dirs = mapAttrsToList (_: c: c.proxy.includeDir) withProxy;
      in
      mkIf (withProxy != { }) {
        # The vhost files, and what `nginx -t` writes even when it only tests: it opens its
        # pid file and makes its temporary directories, and fails on a read-only file system
        # (strictSandbox) without them. NixOS's nginx keeps them in its runtime, cache and
        # logs directories. "-": absent ones are no reason for the agent not to start.
        services.fort-agent.readWritePaths =
          mapAttrsToList (_: c: c.proxy.includeDir) withProxy
          ++ lib.optionals (configured != { }) [
            "-/run/nginx"
            "-/var/cache/nginx"
            "-/var/log/nginx"
          ];
        services.nginx = mkIf (configured != { }) {
          enableReload = mkDefault true;
          # Names of up to 110 characters; the handler is told the same.
          serverNamesHashBucketSize = mkDefault 128;
          appendHttpConfig = lib.concatStringsSep "\n" (
            mapAttrsToList (_: c: "include ${c.proxy.includeDir}/*.conf;") configured
          );
        };
        systemd.tmpfiles.rules = mapAttrsToList (
          _: c: "d ${c.proxy.includeDir} 0755 ${config.services.fort-agent.user} root -"
        ) configured;
        assertions = [
          {
            assertion = lib.length dirs == lib.length (lib.unique dirs);
            message = "fort.host.capabilities.<name>.proxy.includeDir: two capabilities share one directory; give each its own.";
          }
        ];
      };
  }
)
