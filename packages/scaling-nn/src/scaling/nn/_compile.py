"""Regional compilation: ``torch.compile`` on each layer's ``forward``, as torchtitan compiles each block.

Each layer's ``forward`` is replaced by its compiled form, so the module's hooks (ZeRO-3's
gather and free, the trainer's) stay outside the compiled region and run eagerly. Layers
of one class and shape share one compiled graph: Dynamo treats a module's parameters as
inputs, so the second identical layer hits the first one's cache entry, and compile time
does not grow with depth. Compilation is lazy: the first forward of each distinct layer
compiles it (the warm-up step).

Collectives inside a layer (tensor and sequence parallelism, context parallelism, expert
dispatch) go through ``scaling.collectives``' recorded calls, which Dynamo does not trace:
the graph breaks around each, they run eagerly, and the code between them is compiled.
Parity with eager is kept (the tests check it); the fusion lost at a break is the price.

:func:`compile_loss` compiles a trainer's loss function the same way (``CompileConfig.loss``,
torchtitan's "loss" component): a cross-entropy then fuses its upcast and log-softmax.

:class:`CompileMonitor` counts what Dynamo compiled and the guard failures that made it
recompile, so a trainer can say when a layer recompiled and why.
"""

from __future__ import annotations

import functools
import getpass
import os
import re
import tempfile
import types
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Literal, TypeVar, cast

import torch
from pydantic import Field, field_validator

from scaling.config import BaseConfig
from scaling.nn._attention_kernels import cuda_capability

F = TypeVar("F", bound=Callable[..., object])  # the loss function, its signature kept


class CompileConfig(BaseConfig):
    """``torch.compile`` of each layer (regional compilation)."""

    enabled: bool = Field(False, description="Compile each layer's forward with torch.compile.")
    backend: str = Field(
        "inductor", description="torch.compile backend: 'inductor' (CPU C++ or GPU Triton code), 'aot_eager', ..."
    )
    mode: Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"] | None = Field(
        None, description="Inductor mode; None = 'default'."
    )
    fullgraph: bool = Field(
        False,
        description="Refuse graph breaks inside a layer. Layers with collectives (TP, CP, EP) break at each, so "
        "leave it False unless every layer is free of them.",
    )
    dynamic: bool | None = Field(
        None, description="Dynamic shapes: None = Dynamo decides (static first, dynamic after a shape change)."
    )
    cache_dir: Path | None = Field(
        None,
        description="Folder for inductor's compiled code and AOTAutograd's graphs (torch's on-disk caches): a "
        "restart, and every rank after the first, loads from it instead of compiling (a folder on a shared "
        "file system serves every node). None = torch's default (a folder under the system's temp dir).",
    )
    loss: bool = Field(
        True,
        description="With enabled: compile the trainer's loss function too (torchtitan's 'loss' component): "
        "a cross-entropy's upcast, log-softmax and target gather fuse, so its fp32 copy of the logits is never "
        "written out.",
    )

    @field_validator("backend")
    @classmethod
    def _known_backend(cls, backend: str) -> str:
        # The common ones are known without importing Dynamo (seconds); any other is looked up in
        # Dynamo's registry, which also finds backends installed by packages' entry points.
        if backend in _COMMON_BACKENDS:
            return backend
        from torch._dynamo import list_backends, lookup_backend
        from torch._dynamo.exc import InvalidBackend

        try:
            lookup_backend(backend)
        except InvalidBackend:
            choices = ", ".join(repr(name) for name in list_backends())
            raise ValueError(
                f"backend={backend!r} is not a torch.compile backend of torch {torch.__version__}; "
                f"choose one of {choices} (or register yours with torch._dynamo.register_backend first)"
            ) from None
        return backend


_COMMON_BACKENDS = frozenset({"inductor", "aot_eager", "eager", "cudagraphs"})


