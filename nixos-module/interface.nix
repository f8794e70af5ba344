# Typed capability interfaces: a capability's request declared as a NixOS module of
# options (after Clan's service `interface`), evaluated on its own, without any host.
# From the one declaration come:
#   - checkRequest: what is wrong with a consumer's request (unknown field, wrong type,
#     missing required option), as data the assertions turn into messages;
#   - fillDefaults: the request with the interface's defaults filled in (what ships);
#   - requestSchema: JSON Schema (draft 2020-12) for capabilities.json `request_schema`,
#     which the provider's agent checks every incoming request against;
#   - renderInterfaces / renderOptions: Markdown, also used for docs/options.md.
#
# Values `{ "$fort_ref" = "<type>/<id>#<pointer>"; }` and `{ "$fort_key" = "<name>"; as =
# "csr"; }` are accepted for any option type: the consumer's agent resolves them before
# sending, and the provider checks the resolved request against the schema.
#
# An interface is data about requests, so its defaults must be constants (they are read
# without a request: a default that reads `config` fails), and values must be JSON.
# `apply` and `freeformType` are not used: an unknown field is always an error.
{ lib }:
let
  inherit (lib)
    any
    attrNames
    attrValues
    concatLists
    concatMap
    concatMapStrings
    elemAt
    filter
    hasPrefix
    isOption
    listToAttrs
    mapAttrs
    mapAttrsToList
    nameValuePair
    optionalAttrs
    optionalString
    ;
  inherit (builtins)
    isAttrs
    isList
    match
    ;

  refKey = "$fort_ref";
  isRef = v: isAttrs v && v ? ${refKey};
  keyRefKey = "$fort_key";
  isKeyRef = v: isAttrs v && v ? ${keyRefKey};
  # What the agent replaces before sending: never checked against the option's type.
  isPlaceholder = v: isRef v || isKeyRef v;

  # `apply`-free option tree of a module or a submodule type, without the module
  # system's own `_module` options.
  userOptions = opts: removeAttrs opts [ "_module" "_freeformOptions" ];
  subOptionsOf = type: userOptions (type.getSubOptions [ ]);

  # Where a value sits, for messages: request.scopes[0], request."odd key".
  showKey = k: if match "[A-Za-z_][A-Za-z0-9_'-]*" k != null then k else builtins.toJSON k;
  child = path: k: "${path}.${showKey k}";
  item = path: i: "${path}[${toString i}]";

  show =
    v:
    let
      s = lib.generators.toPretty { multiline = false; } v;
    in
    if builtins.stringLength s > 80 then builtins.substring 0 77 s + "..." else s;

  # Composite types are walked here; every other type's own `check` is complete
  # (str, int, bool, enum, strMatching, ints.between, ...), and is what the module
  # system would apply.
  nameOf = type: type.name or "";
  isAttrsType = type: builtins.elem (nameOf type) [ "attrsOf" "lazyAttrsOf" ];
  elemOf = type: type.nestedTypes.elemType;

  typeProblem = path: type: v: {
    inherit path;
    kind = "type";
    expected = type.description;
    got = show v;
  };

  checkValue =
    path: type: v:
    let
      n = nameOf type;
    in
    if isPlaceholder v then
      [ ]
    else if n == "submodule" then
      checkObject path (subOptionsOf type) v
    else if n == "listOf" then
      if isList v then
        concatLists (lib.imap0 (i: checkValue (item path i) (elemOf type)) v)
      else
        [ (typeProblem path type v) ]
    else if isAttrsType type then
      if isAttrs v then
        concatLists (mapAttrsToList (k: checkValue (child path k) (elemOf type)) v)
      else
        [ (typeProblem path type v) ]
    else if n == "nullOr" then
      if v == null then [ ] else checkValue path (elemOf type) v
    else if n == "unique" || n == "uniq" then
      checkValue path (elemOf type) v
    else if n == "either" then
      if checkValue path type.nestedTypes.left v == [ ] || checkValue path type.nestedTypes.right v == [ ] then
        [ ]
      else
        [ (typeProblem path type v) ]
    else if type.check v then
      [ ]
    else
      [ (typeProblem path type v) ];

  # An object against an option tree: unknown fields, missing required options, and
  # each present value against its option's type. Nested option groups
  # (`options.tls.enable = ...`) are objects too.
  checkObject =
    path: opts: value:
    if isPlaceholder value then
      [ ]
    else if !(isAttrs value) then
      [
        {
          inherit path;
          kind = "type";
          expected = "an attribute set (JSON object)";
          got = show value;
        }
      ]
    else
      map (k: {
        path = child path k;
        kind = "unknown";
        known = attrNames opts;
      }) (filter (k: !(opts ? ${k})) (attrNames value))
      ++ concatLists (
        mapAttrsToList (
          k: o:
          if isOption o then
            if value ? ${k} then
              checkValue (child path k) o.type value.${k}
            else if o ? default then
              [ ]
            else
              [
                {
                  path = child path k;
                  kind = "missing";
                  expected = o.type.description;
                }
              ]
          else
            checkObject (child path k) o (value.${k} or { })
        ) opts
      );

  fillValue =
    type: v:
    let
      n = nameOf type;
    in
    if isPlaceholder v then
      v
    else if n == "submodule" then
      fillObject (subOptionsOf type) v
    else if n == "listOf" && isList v then
      map (fillValue (elemOf type)) v
    else if isAttrsType type && isAttrs v then
      mapAttrs (_: fillValue (elemOf type)) v
    else if (n == "nullOr" && v != null) || n == "unique" || n == "uniq" then
      fillValue (elemOf type) v
    else if n == "either" then
      fillValue (
        if checkValue "" type.nestedTypes.left v == [ ] then type.nestedTypes.left else type.nestedTypes.right
      ) v
    else
      v;

  # Total: a request with problems is filled as far as it goes (the assertions report
  # the problems; nothing here throws on a bad request).
  fillObject =
    opts: value:
    if isPlaceholder value || !(isAttrs value) then
      value
    else
      value
      // listToAttrs (
        concatLists (
          mapAttrsToList (
            k: o:
            if isOption o then
              if value ? ${k} then
                [ (nameValuePair k (fillValue o.type value.${k})) ]
              else if o ? default then
                [ (nameValuePair k (fillValue o.type o.default)) ]
              else
                [ ]
            else
              let
                sub = fillObject o (value.${k} or { });
              in
              lib.optional (value ? ${k} || sub != { }) (nameValuePair k sub)
          ) opts
        )
      );

  # ------------------------------------------------------------------ JSON Schema
  # Option type -> JSON Schema (draft 2020-12):
  #   str, separatedString, passwdEntry, path   string
  #   nonEmptyStr                               string, pattern "[^ \t\n]"
  #   singleLineStr                             string, pattern ^[^\n\r]*\n?$
  #   strMatching P                             string, pattern ^(?:P)$ (POSIX classes
  #                                             such as [:alnum:] translated)
  #   int / float / number                      integer / number
  #   ints.between, ints.u8..u32, s8..s32,      integer (or number) with minimum and
  #   port, ints.unsigned, ints.positive,       maximum (or exclusiveMinimum 0), read
  #   numbers.between/nonnegative/positive      from the type's description (addCheck
  #                                             closures cannot be inspected)
  #   bool                                      boolean
  #   enum [ ... ]                              enum
  #   listOf T                                  array, items T
  #   attrsOf T, lazyAttrsOf T                  object, additionalProperties T
  #   submodule, nested option groups           object: properties, required (options
  #                                             without default), additionalProperties false
  #   nullOr T                                  T with type [ "...", "null" ], or anyOf
  #   either / oneOf / coercedTo                anyOf
  #   attrs                                     object
  #   anything, raw, unspecified                {} (any value, by the type's meaning)
  # Any other type becomes {} (any value) with a "$comment" naming it; checks added
  # with addCheck are enforced at evaluation only.

  boundsFromDescription =
    desc:
    let
      m = match ".*between (-?[0-9][0-9.e+-]*) and (-?[0-9][0-9.e+-]*) \\(both inclusive\\).*" desc;
    in
    if m == null then
      { }
    else
      {
        minimum = builtins.fromJSON (elemAt m 0);
        maximum = builtins.fromJSON (elemAt m 1);
      };

  # POSIX ERE (builtins.match) and ECMA-262 (JSON Schema) agree on the common subset;
  # the bracket classes are the usual difference.
  posixClasses = {
    "[:alnum:]" = "A-Za-z0-9";
    "[:alpha:]" = "A-Za-z";
    "[:digit:]" = "0-9";
    "[:lower:]" = "a-z";
    "[:upper:]" = "A-Z";
    "[:xdigit:]" = "0-9A-Fa-f";
    "[:space:]" = " \\t\\n\\r\\f\\v";
    "[:blank:]" = " \\t";
  };
  ecmaPattern =
    p:
    "^(?:"
    + builtins.replaceStrings (attrNames posixClasses) (attrValues posixClasses) p
    + ")$";

  # A default goes into the schema only when it is plain JSON (a path or a derivation
  # would be copied to the store or fail in builtins.toJSON).
  isJson =
    v:
    v == null
    || builtins.isBool v
    || builtins.isInt v
    || builtins.isFloat v
    || builtins.isString v
    || (isList v && lib.all isJson v)
    || (isAttrs v && !(lib.isDerivation v) && lib.all isJson (attrValues v));

  anyOf =
    schemas:
    {
      anyOf = concatMap (s: if attrNames s == [ "anyOf" ] then s.anyOf else [ s ]) schemas;
    };

  typeSchema =
    type:
    let
      n = nameOf type;
      int = { type = "integer"; };
      number = { type = "number"; };
    in
    if builtins.elem n [ "str" "separatedString" "path" ] || hasPrefix "passwdEntry" n then
      { type = "string"; }
    else if n == "nonEmptyStr" then
      {
        type = "string";
        pattern = "[^ \t\n]";
      }
    else if n == "singleLineStr" then
      {
        type = "string";
        pattern = "^[^\n\r]*\n?$";
      }
    else if hasPrefix "strMatching" n then
      {
        type = "string";
        pattern = ecmaPattern (
          type.functor.payload.pattern or (lib.removePrefix "string matching the pattern " type.description)
        );
      }
    else if n == "int" then
      int
    else if n == "intBetween" || hasPrefix "unsignedInt" n && n != "unsignedInt" || hasPrefix "signedInt" n then
      int // boundsFromDescription type.description
    else if n == "unsignedInt" then
      int // { minimum = 0; }
    else if n == "positiveInt" then
      int // { minimum = 1; }
    else if n == "float" then
      number
    else if n == "numberBetween" then
      number // boundsFromDescription type.description
    else if n == "numberNonnegative" then
      number // { minimum = 0; }
    else if n == "numberPositive" then
      number // { exclusiveMinimum = 0; }
    else if n == "bool" || n == "boolByOr" then
      { type = "boolean"; }
    else if n == "enum" then
      {
        enum =
          let
            p = type.functor.payload;
          in
          if isList p then p else p.values;
      }
    else if n == "listOf" then
      {
        type = "array";
        items = typeSchema (elemOf type);
      }
    else if isAttrsType type then
      {
        type = "object";
        additionalProperties = typeSchema (elemOf type);
      }
    else if n == "submodule" then
      objectSchema (subOptionsOf type)
    else if n == "attrs" then
      { type = "object"; }
    else if n == "nullOr" then
      let
        s = typeSchema (elemOf type);
      in
      if builtins.isString (s.type or null) && !(s ? enum) then
        s // { type = [ s.type "null" ]; }
      else
        anyOf [ s { type = "null"; } ]
    else if n == "unique" || n == "uniq" then
      typeSchema (elemOf type)
    else if n == "either" then
      anyOf [ (typeSchema type.nestedTypes.left) (typeSchema type.nestedTypes.right) ]
    else if n == "coercedTo" then
      anyOf [ (typeSchema type.nestedTypes.coercedType) (typeSchema type.nestedTypes.finalType) ]
    else if builtins.elem n [ "anything" "raw" "unspecified" ] then
      { }
    else
      {
        "$comment" = "option type ${n} (${type.description or "?"}) has no JSON Schema mapping; any value is accepted";
      };

  # Required: an option without a default, or a group holding one.
  isRequired = o: if isOption o then !(o ? default) else any isRequired (attrValues o);

  optionSchema =
    o:
    typeSchema o.type
    // optionalAttrs (builtins.isString (o.description or null)) { inherit (o) description; }
    // optionalAttrs (o ? default && isJson o.default) { inherit (o) default; };

  objectSchema = opts: {
    type = "object";
    properties = mapAttrs (_: o: if isOption o then optionSchema o else objectSchema o) opts;
    required = filter (k: isRequired opts.${k}) (attrNames opts);
    additionalProperties = false;
  };

  # ------------------------------------------------------------------- Markdown
  # Like lib.optionAttrSetToDocList, but it keeps whether an option has a default
  # (that function renders an empty list or set for a required list option) and skips
  # what is below an internal or invisible option.
  docList =
    options:
    concatMap (
      opt:
      let
        visible = opt.visible or true;
        subs = userOptions (opt.type.getSubOptions opt.loc);
        entry = {
          name = lib.showOption opt.loc;
          type = opt.type.description or "unspecified";
          description = opt.description or null;
          readOnly = opt.readOnly or false;
          hasDefault = opt ? default || opt ? defaultText;
        }
        // optionalAttrs (opt ? defaultText || opt ? default) {
          default = lib.options.renderOptionValue (opt.defaultText or opt.default);
        }
        // optionalAttrs (opt ? example) { example = lib.options.renderOptionValue opt.example; };
      in
      if opt.internal or false || visible == false then
        [ ]
      else
        lib.optional (visible != "transparent") entry ++ lib.optionals (visible != "shallow") (docList subs)
    ) (lib.collect isOption (userOptions options));

  # With its leading separator: " `[ ]`", or a block on its own lines.
  renderValue =
    v:
    if v._type or "" == "literalMD" then
      " ${v.text}"
    else if lib.hasInfix "\n" v.text then
      "\n\n```nix\n${v.text}\n```"
    else
      " `${v.text}`";

  renderEntry =
    heading: e:
    ''
      ${heading} `${e.name}`

      ${optionalString (e.description != null) "${lib.strings.trim e.description}\n\n"}*Type:* ${e.type}

      ${
        if e ? default then
          "*Default:*${renderValue e.default}"
        else if e.readOnly then
          "*Default:* none (set by the module)"
        else
          "*Default:* none (required)"
      }
    ''
    + optionalString (e ? example) "\n*Example:*${renderValue e.example}\n"
    + optionalString e.readOnly "\n*Read-only.*\n"
    + "\n";
