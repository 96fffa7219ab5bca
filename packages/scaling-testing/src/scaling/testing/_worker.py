"""The loop each pooled worker process runs: receive a task, run it as one rank, report."""

from __future__ import annotations

import datetime
import gc
import importlib
import importlib.util
import multiprocessing as mp
import os
import pickle
import queue
import sys
import traceback
import types
from collections.abc import Callable
from typing import TYPE_CHECKING, TypedDict

# Imported here, so the forkserver (which preloads this module) imports it once for every worker.
from scaling.topology import barrier_device_ids, destroy_process_group

if TYPE_CHECKING:
    import multiprocessing.queues


class Task(TypedDict):
    """What one rank is told to run (pickled through its task queue)."""

    module: str
    module_file: str | None
    qualname: str
    sys_path: list[str]
    payload: bytes  # pickled (args, kwargs)
    world_size: int
    backend: str
    pg_timeout: float
    env: dict[str, str]
    init_method: str
    task_id: int
    rank: int


class Reply(TypedDict):
    """One rank's answer: ``payload`` is its pickled result (bytes) or its failure's traceback (str)."""

    task_id: int
    rank: int
    payload: bytes | str


def _register_parents(name: str, module_file: str) -> None:
    """Make ``a.b`` importable for a module ``a.b.c`` loaded by path (pytest's importlib mode).

    pickle resolves classes with ``__import__(module)``, which needs every parent package
    in ``sys.modules``; test folders are rarely importable packages on ``sys.path``.
    """
    parts = name.split(".")
    folder = os.path.dirname(module_file)
    for depth in range(len(parts) - 1, 0, -1):
        parent = ".".join(parts[:depth])
        if parent not in sys.modules:
            package = types.ModuleType(parent)
            package.__path__ = [folder]
            sys.modules[parent] = package
        folder = os.path.dirname(folder)


def _resolve(task: Task) -> Callable[..., object]:
    for p in task["sys_path"]:
        if p not in sys.path:
            sys.path.append(p)
    name = task["module"]
    try:
        module = importlib.import_module(name)
    except ImportError:
        if not task["module_file"]:
            raise
        spec = importlib.util.spec_from_file_location(name, task["module_file"])
        if spec is None or spec.loader is None:
            raise
        module = importlib.util.module_from_spec(spec)
        _register_parents(name, task["module_file"])
        sys.modules[name] = module
        spec.loader.exec_module(module)
    obj: object = module
    for part in task["qualname"].split("."):
        obj = getattr(obj, part)
    if not callable(obj):
        raise TypeError(f"{name}.{task['qualname']} is a {type(obj).__name__}, not a function")
    return obj


def _run_task(task: Task) -> object:
    import torch
    import torch.distributed as dist

    gc.disable()  # no collection passes over the modules while they import
    try:
        fn = _resolve(task)
    finally:
        gc.enable()
    args, kwargs = pickle.loads(task["payload"])
    rank, world_size = task["rank"], task["world_size"]
    saved_env = dict(os.environ)
    os.environ.update(task["env"])
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank)})
    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            backend=task["backend"],
            init_method=task["init_method"],
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=task["pg_timeout"]),
        )
        result = fn(*args, **kwargs)
        # Every rank finishes before any tears its groups down: a rank that returns early
        # would otherwise close connections a slower peer is still opening (gloo's
        # connectFullMesh fails on the peer).
        dist.barrier(device_ids=barrier_device_ids())
        return result
    finally:
        destroy_process_group()  # with torch 2.6's teardown-deadlock pause
        os.environ.clear()
        os.environ.update(saved_env)


def worker_main(
    idx: int, tasks: multiprocessing.queues.Queue[Task | None], results: multiprocessing.queues.Queue[Reply]
) -> None:
    """Serve tasks until told to stop (``None``) or the test process is gone."""
    import torch

    torch.set_num_threads(1)
    # torch's import leaves hundreds of thousands of long-lived objects that every full
    # garbage collection would walk again: move them out of the collector's sight, then
    # turn collection back on (the forkserver imported them with it off, see _gc_off).
    gc.freeze()
    gc.enable()
    while True:
        try:
            task = tasks.get(timeout=1.0)
        except queue.Empty:
            # The test process (multiprocessing's parent sentinel: the requester of the fork
            # under forkserver, whose pipe closes when it exits, zombie or not).
            parent = mp.parent_process()
            if parent is not None and not parent.is_alive():
                return
            continue
        if task is None:
            return
        try:
            payload: bytes | str = pickle.dumps(_run_task(task))
        except BaseException as exc:  # noqa: BLE001 - every failure is reported to the parent
            payload = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
        reply: Reply = {"task_id": task["task_id"], "rank": task["rank"], "payload": payload}
        results.put(reply)
        del task, reply
        # What the task imported or cached lives as long as this worker: collect the task's
        # cyclic garbage, then freeze what is left, so the next tasks' collections skip it.
        gc.collect()
        gc.freeze()
