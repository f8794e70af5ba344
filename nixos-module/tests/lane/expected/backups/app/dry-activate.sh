#!/bin/bash
if [ "${NIXOS_ACTION-}" = dry-activate ]; then
  fortPlan() {
    if ! /nix/store/c600639b519356709763302967ca377b-systemd-257/bin/systemctl is-active --quiet fort-agent.service; then
      echo "fort: the agent is not running; no plan to show"
      return 0
    fi
    echo "fort: what loading the new configuration would change:"
    /nix/store/8f30011c367bb18e206b12e3c42a2c71-fort-0.1.0/bin/fort-agent plan --config /etc/fort/agent.toml \
      --new-config /nix/store/1f84e50c18aa4e62279fda1f25ed4817-fort-agent-checked.toml \
      --hosts /nix/store/9287ba1df5266c72eae9d9b3b1dfd002-fort-hosts.json \
      --needs /nix/store/ec5d967cf22e75855ade802b9307e8b7-fort-needs.json \
      --capabilities /nix/store/0854301e1a34259490335cbc59ce99e5-fort-capabilities.json ||
      echo "fort: fort-agent plan failed (exit $?); dry-activate goes on"
  }
  fortPlan || true
fi
