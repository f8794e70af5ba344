# Option declarations for this host: what it needs (with how the payload is delivered),
# what it serves (with the request interface), and what it exports to the fleet.
{
  config,
  lib,
  ...
}:
let
  inherit (lib) mkOption types literalExpression;
  fortLib = import ./lib.nix { inherit lib; };

  jsonObject = types.attrsOf types.anything;
  unitList =
    example: description:
    mkOption {
      type = types.listOf types.str;
      default = [ ];
      inherit example description;
    };
  # `<type>.<id>` in the options reference instead of `<name>.<name>`.
  attrsNamed =
    placeholder: elemType:
    if types ? attrsWith then
      types.attrsWith { inherit placeholder elemType; }
    else
      types.attrsOf elemType;

  file = types.submodule (
    {
      name,
      options,
      config,
      ...
    }:
    let
      # fort.host.needs.<type>.<id>.files.<name>.path: the need's type and id, for the
      # default path, from where the option sits.
      loc = options.path.loc;
      at = i: lib.elemAt loc (lib.length loc - i);
    in
    {
      options = {
        path = mkOption {
          type = types.str;
          default =
            if config.encrypt then
              "/var/lib/fort/credentials/${at 5}/${at 4}/${name}.cred"
            else
              "/run/fort/needs/${at 5}/${at 4}/${name}";
          defaultText = literalExpression ''
            if encrypt then "/var/lib/fort/credentials/<type>/<id>/<name>.cred"
            else "/run/fort/needs/<type>/<id>/<name>"
          '';
          example = "/var/lib/outline/oidc-secret";
          description = ''
            Where the agent writes the file, atomically, each time the need's payload
            arrives. Other modules read it as
            `config.fort.host.needs.<type>.<id>.files.<name>.path`. The default for a plain
            file lives in the agent's runtime directory, which survives agent restarts but
            not a reboot (the agent asks for the files again); an encrypted file's lives in
            the agent's state directory and survives a reboot.
          '';
        };
        encrypt = mkOption {
          type = types.bool;
          default = false;
          example = true;
          description = ''
            Store the file as a systemd encrypted credential instead of its content: the
            agent encrypts it on this host with `systemd-creds encrypt --name=<name>`
            (bound to `services.fort-agent.credentialEncryption.withKey`), the plaintext
            going to it through a pipe and never to a file, and the services in
            `credentialFor` get `LoadCredentialEncrypted=`. The recommended form for every
            secret a service reads; see docs/at-rest.md. Where `systemd-creds` cannot
            encrypt, the need fails with the reason, never falling back to a plaintext file.
            Needs the agent to run as root (encrypting reads the host's credential secret).
          '';
        };
        pointer = mkOption {
          type = types.str;
          default = "";
          example = "/client_secret";
          description = ''
            JSON pointer (RFC 6901) into the payload; the file holds that value (a string
            as its text, anything else as compact JSON). `""`: the whole payload.
          '';
        };
        owner = mkOption {
          type = types.str;
          default = "root";
          example = "outline";
          description = "Owner of the file (a user name).";
        };
        group = mkOption {
          type = types.str;
          default = "root";
          description = "Group of the file.";
        };
        mode = mkOption {
          type = types.strMatching "[0-7]{3,4}";
          default = "0400";
          example = "0440";
          description = "Permissions of the file, in octal.";
        };
        credentialFor = mkOption {
          type = types.listOf types.str;
          default = [ ];
          example = [ "outline.service" ];
          description = ''
            Services that receive the file as a systemd credential: each gets
            `LoadCredential=<name>:<path>`, or `LoadCredentialEncrypted=<name>:<path>` with
            `encrypt` (read as `$CREDENTIALS_DIRECTORY/<name>`, also under `DynamicUser=`,
            so the file itself can stay root-only), is skipped
            rather than failed while the file is missing (`ConditionPathExists=`), is
            started by a path unit once the file appears (once: the agent does not
            restart it for a file it creates), and is restarted when the file's content
            changes.
          '';
        };
      };
    }
  );

  # A key the host makes for a need (docs/protocol.md §11.10).
  key = types.submodule (
    { name, options, ... }:
    let
      loc = options.path.loc;
      at = i: lib.elemAt loc (lib.length loc - i);
    in
    {
      options = {
        type = mkOption {
          type = types.enum [
            "ecdsa-p256"
            "ed25519"
            "rsa-2048"
            "rsa-3072"
            "wireguard"
          ];
          default = "ecdsa-p256";
          description = ''
            The key's algorithm. `ecdsa-p256` for TLS (every ACME CA takes it) and for
            SSH; `ed25519` for SSH (with `format = "openssh"`); `wireguard` (X25519) for
            a WireGuard interface: installed as `wg` reads it, and the payload names
            its public key back (at `certificate`) instead of certifying it.
          '';
        };
        path = mkOption {
          type = types.str;
          default = "/run/fort/needs/${at 5}/${at 4}/${name}.key";
          defaultText = literalExpression ''"/run/fort/needs/<type>/<id>/<name>.key"'';
          example = "/var/lib/acme/wiki/key.pem";
          description = ''
            Where the private key is installed, together with the certificate that
            matches it. The key is made on this host and never leaves it: requests carry
            its public half or a CSR. Until the certificate arrives the key waits in the
            agent's state directory, and the previous key stays here.
          '';
        };
        owner = mkOption {
          type = types.str;
          default = "root";
          example = "nginx";
          description = "Owner of the key file (a user name).";
        };
        group = mkOption {
          type = types.str;
          default = "root";
          description = "Group of the key file.";
        };
        mode = mkOption {
          type = types.strMatching "[0-7]{3,4}";
          default = "0400";
          description = "Permissions of the key file, in octal.";
        };
        format = mkOption {
          type = types.enum [
            "pem"
            "openssh"
          ];
          default = "pem";
          description = ''
            `pem`: PKCS#8 (`BEGIN PRIVATE KEY`), what TLS servers read, and OpenSSH for
            P-256 keys. `openssh`: OpenSSH's own format, for `ed25519` keys used by
            `ssh` or `sshd`.
          '';
        };
        names = mkOption {
          type = types.listOf types.str;
          default = [ ];
          example = [
            "wiki.example.org"
            "*.wiki.example.org"
          ];
          description = ''
            DNS names (or IP addresses) of the certificate signing request made with
            the key; the first is its common name. Needed for `as = "csr"`.
          '';
        };
        certificate = mkOption {
          type = types.str;
          default = "/certificate";
          description = ''
            JSON pointer to the certificate in the payload (PEM X.509, or an OpenSSH
            certificate). A payload whose certificate is not for this key (the one
            installed or the one asked with) is refused and nothing is written.
          '';
        };
        reuse = mkOption {
          type = types.bool;
          default = false;
          description = "Keep the key across renewals; by default every renewal asks with a new key.";
        };
        authorized = mkOption {
          type = types.bool;
          default = false;
          description = ''
            The provider authorizes the key instead of certifying it (an
            `authorized_keys` entry, as `backup-repo` makes): the value at `certificate`
            is the key's own OpenSSH public key line, which the provider answers once it
            has authorized that key.
          '';
        };
      };
    }
  );

  need = types.submodule (
    { options, ... }:
    {
      options = {
        from = mkOption {
          type = types.either types.str (types.nonEmptyListOf types.str);
          example = [
            "edge1"
            "edge2"
          ];
          description = ''
            The host (a name in `fort.cluster.hosts`) whose capability of this need's
            type serves it, or several in order of preference: the need is served by
            one of them at a time (its home), and moves to the next only when it is due
            and its home has failed for `failoverAfter` (docs/protocol.md §11.13). Each
            host listed accepts this host as a caller.
          '';
        };
        failoverAfter = mkOption {
          type = types.nullOr fortLib.durationType;
          default = null;
          example = "1h";
          description = ''
            With several providers in `from`: how long the home must have failed before
            a due need moves to the next one (shipped as `failover_after_seconds`).
            `null`: twice `nag`.
          '';
        };
        request = mkOption {
          type = jsonObject;
          default = { };
          example = literalExpression ''
            {
              client_name = "outline";
              redirect_uris = [ "https://outline.example.org/auth/oidc.callback" ];
              tls_certificate = config.fort.lib.ref "ssl-cert/outline" "";
            }
          '';
          description = ''
            JSON object sent to the provider as `request` (docs/protocol.md §6.1),
            checked against the provider's interface for this capability, with the
            interface's defaults filled in. A value may be a reference to another need
            of this host, `config.fort.lib.ref "<type>/<id>" "<JSON pointer>"`, which the
            agent replaces with that need's payload before sending (§11.5).
          '';
        };
        nag = mkOption {
          type = fortLib.durationType;
          default = "15m";
          example = "1h";
          description = "How often the need is asked for again while it is unsatisfied (shipped as `nag_seconds`).";
        };
        handler = mkOption {
          type = types.nullOr types.path;
          default = null;
          example = literalExpression ''pkgs.writeShellScript "oidc-callback" "install -m 0400 /dev/stdin /var/lib/outline/oidc.json"'';
          description = ''
            Run with the provider's payload on stdin (after `files` are written); exit 0
            marks the need satisfied. `null` and no `files`: a side-effect-only need,
            satisfied when the provider answers `OK`. Runs as the agent's user
            (`services.fort-agent.user`).
          '';
        };
        check = mkOption {
          type = types.nullOr types.path;
          default = null;
          description = "Freshness probe run for a satisfied need; non-zero exit marks it unsatisfied again.";
        };
        neverSatisfied = mkOption {
          type = types.bool;
          default = false;
          description = "Ask again every `nag` interval even when satisfied (for responses that must be refreshed).";
        };
        files = mkOption {
          type = attrsNamed "name" file;
          default = { };
          example = literalExpression ''
            {
              client_secret = { pointer = "/client_secret"; encrypt = true; credentialFor = [ "outline.service" ]; };
              client_id = { pointer = "/client_id"; owner = "outline"; mode = "0440"; };
            }
          '';
          description = ''
            Files the agent writes from the payload (docs/protocol.md §11.3), before the
            handler runs. A need with files is satisfied once every file is written (and
            the handler, if any, exits 0).
          '';
        };
        keys = mkOption {
          type = attrsNamed "name" key;
          default = { };
          example = literalExpression ''
            { tls = { names = [ "wiki.example.org" ]; owner = "nginx"; }; }
          '';
          description = ''
            Private keys this host makes for the need and never sends
            (docs/protocol.md §11.10). The request refers to one with
            `config.fort.lib.key "<name>" "csr"` (or `"public"`, `"openssh"`); the agent
            puts the CSR or public key there before sending, and installs the key with
            the certificate the payload brings for it, in one go, with one restart or
            reload of the need's units.
          '';
        };
        restartUnits = unitList [ "outline.service" ] ''
          Units restarted (at most once a second) when a file's content changes;
          unchanged content restarts nothing. Services in a file's `credentialFor` need
          not be listed: they restart when that file changes.
        '';
        reloadUnits = unitList [ "nginx.service" ] "Units reloaded when a file's content changes.";
        renewBefore = mkOption {
          type = types.nullOr fortLib.durationType;
          default = null;
          example = "7d";
          description = ''
            Ask for a new payload this long before the received one expires (the
            earliest certificate `notAfter` in a PEM payload, or `expires_at` of a JSON
            object); shipped as `renew_before_seconds`. `null`: never.
          '';
        };
        after = mkOption {
          type = types.listOf types.str;
          default = [ ];
          example = [ "ssl-cert/outline" ];
          description = ''
            Need keys (`<type>/<id>`) of this host that must be satisfied before this
            need is asked for. References in `request` wait for their need anyway.
          '';
        };

        # Set by the inventory, read by the assertions: a need that an instance declares
        # may be extended here (handler, check, nag) but not declared a second time.
        fromInstance = mkOption {
          type = types.nullOr types.str;
          default = null;
          internal = true;
          description = "The fort.cluster.instances entry that declares this need, if any.";
        };
        fromDefinedIn = mkOption {
          type = types.listOf types.str;
          default = map toString options.from.files;
          internal = true;
          readOnly = true;
          description = "Files that define `from` (more than one for an instance need: a duplicate).";
        };
      };
    }
  );

  capability = types.submodule (
    { name, ... }:
    {
      options = {
        handler = mkOption {
          type = types.path;
          description = "Provider handler (docs/protocol.md §9 for async mode, §6.2 for rpc). Runs as the agent's user.";
        };
        args = mkOption {
          type = types.listOf types.str;
          default = [ ];
          example = [
            "acme"
            "--config"
            "/etc/fort/handlers/ssl-cert.json"
          ];
          description = ''
            Arguments the handler is started with, so one program can serve several
            capabilities (`fort-handler <capability> --config FILE`). At most 64, each at
            most 4096 bytes.
          '';
        };
        policy = mkOption {
          type = types.nullOr (types.attrsOf types.unspecified);
          internal = true;
          default = null;
          description = ''
            What a capability module of fort-handler tells consumers of its policy (its
            handler's name, allow lists, the members its response has), so each consumer's
            evaluation holds its requests and file pointers against it (lib.nix
            policyProblems); `null` for handlers fort does not ship.
          '';
        };
        configFiles = mkOption {
          type = types.listOf types.unspecified;
          internal = true;
          default = [ ];
          description = ''
            The store files `args` names that a capability module generated (its handler's
            config), for tools that install a host's files without Nix, such as the
            systemd test lane.
          '';
        };
        mode = mkOption {
          type = types.enum [
            "async"
            "rpc"
          ];
          default = "async";
          description = "`async`: durable entries, callbacks, GC. `rpc`: the handler's stdout is the response.";
        };
        cacheResponse = mkOption {
          type = types.bool;
          default = false;
          description = "Keep each entry's last response and hand it back to the handler (async only).";
        };
        allowed = mkOption {
          type = types.listOf types.str;
          default = [ ];
          example = [ "ops" ];
          description = ''
            Principals and hosts allowed to call this capability besides `callers`, which the
            module computes from every fleet host that declares a need of this type from here.
          '';
        };
        triggers = {
          initialize = mkOption {
            type = types.bool;
            default = false;
            description = "Run the handler over all entries when the agent starts (async only).";
          };
          systemd = mkOption {
            type = types.listOf types.str;
            default = [ ];
            example = [ "acme-example.org.service" ];
            description = ''
              Units whose successful completion runs the handler (async only): each gets
              `OnSuccess=fort-trigger-<capability>.service`. OnSuccess fires when a unit goes
              inactive after succeeding, so list oneshot units (a renewal, a setup job), not
              long-running daemons. Each must be defined by some other module.
            '';
          };
        };
        description = mkOption {
          type = types.nullOr types.str;
          default = null;
          description = "Shown by operator tools.";
        };
        interface = mkOption {
          type = types.nullOr types.deferredModule;
          default = config.fort.cluster.interfaces.${name} or null;
          defaultText = literalExpression "config.fort.cluster.interfaces.<name> or null";
          example = literalExpression ''
            { lib, ... }: {
              options.client_name = lib.mkOption { type = lib.types.str; description = "Client name."; };
            }
          '';
          description = ''
            The request this capability accepts, as a module of options. Every
            consumer's request is checked against it at evaluation (unknown field, wrong
            type, missing option without default), its defaults are filled into the
            shipped request, and the agent refuses requests that do not match
            (`request_schema` in capabilities.json). `null`: any JSON object.
          '';
        };
      };
    }
  );
  # A file rendered from a template over several needs' payloads (§11.14).
  template = types.submodule (
    { name, config, ... }:
    {
      options = {
        template = mkOption {
          type = types.str;
          example = "DATABASE_URL={{ needs[\"postgres/wiki\"].uri }}\n";
          description = ''
            The file's text as a template (Jinja's syntax, rendered by minijinja: no code,
            no file, no include); `needs["<type>/<id>"]` is a need's payload. A value the
            payload does not have is an error, and nothing is written.
          '';
        };
        needs = mkOption {
          type = types.nonEmptyListOf types.str;
          example = [
            "postgres/wiki"
            "oidc/wiki"
          ];
          description = ''
            The needs (`<type>/<id>`, declared on this host) the template reads: it is
            rendered once all are satisfied, and again whenever one of their payloads
            changes. A need with an encrypted file cannot be read (its payload is never
            kept in plaintext); encrypt the template's file instead.
          '';
        };
        path = mkOption {
          type = types.str;
          default =
            if config.encrypt then
              "/var/lib/fort/credentials/templates/${name}.cred"
            else
              "/run/fort/templates/${name}";
          defaultText = literalExpression ''
            if encrypt then "/var/lib/fort/credentials/templates/<name>.cred"
            else "/run/fort/templates/<name>"
          '';
          description = "Where the rendered file is written, atomically.";
        };
        encrypt = mkOption {
          type = types.bool;
          default = false;
          description = ''
            Store the rendering as a systemd encrypted credential, as a need's file with
            `encrypt` (see docs/at-rest.md).
          '';
        };
        owner = mkOption {
          type = types.str;
          default = "root";
          description = "Owner of the file (a user name).";
        };
        group = mkOption {
          type = types.str;
          default = "root";
          description = "Group of the file.";
        };
        mode = mkOption {
          type = types.strMatching "[0-7]{3,4}";
          default = "0400";
          description = "Permissions of the file, in octal.";
        };
        credentialFor = mkOption {
          type = types.listOf types.str;
          default = [ ];
          description = "Services that receive the file as a systemd credential, as a need's file's.";
        };
        restartUnits = unitList [ "wiki.service" ] "Units restarted once each time the rendered file changes.";
        reloadUnits = unitList [ ] "Units reloaded once each time the rendered file changes.";
      };
    }
  );
