#!/usr/bin/env bash
# Fetch, here, the wheels that scripts/device_check.sh installs on the device machine: its image has torch,
# transformers, pyarrow, PyYAML and tqdm, but not pydantic (rlpipe's config). Python 3.12, x86-64, the
# versions this checkout's venv resolved (one version of each: two would stop the install there).
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> "$(git rev-parse --git-path info/exclude)"
PY="${PY:-.venv/bin/python}"
specs=$("$PY" -c "import importlib.metadata as m; print(' '.join(f'{n}=={m.version(n)}' for n in
    ('pydantic', 'pydantic_core', 'annotated_types', 'typing_inspection', 'typing_extensions')))")
rm -rf .whl && mkdir .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl $specs
ls .whl
