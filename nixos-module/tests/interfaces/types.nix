# An interface using every option type the JSON Schema mapping knows (interface.nix), and
# one it does not, for the evaluation test's expected/schemas.json.
{ lib, ... }:
let
  inherit (lib) mkOption types;
  opt = type: mkOption { inherit type; };
in
{
  options = {
    str = opt types.str;
    nonEmpty = opt types.nonEmptyStr;
    singleLine = opt types.singleLineStr;
    matching = opt (types.strMatching "[[:alnum:]_]+");
    int = opt types.int;
    between = opt (types.ints.between (-5) 5);
    positive = opt types.ints.positive;
    unsigned = opt types.ints.unsigned;
    port = opt types.port;
    float = opt types.float;
    number = opt types.number;
    fraction = opt (types.numbers.between 0 1);
    bool = opt types.bool;
    enum = opt (types.enum [ "a" "b" 3 ]);
    list = opt (types.listOf types.str);
    attrs = opt (types.attrsOf types.int);
    nullable = mkOption {
      type = types.nullOr types.str;
      default = null;
      description = "Nullable, with a default.";
    };
    nullableEnum = opt (types.nullOr (types.enum [ "x" ]));
    oneOf = opt (types.oneOf [ types.int types.bool types.str ]);
    sub = opt (
      types.submodule {
        options.inner = mkOption {
          type = types.bool;
          default = true;
        };
        options.needed = opt types.str;
      }
    );
    group.leaf = opt types.str;
    group.optional = mkOption {
      type = types.int;
      default = 1;
    };
    anything = opt types.anything;
    unknown = opt types.package;
  };
}
