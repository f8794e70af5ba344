# Pure functions behind the module: name grammar, durations, the inventory, references
# between needs, and the shape of /etc/fort/*.json (docs/protocol.md §10 and §11). Only
# nixpkgs `lib` is used here, so the evaluation test runs them exactly as a real NixOS
# build does.
{ lib }:
let
  interface = import ./interface.nix { inherit lib; };
  inherit (lib)
    any
    attrNames
    attrValues
    concatLists
    concatMap
    concatStringsSep
    elem
    elemAt
    filter
    hasPrefix
    hasSuffix
    foldl'
    head
    length
    listToAttrs
    mapAttrs
    mapAttrsToList
    nameValuePair
    optional
    optionalAttrs
    optionals
    recursiveUpdate
    replaceStrings
    splitString
    stringLength
    substring
    toLower
    unique
    zipAttrsWith
    ;

  sortStrings = builtins.sort builtins.lessThan;
in
rec {
  inherit interface;

  # docs/protocol.md §5a. A user capability never replaces one of these.
  builtinCapabilities = [
    "status"
    "manifest"
    "needs"
    "journal"
    "systemd"
    "trigger"
    "resend"
    "audit"
  ];

  # docs/protocol.md §1, anchored by builtins.match.
  grammar = {
    host = "[a-z0-9][a-z0-9-]{0,62}";
    principal = "[a-z_][a-z0-9_-]{0,31}";
    capability = "[a-z0-9][a-z0-9_-]{0,63}";
  };
  matches = re: s: builtins.isString s && builtins.match re s != null;

  # docs/protocol.md §11.1: https://HOST:PORT (TLS pinned to the host key); http:// only
  # with `plaintext`. No path: the agent adds its own.
  addressPattern = "(https?)://[^/?#[:space:]]+:[0-9]+";
  isPlainAddress = lib.hasPrefix "http://";

  # Durations: "15m", "1h", "1h30m", "7d". Deliberately a subset of humantime so that a
  # value the module accepts means the same thing to the agent.
  durationPattern = "([0-9]+[smhd])+";
  durationType =
    lib.types.strMatching durationPattern
    // {
      description = ''duration such as "30s", "15m", "1h" or "1h30m"'';
    };
  durationSeconds =
    s:
    let
      unit = {
        s = 1;
        m = 60;
        h = 3600;
        d = 86400;
      };
      parts = filter builtins.isList (builtins.split "([0-9]+)([smhd])" s);
    in
    foldl' (acc: p: acc + lib.toIntBase10 (elemAt p 0) * unit.${elemAt p 1}) 0 parts;

  # "0.0.0.0:7770", "[::]:7770" -> { host; port }; null without a port in range, so the
  # assertions can say so (lib.toInt would fail evaluation with its own message).
  parseListen =
    listen:
    let
      m = builtins.match "(.*):([0-9]{1,5})" listen;
      port = lib.toIntBase10 (elemAt m 1);
    in
    if m == null || port < 1 || port > 65535 then
      null
    else
      {
        host = elemAt m 0;
        inherit port;
      };
  # Two listen addresses collide when they share a port and one of them binds every
  # address (or both bind the same one).
  listenClash =
    a: b:
    let
      wildcard = h: builtins.elem h [ "" "*" "0.0.0.0" "[::]" "::" ];
    in
    a != null && b != null && a.port == b.port && (a.host == b.host || wildcard a.host || wildcard b.host);

  # LoadCredential= puts the key here, readable by the service user only, so the agent
  # need not run as root to sign and the key never passes through the store.
  credentialKeyPath = "/run/credentials/fort-agent.service/host-key";
  # services.fort-agent.stateEncryption: the state key as systemd decrypts it.
  stateKeyPath = "/run/credentials/fort-agent.service/state-key";

  # Interpolation, not toString: a handler given as a path literal (./callback.sh) is
  # copied into the store and so exists on the target; a derivation becomes its out path.
  storeString = x: if x == null then null else "${x}";

  # fort.host.needs (type -> id -> need) as a flat list of needs carrying their key.
  needList =
    needs:
    concatLists (
      mapAttrsToList (
        type: ids:
        mapAttrsToList (
          id: need:
          need
          // {
            inherit type id;
            key = "${type}/${id}";
            # `from` as declared (a host or a list of them, §11.13) is what needs.json
            # ships; `from` here is the host a need starts at, `providers` all of them.
            declaredFrom = need.from;
            providers = lib.toList need.from;
            from = builtins.head (lib.toList need.from);
          }
        ) ids
      ) needs
    );

  # ------------------------------------------------------------------ inventory
  # fort.cluster.instances, after Clan's service instances: one declaration names the
  # provider and the consumers (by machine or by tag) of one capability.

  # The single provider machine, or null when there is not exactly one (an assertion
  # reports that; no need is generated for such an instance).
  instanceProvider =
    inst:
    let
      ps = attrNames inst.roles.provider.machines;
    in
    if length ps == 1 then head ps else null;

  # Tags of `inst` that `machine` carries, in name order (the merge order of tag settings).
  instanceTagsOf =
    hosts: inst: machine:
    sortStrings (filter (t: inst.roles.consumer.tags ? ${t}) (hosts.${machine}.tags or [ ]));

  # Settings for one consumer: instance, then each of its tags in name order, then the
  # machine entry. recursiveUpdate: nested attribute sets merge, anything else (lists
  # included) is replaced by the later layer.
  instanceSettingsFor =
    hosts: inst: machine:
    foldl' recursiveUpdate { } (
      [ inst.settings ]
      ++ map (t: inst.roles.consumer.tags.${t}.settings) (instanceTagsOf hosts inst machine)
      ++ optional (
        inst.roles.consumer.machines ? ${machine}
      ) inst.roles.consumer.machines.${machine}.settings
    );

  # Names of systemd.services that a module other than fort's own defines. fort adds
  # OnSuccess= (triggers.systemd) and LoadCredential= (credentialFor) to units named by
  # the user; if nothing else defines such a unit, NixOS writes a unit holding only
  # that, which never runs. Any definition counts, not only ExecStart or script: a unit
  # shipped by a package (systemd.packages) is usually given just wantedBy or
  # overrides here, and its ExecStart is invisible to evaluation.
  ownServiceFiles = map toString [
    ./service.nix
    ./delivery.nix
  ];
  servicesDefinedElsewhere =
    options:
    unique (
      concatMap (d: attrNames d.value) (
        filter (d: !(builtins.elem d.file ownServiceFiles)) options.systemd.services.definitionsWithLocations
      )
    );

  # ---------------------------------------------------------------- references
  # docs/protocol.md §11.5: a request value `{ "$fort_ref" = "<type>/<id>[#<pointer>]"; }`
  # is replaced by the consumer's agent with that need's payload (or the value at the
  # JSON pointer) before the request is sent.
  inherit (interface) refKey isRef;

  # ref "ssl-cert/outline" "/fingerprint" -> { "$fort_ref" = "ssl-cert/outline#/fingerprint"; }
  # ref "ssl-cert/outline" ""             -> { "$fort_ref" = "ssl-cert/outline"; } (whole payload)
  ref = need: pointer: {
    ${interface.refKey} = if pointer == "" then need else "${need}#${pointer}";
  };

  # docs/protocol.md §11.10: a request value naming one of the need's own keys, replaced
  # by the agent with a CSR or public key made with it.
  # key "tls" "csr" -> { "$fort_key" = "tls"; as = "csr"; }
  inherit (interface) keyRefKey isKeyRef;
  key = name: form: {
    ${interface.keyRefKey} = name;
    "as" = form;
  };

  # Every $fort_key in a request: [ { path; ref = <the attrset>; } ].
  keyRefsIn =
    path: v:
    if interface.isKeyRef v then
      [
        {
          inherit path;
          ref = v;
        }
      ]
    else if lib.isDerivation v then
      [ ]
    else if builtins.isAttrs v then
      concatLists (mapAttrsToList (k: keyRefsIn "${path}.${k}") v)
    else if builtins.isList v then
      concatLists (lib.imap0 (i: keyRefsIn "${path}[${toString i}]") v)
    else
      [ ];

  # "<type>/<id>#<pointer>" -> { need; pointer (null without '#'); }
  parseRef =
    s:
    let
      m = builtins.match "([^#]*)(#(.*))?" s;
    in
    {
      need = elemAt m 0;
      pointer = elemAt m 2;
    };
  # RFC 6901: "" or "/"-separated tokens where "~" only escapes 0 or 1.
  isPointer = p: builtins.match "(/([^~]|~[01])*)*" p != null;

  # Every $fort_ref in a request: [ { path = "request.tls.cert"; ref = <the attrset>; } ].
  refsIn =
    path: v:
    if interface.isRef v then
      [
        {
          inherit path;
          ref = v;
        }
      ]
    else if lib.isDerivation v then
      [ ]
    else if builtins.isAttrs v then
      concatLists (mapAttrsToList (k: refsIn "${path}.${k}") v)
    else if builtins.isList v then
      concatLists (lib.imap0 (i: refsIn "${path}[${toString i}]") v)
    else
      [ ];

  # The need keys one need waits for: its references and its `after`.
  waitsFor =
    n:
    unique (
      map (v: (parseRef v).need) (
        filter builtins.isString (map (r: r.ref.${interface.refKey}) (refsIn "request" n.request))
      )
      ++ n.after
    );

  # A cycle in `graph` (key -> [ keys ]) as [ a b ... a ], or null. Nodes that cannot
  # reach a cycle are pruned (repeatedly, those without edges into what is left); from
  # any node left, following edges that stay in what is left must come back around.
  findCycle =
    graph:
    let
      edges = n: filter (m: graph ? ${m}) graph.${n};
      prune =
        nodes:
        let
          keep = filter (n: any (m: builtins.elem m nodes) (edges n)) nodes;
        in
        if length keep == length nodes then nodes else prune keep;
      rest = prune (attrNames graph);
      from = n: l: if head l == n then l else from n (builtins.tail l);
      walk =
        path: n:
        if builtins.elem n path then
          from n path ++ [ n ]
        else
          walk (path ++ [ n ]) (head (filter (m: builtins.elem m rest) (edges n)));
    in
    if rest == [ ] then null else walk [ ] (head rest);

  # " Did you mean X?" when `name` is a close spelling (at most two edits) of one of
  # `candidates`, else "": a mistyped key names the one it resembles. Silent with a
  # nixpkgs lib too old to measure edits.
  didYouMean =
    name: candidates:
    let
      close = lib.strings.levenshteinAtMost or null;
      near = if close == null then [ ] else filter (c: c != name && close 2 c name) candidates;
    in
    if near == [ ] then "" else " Did you mean ${head (sortStrings near)}?";

  # ------------------------------------------------------------------ policy
  # A need's request and files held against its provider's policy (a capability of
  # fort-handler: `policy` as its module sets it), as the handler would hold them at run
  # time (handlers/src/common/allow.rs): a pattern is an exact name or `*.SUFFIX` (every
  # name below SUFFIX, not SUFFIX), `{origin}` stands for the caller, and a caller gets
  # its own patterns and those of `"*"`. Only literal values are held: a value built from
  # another need's response is known when the request is sent. Returns
  # [ { path; message; } ], `path` under the need's option.
  policyProblems =
    {
      policy,
      origin,
      need,
      provider,
    }:
    let
      patternsOf = allow: map (p: toLower (replaceStrings [ "{origin}" ] [ origin ] p)) (
        (allow.${origin} or [ ]) ++ (allow."*" or [ ])
      );
      permits =
        patterns: value:
        let
          v = toLower value;
        in
        any (
          p:
          if hasPrefix "*." p then
            hasSuffix (substring 1 (stringLength p) p) v && stringLength v > stringLength p - 1
          else
            p == v
        ) patterns;
      literal = v: builtins.isString v;
      strings = v: if builtins.isList v then filter literal v else if literal v then [ v ] else [ ];
      request = need.request;
      capability = "capability ${need.type} of ${provider}";
      outside =
        field: allow: values:
        let
          patterns = patternsOf allow;
        in
        map (v: {
          path = "request.${field}";
          message = "${v} is not one ${capability} allows ${origin} (${
            if patterns == [ ] then "it allows ${origin} nothing" else "allowed: ${concatStringsSep ", " patterns}"
          })";
        }) (filter (v: !(permits patterns v)) values);
      # acme: the names of the CSR, from the key the request names when it is one.
      csrNames =
        let
          ref = request.csr or null;
          key = if builtins.isAttrs ref then ref."$fort_key" or null else null;
        in
        if request ? names && builtins.isList request.names then
          strings request.names
        else if key != null && need.keys ? ${key} then
          need.keys.${key}.names or [ ]
        else
          [ ];
      byKind = {
        proxy = outside "server_names" policy.allow (strings (request.server_names or [ ]));
        dns-record = outside "name" policy.allow (strings (request.name or [ ]));
        acme =
          outside "csr" policy.allow csrNames
          ++ optionals (!policy.dns01) (
            map (n: {
              path = "request.csr";
              message = "${n} is a wildcard name, and ${capability} has no DNS-01";
            }) (filter (n: hasPrefix "*." n) csrNames)
          );
        postgres = outside "name" policy.allow (strings (request.name or [ ]));
        oidc =
          outside "client_name" policy.allow (strings (request.client_name or [ ]))
          ++ (
            let
              uris = patternsOf policy.allowRedirectUris;
              ok = u: any (p: u == p || (hasSuffix "/" p && hasPrefix p u)) uris;
            in
            map (u: {
              path = "request.redirect_uris";
              message = "${u} is not a redirect URI ${capability} allows ${origin} (allowed: ${
                if uris == [ ] then "none" else concatStringsSep ", " uris
              })";
            }) (filter (u: !(ok u)) (strings (request.redirect_uris or [ ])))
          )
          ++ (
            let
              grants = (policy.allowGrantTypes.${origin} or [ ]) ++ (policy.allowGrantTypes."*" or [ ]);
            in
            map (g: {
              path = "request.grant_types";
              message = "${g} is not a grant type ${capability} allows ${origin} (allowed: ${
                if grants == [ ] then "none" else concatStringsSep ", " grants
              })";
            }) (filter (g: !(elem g grants)) (strings (request.grant_types or [ ])))
          );
        ssh-ca =
          let
            kind = request.kind or "host";
          in
          outside "principals" (
            if kind == "user" then policy.userPrincipals else policy.hostPrincipals
          ) (strings (request.principals or [ ]));
        # Full access (append_only = false) to the repositories the provider grants it.
        backup-repo =
          let
            granted = patternsOf policy.fullAccess;
          in
          optional ((request.append_only or true) == false && !(permits granted need.id)) {
            path = "request.append_only";
            message = "false asks for full access to repository ${need.id}, which ${capability} grants ${origin} ${
              if granted == [ ] then "to no repository" else "only to ${concatStringsSep ", " granted}"
            }";
          };
        # The port and the labels the provider allows this host.
        scrape =
          let
            ranges = map (
              r:
              let
                ends = map lib.toInt (splitString "-" r);
              in
              {
                low = head ends;
                high = lib.last ends;
              }
            ) ((policy.ports.${origin} or [ ]) ++ (policy.ports."*" or [ ]));
            port = request.port or null;
            labelNames = if builtins.isAttrs (request.labels or null) then attrNames request.labels else [ ];
            reserved =
              n:
              elem n ([ "job" "instance" "fort_host" "fort_need" ] ++ policy.reservedLabels) || hasPrefix "__" n;
            allowedLabels = patternsOf policy.labels;
          in
          optional (builtins.isInt port && !(any (r: port >= r.low && port <= r.high) ranges)) {
            path = "request.port";
            message = "${toString port} is not a port ${capability} scrapes ${origin} on (allowed: ${
              concatStringsSep ", " ((policy.ports.${origin} or [ ]) ++ (policy.ports."*" or [ ]))
            })";
          }
          ++ map (n: {
            path = "request.labels.${n}";
            message =
              if reserved n then
                "the label ${n} is reserved; ${capability} sets job, instance, __… and fort_* itself"
              else
                "${n} is not a label ${capability} lets ${origin} set (allowed: ${concatStringsSep ", " allowedLabels})";
          }) (filter (n: reserved n || !(elem (toLower n) allowedLabels)) labelNames);
      };
      # A file's pointer names a member of the response: the first step must be one.
      pointers = concatMap (
        name:
        let
          pointer = need.files.${name}.pointer or "";
          first = head (splitString "/" (substring 1 (stringLength pointer) pointer));
        in
        optional (pointer != "" && policy ? response && !(elem first policy.response)) {
          path = "files.${name}.pointer";
          message = "${pointer} names no member of what ${capability} answers (${concatStringsSep ", " policy.response})";
        }
      ) (attrNames (need.files or { }));
    in
    (byKind.${policy.handler} or [ ]) ++ pointers;

  # --------------------------------------------------------------------- fleet
  # What one host tells the others (fort.host.exported). Kept small so each host's
  # evaluation reads only the parts of the others it needs. Everything but
  # manifestSha256 depends on this host alone; manifestSha256 (which depends on the
  # fleet, through callers) is for tools, and no host reads it from the fleet.
  exportedOf =
    {
      enable,
      hostName,
      needs,
      capabilities,
      manifestSha256,
    }:
    {
      inherit enable;
      host = hostName;
      needs =
        if enable then
          listToAttrs (
            map (n: nameValuePair n.key { inherit (n) type id from providers; }) (needList needs)
          )
        else
          { };
      capabilities =
        if enable then mapAttrs (_: c: { inherit (c) mode interface policy; }) capabilities else { };
      manifestSha256 = if enable then manifestSha256 else null;
    };

  # Fleet entries by fort host name (the fleet is keyed by flake attribute name, which
  # usually but not necessarily equals services.fort-agent.hostName). A host without an
  # enabled agent stays in, exporting nothing: it serves nothing and calls nobody.
  fleetByHost = fleet: listToAttrs (map (e: nameValuePair e.host e) (attrValues fleet));

  # The fleet as every host reads it (fort.cluster.fleet), built once for the fleet from
  # each host's export ({ <flake attribute> = fort.host.exported; }) and handed to every
  # host as it is, so that what is the same for all hosts is computed once, not once
  # per host that reads it. Plain data: its parts are fort's own exportedOf, and
  # `cluster`, the facts of mkFleet's `cluster` modules (cluster.nix clusterFacts, with
  # the files that define them), or null. callersFromInventory: every need on another
  # host is an instance of the inventory, so a provider's callers come from the
  # inventory and no provider reads the other hosts (a need declared otherwise fails
  # the consumer's evaluation).
  fleetIndex =
    {
      exports,
      cluster ? null,
      callersFromInventory ? false,
    }:
    rec {
      inherit exports cluster callersFromInventory;
      # Every entry by fort host name; reads every host's name.
      byHost = fleetByHost exports;
      # One host's entry by fort host name, or null. mkFleet names each host after its
      # attribute unless told otherwise, so this reads that one host; only a name no
      # attribute carries (or one whose host took another name) reads every host's.
      entry =
        name:
        let
          named = exports.${name} or null;
        in
        if named != null && named.host == name then named else byHost.${name} or null;
      # { <provider> = { <capability> = { <consumer> = [ <need id> ... ]; }; }; }: every
      # need of every host, grouped once, so a provider's callers cost what it serves.
      callers =
        let
          needs = concatMap (
            e:
            # Every provider a need lists hears of its consumer (§11.13).
            concatMap (
              n:
              map (from: {
                inherit from;
                inherit (n) type id;
                inherit (e) host;
              }) (n.providers or [ n.from ])
            ) (attrValues e.needs)
          ) (attrValues byHost);
          ids = ns: map (n: n.id) ns;
        in
        mapAttrs (
          _: fromProvider:
          mapAttrs (_: ofType: mapAttrs (_: ids) (lib.groupBy (n: n.host) ofType)) (
            lib.groupBy (n: n.type) fromProvider
          )
        ) (lib.groupBy (n: n.from) needs);
    };

  # The interface a need's request is checked against and filled from: the provider's
  # own (this host, or its entry in the fleet index); without the fleet, the one
  # declared fleet-wide in fort.cluster.interfaces; null when untyped or unknown.
  providerInterface =
    {
      self,
      fleet,
      capabilities,
      interfaces,
    }:
    n:
    let
      provider = if fleet == null then null else fleet.entry n.from;
    in
    if n.from == self then
      capabilities.${n.type}.interface or null
    else if provider != null then
      provider.capabilities.${n.type}.interface or null
    else
      interfaces.${n.type} or null;

  # The policy of the capability `n` asks for at its provider (options-host.nix
  # `policy`), from this host's own capabilities or the provider's export; null when the
  # provider is not in the fleet or its handler is not fort's.
  providerPolicy =
    {
      self,
      fleet,
      capabilities,
    }:
    n:
    let
      provider = if fleet == null then null else fleet.entry n.from;
    in
    if n.from == self then
      capabilities.${n.type}.policy or null
    else if provider != null then
      provider.capabilities.${n.type}.policy or null
    else
      null;

  # docs/protocol.md §5 and §11.2: who may ask `self` for `capability`, as
  # { <host> = [ <need id> ... ]; }: every host that declares a need of that type from
  # `self`, with the ids it declares. Three sources, unioned, so the answer is right
  # with or without mkFleet: the fleet index (every host's evaluated needs, grouped by
  # provider once for the fleet; not read under callersFromInventory), this host's own
  # needs, and the inventory's callers (cluster.nix; the inventory is shared, so it
  # names consumers on every host).
  callersOf =
    {
      self,
      fleet,
      needs,
      inventory,
    }:
    capability:
    let
      idsFrom = ns: map (n: n.id) (filter (n: n.type == capability && lib.elem self n.providers) ns);
      entry = host: ids: optionals (ids != [ ]) [ { ${host} = ids; } ];
      fromFleet =
        if fleet == null || fleet.callersFromInventory then
          [ ]
        else
          concatLists (mapAttrsToList entry (fleet.callers.${self}.${capability} or { }));
      fromSelf = entry self (idsFrom (needList needs));
      fromInventory = inventory.callers.${self}.${capability} or [ ];
    in
    zipAttrsWith (_: idLists: unique (sortStrings (concatLists idLists))) (
      fromFleet ++ fromSelf ++ fromInventory
    );

  # -------------------------------------------------------- §10 and §11 files
  # Keys are trimmed: `builtins.readFile ./forge.pub` ends in a newline.

  hostsJson =
    { hosts, principals }:
    {
      hosts = mapAttrs (_: h: {
        inherit (h) address;
        keys = map lib.strings.trim h.publicKeys;
      }) hosts;
      principals = mapAttrs (_: p: { keys = map lib.strings.trim p.publicKeys; }) principals;
    };

  # Units a need's files are credentials of (credentialFor).
  credentialUnitsOf = n: unique (concatMap (f: f.credentialFor) (attrValues n.files));

  # requestOf: the request as shipped (the provider interface's defaults filled in).
  # credentialKey: what encrypted files are bound to
  # (services.fort-agent.credentialEncryption.withKey).
  needsJson =
    {
      needs,
      requestOf,
      credentialKey ? "auto",
    }:
    listToAttrs (
      map (
        n:
        nameValuePair n.key (
          {
            from = n.declaredFrom;
            request = requestOf n;
            nag_seconds = durationSeconds n.nag;
            handler = storeString n.handler;
            check = storeString n.check;
            never_satisfied = n.neverSatisfied;
            # mapAttrsToList: sorted by name.
            # A credential's service is restarted when the file changes, but not when
            # it first appears: its path unit starts it then (docs/protocol.md §11.3).
            # `encrypt` only on encrypted files: a plain file reads (and hashes) as it did.
            files = mapAttrsToList (
              name: f:
              {
                inherit name;
                inherit (f)
                  path
                  pointer
                  owner
                  group
                  mode
                  ;
                credential_for = unique f.credentialFor;
              }
              // lib.optionalAttrs f.encrypt { encrypt = credentialKey; }
            ) n.files;
            restart_units = unique n.restartUnits;
            reload_units = unique n.reloadUnits;
            renew_before_seconds = if n.renewBefore == null then null else durationSeconds n.renewBefore;
            after = unique n.after;
          }
          # Written only with several providers: a need with one reads as it always did.
          // lib.optionalAttrs (builtins.isList n.declaredFrom) {
            failover_after_seconds =
              if n.failoverAfter == null then null else durationSeconds n.failoverAfter;
          }
          # Written only when the need has keys, as the agent hashes its declaration.
          // lib.optionalAttrs (n.keys != { }) {
            keys = mapAttrs (
              _: k:
              {
                type = k.type;
                inherit (k)
                  path
                  owner
                  group
                  mode
                  format
                  names
                  certificate
                  reuse
                  ;
              }
              # Written only when set, as the agent hashes the declaration.
              // lib.optionalAttrs (k.authorized or false) { authorized = true; }
            ) n.keys;
          }
        )
      ) (needList needs)
    );

  # The units the agent restarts and reloads, read from the needs.json it is given (what
  # it acts on), named as systemd and polkit name them: systemctl adds ".service" to a
  # name without a unit type.
  unitGrants =
    needsJson:
    let
      types = "service|socket|device|mount|automount|swap|target|path|timer|slice|scope";
      full = u: if builtins.match ".+\\.(${types})" u != null then u else "${u}.service";
      all = f: lib.sort lib.lessThan (unique (map full (concatMap f (attrValues needsJson))));
    in
    {
      restart = all (n: n.restart_units ++ concatMap (f: f.credential_for) n.files);
      reload = all (n: n.reload_units);
    };

  # A polkit rule (JavaScript as polkitd runs it: ES5) that lets an agent running as
  # `user` restart the units of `grants.restart` and reload those of `grants.reload`
  # through systemd's D-Bus API, as `systemctl restart/reload` asks; anything else
  # (another unit, another verb: start, stop, kill, enable) is left to polkit's
  # defaults, which refuse a system user.
  polkitUnitRule =
    { user, grants }:
    ''
      // fort-agent runs as ${user}: it may restart and reload the units its needs name
      // (restartUnits and credentialFor, reloadUnits), and nothing else.
      polkit.addRule(function (action, subject) {
        if (action.id !== "org.freedesktop.systemd1.manage-units" || subject.user !== ${builtins.toJSON user}) {
          return polkit.Result.NOT_HANDLED;
        }
        var verb = action.lookup("verb");
        var units = verb === "restart" ? ${builtins.toJSON grants.restart}
          : verb === "reload" ? ${builtins.toJSON grants.reload}
          : [];
        if (units.indexOf(action.lookup("unit")) !== -1) {
          return polkit.Result.YES;
        }
        return polkit.Result.NOT_HANDLED;
      });
    '';

  capabilitiesJson =
    { capabilities, callers }:
    mapAttrs (name: c: {
      handler = storeString c.handler;
      inherit (c) mode cacheResponse description;
      allowed = unique c.allowed;
      callers = callers name;
      triggers = {
        inherit (c.triggers) initialize systemd;
      };
      request_schema =
        if c.interface == null then null else interface.requestSchema (interface.optionsOf c.interface);
    }
    # Only when given, so capabilities without arguments ship the same bytes as before.
    // optionalAttrs (c.args != [ ]) { inherit (c) args; }
    ) capabilities;

  # docs/protocol.md §11.7: what the agent reports as manifest_sha256, from the exact
  # bytes installed (the files are these strings, written by pkgs.writeText).
  manifestSha256 =
    {
      hostsText,
      needsText,
      capabilitiesText,
    }:
    builtins.hashString "sha256" (hostsText + "\n" + needsText + "\n" + capabilitiesText);
}
