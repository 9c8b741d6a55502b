#!/usr/bin/env bash
# Install (first run only takes long) and start the app; flags go to launch.py.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python launch.py "$@"
