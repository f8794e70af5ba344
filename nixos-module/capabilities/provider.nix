# What every provider module of `fort-handler` shares, so that a capability module says
# only what is its own. A capability module is
#
#   import ./provider.nix ({ config, lib, pkgs, shapes, ... }: { option = "…"; … })
#
# and declares `fort.host.capabilities.<name>.<option> = { <its settings>; stateFile; }`,
# which makes that capability run `fort-handler <handler> --config <store file>` with the
# config rendered from the settings, tells consumers its policy and the members of its
# responses, and checks at evaluation what every such capability checks (async, its
# state file its own and absolute, no secret file in the store, allow patterns,
# durations). `shapes` are option shapes several capabilities declare alike.
#
# What the function gives (the rest is optional):
#   option      its settings' attribute: `fort.host.capabilities.<name>.<option>`
#   handler     the subcommand of fort-handler, as its `Capability` table names it
#   description, example   the settings option's (example: a literalExpression's text)
#   settings    name: the options of its settings, besides `stateFile`
#   stateFile   { description; default ? name: path; shared ? ", and each would …" }:
#               the state file option, and what two capabilities sharing one would do
#               to each other
#   configFile  name: settings: the handler's config as a JSON value (in the store)
#   answers     the members every response has (`fort-handler <handler> --answers`)
#   policy      name: settings: what the policy tells consumers besides `handler` and
#               `response` (allow lists, failover)
#   defaults    name: settings: the capability's own settings it sets by default
#               (`interface`, `description`, `triggers`, …); their names must not depend
#               on the settings (they are null where another handler serves it)
#   async       why the capability must be async
#   keepsResponses  why it must keep each entry's last response (`cacheResponse`)
#   paths, secrets, patterns, durations   fields of the settings (dotted paths) that
#               must be absolute paths (`stateFile` always is), that must not be in the
#               world-readable store, that are allow lists of exact names and
#               `*.SUFFIX` patterns, and that are durations ("40s")
#   assertions  { name, at, capability, settings }: its own assertions
#   extraConfig the capabilities it serves here (name → capability): the rest of the
#               host's configuration they imply
describe:
args@{
  config,
  lib,
  pkgs,
  ...
}:
let
  inherit (lib)
    concatStringsSep
    filterAttrs
    literalExpression
    mapAttrsToList
    mkDefault
    mkIf
    mkOption
    types
    ;
  fortPackage = config.services.fort-agent.package;

  # "a", "a and b", "a, b and c": the fields one message names.
  enumerate =
    names:
    if lib.length names < 2 then
      concatStringsSep "" names
    else
      "${concatStringsSep ", " (lib.init names)} and ${lib.last names}";

  # The settings' value at a dotted path ("dns01.key.file"); null where a part is unset.
  field = settings: path: lib.attrByPath (lib.splitString "." path) null settings;

  # One assertion over the non-null values of some fields, worded by `one` for a single
  # field and by `several` for the list of them ("a, b and c").
  fieldCheck =
    {
      settings,
      fields,
      ok,
      one,
      several,
    }:
    let
      values = lib.filter (v: v != null) (map (field settings) fields);
    in
    lib.optional (fields != [ ]) {
      assertion = lib.all ok values;
      message = if lib.length fields == 1 then one (lib.head fields) else several (enumerate fields);
    };

  isDuration = d: builtins.match "[0-9]+(ms|s|m|h)" d != null;
  isPattern = p: builtins.match "[*][.].+|[^*]+" p != null;

  shapes = rec {
    # A DNS name, as the handlers read it (a trailing dot allowed).
    dnsName = types.strMatching "([A-Za-z0-9_-]{1,63}\\.)*[A-Za-z0-9_-]{1,63}\\.?";

    # A DNS server by address: `IP` (port 53), `IP:PORT` or `[IPv6]:PORT`.
    dnsServer = types.strMatching "[0-9.]+(:[0-9]+)?|[0-9A-Fa-f:]+|[[][0-9A-Fa-f:]+[]]:[0-9]+";

    # Per caller (a host or principal, `"*"` for everyone) the values it may ask for.
    allow =
      { example, description }:
      mkOption {
        type = types.attrsOf (types.listOf types.str);
        default = { };
        example = literalExpression example;
        inherit description;
      };

    # A duration the handler reads ("40s", "500ms"); the capability lists it in
    # `durations` to have it checked.
    duration =
      { default, description }:
      mkOption {
        type = types.str;
        inherit default description;
      };

    # How much a run may do before it leaves the rest to the next one.
    runBudget =
      what:
      mkOption {
        type = types.str;
        default = "40s";
        description = "${what} work one handler run may do (the agent's `handler_timeout` is 60 s); the rest continues in the next run.";
      };

    # A TSIG key at a DNS primary: `file` is described by the capability.
    tsigKey =
      {
        nameExample ? null,
        file,
      }:
      {
        name = mkOption (
          {
            type = dnsName;
            description = "The TSIG key's name, as the primary knows it.";
          }
          // lib.optionalAttrs (nameExample != null) { example = nameExample; }
        );
        algorithm = mkOption {
          type = types.enum [
            "hmac-sha256"
            "hmac-sha384"
            "hmac-sha512"
          ];
          default = "hmac-sha256";
          description = "The TSIG key's algorithm.";
        };
        file = mkOption (
          {
            type = types.str;
            example = "/run/secrets/fort-tsig";
          }
          // file
        );
      };
  };

  spec = describe (args // { inherit shapes; });
  inherit (spec)
    option
    handler
    description
    example
    settings
    stateFile
    configFile
    answers
    async
    ;
  policy = spec.policy or (_: _: { });
  defaults = spec.defaults or (_: _: { });
  keepsResponses = spec.keepsResponses or null;
  paths = spec.paths or [ ];
  secrets = spec.secrets or [ ];
  patterns = spec.patterns or [ ];
  durations = spec.durations or [ ];
  assertions = spec.assertions or (_: [ ]);
  extraConfig = spec.extraConfig or (_: { });

  stateDefault = stateFile.default or (name: "/var/lib/fort/handlers/${name}.json");
  options =
    name:
    types.submodule {
      options = settings name // {
        stateFile = mkOption {
          type = types.str;
          default = stateDefault name;
          defaultText = literalExpression ''"${stateDefault "<name>"}"'';
          inherit (stateFile) description;
        };
      };
    };
  file =
    name: s: pkgs.writeText "fort-${handler}-${name}.json" (builtins.toJSON (configFile name s));
  served = filterAttrs (_: c: c.${option} != null) config.fort.host.capabilities;

  checks =
    name: c:
    let
      s = c.${option};
      at = "fort.host.capabilities.${name}.${option}";
      over =
        fields: check:
        fieldCheck (
          {
            inherit fields;
            settings = s;
          }
          // check
        );
    in
    [
      (
        if keepsResponses == null then
          {
            assertion = c.mode == "async";
            message = "${at}: the capability must be async (${async}).";
          }
        else
          {
            assertion = c.mode == "async" && c.cacheResponse;
            message = "${at}: the capability must be async with cacheResponse = true (${keepsResponses}).";
          }
      )
    ]
    ++ over secrets {
      ok = v: !lib.hasPrefix builtins.storeDir (toString v);
      one = f: "${at}.${f} is in the Nix store, readable by every user; give a path outside it (a secret manager's file).";
      several = fs: "${at}: ${fs} must not be in the Nix store, readable by every user; give paths outside it (a secret manager's files).";
    }
    ++ over (lib.unique (paths ++ [ "stateFile" ])) {
      ok = v: lib.hasPrefix "/" (toString v);
      one = f: "${at}.${f} must be an absolute path.";
      several = fs: "${at}: ${fs} must be absolute paths.";
    }
    ++ over patterns {
      ok = allow: lib.all (lib.all isPattern) (builtins.attrValues allow);
      one = f: "${at}.${f}: every pattern is an exact name or *.SUFFIX.";
      several = fs: "${at}: every pattern of ${fs} is an exact name or *.SUFFIX.";
    }
    ++ over durations {
      ok = isDuration;
      one = f: "${at}.${f}: a duration such as \"40s\" or \"500ms\".";
      several = fs: "${at}: ${fs} are durations such as \"10s\" or \"500ms\".";
    }
    ++ assertions {
      inherit name at;
      capability = c;
      settings = s;
    };

  stateFiles = mapAttrsToList (_: c: c.${option}.stateFile) served;
in
{
  options.fort.host.capabilities = mkOption {
    type = types.attrsOf (
      types.submodule (
        { name, config, ... }:
        let
          s = config.${option};
        in
        {
          options.${option} = mkOption {
            type = types.nullOr (options name);
            default = null;
            example = literalExpression example;
            inherit description;
          };
          config = mkIf (s != null) (
            {
              handler = mkDefault "${fortPackage}/bin/fort-handler";
              args = [
                handler
                "--config"
                "${file name s}"
              ];
              configFiles = [ (file name s) ];
              policy = {
                inherit handler;
                response = answers;
              }
              // policy name s;
            }
            // lib.mapAttrs (_: mkDefault) (
              lib.optionalAttrs (keepsResponses != null) { cacheResponse = true; } // defaults name s
            )
          );
        }
      )
    );
  };

  config = lib.mkMerge [
    {
      assertions = [
        {
          assertion = lib.length stateFiles == lib.length (lib.unique stateFiles);
          message = "fort.host.capabilities.<name>.${option}.stateFile: two capabilities share one state file${
            stateFile.shared or ""
          }; give each its own.";
        }
      ]
      ++ lib.concatLists (mapAttrsToList checks served);
    }
    (extraConfig served)
  ];
}