def check_compile_layout(config: CompileConfig, field: str, *, collectives: list[str]) -> None:
    """Raise ValueError when ``fullgraph`` is asked of layers that communicate.

    ``collectives`` names the layout settings that put a collective inside a layer or the loss
    (tensor, context or expert parallelism), e.g. ``["topology.model_parallel_size=2"]``: each
    collective is a graph break, which ``fullgraph=True`` turns into an error at the first step.
    ``field`` is where the config sits (``compile`` or ``training.compile``).
    """
    if config.enabled and config.fullgraph and collectives:
        raise ValueError(
            f"{field}.fullgraph=true with {', '.join(collectives)}: the layers' collectives break the graph, "
            f"which fullgraph refuses at the first step; set {field}.fullgraph=false (the code between "
            "collectives is still compiled)"
        )


# The modules of scaling.collectives that communicate or keep the collective record; the
# region functions (_regions, _context) stay traceable, so with one rank (group None or of
# size 1) they compile away, and with more the autograd function calling one of these
# runs eagerly at a graph break.
_EAGER_MODULES = ("_ops", "_recorder", "_diagnosis", "_p2p_diagnosis", "_pipe", "_broadcast", "_frames")


@functools.cache
def _keep_collectives_eager() -> None:
    """Dynamo skips the communicating modules of ``scaling.collectives``: a call into one breaks
    the graph and runs eagerly.

    Without this Dynamo would trace into the recorded collectives' bookkeeping and, after
    a break inside one, compile resumption fragments of it. ``trace_rules.add`` is Dynamo's
    own registry of skipped modules (private, present in every torch of the matrix). Once
    per process: each registration rebuilds Dynamo's skip pattern. It also marks
    :func:`cuda_capability` a constant of the graph (the fused attention kernels' choice).
    """
    from torch._dynamo import trace_rules

    for name in _EAGER_MODULES:
        trace_rules.add(f"scaling.collectives.{name}")
    # A constant of the graph where a fused kernel is chosen by the GPU's compute capability.
    torch.compiler.assume_constant_result(cuda_capability)


def _use_cache_dir(cache_dir: Path | None) -> None:
    """Point torch's compile caches at ``cache_dir`` (a per-capability subfolder when
    ``ATEN_CPU_CAPABILITY`` is set), or leave torch's default; then the capability rule
    (:func:`_default_cache_dir`). Checked at every call (a string comparison; the folder is
    made once): a process that compiles under several configs, or whose environment another
    caller changed, gets the folder of the config at hand (a cached once-per-process setting
    let a test worker compile under ``ATEN_CPU_CAPABILITY=default`` into the host's folder,
    whose kernels then failed to build or trained on NaN)."""
    capability = os.environ.get("ATEN_CPU_CAPABILITY") or None
    if cache_dir is not None:
        target = _made_folder(cache_dir, capability)
    else:
        current = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
        default = _default_cache_dir()
        # torch writes its default into the variable on first use (importing torch._dynamo does):
        # that value is still "not chosen by the user"; nor is a folder this function chose.
        chosen_here = current is not None and current.startswith(default + "_")
        if capability is None or (current not in (None, default) and not chosen_here):
            return
        target = f"{default}_{re.sub(r'[^A-Za-z0-9_]', '_', capability)}"
    if os.environ.get("TORCHINDUCTOR_CACHE_DIR") != target:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = target


@functools.cache
def _made_folder(cache_dir: Path, capability: str | None) -> str:
    """``cache_dir`` (with a subfolder per ``ATEN_CPU_CAPABILITY`` when it is set), made; its absolute path."""
    folder = cache_dir / re.sub(r"[^A-Za-z0-9_]", "_", capability) if capability else cache_dir
    folder.mkdir(parents=True, exist_ok=True)
    return str(folder.resolve())


@functools.cache
def _default_cache_dir() -> str:
    """torch's default inductor cache folder, ``<tmp>/torchinductor_<user>``.

    Inductor's on-disk cache does not tell kernels built under one ``ATEN_CPU_CAPABILITY`` from
    another's: after a run under ``avx2`` filled it, a run under ``avx512`` on the same machine
    loaded them and died (SIGABRT), or trained on NaN losses (seen 2026-11-28, torch 2.13). With
    the variable set and ``TORCHINDUCTOR_CACHE_DIR`` not chosen, the cache goes to this folder
    with the capability appended; without the variable nothing changes.
    """
    user = re.sub(r'[\\/:*?"<>|]', "_", getpass.getuser())  # torch's default_cache_dir() sanitises so
    return os.path.join(tempfile.gettempdir(), f"torchinductor_{user}")


