#!/usr/bin/env bash
# GPU checks and measurements in as few calls as possible (a lent GPU machine is billed by the
# second and starts bare). Runs from the repository root with the machine's own torch; meshloom
# is used from src/ without installing. Results go to $OUT (default benchmarks/results/gpu_check).
#
#   bash benchmarks/gpu_check.sh train      # env, meshloom train / generate on CUDA
#   bash benchmarks/gpu_check.sh mfu MODELS [gpu_mfu.py args]   # the MFU benchmark
#   bash benchmarks/gpu_check.sh lib NAME [--set ...]   # meshloom train on the 1B Llama
#   bash benchmarks/gpu_check.sh tests      # tests/test_gpu.py
#   bash benchmarks/gpu_check.sh kernels [bench args]   # kernel table (docs/kernel-tables.md);
#                                   # on an H100/H200 its GEMMs in fp8 too (--no-fp8: bf16 only)
#   bash benchmarks/gpu_check.sh fp8 [bench args]       # the Float8 rows' GEMMs, bf16 and fp8
#   bash benchmarks/gpu_check.sh power [--seconds S]    # GEMM rate against GEMM duty cycle
#   bash benchmarks/gpu_check.sh probe [probe args]     # one MPT-30B FSDP1 rank, 4096/8192
set -uo pipefail
OUT=${OUT:-benchmarks/results/gpu_check}
mkdir -p "$OUT"
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
PY=${PY:-python3}

phase=${1:-train}
shift || true

if [ "$phase" = train ]; then
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm \
    --format=csv | tee "$OUT/env.txt"
  "$PY" -c "import torch, sys; print(sys.version.split()[0], torch.__version__,
torch.cuda.get_device_name(), torch.distributed.is_nccl_available())" | tee -a "$OUT/env.txt"
  common=(--set model.preset=small --set data.seq_len=1024 --set train.global_batch=16
          --set train.steps=30 --set train.eval_every=0 --set train.log_every=10
          --set run.device=cuda)
  echo "== meshloom train, 1 rank through torchrun (NCCL), bf16, compile, selective AC"
  timeout 300 "$PY" -m meshloom train configs/tiny.toml --nproc 1 "${common[@]}" \
    --set train.dtype=bf16 --set train.compile=true \
    --set train.activation_checkpointing=selective --set run.dir=/tmp/gpu_runs/bf16 \
    --set train.sample_tokens=40 2>&1 | tail -n 20
  cp /tmp/gpu_runs/bf16/summary.json "$OUT/train_bf16.json" 2>/dev/null

  echo "== meshloom train, in process, fp16 with loss scaling, full AC"
  timeout 200 "$PY" -m meshloom train configs/tiny.toml "${common[@]}" --set train.dtype=fp16 \
    --set train.activation_checkpointing=full \
    --set run.dir=/tmp/gpu_runs/fp16 2>&1 | tail -n 8
  cp /tmp/gpu_runs/fp16/summary.json "$OUT/train_fp16.json" 2>/dev/null

  echo "== meshloom train, DataParallel mode on the one GPU"
  timeout 150 "$PY" -m meshloom train configs/tiny.toml "${common[@]}" --set train.steps=10 \
    --set parallel.mode=dp --set parallel.dp_devices=1 --set run.dir=/tmp/gpu_runs/dp \
    2>&1 | tail -n 5

  echo "== meshloom generate on CUDA from the bf16 run's checkpoint"
  timeout 120 "$PY" -m meshloom generate --checkpoint /tmp/gpu_runs/bf16 --prompt "def " \
    --max-new-tokens 64 --temperature 0 2>&1 | tail -n 6
  exit 0
fi

if [ "$phase" = mfu ]; then
  models=${1:-llama1b}
  shift || true
  timeout 560 "$PY" benchmarks/gpu_mfu.py --models "$models" --out "$OUT/mfu_${models//,/_}.json" \
    "$@" 2>&1 | grep -v "^W1\|UserWarning" | tail -n 40
  exit 0
