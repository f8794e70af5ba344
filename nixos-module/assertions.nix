# Mistakes a user can make in Nix, reported at evaluation time with the option to fix.
# `fort-agent check` in the build repeats the file-level checks; these come first and
# name options, not JSON paths, and they see the whole fleet, which the agent cannot.
# This file: the fleet, the agent service and the capabilities; needs (requests,
# interfaces, references, delivery) are in assertions-needs.nix.
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
  inherit (fortLib) grammar matches needList;
  definedServices = fortLib.servicesDefinedElsewhere options;
  inherit (lib)
    attrNames
    attrValues
    concatLists
    concatStringsSep
    filter
    length
    mapAttrsToList
    ;

  self = cfg.hostName;
  hostNames = attrNames cluster.hosts;
  principalNames = attrNames cluster.principals;
  isHost = n: cluster.hosts ? ${n};
  isPrincipal = n: cluster.principals ? ${n};
  quote = s: ''"${s}"'';
  inherit (fortLib) credentialKeyPath;
  haveFleet = cluster.fleet != null;

  check = assertion: message: { inherit assertion message; };
  # One assertion per offending item, so every mistake is reported at once.
  each = list: f: map f list;

  # Every (name, key) pair, hosts and principals alike: the origin namespace is shared.
  keyOwners = concatLists (
    mapAttrsToList (n: h: map (k: { inherit n k; }) h.publicKeys) cluster.hosts
    ++ mapAttrsToList (n: p: map (k: { inherit n k; }) p.publicKeys) cluster.principals
  );
  # The key material without the comment: the same key with two comments is one key.
  keyBody = k: concatStringsSep " " (lib.take 2 (lib.splitString " " (lib.strings.trim k)));
  ownersOf = k: lib.unique (map (o: o.n) (filter (o: keyBody o.k == keyBody k) keyOwners));
  sharedKeys = lib.unique (
    map (o: keyBody o.k) (filter (o: length (ownersOf o.k) > 1) keyOwners)
  );

  capabilityAssertions = concatLists (
    mapAttrsToList (
      name: c:
      let
        where = "fort.host.capabilities.${name}";
      in
      [
        (check (matches grammar.capability name) "${where}: name must match ^${grammar.capability}$.")
        (check (!builtins.elem name fortLib.builtinCapabilities)
          "${where}: ${quote name} clashes with a built-in capability (${concatStringsSep ", " fortLib.builtinCapabilities}); choose another name."
        )
        (check (c.mode == "async" || (!c.cacheResponse && !c.triggers.initialize && c.triggers.systemd == [ ]))
          "${where}: cacheResponse and triggers apply to async capabilities only (mode is rpc)."
        )
      ]
      ++ each c.allowed (
        who:
        check (isHost who || isPrincipal who)
          "${where}.allowed: ${quote who} is neither a host nor a principal in fort.cluster."
      )
      ++ each c.triggers.systemd (
        unit:
        check (lib.hasSuffix ".service" unit && matches "[A-Za-z0-9:_.@-]+" unit)
          "${where}.triggers.systemd: ${quote unit} must be a service unit name ending in .service."
      )
      ++ each (filter (lib.hasSuffix ".service") c.triggers.systemd) (
        unit:
        let
          base = lib.removeSuffix ".service" unit;
        in
        check (builtins.elem base definedServices)
          "${where}.triggers.systemd: no module on ${self} defines the unit ${quote unit} (systemd.services.${base}), so its OnSuccess= would sit in an empty unit that never runs. Name a unit this host defines; an ACME renewal is acme-<certificate name>.service (security.acme.certs.<name>), a timer's job is the .service the timer starts."
      )
    ) capabilities
  );

  instanceAssertions = concatLists (
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
        (check (provider != self || capabilities ? ${inst.capability})
          "${where}: this host (${self}) is the provider but declares no fort.host.capabilities.${inst.capability}."
        )
      ]
      ++ each (attrNames inst.roles.consumer.machines) (
        m:
        check (isHost m)
          "${where}.roles.consumer.machines.${m}: not a host in fort.cluster.hosts."
      )
    ) cluster.instances
  );

  # The listen addresses in effect: settings.* (which default to the options) win.
  listenOption =
    if cfg.settings.listen == cfg.listen then "services.fort-agent.listen" else "services.fort-agent.settings.listen";
  listening = fortLib.parseListen cfg.settings.listen;
  metricsListen = cfg.settings.metrics_listen or null;

  serviceAssertions = [
    (check (isHost self)
      "services.fort-agent.hostName = ${quote self} is not in fort.cluster.hosts; every agent must be listed there (hosts: ${concatStringsSep ", " hostNames})."
    )
    (check (listening != null)
      "${listenOption} = ${quote cfg.settings.listen} has no port (1-65535): write HOST:PORT, such as 0.0.0.0:7770 or [::]:7770."
    )
    (check (
      metricsListen == null || !fortLib.listenClash listening (fortLib.parseListen metricsListen)
    ) "services.fort-agent.metrics.listen = ${quote (toString metricsListen)} uses the port the agent already listens on (${listenOption} = ${quote cfg.settings.listen}); give the metrics endpoint a port of its own (default 127.0.0.1:9770).")
    # systemd loads hostKeyFile as the credential host-key; a different settings.host_key
    # would make the agent read a file it may not be allowed to, and sign with a key
    # other than the one the fleet was told about.
    (check (cfg.settings.host_key == credentialKeyPath)
      "services.fort-agent.settings.host_key = ${quote (toString cfg.settings.host_key)}: the agent reads its key from the credential systemd loads from services.fort-agent.hostKeyFile (${toString cfg.hostKeyFile}). Set hostKeyFile = ${quote (toString cfg.settings.host_key)} instead and leave settings.host_key unset."
    )
  ];

  clusterAssertions =
    serviceAssertions
    ++ each hostNames (
      h:
      check (matches grammar.host h) "fort.cluster.hosts.${h}: host names must match ^${grammar.host}$."
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
        (check (cfg.plaintext || !fortLib.isPlainAddress host.address)
          "fort.cluster.hosts.${h}.address = ${quote host.address} is plaintext HTTP, which the agent on ${self} refuses: use https://HOST:PORT (TLS pinned to ${h}'s host key), or, where an overlay network such as WireGuard already encrypts, set services.fort-agent.plaintext = true on every host."
        )
        (check (host.publicKeys != [ ]) "fort.cluster.hosts.${h}.publicKeys is empty.")
      ]) cluster.hosts
    )
    ++ each principalNames (
      p:
      check (cluster.principals.${p}.publicKeys != [ ]) "fort.cluster.principals.${p}.publicKeys is empty."
    )
    ++ each keyOwners (
      o:
      check (lib.hasPrefix "ssh-ed25519 " o.k)
        "fort.cluster: a key of ${quote o.n} is not an OpenSSH ed25519 public key (\"ssh-ed25519 AAAA...\")."
    )
    ++ each sharedKeys (
      k:
      check false
        "fort.cluster: duplicate key: one public key (${lib.substring 0 40 k}...) is listed for ${concatStringsSep " and " (ownersOf k)}; every host and principal needs its own."
    )
    ++ concatLists (
      mapAttrsToList (
        builtin: names:
        each names (
          who:
          check (isPrincipal who)
            "services.fort-agent.settings.access.${builtin}: ${quote who} is not a principal in fort.cluster.principals."
        )
      ) (cfg.settings.access or { })
    );

  unusedTags = concatLists (
    mapAttrsToList (
      name: inst:
      map (t: "fort.cluster.instances.${name}.roles.consumer.tags.${t}: no host in fort.cluster.hosts carries this tag.") (
        filter (t: !lib.any (h: builtins.elem t h.tags) (attrValues cluster.hosts)) (
          attrNames inst.roles.consumer.tags
        )
      )
    ) cluster.instances
  );
in
{
  config = lib.mkIf cfg.enable {
    assertions = clusterAssertions ++ instanceAssertions ++ capabilityAssertions;

    warnings =
      lib.optional (!haveFleet && (capabilities != { } || lib.any (n: n.from != self) (needList needs)))
        "fort: fort.cluster.fleet is empty, so capabilities.json lists as callers only this host's and fort.cluster.instances' consumers, and needs from other hosts are not checked against what those hosts serve. Build the hosts with fort's lib.mkFleet."
      ++ unusedTags;
  };
}
