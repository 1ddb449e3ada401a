"""scheduled_world(): each launcher's variables give the right rank, world size and local rank.

The local rank picks the GPU (``cuda:<local_rank>``); a variable that is not read puts every
rank of a node on cuda:0. Each case sets only what that launcher sets.
"""
import pytest

from labkit.launching.cluster import SCHEDULER_VARS, scheduled_world

ALL_VARS = {v for rank, size, local, local_size in SCHEDULER_VARS.values()
            for v in (rank, size, *local, *local_size)} | {"SLURM_STEP_ID", "LABKIT_LAUNCH"}

CASES = {  # launcher: (its environment, expected scheduler, expected local rank, local world size)
    "torchrun": (dict(RANK="5", WORLD_SIZE="8", LOCAL_RANK="1", LOCAL_WORLD_SIZE="4"), "torchrun", 1, 4),
    "openmpi": (dict(OMPI_COMM_WORLD_RANK="5", OMPI_COMM_WORLD_SIZE="8", OMPI_COMM_WORLD_LOCAL_RANK="1",
                     OMPI_COMM_WORLD_LOCAL_SIZE="4"), "openmpi", 1, 4),
    "mpich-hydra": (dict(PMI_RANK="5", PMI_SIZE="8", MPI_LOCALRANKID="1", MPI_LOCALNRANKS="4"),
                    "mpich/pbs", 1, 4),
    "cray-pals": (dict(PMI_RANK="5", PMI_SIZE="8", PALS_RANKID="5", PALS_LOCAL_RANKID="1",
                       PALS_LOCAL_SIZE="4"), "mpich/pbs", 1, 4),
    "cray-pmi": (dict(PMI_RANK="5", PMI_SIZE="8", PMI_LOCAL_RANK="1", PMI_LOCAL_SIZE="4"),
                 "mpich/pbs", 1, 4),
    "slurm": (dict(SLURM_PROCID="5", SLURM_NTASKS="8", SLURM_LOCALID="1", SLURM_NTASKS_PER_NODE="4(x2)",
                   SLURM_STEP_ID="0"), "slurm", 1, 4),
}


@pytest.fixture
def clean_env(monkeypatch):
    for var in ALL_VARS | {"PALS_RANKID"}:
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


@pytest.mark.parametrize("launcher", CASES)
def test_scheduled_world_reads_each_launchers_local_rank(clean_env, launcher):
    env, scheduler, local_rank, local_size = CASES[launcher]
    for var, value in env.items():
        clean_env.setenv(var, value)
    assert scheduled_world() == {"scheduler": scheduler, "rank": 5, "world_size": 8,
                                 "local_rank": local_rank, "local_world_size": local_size}


def test_scheduled_world_local_rank_order_mpich_first(clean_env):
    """Where several are set (PALS also exporting an inherited MPI_LOCALRANKID), the stated order wins."""
    for var, value in dict(PMI_RANK="5", PMI_SIZE="8", MPI_LOCALRANKID="2", PALS_LOCAL_RANKID="1",
                           PMI_LOCAL_RANK="3").items():
        clean_env.setenv(var, value)
    assert scheduled_world()["local_rank"] == 2
    clean_env.delenv("MPI_LOCALRANKID")
    assert scheduled_world()["local_rank"] == 1
    clean_env.delenv("PALS_LOCAL_RANKID")
    assert scheduled_world()["local_rank"] == 3


def test_scheduled_world_local_rank_defaults(clean_env):
    """No local variable at all: torchrun's LOCAL_RANK if set, else 0 (one process per node)."""
    clean_env.setenv("PMI_RANK", "3")
    clean_env.setenv("PMI_SIZE", "4")
    assert scheduled_world()["local_rank"] == 0 and scheduled_world()["local_world_size"] is None
    clean_env.setenv("LOCAL_RANK", "2")
    assert scheduled_world()["local_rank"] == 2


def test_no_scheduler_outside_a_launcher(clean_env):
    assert scheduled_world() is None
