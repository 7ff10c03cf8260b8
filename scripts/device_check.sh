#!/usr/bin/env bash
# The prepared GPU check (scripts/device_check.py): one command for a session lent the device machine,
#   bash scripts/device_wheels.sh                                   # here, once: pydantic's wheels in .whl/
#   run(command="bash scripts/device_check.sh", carry=[".whl"], timeout_s=600)
# It writes $OUT/device_check.json (runs/device_check/ elsewhere). Arguments go to device_check.py
# (`--shape tiny` on a CPU). Stays under 10 minutes on one H200 (a 9-minute timeout guards it).
set -euo pipefail
cd "$(dirname "$0")/.."
python="${PYTHON:-python3}"
if ! "$python" -c "import pydantic" 2> /dev/null && compgen -G ".whl/*.whl" > /dev/null; then  # the device image
    "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 RLPIPE_PROGRESS=0
out="${OUT:-runs/device_check}"
timeout 540 "$python" scripts/device_check.py --out "$out/device_check.json" "$@"
