#!/bin/bash
if [ "${NIXOS_ACTION-}" = dry-activate ]; then
  fortPlan() {
    if ! /nix/store/c600639b519356709763302967ca377b-systemd-257/bin/systemctl is-active --quiet fort-agent.service; then
      echo "fort: the agent is not running; no plan to show"
      return 0
    fi
    echo "fort: what loading the new configuration would change:"
    /nix/store/8f30011c367bb18e206b12e3c42a2c71-fort-0.1.0/bin/fort-agent plan --config /etc/fort/agent.toml \
      --new-config /nix/store/930f0175a9166ee84b9a0a0f72a57abc-fort-agent-checked.toml \
      --hosts /nix/store/9287ba1df5266c72eae9d9b3b1dfd002-fort-hosts.json \
      --needs /nix/store/bd8ff07b55d4ced48ea021b8b5bca122-fort-needs.json \
      --capabilities /nix/store/71837f112d71d995326281753742a734-fort-capabilities.json ||
      echo "fort: fort-agent plan failed (exit $?); dry-activate goes on"
  }
  fortPlan || true
fi
