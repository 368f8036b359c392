#!/usr/bin/env bash
# Download into .whl/ the wheels qat4 needs that the GPU machines' image lacks (CPython 3.12,
# x86_64; the image has torch, Triton, transformers, numpy, tokenizers, safetensors, jinja2,
# httpx, uvloop and pytest), at the versions installed in this environment, so that the GPU runs
# what the tests here ran. tools/gpu_check.sh installs whatever .whl/ holds.
#   usage: tools/gpu_wheels.sh        (PYTHON=... picks the environment to read versions from)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
PACKAGES=(fastapi starlette pydantic pydantic-core annotated-types typing-inspection opentelemetry-api uvicorn
          httptools gguf xgrammar apache-tvm-ffi jsonschema jsonschema-specifications referencing rpds-py)
PLATFORMS=()
for tag in manylinux_2_17 manylinux2014 manylinux_2_24 manylinux_2_27 manylinux_2_28 manylinux_2_31 manylinux_2_34 \
           manylinux_2_35 manylinux1; do
    PLATFORMS+=(--platform "${tag}_x86_64")
done
mkdir -p .whl
for name in "${PACKAGES[@]}"; do
    version=$("$PYTHON" -m pip show "$name" 2>/dev/null | awk '/^Version:/ {print $2}')
    if [ -z "$version" ]; then
        echo "gpu_wheels: $name is not installed in $PYTHON's environment; install qat4 with its test extra first" >&2
        exit 1
    fi
    rm -f .whl/"$(echo "$name" | tr - _)"-[0-9]*.whl  # one version of each: two stop the install there
    "$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        "${PLATFORMS[@]}" -d .whl "$name==$version"
done
du -sh .whl
