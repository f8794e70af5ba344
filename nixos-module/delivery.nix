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
#
# A file with encrypt = true is a systemd encrypted credential the agent made with
# systemd-creds (docs/at-rest.md): S gets LoadCredentialEncrypted=<name>:<path> instead,
# and systemd decrypts it into S's $CREDENTIALS_DIRECTORY; one it cannot decrypt fails
# S's start, never a plaintext fallback. The agent then needs the host's credential
# secret made (systemd-creds setup, before it starts, outside its sandbox) and, under
# strictSandbox, the TPM2 device a TPM2-bound key is made with.
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
          inherit (f) path encrypt;
          service = lib.removeSuffix ".service" unit;
        }) f.credentialFor
      ) n.files
    )
  ) (fortLib.needList config.fort.host.needs);
  byService = lib.groupBy (c: c.service) credentials;

  encryptsFiles = lib.any (n: lib.any (f: f.encrypt) (lib.attrValues n.files)) (
    fortLib.needList config.fort.host.needs
  );

  # Under strictSandbox the file system is read-only except the state and runtime
  # directories; files and keys delivered elsewhere need their directory writable ("-": the
  # directory may not exist yet, which is no reason to refuse to start).
  outsideRuntime = lib.filter (p: !lib.hasPrefix "/run/fort/" p && !lib.hasPrefix "/var/lib/fort/" p) (
    lib.concatMap (n: lib.mapAttrsToList (_: f: f.path) (n.files // lib.mapAttrs' (k: v: lib.nameValuePair "key ${k}" v) n.keys)) (
      fortLib.needList config.fort.host.needs
    )
  );
in
{
  config = lib.mkIf cfg.enable (
    lib.mkMerge [
      {
        systemd.services = lib.mapAttrs (
          _: cs:
          let
            load = c: "${c.name}:${c.path}";
            plain = lib.filter (c: !c.encrypt) cs;
            encrypted = lib.filter (c: c.encrypt) cs;
          in
          {
            serviceConfig =
              lib.optionalAttrs (plain != [ ]) { LoadCredential = map load plain; }
              // lib.optionalAttrs (encrypted != [ ]) { LoadCredentialEncrypted = map load encrypted; };
            unitConfig.ConditionPathExists = map (c: c.path) cs;
          }
        ) byService;

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
      (lib.mkIf encryptsFiles {
        # "+": as root outside the sandbox, which leaves /var/lib/systemd read-only.
        systemd.services.fort-agent.serviceConfig.ExecStartPre = [
          "+${config.systemd.package}/bin/systemd-creds setup"
        ];
      })
      (lib.mkIf (encryptsFiles && cfg.strictSandbox && cfg.credentialEncryption.withKey != "host") {
        # PrivateDevices= hides the TPM2: without it, `auto` would bind to the host's
        # secret alone and `tpm2` would fail. "-": a machine without one.
        systemd.services.fort-agent.serviceConfig = {
          BindPaths = [ "-/dev/tpmrm0" ];
          DeviceAllow = [ "/dev/tpmrm0 rw" ];
        };
      })
      (lib.mkIf (cfg.strictSandbox && outsideRuntime != [ ]) {
        systemd.services.fort-agent.serviceConfig.ReadWritePaths = lib.unique (
          map (p: "-${dirOf p}") outsideRuntime
        );
      })
    ]
  );
}
