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
#   HEAD=node01 NNODES=2 NPROC=4 JOB_ID=run42 bash labkit/jobs/torchrun_multi_node.sh --strategy hybrid --dp 2 --pp 4
# PYTHON=.venv/bin/python to use the lab's environment without activating it.
#
# JOB_ID: the rendezvous id; every node must pass the SAME one (nodes with different ids never
#   meet). Under Slurm or PBS the job's id is used; by hand, set it (a date-based default would
#   split nodes started either side of midnight).
# MODEL / STEPS: the defaults (seed model, 200 steps) are sized for GPU nodes. On CPU nodes
#   (gloo) use MODEL=tiny STEPS=20 NPROC=2 (or the number of cores per node), as the tests do.
# TORCHRUN_ARGS: extra torchrun options, e.g. TORCHRUN_ARGS="--local-addr 10.0.0.1 --max-restarts 0"
#   (--local-addr: the address other nodes reach this one at, when its host name does not resolve
#   to it; the rendezvous then hands out addresses instead of host names).
# Network interface: NCCL (GPUs) and gloo (CPUs) each guess which interface to use from the host
#   name; when that resolves to loopback (127.0.x.1 in /etc/hosts) the other nodes cannot connect.
#   Name it: the interface that reaches HEAD is the "dev" in  ip route get <HEAD's address>
#   (or pick from  ip -brief addr), then
#     export GLOO_SOCKET_IFNAME=eth0    # gloo: CPU ranks, and every labkit CPU run
#     export NCCL_SOCKET_IFNAME=ib0     # nccl: its bootstrap / socket transport
set -euo pipefail
cd "$(dirname "$0")/../.."
: "${HEAD:?set HEAD to the host name or address of the first node}"
NNODES=${NNODES:-2}
NPROC=${NPROC:-4}
PORT=${PORT:-29500}
JOB_ID=${JOB_ID:-${SLURM_JOB_ID:-${PBS_JOBID:-}}}
: "${JOB_ID:?set JOB_ID to the same value on every node (Slurm and PBS set it for you)}"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
read -r -a EXTRA <<< "${TORCHRUN_ARGS:-}"
# torchrun hosts the rendezvous store on the node whose host name matches HEAD; given HEAD as an
# address, it would not recognise itself (and every node waits for a store nobody serves).
if hostname -I 2>/dev/null | tr ' ' '\n' | grep -qxF "$HEAD"; then
    EXTRA+=(--rdzv-conf is_host=1)
fi

"${PYTHON:-python}" -m torch.distributed.run --nnodes "$NNODES" --nproc-per-node "$NPROC" \
    --rdzv-backend c10d --rdzv-endpoint "$HEAD:$PORT" --rdzv-id "$JOB_ID" "${EXTRA[@]}" \
    -m labkit.apps.train --model "${MODEL:-seed}" --steps "${STEPS:-200}" "$@"
