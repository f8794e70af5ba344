# The SSH certificate authority (`fort-handler ssh-ca`, docs/handlers.md "ssh-ca").
#   Provider: fort.host.capabilities.<name>.sshCa = { hostPrincipals; userPrincipals; … };
#   Consumer: fort.host.sshCertificate.from = "forge"; — this host's sshd presents a host
#   certificate for its own host key, trusts user certificates of the CA, and refuses
#   the certificates the CA revoked. With several providers (`from = [ "edge1" "edge2" ]`)
#   it trusts every one's CA and refuses what any of them revoked (one `{kind = "ca";}`
#   need per provider, installed with the certificate by `ssh-ca-krl --providers`).
{
  config,
  lib,
  pkgs,
  ...
}:
let
  inherit (lib)
    mkOption
    mkIf
    types
    literalExpression
    ;
  agent = config.services.fort-agent;
  fortLib = import ../lib.nix { inherit lib; };
  seconds = d: "${toString (fortLib.durationSeconds d)}s";

  principals =
    example: description:
    mkOption {
      type = types.attrsOf (types.listOf types.str);
      inherit example description;
    };

  # Mistakes the handler would only find at run time, on every run.
  badPattern =
    p:
    builtins.match "([*][.])?[a-z0-9_{}][a-z0-9._@+:{}-]*" p == null;

  provider = import ./provider.nix (_: {
    option = "sshCa";
    handler = "ssh-ca";
    description = ''
      Serve this capability with fort's SSH certificate authority
      (`fort-handler ssh-ca`): host certificates for each host's own key, user
      certificates for the accounts each caller may use, and a KRL of what was
      released. Sets `handler`, `args`, `interface` and `cacheResponse`.
    '';
    example = ''
      {
        hostPrincipals."*" = [ "{origin}" "{origin}.example.org" ];
        userPrincipals.ci = [ "deploy" ];
      }
    '';
    settings = name: {
      caKeyFile = mkOption {
        type = types.str;
        default = "/var/lib/fort/handlers/${name}/ca_key";
        defaultText = literalExpression ''"/var/lib/fort/handlers/<name>/ca_key"'';
        description = ''
          The CA's private key: an unencrypted OpenSSH ed25519 key that only the
          agent's user can read (mode 0400), on the host, never in the Nix store.
        '';
      };
      generateCaKey = mkOption {
        type = types.bool;
        default = true;
        description = "Make a new ed25519 key at `caKeyFile` on the first run when there is none.";
      };
      hostPrincipals = principals { "*" = [ "{origin}" "{origin}.example.org" ]; app = [ "*.app.example.org" ]; } ''
        Names a host certificate may carry, per caller: `"*"` applies to every host of
        the fleet (never to principals), `{origin}` stands for the caller, `*.SUFFIX`
        allows every name below SUFFIX. A request without `principals` gets every exact
        name it may have.
      '' // {
        default = {
          "*" = [ "{origin}" ];
        };
      };
      userPrincipals = principals { ci = [ "deploy" ]; ops = [ "{origin}" "root" ]; } ''
        Accounts a user certificate may log in as, per caller (hosts and principals;
        `"*"` applies to every caller). Nobody gets a user certificate unless listed.
      '' // {
        default = { };
      };
      hostValidity = mkOption {
        type = fortLib.durationType;
        default = "30d";
        description = "How long a host certificate is valid.";
      };
      userValidity = mkOption {
        type = fortLib.durationType;
        default = "8h";
        description = "How long a user certificate is valid (a request may ask for less).";
      };
      renewFraction = mkOption {
        type = types.numbers.between 0.01 0.99;
        default = 0.25;
        description = "A certificate is issued again once less than this fraction of its validity is left.";
      };
      userExtensions = mkOption {
        type = types.listOf types.str;
        default = [
          "permit-X11-forwarding"
          "permit-agent-forwarding"
          "permit-port-forwarding"
          "permit-pty"
          "permit-user-rc"
        ];
        description = "Extensions of user certificates (those `ssh-keygen -s` grants by default).";
      };
      knownHostsPatterns = mkOption {
        type = types.listOf types.str;
        default = [ "*" ];
        example = [ "*.example.org" ];
        description = "Host patterns of the `@cert-authority` line handed to consumers.";
      };
      firstSerial = mkOption {
        type = types.ints.positive;
        default = 1;
        description = ''
          The first serial number fort gives. Certificates signed by hand with the same
          CA should use serials below it (or 0), so no revocation touches them.
        '';
      };
      backdate = mkOption {
        type = fortLib.durationType;
        default = "5m";
        description = "Certificates are valid from this long before they are signed (clock skew).";
      };
      maxNewCertificatesPerCallerPerHour = mkOption {
        type = types.nullOr (types.ints.between 1 100000);
        default = null;
        description = ''
          Certificates for new or changed requests in any hour for all entries of one
          caller together; past it an entry keeps what it has and waits. `null`: 10.
          Every response carries the KRL, and each such certificate revokes the one it
          replaces (or is revoked when its entry is released): without it one caller
          could change every other consumer's payload on every run.
        '';
      };
    };
    stateFile = {
      default = name: "/var/lib/fort/handlers/${name}/state.json";
      description = "Serials, what each entry holds and the revoked certificates (mode 0600).";
      shared = ", and each would revoke the other's certificates";
    };
    configFile =
      _: ca:
    {
      ca_key_file = ca.caKeyFile;
      generate_ca_key = ca.generateCaKey;
      state_file = ca.stateFile;
      hosts_file = "/etc/fort/hosts.json";
      host_principals = ca.hostPrincipals;
      user_principals = ca.userPrincipals;
      host_validity = seconds ca.hostValidity;
      user_validity = seconds ca.userValidity;
      renew_fraction = ca.renewFraction;
      user_extensions = ca.userExtensions;
      known_hosts_patterns = ca.knownHostsPatterns;
      first_serial = ca.firstSerial;
      backdate = seconds ca.backdate;
    }
    // lib.optionalAttrs (ca.maxNewCertificatesPerCallerPerHour != null) {
      max_new_certificates_per_caller_per_hour = ca.maxNewCertificatesPerCallerPerHour;
    };
    answers = [
      "kind" "certificate" "serial" "key_id" "principals" "valid_after" "valid_before"
      "expires_at" "krl" "ca_public_key" "known_hosts_line"
    ];
    policy = _: ca: { inherit (ca) hostPrincipals userPrincipals; };
    defaults = _: _: {
      interface = ../interfaces/ssh-ca.nix;
      cacheResponse = true;
      description = "SSH host and user certificates";
    };
    async = "certificates are entries the handler reconciles and revokes";
    paths = [ "caKeyFile" ];
    assertions =
      { at, settings, ... }:
      let
        patterns = field: lib.concatLists (lib.attrValues settings.${field});
        bad = field: lib.filter badPattern (patterns field);
      in
      [
        {
          assertion = !lib.hasPrefix "${builtins.storeDir}/" settings.caKeyFile;
          message = "${at}.caKeyFile = ${settings.caKeyFile}: the Nix store is world readable; name a file on the host (the default is made on the first run).";
        }
        {
          assertion = bad "hostPrincipals" == [ ] && bad "userPrincipals" == [ ];
          message = "${at}: principal patterns must be lower-case names, {origin} templates or *.SUFFIX; not ${lib.concatMapStringsSep ", " builtins.toJSON (bad "hostPrincipals" ++ bad "userPrincipals")}.";
        }
      ];
  });

  cert = config.fort.host.sshCertificate;
  selfKeys = config.fort.cluster.facts.hosts.${agent.hostName}.publicKeys or [ ];
  sshdKey = "/etc/ssh/ssh_host_ed25519_key";
  providers = lib.toList cert.from;
  several = lib.length providers > 1;
  krlHandler = pkgs.writeShellScript "fort-ssh-ca-krl" (
    if several then
      ''
        exec ${agent.package}/bin/fort-handler ssh-ca-krl --out ${cert.revokedKeysFile} \
          --providers ${lib.concatStringsSep "," providers} \
          --ca-keys ${cert.caKeyFile} --known-hosts ${cert.knownHostsFile}
      ''
    else
      ''
        exec ${agent.package}/bin/fort-handler ssh-ca-krl --out ${cert.revokedKeysFile}
      ''
  );
  # What each provider is trusted for, when there are several (docs/handlers.md, ssh-ca,
  # "How it fails over"): a need that names that provider alone and never moves.
  caNeeds = lib.listToAttrs (
    map (p: {
      name = "${cert.id}-ca-${p}";
      value = {
        from = p;
        request.kind = "ca";
        handler = krlHandler;
      };
    }) providers
  );
