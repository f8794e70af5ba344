# Pure functions behind the module: name grammar, durations, the inventory, and the
# shape of /etc/fort/*.json (PROTOCOL.md §10). Only nixpkgs `lib` is used here, so the
# evaluation test runs them exactly as a real NixOS build does.
{ lib }:
let
  inherit (lib)
    any
    attrNames
    attrValues
    concatLists
    concatMap
    elemAt
    filter
    filterAttrs
    foldl'
    head
    length
    listToAttrs
    mapAttrs
    mapAttrsToList
    nameValuePair
    optional
    recursiveUpdate
    unique
    ;

  sortStrings = builtins.sort builtins.lessThan;
in
rec {
  # PROTOCOL.md §5a. A user capability never replaces one of these.
  builtinCapabilities = [
    "status"
    "manifest"
    "needs"
    "journal"
    "systemd"
  ];

  # PROTOCOL.md §1, anchored by builtins.match.
  grammar = {
    host = "[a-z0-9][a-z0-9-]{0,62}";
    principal = "[a-z_][a-z0-9_-]{0,31}";
    capability = "[a-z0-9][a-z0-9_-]{0,63}";
  };
  matches = re: s: builtins.isString s && builtins.match re s != null;

  # The agent reads plain http://HOST:PORT addresses (no path, no TLS: requests are signed).
  addressPattern = "http://[^/?#[:space:]]+:[0-9]+";

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

  # The listen port, for the firewall: "0.0.0.0:7770" and "[::]:7770" both end in it.
  listenPort = listen: lib.toInt (lib.last (lib.splitString ":" listen));

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

  # Every consumer: named machines plus every host carrying one of the consumer tags.
  instanceConsumers =
    hosts: inst:
    unique (
      sortStrings (
        attrNames inst.roles.consumer.machines
        ++ filter (h: instanceTagsOf hosts inst h != [ ]) (attrNames hosts)
      )
    );

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

  # The needs the inventory gives `self`: one per instance that lists it as a consumer.
  # The need id is the instance name, so two instances of one capability never collide.
  inventoryNeedsFor =
    {
      instances,
      hosts,
      self,
    }:
    concatLists (
      mapAttrsToList (
        name: inst:
        let
          provider = instanceProvider inst;
        in
        optional (provider != null && builtins.elem self (instanceConsumers hosts inst)) {
          type = inst.capability;
          id = name;
          from = provider;
          request = instanceSettingsFor hosts inst self;
          instance = name;
        }
      ) instances
    );

  # --------------------------------------------------------------------- fleet
  # What one host tells the others (fort.host.exported). Kept small so each host's
  # evaluation reads only the parts of the others it needs.
  exportedOf =
    {
      enable,
      hostName,
      needs,
      capabilities,
    }:
    {
      inherit enable;
      host = hostName;
      needs =
        if enable then
          listToAttrs (
            map (n: nameValuePair n.key { inherit (n) type id from; }) (needList needs)
          )
        else
          { };
      capabilities = if enable then mapAttrs (_: c: { inherit (c) mode; }) capabilities else { };
    };

  # Fleet entries by fort host name (the fleet is keyed by flake attribute name, which
  # usually but not necessarily equals services.fort-agent.hostName). A host without an
  # enabled agent stays in, exporting nothing: it serves nothing and calls nobody.
  fleetByHost = fleet: listToAttrs (map (e: nameValuePair e.host e) (attrValues fleet));

  # PROTOCOL.md §5: the hosts that may ask `self` for `capability`, i.e. every host that
  # declares a need of that type from `self`. Three sources, unioned, so the answer is
  # right with or without mkFleet: the fleet (every host's evaluated needs), this host's
  # own needs, and the inventory (shared, so it names consumers on every host).
  callersOf =
    {
      self,
      fleet,
      needs,
      instances,
      hosts,
    }:
    capability:
    let
      fromFleet = concatMap (
        e: optional (any (n: n.type == capability && n.from == self) (attrValues e.needs)) e.host
      ) (attrValues (fleetByHost fleet));
      fromSelf = optional (any (n: n.type == capability && n.from == self) (needList needs)) self;
      fromInventory = concatLists (
        mapAttrsToList (_: inst: instanceConsumers hosts inst) (
          filterAttrs (
            _: inst: inst.capability == capability && instanceProvider inst == self
          ) instances
        )
      );
    in
    unique (sortStrings (fromFleet ++ fromSelf ++ fromInventory));

  # ---------------------------------------------------------------- §10 files
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

  needsJson =
    needs:
    listToAttrs (
      map (
        n:
        nameValuePair n.key {
          inherit (n) from request;
          nag_seconds = durationSeconds n.nag;
          handler = storeString n.handler;
          check = storeString n.check;
          never_satisfied = n.neverSatisfied;
        }
      ) (needList needs)
    );

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
    }) capabilities;
}
