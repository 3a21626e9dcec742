#!/bin/sh
# Installs the test dependencies, builds, and runs every test suite, then prints
# one summary line ("N passed, N failed, N skipped").
#
#   tools/test.sh [meson test arguments...]    e.g. tools/test.sh --suite unit
set -eu

cd "$(dirname "$0")/.."
BUILD_DIR=${BUILD_DIR:-build}
tools/setup.sh --tests

status=0
meson test -C "$BUILD_DIR" --print-errorlogs "$@" || status=$?

/usr/bin/python3 - "$BUILD_DIR/meson-logs/testlog.json" <<'PY'
import json, sys
passed = failed = skipped = 0
for line in open(sys.argv[1]):
    r = json.loads(line).get("result")
    if r in ("OK", "EXPECTEDFAIL"):
        passed += 1
    elif r == "SKIP":
        skipped += 1
    else:
        failed += 1
print(f"{passed} passed, {failed} failed, {skipped} skipped")
PY
exit $status
