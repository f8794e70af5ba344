# What the lane installs on each host, rendered from the module's evaluation (the real
# nixpkgs lib, tests/stubs.nix for the rest of NixOS): { "<tree>" = { files; packages;
# dryActivate; }; }, where files."<path>" is { text; mode; } or { symlink; }.
#
# Units follow NixOS's rules (nixos/lib/systemd-lib.nix): keys in name order, a list
# becomes one line per element, booleans true/false, `path` plus NixOS's default path
# becomes Environment="PATH=…", `script` becomes ExecStart= of a script of its own
# (`set -e` first), description/wants/after/onSuccess and the triggers go
# to [Unit], wantedBy to [Install] and to <target>.wants/ links. A service the fleet
# defines without ExecStart is one a package ships (here: the lane's own units), so what
# the modules add to it is written as <unit>.d/overrides.conf, as NixOS does then.
# Store paths stay as the stubs make them: the lane puts the binaries just built and its
# own tools at those paths (`packages`), and every store file a unit, /etc/fort or the
# dry-activate plan names is a file of the tree.
#
# Trees: forge, app (generation 1), app-fort (app with services.fort-agent.user =
# "fort"), next/forge and next/app (generation 2), certs/forge and certs/app (forge serves
# ssl-cert from an ACME CA, app asks for a certificate), records/forge and records/app
# (forge serves dns-record from a DNS primary, app asks for a record), clients/forge and
# clients/app (forge serves oidc from an OpenID provider, app asks for a client), ssh/forge
# and ssh/app (forge is an SSH CA, app asks for a host certificate), databases/forge and
# databases/app (forge serves postgres, app asks for a database), encrypted/forge and
# encrypted/app (app's keeper reads its token as an encrypted credential), failover/forge,
# failover/spare and failover/app (forge and spare both serve lease, app asks either),
# atrest/forge and atrest/app (every capability above but dns-record, forge's state
# sealed, app's secrets encrypted credentials).
{
  lib ? import <nixpkgs-lib/lib>,
}:
let
  inherit (lib)
    attrNames
    concatLists
    concatMapStrings
    concatMapStringsSep
    concatStrings
    concatStringsSep
    filter
    filterAttrs
    isList
    listToAttrs
    mapAttrs'
    mapAttrsToList
    nameValuePair
    optionalAttrs
    optionalString
    removePrefix
    ;
  stubs = import ../stubs.nix { inherit lib; };
  inherit (stubs) pkgs;
  fleetLib = import ../../fleet.nix { inherit lib; };
  fortLib = import ../../lib.nix { inherit lib; };
  mkFleet = fleetLib.mkFleetWith {
    module = ../../default.nix;
    evalHost =
      { modules, specialArgs, ... }:
      lib.evalModules {
        modules = [ stubs.module ] ++ modules;
        specialArgs = { inherit pkgs; } // specialArgs;
      };
  };
  fleet = args: mkFleet (import ./fleet.nix args);

  # ------------------------------------------------ NixOS's unit text (systemd-lib.nix)
  toOption =
    x:
    if x == true then
      "true"
    else if x == false then
      "false"
    else
      toString x;
  attrsToSection =
    as:
    concatStrings (
      concatLists (
        mapAttrsToList (name: value: map (x: "${name}=${toOption x}\n") (if isList value then value else [ value ])) as
      )
    );
  triggersFile =
    what: name: triggers:
    "${pkgs.writeText "X-${what}-Triggers-${name}" (toString (lib.flatten triggers))}";
  unitSection =
    name: def:
    def.unitConfig
    // optionalAttrs (def.wants or [ ] != [ ]) { Wants = toString def.wants; }
    // optionalAttrs (def.after or [ ] != [ ]) { After = toString def.after; }
    // optionalAttrs (def.restartTriggers or [ ] != [ ]) {
      X-Restart-Triggers = triggersFile "Restart" name def.restartTriggers;
    }
    // optionalAttrs (def.reloadTriggers or [ ] != [ ]) {
      X-Reload-Triggers = triggersFile "Reload" name def.reloadTriggers;
    }
    // optionalAttrs (def.description != "") { Description = def.description; }
    // optionalAttrs (def.onSuccess or [ ] != [ ]) { OnSuccess = toString def.onSuccess; };
  commonUnitText =
    name: def: lines:
    "[Unit]\n${attrsToSection (unitSection name def)}\n"
    + lines
    + optionalString (def.wantedBy != [ ]) "\n[Install]\nWantedBy=${concatStringsSep " " def.wantedBy}\n";
  serviceText =
    config: name: def:
    let
      # NixOS appends its default path to every service (stage2ServiceConfig).
      path = def.path ++ [
        pkgs.coreutils
        pkgs.findutils
        pkgs.gnugrep
        pkgs.gnused
        config.systemd.package
      ];
      env = def.environment // {
        PATH = "${lib.makeBinPath path}:${lib.makeSearchPathOutput "bin" "sbin" path}";
      };
    in
    commonUnitText name def (
      "[Service]\n"
      + concatMapStrings (n: "Environment=${builtins.toJSON "${n}=${env.${n}}"}\n") (attrNames env)
      + attrsToSection (
        def.serviceConfig
        // optionalAttrs (def.script != "") { ExecStart = "${startScript name def}"; }
      )
    );
  # A unit's `script` as NixOS runs it (makeJobScript): a shell script of its own that
  # stops at the first failing command.
  startScript = name: def: pkgs.writeShellScript "unit-script-${name}-start" "set -e\n${def.script}";
  pathText = name: def: commonUnitText name def "[Path]\n${attrsToSection def.pathConfig}\n";

  # --------------------------------------------------------- TOML (pkgs.formats.toml)
  toTOML =
    value:
    let
      key = k: if builtins.match "[A-Za-z0-9_-]+" k != null then k else builtins.toJSON k;
      scalars =
        attrs:
        concatStrings (
          mapAttrsToList (
            k: v: optionalString (v != null && !builtins.isAttrs v) "${key k} = ${builtins.toJSON v}\n"
          ) attrs
        );
      tables =
        prefix: attrs:
        concatStrings (
          mapAttrsToList (
            k: v:
            optionalString (builtins.isAttrs v) "\n[${prefix}${key k}]\n${scalars v}${tables "${prefix}${key k}." v}"
          ) attrs
        );
    in
    scalars value + tables "" value;

  # ------------------------------------------------------------------- one host's tree
  storeFile = drv: removePrefix "/" "${drv}";
  # A stub's content: writeText keeps `text`, formats.toml `value`, the build-time
  # check (runCommand) the config it copies.
  contentOf =
    drv:
    if drv ? text then
      drv.text
    else if drv ? value then
      toTOML drv.value
    else if drv ? env.config then
      contentOf drv.env.config
    else
      throw "lane: no content for ${drv}";
  # writeShellScript: `#!${runtimeShell}` and the text, executable.
  script = drv: {
    name = storeFile drv;
    value = {
      text = "#!/bin/bash\n${drv.text}";
      mode = "0755";
    };
  };
  textFile = text: {
    inherit text;
    mode = "0644";
  };

  render =
    node:
    let
      config = node.config;
      cfg = config.services.fort-agent;
      problems =
        map (a: a.message) (filter (a: !a.assertion) config.assertions) ++ config.warnings;
      unitDir = "etc/systemd/system";
      # A package's unit (no ExecStart here) gets what the modules add as a drop-in.
      serviceFile =
        name: def:
        if def.serviceConfig ? ExecStart || def.script != "" then
          "${unitDir}/${name}.service"
        else
          "${unitDir}/${name}.service.d/overrides.conf";
      units =
        mapAttrs' (name: def: nameValuePair (serviceFile name def) (textFile (serviceText config name def))) config.systemd.services
        // mapAttrs' (
          name: def: nameValuePair "${unitDir}/${name}.path" (textFile (pathText name def))
        ) config.systemd.paths;
      wants = listToAttrs (
        concatLists (
          mapAttrsToList (
            unit: def: map (target: nameValuePair "${unitDir}/${target}.wants/${unit}" { symlink = "../${unit}"; }) def.wantedBy
          ) (
            mapAttrs' (n: v: nameValuePair "${n}.service" v) config.systemd.services
            // mapAttrs' (n: v: nameValuePair "${n}.path" v) config.systemd.paths
          )
        )
      );
      etc = mapAttrs' (
        name: e:
        nameValuePair "etc/${name}" { symlink = "${e.source}"; }
      ) config.environment.etc;
      storeFiles =
        mapAttrs' (_: e: nameValuePair (storeFile e.source) (textFile (contentOf e.source))) config.environment.etc
        // listToAttrs (
          map (f: nameValuePair (storeFile f) (textFile (contentOf f))) (
            concatLists (mapAttrsToList (_: c: c.configFiles) config.fort.host.capabilities)
          )
        );
      needs = fortLib.needList config.fort.host.needs;
      # Handlers the fleet wrote (a handler of the fort package is one of its binaries).
      scripts = listToAttrs (
        map script (
          filter builtins.isAttrs (
            concatLists (map (n: [ n.handler n.check ]) needs)
            ++ mapAttrsToList (_: c: c.handler) config.fort.host.capabilities
          )
          ++ mapAttrsToList startScript (filterAttrs (_: def: def.script != "") config.systemd.services)
        )
      );
      # users.users and users.groups as sysusers.d lines (NixOS creates them its own way;
      # systemd-sysusers does it on the lane's first boot).
      users =
        concatMapStrings (g: "g ${g} -\n") (attrNames config.users.groups)
        + concatStrings (
          mapAttrsToList (n: u: "u ${n} - ${builtins.toJSON (u.description or n)}\n") config.users.users
        );
      polkit = config.security.polkit or { };
    in
    if problems != [ ] then
      throw "lane host ${cfg.hostName}: ${concatStringsSep "\n" problems}"
    else
      {
        files =
          units
          // wants
          // etc
          // storeFiles
          // scripts
          // optionalAttrs (users != "") { "etc/sysusers.d/lane-users.conf" = textFile users; }
          // optionalAttrs (polkit.extraConfig or "" != "") {
            "etc/polkit-1/rules.d/10-nixos.rules" = textFile polkit.extraConfig;
          };
        # Store paths the lane provides: the binaries just built, or the container's
        # own tools (bin/ and sbin/ of /usr).
        packages = {
          "${cfg.package}" = "fort";
        }
        // listToAttrs (
          map (p: nameValuePair "${p}" "system") [
            pkgs.coreutils
            pkgs.findutils
            pkgs.gnugrep
            pkgs.gnused
            pkgs.jq
            config.systemd.package
          ]
        );
        dryActivate = "#!/bin/bash\n${config.system.activationScripts.fort-plan.text}";
      };

  one = fleet { };
  fortUser = fleet { appUser = "fort"; };
  next = fleet { generation = 2; };
  certs = fleet { certificates = true; };
  records = fleet { records = true; };
  clients = fleet { clients = true; };
  ssh = fleet { sshCertificates = true; };
  databases = fleet { databases = true; };
  encrypted = fleet { encrypted = true; };
  failover = fleet { failover = true; };
  monitoring = fleet { monitoring = true; };
  backups = fleet { backups = true; };
  atRest = fleet {
    atRest = true;
    certificates = true;
    clients = true;
    sshCertificates = true;
    databases = true;
  };
in
{
  forge = render one.forge;
  app = render one.app;
  app-fort = render fortUser.app;
  "next/forge" = render next.forge;
  "next/app" = render next.app;
  "certs/forge" = render certs.forge;
  "certs/app" = render certs.app;
  "records/forge" = render records.forge;
  "records/app" = render records.app;
  "clients/forge" = render clients.forge;
  "clients/app" = render clients.app;
  "ssh/forge" = render ssh.forge;
  "ssh/app" = render ssh.app;
  "databases/forge" = render databases.forge;
  "databases/app" = render databases.app;
  "encrypted/forge" = render encrypted.forge;
  "encrypted/app" = render encrypted.app;
  "failover/forge" = render failover.forge;
  "failover/spare" = render failover.spare;
  "failover/app" = render failover.app;
  "monitoring/forge" = render monitoring.forge;
  "monitoring/app" = render monitoring.app;
  "backups/forge" = render backups.forge;
  "backups/app" = render backups.app;
  "atrest/forge" = render atRest.forge;
  "atrest/app" = render atRest.app;
}
