#!/usr/bin/env bash
# make test: every test but the soak runs' full counts, in two parts.
#  1. On TEST_WORKERS pytest-xdist workers (default 2), a test file at a time per worker (`--dist loadfile`:
#     a file's module fixtures -- a trained job, a started server -- are built once). Most of a job test's
#     time is waiting (kill graces, timeouts, a rank's start), so a neighbour's work fills it: the suite
#     takes ~22 min on 2 cores instead of ~34 serially. The tests are written for neighbours: free ports,
#     their own AZULITE_HOME and temporary folders, processes found by their own tags, never system-wide.
#  2. The tests marked `serial` (they measure the machine itself), alone, after the rest.
# Arguments go to both parts (a path or -k narrows both; a part left with no test is not a failure).
set -uo pipefail
cd "$(dirname "$0")/.."
py=${VENV:-.venv}/bin/python
workers=${TEST_WORKERS:-2}

"$py" -m pytest -n "$workers" --dist loadfile -m "not soak and not serial" "$@"
first=$?
"$py" -m pytest -m "serial and not soak" "$@"
second=$?
# 5: no test collected in that part
if [[ $first == 5 && $second == 5 ]]; then
  echo "make test: no test matched" >&2
  exit 5
fi
[[ $first == 5 ]] && first=0
[[ $second == 5 ]] && second=0
if ((first != 0)); then exit "$first"; fi
exit "$second"
