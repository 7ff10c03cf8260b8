#!/usr/bin/env bash
# The prepared GPU check: one command for a session lent the device machine,
#   bash scripts/device_wheels.sh                                   # here, once: pydantic's wheels in .whl/
#   run(command="bash scripts/device_check.sh", carry=[".whl"], timeout_s=600)
# 1. scripts/device_check.py: the update (DDP, FSDP2), logprob agreement, HF rollout and the model store's
#    offload on a model of Qwen2.5-0.5B's shape; writes $OUT/device_check.json. Arguments go to it
#    (`--shape tiny` on a CPU).
# 2. scripts/device_pipeline.py: the pipeline's stages on the GPU, cold and warm, with runtime.deterministic
#    on and off, and whether they write the same bytes; writes $OUT/device_pipeline.json. Its arguments come
#    from DEVICE_PIPELINE_ARGS; DEVICE_PIPELINE=off skips it.
# Each part has its own time limit (4 and 5.5 minutes), so the whole stays under 10 minutes, and the second
# runs even if the first fails. (runs/device_check/ instead of $OUT elsewhere.)
set -euo pipefail
cd "$(dirname "$0")/.."
python="${PYTHON:-python3}"
if ! "$python" -c "import pydantic" 2> /dev/null && compgen -G ".whl/*.whl" > /dev/null; then  # the device image
    "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 RLPIPE_PROGRESS=0
out="${OUT:-runs/device_check}"
status=0
timeout 240 "$python" scripts/device_check.py --out "$out/device_check.json" "$@" || status=$?
if [ "${DEVICE_PIPELINE:-on}" != off ]; then
    # ppo, so that the critic runs on the GPU too, in bf16 as a GPU run would be; the init stage's warm
    # start runs on the CPU, where the device machine's cores make it quick
    # shellcheck disable=SC2086  # DEVICE_PIPELINE_ARGS is a list of arguments
    timeout 330 "$python" scripts/device_pipeline.py --out "$out/device_pipeline.json" \
        ${DEVICE_PIPELINE_ARGS:---set runtime.torch_threads=8 --set algorithm.preset=ppo --set update.bf16=true --set rollout.bf16=true} \
        || status=$((status ? status : $?))
fi
exit "$status"
