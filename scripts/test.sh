#!/usr/bin/env bash
# Install everything the tests need, then run them; arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --dev
if [ ! -x /usr/bin/chromium ]; then  # the browser test drives Debian's Chromium: no browser, no test run
  if [ "$(id -u)" = 0 ]; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) || true
  fi
  if [ ! -x /usr/bin/chromium ]; then
    echo "error: the browser test needs Debian's Chromium at /usr/bin/chromium: run 'sudo apt-get install chromium'" >&2
    echo "       (or, to run the other tests only: .venv/bin/python -m pytest --deselect tests/test_browser.py)" >&2
    exit 1
  fi
fi
exec .venv/bin/python -m pytest "$@"
