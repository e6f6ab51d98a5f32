#!/usr/bin/env bash
# Wheels a CUDA machine without network needs to run axon's server and tests, into .whl/, and
# SmolLM2's tokenizer files into .gpu_assets/ (both git-ignored; they travel with the tree).
#
# The target machine (Python 3.12, torch + CUDA, transformers, tokenizers, httpx, anyio,
# numpy, ... preinstalled) lacks these. Versions are the ones this repository is tested with,
# except where that version's dependencies would not resolve there: openai 3.x needs httpx2 (the
# machine has httpx), so the last httpx-based release is carried. torch and transformers are
# never carried: the machine's torch/CUDA stack stays, and its transformers (>= 4.57, axon's
# floor) is the oracle there.
#
# Install there:  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
#                   --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
set -euo pipefail
cd "$(dirname "$0")/../.."

BINARY=(  # compiled for CPython 3.12 on x86_64 Linux
    msgspec==0.23.0
    pyzmq==27.3.0
    pydantic-core==2.46.4
    rpds-py==0.30.0
    jiter==0.19.0
    xgrammar==0.2.9
    apache-tvm-ffi==0.1.15.post2
)
PURE=(
    fastapi==0.165.0
    opentelemetry-api==1.45.2
    starlette==1.10.0
    uvicorn==0.55.0
    pydantic==2.13.4
    annotated-types==0.7.0
    typing-inspection==0.4.2
    typing-extensions==4.16.0
    gguf==0.19.0
    openai==2.54.0
    distro==1.9.0
    sniffio==1.3.1
    jsonschema==4.26.0
    jsonschema-specifications==2025.9.1
    referencing==0.37.0
)

rm -rf .whl && mkdir -p .whl
common=(python3 -m pip download -q --no-deps --only-binary=:all: -d .whl)
"${common[@]}" --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 "${BINARY[@]}"
"${common[@]}" --python-version 3.12 "${PURE[@]}"

# Tokenizer files of the bundled SmolLM2 (its 98 MB GGUF stays behind): tiny random models are
# built with them on the target, as tests/conftest.py does with the whole folder here.
model_dir=$(python3 -c "from axon.engine.arg_utils import create_engine_config; \
print(create_engine_config().model_config.model_path)")
rm -rf .gpu_assets && mkdir -p .gpu_assets/smollm2-tokenizer
for f in tokenizer.json tokenizer_config.json special_tokens_map.json chat_template.jinja \
         generation_config.json config.json vocab.json merges.txt; do
    if [[ -f "$model_dir/$f" ]]; then cp "$model_dir/$f" .gpu_assets/smollm2-tokenizer/; fi
done

ls -1 .whl
du -sh .whl .gpu_assets
