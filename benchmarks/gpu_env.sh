# Sourced by the GPU scripts (gpu_check.sh, gpu_gym.sh) from the repository root: stop at once without CUDA, and put
# the wheels carried in .whl/ (benchmarks/prepare_gpu_wheels.sh) on the Python path.
gpu_env() {
    if ! python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
        echo "$1 needs a CUDA device; none is available here." >&2
        exit 2
    fi
    if [ -d .whl ]; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
        export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
    fi
}
