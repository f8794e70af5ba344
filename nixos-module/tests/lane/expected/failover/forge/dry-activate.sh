#!/bin/bash
if [ "${NIXOS_ACTION-}" = dry-activate ]; then
  fortPlan() {
    if ! /nix/store/c600639b519356709763302967ca377b-systemd-257/bin/systemctl is-active --quiet fort-agent.service; then
      echo "fort: the agent is not running; no plan to show"
      return 0
    fi
    echo "fort: what loading the new configuration would change:"
    /nix/store/8f30011c367bb18e206b12e3c42a2c71-fort-0.1.0/bin/fort-agent plan --config /etc/fort/agent.toml \
      --new-config /nix/store/aae248652d3e9e7b201f85491e154d2f-fort-agent-checked.toml \
      --hosts /nix/store/2cd23e612036eb23f748e0fff6f47365-fort-hosts.json \
      --needs /nix/store/bd8ff07b55d4ced48ea021b8b5bca122-fort-needs.json \
      --capabilities /nix/store/7ea598f9c9bbed46b56c70fa002582c8-fort-capabilities.json ||
      echo "fort: fort-agent plan failed (exit $?); dry-activate goes on"
  }
  fortPlan || true
fi
