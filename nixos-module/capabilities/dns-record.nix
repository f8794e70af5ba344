# The provider side of `fort-handler dns-record`: `fort.host.capabilities.<name>.dnsRecord`
# turns a capability into records in one zone, made by RFC 2136 updates signed with TSIG
# at the zone's primary (docs/handlers.md, "dns-record"). The handler's config is written
# to the store as JSON; it names the TSIG key file, never the secret.
import ./provider.nix (
  { lib, shapes, ... }:
  let
    inherit (lib) mkOption types;
  in
  {
    option = "dnsRecord";
    handler = "dns-record";
    description = ''
      Serve this capability with `fort-handler dns-record`: one A, AAAA, CNAME or
      TXT record set per entry in `zone`, by RFC 2136 updates signed with TSIG,
      delivered as `{name, type, values, ttl}`. Records it did not create are
      never deleted; at start (`triggers.initialize`) it puts back records of its
      own that went missing.
    '';
    example = ''
      {
        zone = "example.org";
        primary = "10.0.0.53";
        key = { name = "fort"; file = "/run/secrets/fort-tsig"; };
        allow."*" = [ "{origin}.example.org" ];
      }
    '';
    settings = _: {
      zone = mkOption {
        type = shapes.dnsName;
        example = "example.org";
        description = "The zone records are made in; every requested name must be in it.";
      };
      primary = mkOption {
        type = shapes.dnsServer;
        example = "10.0.0.53:53";
        description = ''
          The zone's primary server, `IP` (port 53) or `IP:PORT` (`[IPv6]:PORT`).
          Updates and queries go to it over TCP; names are not resolved.
        '';
      };
      key = shapes.tsigKey {
        nameExample = "fort";
        file.description = ''
          A file holding the key's base64 secret (alone, or as `tsig-keygen` or
          `keymgr -t` print it), readable by the agent's user. Never a store path: a
          missing or unreadable file fails every run, so nothing is sent unsigned.
        '';
      };
      allow = shapes.allow {
        example = ''{ app = [ "wiki.example.org" "*.app.example.org" ]; "*" = [ "{origin}.hosts.example.org" ]; }'';
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
    };
    stateFile = {
      description = ''
        The handler's record of the records it created (mode 0600): only these are
        ever deleted. One per capability.
      '';
      shared = ", and each would delete the other's records";
    };
    configFile = _: s: {
      inherit (s) zone primary allow;
      key = {
        inherit (s.key) name algorithm file;
      };
      default_ttl = s.defaultTtl;
      max_ttl = s.maxTtl;
      timeout_seconds = s.timeoutSeconds;
      hosts = "/etc/fort/hosts.json";
      state = s.stateFile;
    };
    answers = [ "name" "type" "values" "ttl" ];
    policy = _: s: {
      inherit (s) allow;
      # As `fort-handler dns-record --failover` says.
      failover = {
        kind = "one-provider";
        why = "its providers would share one DNS primary, and a standby does not adopt the records another provider made there";
      };
    };
    defaults = _: s: {
      interface = ../interfaces/dns-record.nix;
      cacheResponse = true;
      triggers.initialize = true;
      description = "DNS records in ${s.zone}";
    };
    async = "records are entries the handler reconciles";
    paths = [ "key.file" ];
    secrets = [ "key.file" ];
    patterns = [ "allow" ];
    assertions =
      { at, settings, ... }:
      [
        {
          assertion = settings.defaultTtl <= settings.maxTtl;
          message = "${at}: defaultTtl (${toString settings.defaultTtl}) is above maxTtl (${toString settings.maxTtl}).";
        }
      ];
  }
)
