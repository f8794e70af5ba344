# Request of `dns-record` (fort-handler dns-record): one record set in the provider's zone,
# at a name the provider allows the consumer. The payload is {name, type, values, ttl}.
{ lib, ... }:
let
  inherit (lib) mkOption types;
in
{
  options = {
    name = mkOption {
      type = types.strMatching "(\\*\\.)?([A-Za-z0-9_-]{1,63}\\.)*[A-Za-z0-9_-]{1,63}\\.?";
      example = "wiki.example.org";
      description = ''
        The record's name, in the provider's zone and among the names the provider
        allows this host (`dnsRecord.allow`).
      '';
    };
    type = mkOption {
      type = types.nullOr (
        types.enum [
          "A"
          "AAAA"
          "CNAME"
          "TXT"
        ]
      );
      default = null;
      description = "The record type. `null`: A or AAAA, as this host's address in hosts.json is.";
    };
    values = mkOption {
      type = types.listOf types.str;
      default = [ ];
      example = [ "v=spf1 -all" ];
      description = ''
        The record's values (one for a CNAME). `[ ]`: this host's own address from
        hosts.json (A and AAAA only).
      '';
    };
    ttl = mkOption {
      type = types.nullOr (types.ints.between 1 604800);
      default = null;
      description = "Seconds resolvers may cache the record. `null`: the provider's `defaultTtl`.";
    };
  };
}
