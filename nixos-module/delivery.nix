# Payload files handed to other services as systemd credentials
# (fort.host.needs.<type>.<id>.files.<name>.credentialFor).
#
# For a service S and a delivered file F the module adds to S:
#   LoadCredential=<name>:<path>   systemd (PID 1, as root) copies F into S's private
#                                  $CREDENTIALS_DIRECTORY, readable by S's user, also a
#                                  DynamicUser=, so F itself stays root-only;
#   ConditionPathExists=<path>     until the agent has written F, starting S is skipped
#                                  (a missing credential would otherwise fail S at boot);
# and a path unit fort-credential-S (PathChanged= on every such file, Unit=S) that starts
# S when a file appears. PathChanged, not PathExists: PathExists restarts the unit
# whenever it stops while the path exists, so S could not be stopped by hand, and while
# only some of S's files exist the skipped start would re-trigger in a loop until
# systemd's trigger limit disables the path unit. A change of content afterwards is the
# agent's job: the file's credential_for names S (lib.nix, needsJson), and the agent
# restarts S when the file's content is replaced, not when the file first appears
# (the path unit starts S then; restarting it too would start it twice).
{
  config,
  lib,
  ...
}:
let
  cfg = config.services.fort-agent;
  fortLib = import ./lib.nix { inherit lib; };

  # Every (file, service) pair, grouped by service (its systemd.services attribute).
  credentials = lib.concatMap (
    n:
    lib.concatLists (
      lib.mapAttrsToList (
        name: f:
        map (unit: {
          inherit name;
          inherit (f) path;
          service = lib.removeSuffix ".service" unit;
        }) f.credentialFor
      ) n.files
    )
  ) (fortLib.needList config.fort.host.needs);
  byService = lib.groupBy (c: c.service) credentials;

  # Under strictSandbox the file system is read-only except the state and runtime
  # directories; files and keys delivered elsewhere need their directory writable ("-": the
  # directory may not exist yet, which is no reason to refuse to start).
  outsideRuntime = lib.filter (p: !lib.hasPrefix "/run/fort/" p) (
    lib.concatMap (n: lib.mapAttrsToList (_: f: f.path) (n.files // lib.mapAttrs' (k: v: lib.nameValuePair "key ${k}" v) n.keys)) (
      fortLib.needList config.fort.host.needs
    )
  );
in
{
  config = lib.mkIf cfg.enable (
    lib.mkMerge [
      {
        systemd.services = lib.mapAttrs (_: cs: {
          serviceConfig.LoadCredential = map (c: "${c.name}:${c.path}") cs;
          unitConfig.ConditionPathExists = map (c: c.path) cs;
        }) byService;

        systemd.paths = lib.mapAttrs' (
          service: cs:
          lib.nameValuePair "fort-credential-${service}" {
            description = "Start ${service}.service once fort has delivered its credentials";
            wantedBy = [ "multi-user.target" ];
            pathConfig = {
              PathChanged = lib.unique (map (c: c.path) cs);
              Unit = "${service}.service";
            };
          }
        ) byService;
      }
      (lib.mkIf (cfg.strictSandbox && outsideRuntime != [ ]) {
        systemd.services.fort-agent.serviceConfig.ReadWritePaths = lib.unique (
          map (p: "-${dirOf p}") outsideRuntime
        );
      })
    ]
  );
}
