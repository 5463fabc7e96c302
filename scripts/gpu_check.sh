#!/usr/bin/env bash
# CUDA check of the real executor (offline, repo only): calibrate this GPU, validate sim vs real
# on a generated checkpoint, run the correctness tests including the @pytest.mark.gpu ones, and an
# expert-parallel torchrun/NCCL run.
# Budget: under 8 minutes on one GPU. Usage: bash scripts/gpu_check.sh [workdir]
set -euo pipefail
cd "$(dirname "$0")/.."
WORK=${1:-runs/gpu_check}
mkdir -p "$WORK"
python -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print('cuda:', torch.cuda.get_device_name(0))"
echo "== checkpoint"
[ -f "$WORK/ckpt/config.json" ] || timeout 120 python -m real.make_checkpoint model=mixtral-tiny out="$WORK/ckpt" \
  hidden_size=512 expert_ffn_size=1536 n_heads=8 n_kv_heads=4 head_dim=64 vocab_size=1024
echo "== calibrate"
timeout 150 python -m experiments.calibrate hardware.name=gpu-check checkpoint="$WORK/ckpt" device=cuda \
  disk_dir="$WORK/calib" out="$WORK/gpu-check.yaml"
cp "$WORK/gpu-check.yaml" conf/hardware/gpu-check.yaml
echo "== validate"
timeout 200 python -m experiments.validate checkpoint="$WORK/ckpt" hardware=gpu-check \
  planners=sequential,flexgen,klotski,fiddler out="$WORK/validate"
cat "$WORK/validate/validate.md"
echo "== correctness tests (CPU and CUDA)"
timeout 200 python -m pytest tests/real/test_executor.py -q -m "gpu or not slow" -x
echo "== expert parallel: torchrun + NCCL (2 ranks on 2 GPUs; 1 rank on a 1-GPU machine)"
NGPU=$(python -c "import torch; print(torch.cuda.device_count())")
NPROC=$(( NGPU >= 2 ? 2 : 1 ))
[ "$NPROC" -eq 1 ] && echo "only 1 GPU: NCCL cannot run 2 ranks on one GPU, running G=1"
timeout 120 python -m torch.distributed.run --nproc_per_node="$NPROC" --master_port=29541 -m experiments.ep_run \
  checkpoint="$WORK/ckpt" planner=ep_static batch_size=4 prompt_len=16 gen_len=4 device=cuda out="$WORK/ep_run"
timeout 120 python -m pytest tests/real/test_distributed.py -q -m gpu -x
echo "gpu_check: done"
