# Request of `backup-repo` (fort-handler backup-repo): a borg repository at the provider's
# backup server, reached over SSH with a key this host's agent makes; only its public
# half travels. The payload is {repo, path, known_hosts, public_key, append_only, quota,
# retention_seconds, expires_at}.
{ lib, ... }:
let
  inherit (lib) mkOption types;
in
{
  options = {
    public_key = mkOption {
      type = types.str;
      example = lib.literalExpression ''config.fort.lib.key "ssh" "openssh"'';
      description = ''
        The OpenSSH public key that reaches the repository: the public half of a key
        this host makes (`fort.lib.key "ssh" "openssh"`), which the provider authorizes
        for `borg serve` on this repository alone. A key another repository has is
        refused.
      '';
    };
    quota = mkOption {
      type = types.nullOr (types.strMatching "[0-9]{1,20}((\\.[0-9]{1,3})?[KMGTP])?");
      default = null;
      example = "50G";
      description = ''
        The repository's storage quota (borg's sizes: `10M` to the provider's most,
        powers of 1000). `null`: the provider's. The quotas of one host's repositories
        together are bounded by the provider.
      '';
    };
    append_only = mkOption {
      type = types.bool;
      default = true;
      description = ''
        Whether the key may only add archives: what it deletes or prunes can be rolled
        back on the server, and the repository cannot be deleted. `false` (prune,
        delete, compact) only where the provider grants it (`backupRepo.fullAccess`).
      '';
    };
  };
}
