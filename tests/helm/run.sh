#!/usr/bin/env bash
# tests/helm/run.sh - lint, render and check the Helm chart helm/nvmeof-gateway offline.
#
# usage: tests/helm/run.sh [pytest args...]
# Makes (once) a Python venv with the pinned test tools, then runs pytest on tests/helm/.
# Needs python3 with venv and network access to PyPI the first time only.
#
# Env: HELM_TEST_VENV (default ~/.cache/nvmeof-helm-venv), PYTHON (default python3),
#      HELM_TEST_GATEWAY_BIN (a built nvmeof-gateway: every rendered gateway TOML is also given
#      to its --check; unset: those tests are skipped, this script compiles nothing).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
VENV=${HELM_TEST_VENV:-$HOME/.cache/nvmeof-helm-venv}
PYTHON=${PYTHON:-python3}
# pinned: helm-python-sdk bundles Helm v4's Go library (lint, offline render);
# kubernetes-validate carries the Kubernetes OpenAPI schemas per minor version.
REQS=(helm-python-sdk==0.2.2 kubernetes-validate==1.37.0 pytest==8.3.4 PyYAML==6.0.2)
STAMP=$VENV/.nvmeof-helm-reqs

if [ ! -x "$VENV/bin/python" ] || [ "$(cat "$STAMP" 2>/dev/null)" != "${REQS[*]}" ]; then
  echo "+ $PYTHON -m venv $VENV && pip install ${REQS[*]}"
  "$PYTHON" -m venv "$VENV"
  "$VENV/bin/pip" install --quiet --disable-pip-version-check "${REQS[@]}"
  echo "${REQS[*]}" >"$STAMP"
fi
"$VENV/bin/python" -c 'import helm_python, kubernetes_validate, yaml, pytest' \
  || { echo "the venv $VENV lacks a test tool: remove it and rerun"; exit 1; }

cd "$ROOT"
echo "+ $VENV/bin/python -m pytest tests/helm $*"
exec "$VENV/bin/python" -m pytest -ra tests/helm "$@"
