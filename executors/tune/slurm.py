"""A Slurm batch script that runs one tuner worker per node, all sharing one study.

Across nodes the tuner scales out by workers, not by trials: each node runs `meshplan tune` with
the same job and the same study, its trials on that node's GPUs (torchrun --standalone, NCCL),
and the workers divide the trials through the shared storage (a strategy one worker measures is
never run by another; see executors.tune.tuner). The storage must be a database server every node
reaches (PostgreSQL): a SQLite file on a shared filesystem is refused, as SQLite's locking over
NFS is unreliable. Every argument is quoted for the shell (planner.emit.quoting), so a model path
or study name is never read as code.
"""

from __future__ import annotations

from planner.emit.quoting import check_name, shell_word
from executors.tune.study import masked
from planner.errors import SpecError, escape_hidden

MAX_NODES = 4096
"""Largest --slurm-workers: one worker per node of a large cluster."""


def slurm_workers_script(tune_args: list[str], nodes: int, gpus_per_node: int, storage: str,
                         job_name: str = "meshplan-tune") -> str:
    """The sbatch script: `nodes` nodes, one task each, every task running `meshplan tune
    <tune_args> --storage "$MESHPLAN_TUNE_STORAGE"` (`tune_args`: the caller's flags without
    --storage). The storage URL may hold a password, so the script reads it from the environment
    of the submission (`sbatch --export=ALL`, Slurm's default) and names it only masked."""
    if not 1 <= nodes <= MAX_NODES:
        raise SpecError(f"--slurm-workers must be 1 to {MAX_NODES} nodes (got {nodes})")
    if storage.startswith("sqlite"):
        raise SpecError("--slurm-workers needs a storage every node reaches, a database server such as "
                        f"postgresql+psycopg://user@host/db (got {storage!r}: SQLite's locking is unreliable on "
                        "shared filesystems)")
    check_name("job_name", job_name)
    command = " ".join(shell_word(w) for w in ["meshplan", "tune", *tune_args]) + ' --storage "$MESHPLAN_TUNE_STORAGE"'
    shown = escape_hidden(masked(storage))
    return (
        "#!/bin/bash\n"
        f"#SBATCH --job-name={job_name}\n"
        f"#SBATCH --nodes={nodes}\n"
        "#SBATCH --ntasks-per-node=1\n"
        f"#SBATCH --gpus-per-node={gpus_per_node}\n"
        "#SBATCH --exclusive\n"
        "# One `meshplan tune` worker per node; the workers share the study in the storage named below and\n"
        "# divide its trials. Each trial runs on its worker's node (torchrun --standalone, NCCL).\n"
        "# export NCCL_SOCKET_IFNAME=...   # site-specific, as for any NCCL job\n"
        "set -euo pipefail\n"
        f"# the study storage, e.g. {shell_word(shown)[:200]}: export it before sbatch (it may hold a password)\n"
        ': "${MESHPLAN_TUNE_STORAGE:?set MESHPLAN_TUNE_STORAGE to the study storage URL before sbatch}"\n'
        f"srun --nodes={nodes} --ntasks-per-node=1 {command}\n"
    )
