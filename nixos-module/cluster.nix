# What fort derives from the fleet's declarations alone (fort.cluster's hosts,
# principals and instances): hosts.json, the mistakes in them, and the inventory's needs
# and callers. It is the same on every host, so lib.mkFleet computes it once for the
# fleet from its `cluster` modules (fleet.nix) and every host reads that one value; a
# host evaluated alone, or one that adds fort.cluster definitions of its own, computes
# it for itself (default.nix). Only nixpkgs `lib` is used here.
{ lib }:
let
  fortLib = import ./lib.nix { inherit lib; };
  inherit (fortLib) grammar matches;
  inherit (lib)
    attrNames
    concatLists
    concatMap
    concatStringsSep
    filter
    groupBy
    length
    mapAttrs
    mapAttrsToList
    optionals
    ;

  quote = s: ''"${s}"'';
  check = assertion: message: { inherit assertion message; };
  each = list: f: map f list;
  failing = checks: map (c: c.message) (filter (c: !c.assertion) checks);
in
{
  clusterFacts =
    {
      hosts,
      principals,
      instances,
    }:
    let
      hostNames = attrNames hosts;
      principalNames = attrNames principals;
      isHost = n: hosts ? ${n};

      # Every (name, key) pair, hosts and principals alike: the origin namespace is shared.
      keyOwners = concatLists (
        mapAttrsToList (n: h: map (k: { inherit n k; }) h.publicKeys) hosts
        ++ mapAttrsToList (n: p: map (k: { inherit n k; }) p.publicKeys) principals
      );
      # The key material without the comment: the same key with two comments is one key.
      keyBody = k: concatStringsSep " " (lib.take 2 (lib.splitString " " (lib.strings.trim k)));
      # { <key body> = [ owner names ]; } for keys listed for more than one name. Grouped
      # once: comparing every key with every other would cost the square of the fleet.
      sharedKeys = lib.filterAttrs (_: owners: length owners > 1) (
        mapAttrs (_: os: lib.unique (map (o: o.n) os)) (groupBy (o: keyBody o.k) keyOwners)
      );

      hostProblems =
        each hostNames (
          h: check (matches grammar.host h) "fort.cluster.hosts.${h}: host names must match ^${grammar.host}$."
        )
        ++ each principalNames (
          p:
          check (matches grammar.principal p && !isHost p)
            "fort.cluster.principals.${p}: principal names must match ^${grammar.principal}$ and differ from every host name (duplicate key)."
        )
        ++ concatLists (
          mapAttrsToList (h: host: [
            (check (matches fortLib.addressPattern host.address)
              "fort.cluster.hosts.${h}.address = ${quote host.address} must look like https://HOST:PORT."
            )
            (check (host.publicKeys != [ ]) "fort.cluster.hosts.${h}.publicKeys is empty.")
          ]) hosts
        )
        ++ each principalNames (
          p: check (principals.${p}.publicKeys != [ ]) "fort.cluster.principals.${p}.publicKeys is empty."
        )
        ++ each keyOwners (
          o:
          check (lib.hasPrefix "ssh-ed25519 " o.k)
            "fort.cluster: a key of ${quote o.n} is not an OpenSSH ed25519 public key (\"ssh-ed25519 AAAA...\")."
        )
        ++ mapAttrsToList (
          k: owners:
          check false
            "fort.cluster: duplicate key: one public key (${lib.substring 0 40 k}...) is listed for ${concatStringsSep " and " owners}; every host and principal needs its own."
        ) sharedKeys;

      # { <tag> = [ host names ]; }, so an instance's tagged consumers are looked up,
      # not searched for among all hosts.
      taggedWith = mapAttrs (_: map (e: e.host)) (
        groupBy (e: e.tag) (concatLists (mapAttrsToList (host: h: map (tag: { inherit host tag; }) h.tags) hosts))
      );
      # Every consumer of an instance: named machines plus every host carrying one of its
      # consumer tags (lib.nix instanceConsumers, by the tag index).
      consumersOf =
        inst:
        lib.unique (
          lib.sort lib.lessThan (
            attrNames inst.roles.consumer.machines
            ++ concatMap (t: taggedWith.${t} or [ ]) (attrNames inst.roles.consumer.tags)
          )
        );

      instanceProblems = concatLists (
        mapAttrsToList (
          name: inst:
          let
            where = "fort.cluster.instances.${name}";
            providers = attrNames inst.roles.provider.machines;
            provider = fortLib.instanceProvider inst;
          in
          [
            (check (matches grammar.capability name)
              "${where}: the instance name is the need id and must match ^${grammar.capability}$."
            )
            (check (matches grammar.capability inst.capability)
              "${where}.capability = ${quote inst.capability} must match ^${grammar.capability}$."
            )
            (check (length providers == 1)
              "${where}.roles.provider.machines must name exactly one host (it names ${toString (length providers)}: ${concatStringsSep ", " providers})."
            )
            (check (provider == null || isHost provider)
              "${where}.roles.provider.machines.${toString provider}: not a host in fort.cluster.hosts."
            )
          ]
          ++ each (attrNames inst.roles.consumer.machines) (
            m: check (isHost m) "${where}.roles.consumer.machines.${m}: not a host in fort.cluster.hosts."
          )
        ) instances
      );

      # Every need the inventory declares, with its consumer: one per consumer of each
      # instance that has exactly one provider. The need id is the instance name, so two
      # instances of one capability never collide.
      inventoryNeeds = concatLists (
        mapAttrsToList (
          name: inst:
          let
            provider = fortLib.instanceProvider inst;
          in
          optionals (provider != null) (
            map (consumer: {
              inherit consumer;
              need = {
                type = inst.capability;
                id = name;
                from = provider;
                request = fortLib.instanceSettingsFor hosts inst consumer;
                instance = name;
              };
            }) (consumersOf inst)
          )
        ) instances
      );
    in
    {
      inherit hosts principals instances;

      # hosts.json as installed (the same bytes on every host).
      hostsText = builtins.toJSON (fortLib.hostsJson { inherit hosts principals; });

      # Mistakes in the fleet's declarations, as assertion messages (every host reports
      # them), and the tags no host carries, as warnings.
      problems = failing (hostProblems ++ instanceProblems);
      warnings = concatLists (
        mapAttrsToList (
          name: inst:
          map (t: "fort.cluster.instances.${name}.roles.consumer.tags.${t}: no host in fort.cluster.hosts carries this tag.") (
            filter (t: !(taggedWith ? ${t})) (attrNames inst.roles.consumer.tags)
          )
        ) instances
      );

      # Hosts whose address is plaintext http://, which only an agent with `plaintext` accepts.
      plainHosts = filter (h: fortLib.isPlainAddress hosts.${h}.address) hostNames;

      inventory = {
        # { <consumer> = [ need ]; }: what default.nix adds to that host's fort.host.needs.
        needsOf = mapAttrs (_: map (e: e.need)) (groupBy (e: e.consumer) inventoryNeeds);
        # { <provider> = { <capability> = [ { <consumer> = [ <instance> ]; } ]; }; }: the
        # inventory's share of a provider's callers (lib.nix callersOf).
        callers = mapAttrs (
          _: fromProvider:
          mapAttrs (_: map (e: { ${e.consumer} = [ e.need.id ]; })) (groupBy (e: e.need.type) fromProvider)
        ) (groupBy (e: e.need.from) inventoryNeeds);
        # { <provider> = [ { name; capability; } ]; }: instances each host provides, which
        # it must serve (assertions.nix).
        providedBy = groupBy (i: i.provider) (
          filter (i: i.provider != null) (
            mapAttrsToList (name: inst: {
              inherit name;
              inherit (inst) capability;
              provider = fortLib.instanceProvider inst;
            }) instances
          )
        );
      };
    };
}
