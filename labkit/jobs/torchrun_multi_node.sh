#!/usr/bin/env bash
# Several nodes: run THIS SAME command on every node (by hand, pdsh, or a scheduler).
# torchrun's c10d rendezvous on HEAD:PORT gathers NNODES x NPROC processes and numbers them:
#   RANK        0 .. WORLD_SIZE-1, unique over all nodes (node_rank * NPROC + LOCAL_RANK)
#   LOCAL_RANK  0 .. NPROC-1 on each node: which GPU this process uses
#   WORLD_SIZE  NNODES x NPROC
#   MASTER_ADDR / MASTER_PORT  where the process group's store lives (rank 0's node)
# Example, 2 nodes x 4 GPUs, hybrid dp=2 x pp=4. make_mesh's grid arange(8).view(dp, pp) puts
# pp innermost: consecutive ranks, i.e. one node's GPUs, form one pipeline, so activations
# stay inside a node and each stage's gradient all-reduce (once per step) crosses nodes.
# (Notebook 10 discusses which axis should cross the slow links.)
#   HEAD=node01 NNODES=2 NPROC=4 bash labkit/jobs/torchrun_multi_node.sh --strategy hybrid --dp 2 --pp 4
# PYTHON=.venv/bin/python to use the lab's environment without activating it.
set -euo pipefail
cd "$(dirname "$0")/../.."
: "${HEAD:?set HEAD to the host name of the first node}"
NNODES=${NNODES:-2}
NPROC=${NPROC:-4}
PORT=${PORT:-29500}
JOB_ID=${JOB_ID:-labkit-$(date +%Y%m%d)}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# export NCCL_SOCKET_IFNAME=ib0   # pick the fast network interface if NCCL guesses wrong

"${PYTHON:-python}" -m torch.distributed.run --nnodes "$NNODES" --nproc-per-node "$NPROC" \
    --rdzv-backend c10d --rdzv-endpoint "$HEAD:$PORT" --rdzv-id "$JOB_ID" \
    -m labkit.apps.train --model "${MODEL:-seed}" --steps "${STEPS:-200}" "$@"
