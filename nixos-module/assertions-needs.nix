# Mistakes in this host's needs, reported at evaluation time with the option to fix: the
# provider, the request against the provider's interface, references between needs, and
# the delivery of payload files.
{
  config,
  options,
  lib,
  ...
}:
let
  cfg = config.services.fort-agent;
  cluster = config.fort.cluster;
  inherit (config.fort.host) needs capabilities;
  fortLib = import ./lib.nix { inherit lib; };
  inherit (fortLib) grammar matches interface;
  inherit (lib)
    attrNames
    attrValues
    concatMap
    concatStringsSep
    filter
    hasSuffix
    length
    mapAttrsToList
    optionalString
    removeSuffix
    ;

  self = cfg.hostName;
  hostNames = attrNames cluster.facts.hosts;
  isHost = n: cluster.facts.hosts ? ${n};
  quote = s: ''"${s}"'';
  inherit (cluster) fleet;
  definedServices = fortLib.servicesDefinedElsewhere options;

  allNeeds = fortLib.needList needs;
  declared = lib.listToAttrs (map (n: lib.nameValuePair n.key n) allNeeds);
  optionOf = key: "fort.host.needs.${lib.replaceStrings [ "/" ] [ "." ] key}";

  # Where the inventory's need definitions come from (default.nix defines them).
  inventoryFile = toString ./default.nix;

  check = assertion: message: { inherit assertion message; };
  # One assertion per offending item, so every mistake is reported at once.
  each = list: f: map f list;
  unitPattern = "[A-Za-z0-9:_.@-]+";

  # What the host a need names serves, as far as this evaluation can see.
  servedBy =
    host:
    if host == self then
      lib.mapAttrs (_: c: { inherit (c) mode; }) capabilities
    else if fleet != null && fleet.entry host != null then
      (fleet.entry host).capabilities
    else
      null; # unknown without mkFleet: not checked (a warning says so)

  basicAssertions = concatMap (
    n:
    let
      where = optionOf n.key;
    in
    [
      (check (matches grammar.capability n.type && matches grammar.capability n.id)
        "${where}: need type and id must match ^${grammar.capability}$ (docs/protocol.md §1)."
      )
      (check (length n.providers <= 8 && length (lib.unique n.providers) == length n.providers)
        "${where}.from names ${toString (length n.providers)} providers: at most 8, each once (docs/protocol.md §11.13)."
      )
      (check (n.failoverAfter == null || fortLib.durationSeconds n.failoverAfter > 0)
        "${where}.failoverAfter must be longer than 0s (or null)."
      )
    ]
    # Every provider listed must exist and serve the need: the need may move to any.
    ++ each n.providers (
      p:
      check (isHost p)
        "${where}.from = ${quote p}, which is not a host in fort.cluster.hosts (hosts: ${concatStringsSep ", " hostNames}).${fortLib.didYouMean p hostNames}"
    )
    ++ each n.providers (
      p:
      let
        served = servedBy p;
      in
      check (!(isHost p) || served == null || served ? ${n.type})
        "${where}: nobody serves this need: host ${quote p} declares no capability ${quote n.type} (fort.host.capabilities.${n.type} on ${p}, with services.fort-agent.enable)."
    )
    ++ [
      # A need may be served by an rpc capability too: the provider answers at once and
      # the consumer feeds the verified reply to its handler (no callback, no GC).
      (check (fortLib.durationSeconds n.nag > 0) "${where}.nag must be longer than 0s.")
      (check (n.renewBefore == null || fortLib.durationSeconds n.renewBefore > 0)
        "${where}.renewBefore must be longer than 0s (or null)."
      )
      # Under callersFromInventory no provider reads this host's needs: one that is not
      # the inventory's would never be among its provider's callers.
      (check (fleet == null || !fleet.callersFromInventory || n.from == self || n.fromInstance != null)
        "${where}: lib.mkFleet's callersFromInventory is set, so providers learn their callers from fort.cluster.instances alone and ${quote n.from} would never hear of this need. Declare it as an instance (fort.cluster.instances.${n.id}: capability ${quote n.type}, roles.provider.machines.${n.from}, roles.consumer.machines.${self}) in mkFleet's cluster, or leave callersFromInventory unset."
      )
      (check (n.fromInstance == null || length n.fromDefinedIn <= 1)
        "${where}: duplicate need key ${n.type}/${n.id}: fort.cluster.instances.${toString n.fromInstance} declares it, and `from` is also set in ${concatStringsSep ", " (lib.remove inventoryFile n.fromDefinedIn)}. Rename the instance or the need; to add a handler to the instance's need, set only handler/check/nag here."
      )
    ]
    ++ each (n.restartUnits ++ n.reloadUnits) (
      unit:
      check (matches unitPattern unit) "${where}: ${quote unit} in restartUnits/reloadUnits is not a unit name."
    )
  ) allNeeds;

  # The request against the provider's interface (lib.nix providerInterface): each
  # problem names this host, the option path under the need, and the provider.
  interfaceOf = fortLib.providerInterface {
    inherit self capabilities;
    inherit (cluster) fleet interfaces;
  };
  interfaceAssertions = concatMap (
    n:
    let
      iface = interfaceOf n;
      about = "the interface of capability ${quote n.type} on provider host ${n.from}";
      origin =
        if n.fromInstance == null then
          ""
        else
          " (the request merges fort.cluster.instances.${n.fromInstance}.settings and this host's definitions)";
      message =
        p:
        "host ${self}: ${optionOf n.key}.${p.path}: "
        + (
          if p.kind == "unknown" then
            "unknown field; ${about} declares ${if p.known == [ ] then "no fields" else concatStringsSep ", " p.known}"
          else if p.kind == "missing" then
            "missing; ${about} requires it (${p.expected}, no default)"
          else
            "${about} expects ${p.expected}, got ${p.got}"
        )
        + origin
        + "."
        + optionalString (p.kind == "unknown") (
          fortLib.didYouMean (lib.last (lib.splitString "." p.path)) p.known
        );
    in
    # A `from` that is no host has its own assertion; its interface would be a guess.
    if iface == null || !(isHost n.from) then
      [ ]
    else
      map (p: check false (message p)) (interface.checkRequest (interface.optionsOf iface) n.request)
  ) allNeeds;

  # The request and the files' pointers against the provider's policy (its allow lists,
  # what its response holds), when the provider's handler is fort's: a name the
  # provider would refuse fails here, naming the need, the value and what is allowed.
  policyOf = fortLib.providerPolicy {
    inherit self capabilities;
    inherit (cluster) fleet;
  };
  policyAssertions = concatMap (
    n:
    let
      policy = policyOf n;
    in
    if policy == null || !(isHost n.from) then
      [ ]
    else
      map (p: check false "host ${self}: ${optionOf n.key}.${p.path}: ${p.message}.") (
        fortLib.policyProblems {
          inherit policy;
          origin = self;
          need = n;
          provider = n.from;
        }
      )
  ) allNeeds;

  # A need naming several providers of a capability fort ships (docs/handlers.md,
  # "Several providers"): one that takes one provider refuses it; providers sharing a
  # backend must name the same one and list each other as peers.
  failoverAssertions = concatMap (
    n:
    let
      policies = map (p: {
        provider = p;
        policy = policyOf (n // { from = p; });
      }) (filter isHost n.providers);
      known = filter (x: x.policy != null && x.policy ? failover) policies;
      ofKind = kind: filter (x: x.policy.failover.kind == kind) known;
      shared = ofKind "shared-backend";
      first = lib.head shared;
      sharers = map (x: x.provider) shared;
    in
    if length n.providers < 2 then
      [ ]
    else
      map (
        x:
        check false "${optionOf n.key}.from names ${toString (length n.providers)} providers, but ${n.type} at ${x.provider} takes one: ${x.policy.failover.why}."
      ) (ofKind "one-provider")
      ++ concatMap (
        x:
        lib.optional (x.policy.failover.backend != first.policy.failover.backend) (
          check false "${optionOf n.key}.from: ${x.provider} serves ${n.type} on ${x.policy.failover.backend}, ${first.provider} on ${first.policy.failover.backend}: the providers of one need must share one backend."
        )
        ++ map (
          other:
          check false "${optionOf n.key}.from: ${x.provider} does not list ${other} among its ${n.type} peers (fort.host.capabilities.${n.type}.postgres.peers on ${x.provider}), so it would not take over what ${other} made for this need."
        ) (filter (o: o != x.provider && !(lib.elem o x.policy.failover.peers)) sharers)
      ) shared
  ) allNeeds;

  # docs/protocol.md §11.5: references and `after` name needs of this host, and never
  # come back around to the need itself.
  referenceAssertions = concatMap (
    n:
    let
      where = optionOf n.key;
    in
    map (
      r:
      let
        v = r.ref.${fortLib.refKey};
        parsed = fortLib.parseRef v;
      in
      if !(builtins.isString v) || attrNames r.ref != [ fortLib.refKey ] then
        check false ''${where}.${r.path}: a reference is exactly { "$fort_ref" = "<type>/<id>#<JSON pointer>"; } (config.fort.lib.ref builds one).''
      else if parsed.pointer != null && !(fortLib.isPointer parsed.pointer) then
        check false "${where}.${r.path}: $fort_ref ${quote v}: the part after # must be a JSON pointer, empty or starting with /."
      else
        check (declared ? ${parsed.need})
          "${where}.${r.path}: $fort_ref ${quote v} names the need ${parsed.need}, which host ${self} does not declare (${optionOf parsed.need}); a reference names a need of the same host."
    ) (fortLib.refsIn "request" n.request)
    ++ each n.after (
      a:
      check (declared ? ${a})
        "${where}.after: ${quote a} is not a need host ${self} declares (${optionOf a}); after names needs of this host as <type>/<id>."
    )
  ) allNeeds;
  # docs/protocol.md §11.10: a $fort_key names a key of its own need, in a form the agent
  # makes; a CSR needs names; OpenSSH's own format is for ed25519 keys.
  keyAssertions = concatMap (
    n:
    let
      where = optionOf n.key;
    in
    map (
      r:
      let
        v = r.ref.${fortLib.keyRefKey};
        form = r.ref.as or "public";
      in
      if
        !(builtins.isString v)
        || builtins.any (k: k != fortLib.keyRefKey && k != "as") (attrNames r.ref)
      then
        check false ''${where}.${r.path}: a key reference is exactly { "$fort_key" = "<name>"; as = "csr"; } (config.fort.lib.key builds one).''
      else if !(n.keys ? ${v}) then
        check false "${where}.${r.path}: $fort_key ${quote v} names no key of this need; declare it in ${where}.keys.${v}.${fortLib.didYouMean v (attrNames n.keys)}"
      else if !(builtins.elem form [ "csr" "public" "openssh" ]) then
        check false "${where}.${r.path}: $fort_key ${quote v}: as must be \"csr\", \"public\" or \"openssh\", not ${quote (toString form)}."
      else
        check (form != "csr" || n.keys.${v}.names != [ ])
          "${where}.${r.path}: $fort_key ${quote v} asks for a CSR, but ${where}.keys.${v}.names is empty."
    ) (fortLib.keyRefsIn "request" n.request)
    ++ lib.mapAttrsToList (
      name: k:
      check (k.format != "openssh" || k.type == "ed25519")
        "${where}.keys.${name}: format \"openssh\" is for ed25519 keys; OpenSSH reads ecdsa-p256 keys as PEM."
    ) n.keys
  ) allNeeds;
  cycle = fortLib.findCycle (lib.mapAttrs (_: fortLib.waitsFor) declared);
  cycleAssertion =
    check (cycle == null)
      "fort.host.needs on ${self}: references ($fort_ref) and after form a cycle: ${concatStringsSep " -> " cycle}. A need cannot wait for itself.";

  # docs/protocol.md §11.3 delivery.
  files = concatMap (
    n:
    mapAttrsToList (
      name: f:
      f
      // {
        inherit name;
        at = "${optionOf n.key}.files.${lib.strings.escapeNixIdentifier name}";
      }
    ) n.files
    # A key lands like a file (docs/protocol.md §11.10): the same rules for its path and
    # owner, and no file or other key on the same path.
    ++ mapAttrsToList (
      name: k:
      k
      // {
        inherit name;
        pointer = "";
        credentialFor = [ ];
        encrypt = false;
        at = "${optionOf n.key}.keys.${lib.strings.escapeNixIdentifier name}";
      }
    ) n.keys
  ) allNeeds;
  credentials = concatMap (
    f:
    map (unit: {
      inherit (f) name at;
      service = removeSuffix ".service" unit;
    }) f.credentialFor
  ) files;
  clashes = key: list: filter (g: length g > 1) (attrValues (lib.groupBy key list));

  fileAssertions =
    concatMap (
      f:
      [
        (check (matches "[A-Za-z0-9_][A-Za-z0-9_.-]*" f.name)
          "${f.at}: the file name is also its credential name and must match ^[A-Za-z0-9_][A-Za-z0-9_.-]*$."
        )
        (check (
          lib.hasPrefix "/" f.path && !lib.hasPrefix "${builtins.storeDir}/" f.path && !hasSuffix "/" f.path
        ) "${f.at}.path = ${quote f.path} must be an absolute file path outside the Nix store.")
        (check (fortLib.isPointer f.pointer)
          "${f.at}.pointer = ${quote f.pointer} must be \"\" (the whole payload) or a JSON pointer starting with /."
        )
        (check (cfg.user == "root" || f.owner == cfg.user)
          "${f.at}.owner = ${quote f.owner}: the agent runs as ${cfg.user} and cannot give files to another user; set owner = ${quote cfg.user} or run the agent as root."
        )
        (check (!f.encrypt || cfg.user == "root")
          "${f.at}.encrypt: the agent runs as ${cfg.user}, and systemd-creds encrypts only for root (it reads the host's credential secret); run the agent as root (services.fort-agent.user = \"root\") or deliver the file unencrypted."
        )
      ]
      ++ each f.credentialFor (
        unit:
        check (hasSuffix ".service" unit && matches unitPattern unit)
          "${f.at}.credentialFor: ${quote unit} must be a service unit name ending in .service."
      )
      ++ each (filter (hasSuffix ".service") f.credentialFor) (
        unit:
        check (builtins.elem (removeSuffix ".service" unit) definedServices)
          "${f.at}.credentialFor: no module on ${self} defines ${quote unit} (systemd.services.${removeSuffix ".service" unit}), so its LoadCredential= would sit in an empty unit that never runs. Name a service this host defines."
      )
    ) files
    ++ map (
      g:
      check false "${concatStringsSep " and " (map (f: f.at) g)} write the same file ${(lib.head g).path}; give each its own path."
    ) (clashes (f: f.path) files)
    ++ concatMap (
      cs:
      map (
        g:
        check false "${concatStringsSep " and " (map (c: c.at) g)} are both credentials named ${(lib.head g).name} of ${(lib.head g).service}.service; rename one (the file name is the credential name)."
      ) (clashes (c: c.name) cs)
    ) (attrValues (lib.groupBy (c: c.service) credentials));
in
{
  config = lib.mkIf cfg.enable {
    assertions =
      basicAssertions ++ interfaceAssertions ++ policyAssertions ++ failoverAssertions ++ referenceAssertions ++ keyAssertions ++ [ cycleAssertion ] ++ fileAssertions;
  };
}
