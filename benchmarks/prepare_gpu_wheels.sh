#!/usr/bin/env bash
# Prepare what travels with a GPU check, benchmarks/gpu_check.sh or gpu_gym.sh (run here, with the registries).
#
# The GPU machine this project can borrow has torch, triton, transformers, peft, accelerate, pyarrow and pandas,
# but not TRL, datasets (and two of datasets' own needs), nor this package; it reaches no registry. All of them are
# pure-Python wheels, a few MB in all (the device's limit is 64 MiB per command).
#
#     bash benchmarks/prepare_gpu_wheels.sh        # writes .whl/ (git-ignored)
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .whl && mkdir -p .whl
python -m pip wheel --quiet --no-deps --wheel-dir .whl .
python -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform any -d .whl \
    trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 liger-kernel==0.8.5
# The embedded model's tokenizer (2 MB) for the step-overhead check on a random model of SmolLM2's shape.
python -c "from transformers import AutoTokenizer; from trl_mrtpo.scripts.embedded import embedded_model_path; \
AutoTokenizer.from_pretrained(embedded_model_path()).save_pretrained('.whl/smollm2-tokenizer')"
du -sh .whl
ls .whl
