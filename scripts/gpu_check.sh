#!/usr/bin/env bash
# CUDA check of the real executor (offline, repo only): calibrate this GPU, validate sim vs real
# on a generated checkpoint, run the correctness tests including the @pytest.mark.gpu ones, and an
# expert-parallel torchrun/NCCL run.
# Budget: under 8 minutes on one GPU. Usage: bash scripts/gpu_check.sh [workdir]
#
# The GPU machine's image has torch, numpy, pandas, pyarrow, matplotlib, safetensors, pytest and
# hypothesis, but not simpy or hydra, and it cannot fetch. Carry them as wheels in .whl/ (ignored
# by git; name `.whl` in the device tool's `carry`), made here with:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux2014_x86_64 -d .whl simpy==4.1.2 hydra-core==1.3.8 omegaconf==2.3.1 \
#     hydra-joblib-launcher==1.2.0
#   python3 -m pip wheel --no-deps antlr4-python3-runtime==4.9.3 -w .whl     # sdist only upstream
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -d .whl ] && ! python3 -c "import simpy, hydra" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}   # the repo's packages, uninstalled
WORK=${1:-runs/gpu_check}
mkdir -p "$WORK"
python3 -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print('cuda:', torch.cuda.get_device_name(0))"
echo "== checkpoint"
[ -f "$WORK/ckpt/config.json" ] || timeout 120 python3 -m real.make_checkpoint model=mixtral-tiny out="$WORK/ckpt" \
  hidden_size=512 expert_ffn_size=1536 n_heads=8 n_kv_heads=4 head_dim=64 vocab_size=1024
echo "== calibrate"
timeout 150 python3 -m experiments.calibrate hardware.name=gpu-check checkpoint="$WORK/ckpt" device=cuda \
  disk_dir="$WORK/calib" in_run_s=10 out="$WORK/gpu-check.yaml"
cp "$WORK/gpu-check.yaml" conf/hardware/gpu-check.yaml
echo "== validate"
timeout 200 python3 -m experiments.validate checkpoint="$WORK/ckpt" hardware=gpu-check \
  planners=sequential,flexgen,klotski,fiddler out="$WORK/validate"
cat "$WORK/validate/validate.md"
echo "== correctness tests (CPU and CUDA)"
timeout 200 python3 -m pytest tests/real/test_executor.py -q -m "gpu or not slow" -x
echo "== expert parallel: torchrun + NCCL (2 ranks on 2 GPUs; 1 rank on a 1-GPU machine)"
NGPU=$(python3 -c "import torch; print(torch.cuda.device_count())")
NPROC=$(( NGPU >= 2 ? 2 : 1 ))
[ "$NPROC" -eq 1 ] && echo "only 1 GPU: NCCL cannot run 2 ranks on one GPU, running G=1"
timeout 120 python3 -m torch.distributed.run --nproc_per_node="$NPROC" --master_port=29541 -m experiments.ep_run \
  checkpoint="$WORK/ckpt" planner=ep_static batch_size=4 prompt_len=16 gen_len=4 device=cuda out="$WORK/ep_run"
timeout 120 python3 -m pytest tests/real/test_distributed.py -q -m gpu -x
echo "gpu_check: done"
