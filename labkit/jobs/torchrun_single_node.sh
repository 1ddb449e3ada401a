#!/usr/bin/env bash
# One node, N processes: torchrun starts them and sets RANK, LOCAL_RANK, WORLD_SIZE,
# MASTER_ADDR and MASTER_PORT for each; labkit.launch reads them and runs each process as
# its rank (nccl when every rank has a GPU, gloo on CPU).
#   bash labkit/jobs/torchrun_single_node.sh                 # hybrid 2 x 2 on 4 processes
#   NPROC=2 STRATEGY=dp bash labkit/jobs/torchrun_single_node.sh
# PYTHON=.venv/bin/python to use the lab's environment without activating it.
set -euo pipefail
cd "$(dirname "$0")/../.."
NPROC=${NPROC:-4}
STRATEGY=${STRATEGY:-hybrid}
MODEL=${MODEL:-tiny}
STEPS=${STEPS:-20}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}   # torchrun's default too: one thread per rank

# --standalone: a private rendezvous on this machine, on a free port (no MASTER_* to set)
"${PYTHON:-python}" -m torch.distributed.run --standalone --nproc-per-node "$NPROC" \
    -m labkit.apps.train --strategy "$STRATEGY" --model "$MODEL" --steps "$STEPS" "$@"