in
{
  inherit
    isRef
    refKey
    isKeyRef
    keyRefKey
    ;

  # The option tree an interface module declares, evaluated without any host. The
  # functions below take this tree, so a caller evaluates each interface once.
  optionsOf = module: userOptions (lib.evalModules { modules = [ module ]; }).options;

  # [ { path; kind = "unknown" | "missing" | "type"; ... } ] for `request` (paths start
  # at "request"), against an option tree.
  checkRequest = checkObject "request";

  fillDefaults = fillObject;

  requestSchema =
    opts:
    {
      "$schema" = "https://json-schema.org/draft/2020-12/schema";
    }
    // objectSchema opts;

  # Markdown for an option tree: one section per visible, non-internal option.
  renderOptions = headingLevel: options: concatMapStrings (renderEntry (lib.fixedWidthString headingLevel "#" "")) (docList options);

  # Markdown for { <capability> = <interface module>; } with no host evaluated.
  renderInterfaces =
    interfaces:
    ''
      # Capability request interfaces

      What a need's `request` may contain, per capability. A consumer's request is checked
      against these at evaluation time, options with a default are filled in before it
      ships, and the provider's agent checks every incoming request against the same
      interface as a JSON Schema (`request_schema` in capabilities.json).

    ''
    + concatMapStrings (
      name:
      let
        entries = docList (lib.evalModules { modules = [ interfaces.${name} ]; }).options;
      in
      "## `${name}`\n\n"
      + (
        if entries == [ ] then
          "No options: the request is an empty object.\n\n"
        else
          concatMapStrings (renderEntry "###") entries
      )
    ) (attrNames interfaces);
}
