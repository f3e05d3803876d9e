#!/usr/bin/env bash
# GPU benchmarks, in order: every Triton kernel against its PyTorch reference on the GPU
# (correctness.py), decode attention bandwidth against a memory copy (kernels.py), the fused
# elementwise kernels against the model's PyTorch ops (fused.py), the fused MoE against its
# PyTorch path (moe.py), sliding-window against full attention (sliding_window.py), then the
# engine benchmark (engine.py) when present. Each script takes the same arguments (--smoke: tiny
# shapes, on the CPU through the Triton interpreter when there is no GPU), prints markdown and
# writes it under $OUT when set. Needs python3 with torch and triton only.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD:$PWD/libs${PYTHONPATH:+:$PYTHONPATH}"
PYTHON="${PYTHON:-python3}"

status=0
for script in correctness kernels fused moe sliding_window engine; do
    [[ -f "bench/gpu/$script.py" ]] || continue
    echo "== bench/gpu/$script.py $*" >&2
    "$PYTHON" -m "bench.gpu.$script" "$@" || status=1
done
# Tensor parallelism over every GPU of the machine, when it has several (the lent ones have one).
gpus=$("$PYTHON" -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
if (( gpus > 1 )); then
    echo "== bench/gpu/tensor_parallel.py --tensor-parallel $gpus $*" >&2
    "$PYTHON" -m bench.gpu.tensor_parallel --tensor-parallel "$gpus" "$@" || status=1
fi
exit "$status"
