# Mistakes a user can make in Nix, reported at evaluation time with the option to fix.
# `fort-agent check` in the build repeats the file-level checks; these come first and
# name options, not JSON paths, and they see the whole fleet, which the agent cannot.
# This file: the agent service, the capabilities, and the fleet's mistakes as this host
# reports them (found once for the fleet in cluster.nix); needs (requests, interfaces,
# references, delivery) are in assertions-needs.nix.
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
    concatLists
    concatStringsSep
    filter
    mapAttrsToList
    optionals
    ;

  self = cfg.hostName;
  # What is derived from the fleet's declarations alone, once for the fleet under
  # lib.mkFleet's `cluster` (cluster.nix): its mistakes are found there.
  inherit (cluster) facts;
  hostNames = attrNames facts.hosts;
  isHost = n: facts.hosts ? ${n};
  isPrincipal = n: facts.principals ? ${n};
  quote = s: ''"${s}"'';
  inherit (fortLib) credentialKeyPath stateKeyPath;
  haveFleet = cluster.fleet != null;

  check = assertion: message: { inherit assertion message; };
  # One assertion per offending item, so every mistake is reported at once.
  each = list: f: map f list;

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

  # The instances this host provides must be served here; the rest of each instance is
  # checked with the fleet's declarations.
  instanceAssertions = map (
    inst:
    check (capabilities ? ${inst.capability})
      "fort.cluster.instances.${inst.name}: this host (${self}) is the provider but declares no fort.host.capabilities.${inst.capability}."
  ) (facts.inventory.providedBy.${self} or [ ]);

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
    # stateEncryption loads the credential state-key; the agent must read that one, or
    # it would seal with a key systemd does not protect (or refuse to start).
    (check (!cfg.stateEncryption.enable || (cfg.settings.state_key_file or null) == stateKeyPath)
      "services.fort-agent.settings.state_key_file = ${quote (toString (cfg.settings.state_key_file or ""))}: with stateEncryption the agent reads its state key from the credential systemd decrypts from services.fort-agent.stateEncryption.credentialFile (${cfg.stateEncryption.credentialFile}); leave settings.state_key_file unset."
    )
    (check (cfg.settings.host_key == credentialKeyPath)
      "services.fort-agent.settings.host_key = ${quote (toString cfg.settings.host_key)}: the agent reads its key from the credential systemd loads from services.fort-agent.hostKeyFile (${toString cfg.hostKeyFile}). Set hostKeyFile = ${quote (toString cfg.settings.host_key)} instead and leave settings.host_key unset."
    )
  ];

  clusterAssertions =
    serviceAssertions
    ++ map (check false) facts.problems
    ++ optionals (!cfg.plaintext) (
      map (
        h:
        check false "fort.cluster.hosts.${h}.address = ${quote facts.hosts.${h}.address} is plaintext HTTP, which the agent on ${self} refuses: use https://HOST:PORT (TLS pinned to ${h}'s host key), or, where an overlay network such as WireGuard already encrypts, set services.fort-agent.plaintext = true on every host."
      ) facts.plainHosts
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
in
{
  config = lib.mkIf cfg.enable {
    assertions = clusterAssertions ++ instanceAssertions ++ capabilityAssertions;

    warnings =
      lib.optional (!haveFleet && (capabilities != { } || lib.any (n: lib.any (p: p != self) n.providers) (needList needs)))
        "fort: fort.cluster.fleet is empty, so capabilities.json lists as callers only this host's and fort.cluster.instances' consumers, and needs from other hosts are not checked against what those hosts serve. Build the hosts with fort's lib.mkFleet."
      ++ facts.warnings;
  };
}
