"""Fixtures of the emitter tests (the shared rootdir conftest is tests/conftest.py)."""

from __future__ import annotations

import os
import socket

import pytest


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def deepspeed_comm():
    """DeepSpeed's communication backend on a one-process gloo group, for one test module
    (torn down after it, so no process group outlives the emitter tests).

    DeepSpeedConfig asks deepspeed.comm for the rank first and, only if that
    works, asks the mpu for the data-parallel world size; without a backend it
    silently assumes world size 1. The CPU accelerator would compile a shared-
    memory all-reduce op (tens of seconds) that a config check never uses, so
    that op is marked unavailable for this process.
    """
    pytest.importorskip("deepspeed")
    import deepspeed.ops
    from deepspeed import comm as dist
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    saved_op = None
    if builder is not None:
        saved_op = deepspeed.ops.__compatible_ops__.get(builder.NAME)
        deepspeed.ops.__compatible_ops__[builder.NAME] = False
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "RANK": "0", "WORLD_SIZE": "1",
           "LOCAL_RANK": "0"}
    saved_env = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    started = not dist.is_initialized()
    if started:
        dist.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, verbose=False)
    yield dist
    if started:
        import torch.distributed

        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        dist.comm.cdb = None
    for k, v in saved_env.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    if builder is not None:
        deepspeed.ops.__compatible_ops__[builder.NAME] = saved_op
