# The provider side of `fort-handler dns-record`: `fort.host.capabilities.<name>.dnsRecord`
# turns a capability into records in one zone, made by RFC 2136 updates signed with TSIG
# at the zone's primary (docs/handlers.md, "dns-record"). The handler's config is written
# to the store as JSON; it names the TSIG key file, never the secret.
{
  config,
  lib,
  pkgs,
  ...
}:
let
  inherit (lib)
    filterAttrs
    literalExpression
    mapAttrsToList
    mkDefault
    mkIf
    mkOption
    types
    ;
  fortPackage = config.services.fort-agent.package;
  dnsName = types.strMatching "([A-Za-z0-9_-]{1,63}\\.)*[A-Za-z0-9_-]{1,63}\\.?";

  settings =
    name:
    types.submodule {
      options = {
        zone = mkOption {
          type = dnsName;
          example = "example.org";
          description = "The zone records are made in; every requested name must be in it.";
        };
        primary = mkOption {
          type = types.strMatching "[0-9.]+(:[0-9]+)?|[0-9A-Fa-f:]+|[[][0-9A-Fa-f:]+[]]:[0-9]+";
          example = "10.0.0.53:53";
          description = ''
            The zone's primary server, `IP` (port 53) or `IP:PORT` (`[IPv6]:PORT`).
            Updates and queries go to it over TCP; names are not resolved.
          '';
        };
        key = {
          name = mkOption {
            type = dnsName;
            example = "fort";
            description = "The TSIG key's name, as the primary knows it.";
          };
          algorithm = mkOption {
            type = types.enum [
              "hmac-sha256"
              "hmac-sha384"
              "hmac-sha512"
            ];
            default = "hmac-sha256";
            description = "The TSIG key's algorithm.";
          };
          file = mkOption {
            type = types.str;
            example = "/run/secrets/fort-tsig";
            description = ''
              A file holding the key's base64 secret (alone, or as `tsig-keygen` or
              `keymgr -t` print it), readable by the agent's user. Never a store path: a
              missing or unreadable file fails every run, so nothing is sent unsigned.
            '';
          };
        };
        allow = mkOption {
          type = types.attrsOf (types.listOf types.str);
          default = { };
          example = literalExpression ''{ app = [ "wiki.example.org" "*.app.example.org" ]; "*" = [ "{origin}.hosts.example.org" ]; }'';
          description = ''
            Names each caller may hold records at, per host or principal and `"*"` for
            everyone: an exact name, or `*.SUFFIX` for every name below SUFFIX;
            `{origin}` is the caller's name. A request for any other name is refused,
            with the reason in the consumer's need state.
          '';
        };
        defaultTtl = mkOption {
          type = types.ints.between 1 604800;
          default = 300;
          description = "TTL of a record whose request names none.";
        };
        maxTtl = mkOption {
          type = types.ints.between 1 604800;
          default = 86400;
          description = "The highest TTL a request may ask for; a higher one is refused.";
        };
        timeoutSeconds = mkOption {
          type = types.ints.between 1 120;
          default = 10;
          description = "How long the handler waits for one answer of the primary.";
        };
        stateFile = mkOption {
          type = types.str;
          default = "/var/lib/fort/handlers/${name}.json";
          defaultText = literalExpression ''"/var/lib/fort/handlers/<name>.json"'';
          description = ''
            The handler's record of the records it created (mode 0600): only these are
            ever deleted. One per capability.
          '';
        };
      };
    };

  configFile =
    name: s:
    pkgs.writeText "fort-dns-record-${name}.json" (
      builtins.toJSON {
        inherit (s) zone primary allow;
        key = {
          inherit (s.key) name algorithm file;
        };
        default_ttl = s.defaultTtl;
        max_ttl = s.maxTtl;
        timeout_seconds = s.timeoutSeconds;
        hosts = "/etc/fort/hosts.json";
        state = s.stateFile;
      }
    );

  withDns = filterAttrs (_: c: c.dnsRecord != null) config.fort.host.capabilities;
in
{
  options.fort.host.capabilities = mkOption {
    type = types.attrsOf (
      types.submodule (
        { name, config, ... }:
        {
          options.dnsRecord = mkOption {
            type = types.nullOr (settings name);
            default = null;
            example = literalExpression ''
              {
                zone = "example.org";
                primary = "10.0.0.53";
                key = { name = "fort"; file = "/run/secrets/fort-tsig"; };
                allow."*" = [ "{origin}.example.org" ];
              }
            '';
            description = ''
              Serve this capability with `fort-handler dns-record`: one A, AAAA, CNAME or
              TXT record set per entry in `zone`, by RFC 2136 updates signed with TSIG,
              delivered as `{name, type, values, ttl}`. Records it did not create are
              never deleted; at start (`triggers.initialize`) it puts back records of its
              own that went missing.
            '';
          };
          config = mkIf (config.dnsRecord != null) {
            handler = mkDefault "${fortPackage}/bin/fort-handler";
            args = [
              "dns-record"
              "--config"
              "${configFile name config.dnsRecord}"
            ];
            configFiles = [ (configFile name config.dnsRecord) ];
            policy = {
              handler = "dns-record";
              inherit (config.dnsRecord) allow;
              # As `fort-handler dns-record --failover` says.
              failover = {
                kind = "one-provider";
                why = "its providers would share one DNS primary, and a standby does not adopt the records another provider made there";
              };
              response = [ "name" "type" "values" "ttl" ];
            };
            interface = mkDefault ../interfaces/dns-record.nix;
            cacheResponse = mkDefault true;
            triggers.initialize = mkDefault true;
            description = mkDefault "DNS records in ${config.dnsRecord.zone}";
          };
        }
      )
    );
  };

  config.assertions =
    let
      stateFiles = mapAttrsToList (_: c: c.dnsRecord.stateFile) withDns;
    in
    [
      {
        assertion = lib.length stateFiles == lib.length (lib.unique stateFiles);
        message = "fort.host.capabilities.<name>.dnsRecord.stateFile: two capabilities share one state file, and each would delete the other's records; give each its own.";
      }
    ]
    ++ lib.concatLists (
    mapAttrsToList (name: c: [
      {
        assertion = c.mode == "async";
        message = "fort.host.capabilities.${name}.dnsRecord: the capability must be async (records are entries the handler reconciles).";
      }
      {
        assertion = !lib.hasPrefix builtins.storeDir (toString c.dnsRecord.key.file);
        message = "fort.host.capabilities.${name}.dnsRecord.key.file is in the Nix store, readable by every user; give a path outside it (a secret manager's file).";
      }
      {
        assertion = lib.hasPrefix "/" c.dnsRecord.key.file && lib.hasPrefix "/" c.dnsRecord.stateFile;
        message = "fort.host.capabilities.${name}.dnsRecord: key.file and stateFile must be absolute paths.";
      }
      {
        assertion = c.dnsRecord.defaultTtl <= c.dnsRecord.maxTtl;
        message = "fort.host.capabilities.${name}.dnsRecord: defaultTtl (${toString c.dnsRecord.defaultTtl}) is above maxTtl (${toString c.dnsRecord.maxTtl}).";
      }
      {
        assertion = builtins.all (
          patterns: builtins.all (p: builtins.match "[*][.].+|[^*]+" p != null) patterns
        ) (builtins.attrValues c.dnsRecord.allow);
        message = "fort.host.capabilities.${name}.dnsRecord.allow: every pattern is an exact name or *.SUFFIX.";
      }
    ]) withDns
  );
}
