"""Training on several processes, under DeepSpeed's launcher or torchrun (one process per GPU; on a CPU, gloo).

    torchrun --nproc_per_node 2 -m lightning_otel.cli train --config run.toml
    deepspeed --num_gpus 2 --module lightning_otel.cli train --config run.toml

Rank 0 runs the whole run as one process would: the store, the engine, the rollouts, the compiler, the run
folder. Every other rank holds an identical learner and follows: each learner call that changes or saves the
policy (building it, a pass of optimizer steps, the learning rate, a fresh optimizer, saving and loading) is
broadcast from rank 0 with its arguments, the transitions of a pass included, and every rank makes it.

A pass of steps is data parallel: all ranks cut the same step into the same micro-batches (same rows, same
seed, same order), and micro-batch i runs on rank i mod world. Token weights are fixed over the whole step
first, so each rank's loss is its part of the one-process loss; DeepSpeed averages the gradients over ranks,
so each rank's backward is scaled by the world size and the step's gradient is the one-process gradient (the
test compares them). A rank with fewer micro-batches than another runs a zero-weight one, so that every rank
makes the same collective calls.

Ranks wait for rank 0 in collective calls while it runs rollouts: the process group is created with a
timeout of FOLLOW_TIMEOUT instead of torch's 30 minutes. Saves go to rank 0's run folder, which the other
ranks must reach at the same path (one machine, or a shared file system across nodes).
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import logging
import os
from datetime import timedelta

import torch

log = logging.getLogger(__name__)
FOLLOW_TIMEOUT = timedelta(hours=12)


def launched() -> bool:
    """Whether a launcher started this process as one rank of several (WORLD_SIZE > 1)."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1 and "RANK" in os.environ


def init() -> None:
    """The process group of a multi-process run (no-op for one process: the learner sets its own up)."""
    if launched() and not torch.distributed.is_initialized():
        import deepspeed

        with without_shm_collective():
            deepspeed.init_distributed(timeout=FOLLOW_TIMEOUT)
        log.info("rank %d of %d (%s)", rank(), world(), torch.distributed.get_backend())


@contextlib.contextmanager
def without_shm_collective():
    """Start DeepSpeed's process group (deepspeed.initialize, init_distributed) without its CPU shared-memory
    all-reduce. DeepSpeed compiles that op (deepspeed_shm_comm) for its inference all-reduce, which training
    never calls (its collectives go through the process group: gloo on a CPU). The compile takes about 30 s in
    each new Python environment, under torch's build lock: a file that the compiling process removes when it is
    done. A process killed while compiling leaves the file behind, and every later run on the machine then
    waits for it forever without a word (it hung a whole test suite). Without the op there is nothing to
    compile and nothing to wait for; DeepSpeed's inference all-reduce falls back to the process group's."""
    # by its module's name: deepspeed.comm's attribute `torch` is torch itself
    backend = importlib.import_module("deepspeed.comm.torch")
    build = getattr(backend, "build_shm_op", None)
    if build is None:  # a DeepSpeed without the op
        yield
        return
    backend.build_shm_op = lambda: None
    try:
        yield
    finally:
        backend.build_shm_op = build


def rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def world() -> int:
    return torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1


def leads() -> bool:
    """Rank 0 of a multi-process run: its learner calls are broadcast to the other ranks."""
    return world() > 1 and rank() == 0


def announce(name: str, arguments: dict) -> None:
    """On rank 0 of several, send a learner call to the other ranks (they make it in `follow`)."""
    if leads():
        torch.distributed.broadcast_object_list([(name, arguments)], src=0)


def collective(method):
    """A Learner method every rank makes: rank 0 announces it with its arguments first."""
    signature = inspect.signature(method)

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        bound = signature.bind(self, *args, **kwargs)
        bound.apply_defaults()
        announce(method.__name__, {k: v for k, v in bound.arguments.items() if k != "self"})
        return method(self, *args, **kwargs)
    return wrapper


def release() -> None:
    """On rank 0, at the end of the run: the other ranks leave `follow`."""
    announce("exit", {})


def finish() -> None:
    """Every rank, last: leave the process group, so no gloo thread is still running when the interpreter exits
    (a process that exits with one aborts: 'terminate called without an active exception', exit code 250)."""
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def follow() -> None:
    """Ranks other than 0: make rank 0's learner calls until it releases them."""
    from lightning_otel.train.learner import Learner
    from lightning_otel.train.optimize import optimize

    init()
    learner = None
    while True:
        received = [None]
        torch.distributed.broadcast_object_list(received, src=0)
        name, arguments = received[0]
        log.debug("rank %d: %s", rank(), name)
        if name == "exit":
            if learner is not None:
                learner.close()
            return
        if name == "learner":
            learner = Learner(**arguments)
        elif name == "optimize":
            optimize(learner, **arguments)
        else:
            getattr(learner, name)(**arguments)
            if name == "close":
                learner = None