in
{
  imports = [ provider ];

  options.fort.host.sshCertificate = mkOption {
    default = null;
    example = literalExpression ''{ from = "forge"; }'';
    description = ''
      A host certificate for this host's sshd from an `ssh-ca` provider, in one line:
      `fort.host.sshCertificate.from = "forge";`. Declares the need (the request
      carries the host's public key), delivers the certificate next to the host key,
      the CA key for `TrustedUserCAKeys`, the KRL for `RevokedKeys` and the
      `@cert-authority` line for clients, and reloads sshd when the certificate changes.
    '';
    type = types.nullOr (
      types.submodule {
        options = {
          from = mkOption {
            type = types.either types.str (types.nonEmptyListOf types.str);
            example = [
              "edge1"
              "edge2"
            ];
            description = ''
              The host serving the `ssh-ca` capability, or several in order of
              preference: the certificate comes from one of them at a time (it moves
              as any need does), and sshd and clients trust the CAs of all of them and
              refuse what any of them revoked.
            '';
          };
          capability = mkOption {
            type = types.str;
            default = "ssh-ca";
            description = "The capability's name at the provider (the need's type).";
          };
          id = mkOption {
            type = types.str;
            default = "host";
            description = "The need's id.";
          };
          hostKey = mkOption {
            type = types.str;
            default = sshdKey;
            description = "The sshd host key to certify; the certificate lands at `<hostKey>-cert.pub`.";
          };
          publicKey = mkOption {
            type = types.str;
            default =
              if agent.hostKeyFile == cert.hostKey && selfKeys != [ ] then
                lib.head selfKeys
              else
                "";
            defaultText = literalExpression "the host's first fort.cluster.hosts.<host>.publicKeys, when the agent's hostKeyFile is hostKey";
            description = ''
              The public half of `hostKey` (an OpenSSH public key line). Known without
              asking when the agent signs with the same key, as it does by default.
            '';
          };
          principals = mkOption {
            type = types.nullOr (types.listOf types.str);
            default = null;
            example = [ "app" "app.example.org" ];
            description = "Names the certificate is for; `null`: every exact name the provider allows this host.";
          };
          renewBefore = mkOption {
            type = fortLib.durationType;
            default = "2d";
            description = "Ask for a new certificate this long before the current one expires.";
          };
          trustUserCertificates = mkOption {
            type = types.bool;
            default = true;
            description = "sshd accepts user certificates of the CA (`TrustedUserCAKeys`).";
          };
          revokedKeysFile = mkOption {
            type = types.str;
            default = "/etc/ssh/fort_revoked_keys.krl";
            description = ''
              Where the CA's KRL is installed; sshd refuses what it revokes
              (`RevokedKeys`). With several providers, one KRL revoking what any of
              them revoked (each provider's own is kept in `<file>.d/`). Created empty
              at boot, so sshd never finds it missing (a missing file would refuse
              every public key).
            '';
          };
          caKeyFile = mkOption {
            type = types.str;
            default = "/etc/ssh/fort_user_ca.pub";
            description = "Where the CA's public key is installed (with several providers, every one's, one per line).";
          };
          knownHostsFile = mkOption {
            type = types.str;
            default = "/etc/ssh/ssh_known_hosts_fort";
            description = ''
              Where the CA's `@cert-authority` line is installed (with several
              providers, one line per provider), for clients: list it
              in their `GlobalKnownHostsFile` (or paste its content into
              `programs.ssh.knownHosts`) to trust every host certificate of the CA.
            '';
          };
        };
      }
    );
  };

  config = mkIf (cert != null) {
    assertions = [
      {
        assertion = cert.publicKey != "";
        message = "fort.host.sshCertificate.publicKey: set the public key of ${cert.hostKey}; it is known without asking only when services.fort-agent.hostKeyFile is that key (it is ${toString agent.hostKeyFile}).";
      }
      {
        assertion = agent.user == "root";
        message = "fort.host.sshCertificate: the agent installs sshd's files in /etc/ssh and reloads sshd, so it must run as root (services.fort-agent.user is ${agent.user}).";
      }
    ];
    fort.host.needs.${cert.capability} = lib.optionalAttrs several caNeeds // {
      ${cert.id} = {
        inherit (cert) from renewBefore;
        request = {
          kind = "host";
          public_key = cert.publicKey;
        } // lib.optionalAttrs (cert.principals != null) { inherit (cert) principals; };
        files = {
          certificate = {
            path = "${cert.hostKey}-cert.pub";
            pointer = "/certificate";
            mode = "0644";
          };
        }
        # With several providers the handler writes these, every provider's together.
        // lib.optionalAttrs (!several) {
          ca = {
            path = cert.caKeyFile;
            pointer = "/ca_public_key";
            mode = "0644";
          };
          known_hosts = {
            path = cert.knownHostsFile;
            pointer = "/known_hosts_line";
            mode = "0644";
          };
        };
        handler = krlHandler;
        reloadUnits = [ "sshd.service" ];
      };
    };
    systemd.tmpfiles.rules = [ "f ${cert.revokedKeysFile} 0644 root root -" ];
    services.openssh.extraConfig = ''
      HostCertificate ${cert.hostKey}-cert.pub
      RevokedKeys ${cert.revokedKeysFile}
    '' + lib.optionalString cert.trustUserCertificates ''
      TrustedUserCAKeys ${cert.caKeyFile}
    '';
  };
}
