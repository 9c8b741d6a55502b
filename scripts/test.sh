#!/usr/bin/env bash
# Install everything the tests need, then run them; arguments go to pytest.
# --quick (first): all but the tests marked slow, for a newcomer's loop; CI runs them all.
set -euo pipefail
cd "$(dirname "$0")/.."
quick=""
if [ "${1:-}" = "--quick" ]; then
  quick=" and not slow"
  shift
fi
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
.venv/bin/python -m pip install --quiet -r requirements-ray.txt  # the optional Ray backend: CI tests it
status=0
# Test files run side by side, one per core (a file's tests and its server stay in one process,
# --dist loadfile), all but those that measure; CPU_CHAT_TEST_PROCESSES=1 runs them one after another.
processes="${CPU_CHAT_TEST_PROCESSES:-$(nproc)}"
# What every test server shares (the converted model, kernel and engine verdicts, weights, graph)
# is measured first, alone: measured beside another file's server it would be in doubt, never
# cached, and measured again by every server (tests/warm_cache.py).
.venv/bin/python -m tests.warm_cache
# Exit code 5 is "no test selected" (arguments that pick tests of one phase only).
run_pytest() { .venv/bin/python -m pytest "$@" || { code=$?; [ "$code" = 5 ] || status=$code; }; }
# Side by side, OpenMP's idle threads sleep instead of spinning (libgomp's default): a process's
# spinning threads held the cores its neighbour needed, and two such files took 1.4x as long
# (docs/testing.md). The app's workers still set their own policy where none is given; the
# measuring tests run alone below, with the defaults the app runs on.
OMP_WAIT_POLICY=PASSIVE run_pytest -n "$processes" --dist loadfile -m "not alone$quick" --ignore=tests/test_ray.py "$@"
run_pytest -m "alone$quick" --ignore=tests/test_ray.py "$@"  # one after another: they measure (tests/conftest.py)
# Ray also talks to the machine's own interface address, and tests may reach only 127.0.0.0/8:
# the Ray tests run in a network namespace that has loopback alone (unshare -n needs root).
if [ "$(id -u)" != 0 ]; then
  echo "error: the Ray tests need a loopback-only network namespace: run this script as root (unshare -n)" >&2
  exit 1
fi
CPU_CHAT_RAY_TESTS=required unshare -n sh -c 'ip link set lo up && exec .venv/bin/python -m pytest tests/test_ray.py' \
  || status=$?
exit $status