def compile_layer(module: torch.nn.Module, config: CompileConfig) -> None:
    """Replace ``module.forward`` by its compiled form (hooks stay eager); a no-op unless enabled."""
    if not config.enabled:
        return
    _use_cache_dir(config.cache_dir)
    _keep_collectives_eager()
    # The class's forward function, bound to the module: Dynamo keys its cache by the code
    # object, so layers of one class share entries (and the recompile limit counts per class),
    # and a recompilation names the class's forward.
    compiled = torch.compile(
        type(module).forward,
        backend=config.backend,
        mode=config.mode,
        fullgraph=config.fullgraph,
        dynamic=config.dynamic,
    )
    module.forward = types.MethodType(compiled, module)


def compile_loss(loss_function: F, config: CompileConfig | None) -> F:
    """``loss_function`` compiled by ``torch.compile`` when ``config.enabled`` and ``config.loss``; else itself.

    The trainer compiles its loss this way (``BaseTrainer``, from its module's ``compile_config``);
    a loop of one's own can do the same. A loss with collectives (vocabulary-parallel
    cross-entropy under TP, context parallelism's weight sum) breaks the graph at each and runs
    it eagerly, as a compiled layer does.
    """
    if config is None or not (config.enabled and config.loss):
        return loss_function
    _use_cache_dir(config.cache_dir)
    _keep_collectives_eager()
    compiled = torch.compile(
        loss_function, backend=config.backend, mode=config.mode, fullgraph=config.fullgraph, dynamic=config.dynamic
    )
    return cast("F", compiled)


def compile_layers(modules: Iterable[torch.nn.Module], config: CompileConfig) -> None:
    """:func:`compile_layer` on each module."""
    for module in modules:
        compile_layer(module, config)


class CompileMonitor:
    """What Dynamo compiled in this process since the last :meth:`poll`.

    Reads Dynamo's own process-wide counters (``torch._dynamo.utils``): the number of
    graphs compiled, and the guard failure behind each recompilation (a shape or dtype
    change, a new module state).
    """

    def __init__(self) -> None:
        self._graphs = 0
        self._seen: dict[object, int] = {}  # guard failures seen, per code object
        self._breaks: set[str] = set()
        self.poll()
        self.new_graph_breaks()

    @staticmethod
    def _state() -> tuple[int, Mapping[object, list[object]]]:
        from torch._dynamo.utils import counters, guard_failures

        return int(counters["stats"]["unique_graphs"]), guard_failures

    @property
    def graph_breaks(self) -> int:
        """Distinct reasons Dynamo broke a graph for (code between breaks runs compiled, the call at one eagerly)."""
        from torch._dynamo.utils import counters

        return len(counters["graph_break"])

    def new_graph_breaks(self) -> list[str]:
        """Each graph-break reason not seen by an earlier call: its first two lines (what and why)."""
        from torch._dynamo.utils import counters

        new = [r for r in counters["graph_break"] if r not in self._breaks]
        self._breaks.update(new)
        return [" ".join(line.strip() for line in r.strip().splitlines()[:2]) for r in new]

    @property
    def graphs(self) -> int:
        """Graphs compiled in this process so far."""
        return self._state()[0]

    def poll(self) -> tuple[int, list[str]]:
        """``(graphs compiled since the last poll, the guard failures that recompiled one)``."""
        graphs, failures = self._state()
        new = graphs - self._graphs
        self._graphs = graphs
        reasons = []
        for code, items in list(failures.items()):
            seen = self._seen.get(code, 0)
            name = getattr(code, "co_qualname", getattr(code, "co_name", str(code)))
            reasons += [f"{name}: {reason}" for reason in items[seen:]]
            self._seen[code] = len(items)
        return new, reasons