in
{
  options.fort = {
    host = {
      templates = mkOption {
        type = types.attrsOf template;
        default = { };
        description = ''
          Files rendered from a template over the values of several needs (an
          application's environment file with a database's URL and an OIDC client's
          secret), written like a need's file and rendered again only when an input
          changes; the units that use them are restarted once per change. The template
          is this host's own configuration, never a provider's.
        '';
      };
      needs = mkOption {
        type = attrsNamed "type" (attrsNamed "id" need);
        default = { };
        example = literalExpression ''
          { ssl-cert.app = { from = "forge"; request.domain = "app.example.org"; files."cert.pem" = { }; }; }
        '';
        description = "Needs of this host: `<type>.<id>`; the type is the name of the provider's capability.";
      };
      capabilities = mkOption {
        type = types.attrsOf capability;
        default = { };
        description = "Capabilities this host serves.";
      };
      exported = mkOption {
        type = types.unspecified;
        internal = true;
        readOnly = true;
        description = "This host as the rest of the fleet sees it (read by lib.mkFleet).";
      };
      files = mkOption {
        type = types.attrsOf types.raw;
        internal = true;
        readOnly = true;
        description = ''
          The generated files as store paths: `hosts`, `needs`, `capabilities`, and
          `checkConfig` (an agent.toml naming them, for `fort-agent check`), with
          `skipHandlers` (a handler lies outside the store, so a build cannot check it).
          Read by the flake's `lib.fleetCheck`.
        '';
      };
      manifestSha256 = mkOption {
        type = types.str;
        readOnly = true;
        description = ''
          Lower-case hex SHA-256 of `hosts.json`, a newline, `needs.json`, a newline and
          `capabilities.json` as installed: what the running agent reports as
          `manifest_sha256` (docs/protocol.md §11.7) once it has loaded this
          configuration. Defined when `services.fort-agent.enable` is set; the flake's
          `lib.fleetManifest` collects it from every host.
        '';
      };
    };

    lib = mkOption {
      type = types.attrsOf types.raw;
      default = {
        inherit (fortLib) ref key;
      };
      defaultText = literalExpression "{ ref = need: pointer: ...; key = name: form: ...; }";
      readOnly = true;
      description = ''
        Helpers for host modules, the same as the flake's `lib`:
        `config.fort.lib.ref "ssl-cert/outline" "/fingerprint"` is
        `{ "$fort_ref" = "ssl-cert/outline#/fingerprint"; }`, a request value the agent
        replaces with that need's payload at that JSON pointer (`""`: the whole payload).
        `config.fort.lib.key "tls" "csr"` is `{ "$fort_key" = "tls"; as = "csr"; }`, a
        request value the agent replaces with a CSR (`"public"`: the PEM public key,
        `"openssh"`: an OpenSSH public key line) made with the need's own key `tls`.
      '';
    };
  };
}