fi
if [ "$phase" = lib ]; then
  # The library's own training loop on the 1B Llama (what gpu_mfu.py measures outside it): DDP
  # over NCCL with one rank, grad clipping, the per-step non-finite agreement, metrics.
  name=${1:-lib}
  shift || true
  rm -rf "/tmp/gpu_runs/$name"
  timeout 500 "$PY" -m meshloom train configs/tiny.toml --nproc 1 \
    --set model.preset=llama3-1b --set model.vocab_size=128256 --set data.seq_len=2048 \
    --set train.global_batch=8 --set train.steps=14 --set train.eval_every=0 \
    --set train.eval_sequences=8 --set train.log_every=1 --set train.dtype=bf16 \
    --set run.device=cuda --set run.dir="/tmp/gpu_runs/$name" "$@" 2>&1 \
    | grep -v "^W1\|UserWarning\|warnings.warn" | tail -n 6
  cp "/tmp/gpu_runs/$name/metrics.jsonl" "$OUT/$name.jsonl"
  "$PY" - "/tmp/gpu_runs/$name/metrics.jsonl" <<'EOF2'
import json, statistics, sys
rows = [json.loads(line) for line in open(sys.argv[1])][4:]  # compile and warm-up steps out
med = lambda k: statistics.median(r[k] or 0.0 for r in rows)
print(f"{len(rows)} steps after 4: median step {med('step_time_s') * 1e3:.1f} ms, "
      f"{med('tokens_per_s'):,.0f} tok/s, MFU {100 * med('mfu'):.1f}%, peak allocated "
      f"{max(r['peak_mem_bytes'] or 0 for r in rows) / 2**30:.1f} GiB, reserved "
      f"{max(r['peak_mem_reserved_bytes'] or 0 for r in rows) / 2**30:.1f} GiB")
EOF2
  exit 0
fi
if [ "$phase" = tests ]; then  # the tests that need a GPU (skipped on CI's CPU machine)
  timeout 560 "$PY" -m pytest -q -p no:cacheprovider tests/test_gpu.py "$@" 2>&1 | tail -n 30
  exit 0
fi
if [ "$phase" = kernels ]; then  # the planner's kernel table, written into $OUT to come back
  timeout 560 "$PY" -m meshloom bench kernels --out "$OUT/kernels.json" "$@" 2>&1 | tail -n 60
  exit 0
fi
if [ "$phase" = fp8 ]; then  # every GEMM the Float8 validation rows price in fp8, both ways (~1 min, estimated)
  # validation_shapes.py lists them (the narrow per-rank shapes under tp 8 among them, whose
  # fp8/bf16 ratio the planner reads off an 8192-square benchmark); the tiny preset and one
  # attention point keep the rest of the bench to seconds.
  "$PY" benchmarks/validation_shapes.py --gpu h100-96gb,h200 --fp8 > "$OUT/fp8_shapes.json"
  timeout 500 "$PY" -m meshloom bench kernels --model tiny --micro-batch 1 --tp 1 \
    --shapes "$OUT/fp8_shapes.json" --head-dims 64 --attention-seqs 512 --fp8 \
    --out "$OUT/fp8_kernels.json" "$@" 2>&1 | tail -n 20
  exit 0
fi
if [ "$phase" = power ]; then  # the power limit's cost to GEMMs by duty cycle (~2 min)
  nvidia-smi --query-gpu=name,clocks.max.sm,power.limit,power.max_limit --format=csv \
    | tee "$OUT/power_env.txt"
  timeout 400 "$PY" benchmarks/power_duty_cycle.py --out "$OUT/power_duty_cycle.json" "$@" \
    2>&1 | tail -n 20
  exit 0
fi
if [ "$phase" = probe ]; then  # one FSDP1 rank of MPT-30B near 80 GB, with room, expandable (~4 min)
  nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/probe_env.txt"
  timeout 500 "$PY" benchmarks/fsdp1_rank_probe.py --out "$OUT/fsdp1_rank_probe.json" "$@" \
    2>&1 | tail -n 20
  exit 0
fi
echo "usage: gpu_check.sh train | mfu MODELS [args] | lib NAME [--set ...] | tests | kernels | fp8 | power | probe" >&2
exit 2
