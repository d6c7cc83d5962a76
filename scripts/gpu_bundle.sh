#!/bin/sh
# What a GPU machine without network access needs beside the checkout (docs/GPU.md), written to .gpu/ (git-ignored):
# - .gpu/wheels: the packages of pyproject.toml and its test extra that the GPU image lacks, for its Python 3.12,
#   pinned to the versions this checkout was tested with;
# - .gpu/smollm2: SmolLM2-135M-Instruct's config and tokenizer, without weights (the model's wheel is 93 MB, over
#   what a call may carry): scripts/gpu_check.py builds random weights of its shape there.
# Run here, in the repo root, with pip reaching an index and the model converted once (`make model`).
set -e
mkdir -p .gpu/wheels .gpu/smollm2
MODEL=$(.venv/bin/python -c "from gpu.loading.convert import default_model_dir; print(default_model_dir())")
cp "$MODEL"/config.json "$MODEL"/generation_config.json "$MODEL"/tokenizer.json "$MODEL"/tokenizer_config.json \
  "$MODEL"/chat_template.jinja .gpu/smollm2/
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any -d .gpu/wheels \
  msgspec==0.22.0 pyzmq==27.3.0 setproctitle==1.3.8 gguf==0.19.0 \
  xgrammar==0.2.8 apache-tvm-ffi==0.1.15.post2 \
  pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 \
  openai==3.57.0 httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5 jiter==0.19.0 sniffio==1.3.1 \
  pytest-asyncio==1.5.0 jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 \
  rpds-py==2026.9.1 peft==0.21.2 accelerate==1.16.0 psutil==7.2.2 pyyaml==6.0.4
du -sh .gpu
