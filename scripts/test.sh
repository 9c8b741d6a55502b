#!/usr/bin/env bash
# Install everything the tests need, then run them; arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --dev
if [ ! -x /usr/bin/chromium ]; then  # the browser test drives Debian's Chromium
  if [ "$(id -u)" = 0 ]; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
  else
    echo "note: /usr/bin/chromium is missing; run 'sudo apt-get install chromium' for the browser test" >&2
  fi
fi
exec .venv/bin/python -m pytest "$@"
