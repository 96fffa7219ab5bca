"""TopologyConfig: parallel sizes and batch arithmetic, validated before any process group exists."""

from __future__ import annotations

import math
from typing import Literal

from pydantic import Field, model_validator

from scaling.config import BaseConfig

_SIZE_FIELDS = ("model_parallel_size", "pipe_parallel_size", "data_parallel_size")


def _divisors(n: int) -> str:
    ds = [str(d) for d in range(1, n + 1) if n % d == 0]
    return ", ".join(ds[:-1]) + (" or " if len(ds) > 1 else "") + ds[-1]


class TopologyConfig(BaseConfig):
    """How ranks are laid out and how a global batch splits into micro-batches.

    Sizes: give any three of ``world_size``, ``model_parallel_size``,
    ``pipe_parallel_size`` and ``data_parallel_size`` and the fourth is derived. When
    fewer than three are given, a missing ``model_parallel_size``, ``pipe_parallel_size``
    and then ``data_parallel_size`` is taken as 1 (``TopologyConfig()`` is one process,
    ``TopologyConfig(model_parallel_size=2)`` two). ``context_parallel_size`` (default 1)
    is always given, never derived. All must satisfy ``world_size ==
    model_parallel_size * context_parallel_size * pipe_parallel_size * data_parallel_size``.

    Context parallelism splits each sample's sequence over ``context_parallel_size`` ranks
    that hold the same parameters and read the same samples: it multiplies the ranks, not
    the batch (``global = micro * accumulation * data_parallel_size`` as without it).

    Batches: give any two of ``global_batch_size``, ``micro_batch_size`` and
    ``gradient_accumulation_steps`` (a missing ``gradient_accumulation_steps`` with only
    one other given is taken as 1); ``global = micro * accumulation * data_parallel_size``
    must hold exactly.

    Expert parallelism: ``expert_parallel_size`` splits the experts of mixture-of-experts
    layers over groups of that many consecutive DP ranks (Megatron-Core's and torchtitan's
    layout); it adds no ranks and must divide ``data_parallel_size``.

    HSDP: ``data_parallel_shard_size`` splits the DP ranks into groups of that many
    consecutive DP ranks that shard (ZeRO-3) among themselves, replicated across the
    ``data_parallel_size / data_parallel_shard_size`` groups (torchtitan's
    ``data_parallel_shard_degree`` × ``data_parallel_replicate_degree``); unset, the
    whole DP group shards.

    Validation raises ``ValueError`` (never ``assert``), so it holds under ``python -O``.
    """

    world_size: int | None = Field(
        None, ge=1, description="Total number of processes; None = derived from the three parallel sizes."
    )
    model_parallel_size: int | None = Field(
        None, ge=1, description="Tensor-parallel degree (TP); None = derived, or 1."
    )
    pipe_parallel_size: int | None = Field(
        None, ge=1, description="Number of pipeline stages (PP); None = derived, or 1."
    )
    data_parallel_size: int | None = Field(
        None, ge=1, description="Data-parallel degree (DP); None = derived from world_size, or 1 without it."
    )
    context_parallel_size: int = Field(
        1,
        ge=1,
        description="Context-parallel degree (CP): each sequence is split over this many ranks, which read the "
        "same samples; 1 = off.",
    )
    expert_parallel_size: int = Field(
        1,
        ge=1,
        description="Expert-parallel degree (EP): mixture-of-experts layers split their experts over groups of "
        "this many consecutive DP ranks; must divide data_parallel_size. 1 = every rank holds every expert.",
    )
    data_parallel_shard_size: int | None = Field(
        None,
        ge=1,
        description="HSDP: ZeRO shards over groups of this many consecutive DP ranks and replicates across the "
        "groups; must divide data_parallel_size. None = shard over the whole DP group.",
    )
    global_batch_size: int | None = Field(
        None, ge=1, description="Samples per optimizer step over all DP ranks; None = derived."
    )
    micro_batch_size: int | None = Field(
        None, ge=1, description="Samples per micro-batch on one DP rank; None = derived."
    )
    gradient_accumulation_steps: int | None = Field(
        None, ge=1, description="Micro-batches per optimizer step on one DP rank; None = derived, or 1."
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto",
        description=(
            "Device of each rank: 'cuda' (cuda:LOCAL_RANK), 'cpu', or 'auto' = cuda when available "
            "(cpu with backend='gloo')."
        ),
    )
    backend: Literal["auto", "gloo", "nccl"] = Field(
        "auto", description="torch.distributed backend: 'auto' = nccl on cuda, gloo on cpu."
    )
    timeout_seconds: float = Field(
        600.0,
        gt=0,
        le=604800,
        description="Timeout of every collective and of the rendezvous, in seconds (> 0, at most a week: "
        "604800; torch's timers overflow far beyond).",
    )
    flight_recorder_entries: int = Field(
        2000,
        ge=0,
        description=(
            "NCCL only: collectives each rank keeps in torch's flight recorder, dumped by NCCL's watchdog "
            "when a collective times out (to the trainer's diagnostics_dir; read them with python -m "
            "torch.distributed.flight_recorder.fr_trace <dir>); 0 = off. TORCH_FR_BUFFER_SIZE, when set, wins."
        ),
    )

    @model_validator(mode="after")
    def _derive(self) -> TopologyConfig:
        self._derive_sizes()
        shard, dp = self.data_parallel_shard_size, self.data_parallel_size
        if shard is not None and dp is not None and dp % shard:
            raise ValueError(
                f"topology: data_parallel_shard_size={shard} does not divide data_parallel_size={dp}; choose one of "
                f"{_divisors(dp)} (DP ranks = shard × replicate)"
            )
        ep = self.expert_parallel_size
        if dp is not None and dp % ep:
            raise ValueError(
                f"topology: expert_parallel_size={ep} does not divide data_parallel_size={dp}; choose one of "
                f"{_divisors(dp)} (experts are split over groups of DP ranks)"
            )
        self._derive_batches()
        if self.backend == "nccl" and self.device == "cpu":
            raise ValueError("backend='nccl' needs device='cuda' (or 'auto'); with device='cpu' use backend='gloo'")
        if self.backend == "gloo" and self.device == "cuda":
            # Scaling's gloo groups carry CPU tensors (the collectives check it); NCCL is the CUDA backend.
            raise ValueError("backend='gloo' carries CPU tensors; with device='cuda' use backend='nccl' (or 'auto')")
        return self

    # Derived values are written with object.__setattr__: the model is frozen to users,
    # but filling in the fourth size is part of validation.
    def _set(self, name: str, value: int) -> None:
        object.__setattr__(self, name, value)

    def _derive_sizes(self) -> None:
        missing = [n for n in ("world_size", *_SIZE_FIELDS) if getattr(self, n) is None]
        # Unset sizes default to 1 (TP and PP first, then DP) while two or more are unset, so
        # TopologyConfig() is one process, as a default written into a config class expects.
        for name in ("model_parallel_size", "pipe_parallel_size", "data_parallel_size"):
            if len(missing) > 1 and name in missing:
                self._set(name, 1)
                missing.remove(name)
        mp, pp, dp, ws = self.model_parallel_size, self.pipe_parallel_size, self.data_parallel_size, self.world_size
        cp = self.context_parallel_size
        if missing == ["world_size"]:
            self._set("world_size", mp * cp * pp * dp)  # type: ignore[operator]
            return
        if missing:
            (name,) = missing
            extra = ("context_parallel_size",) if cp > 1 else ()
            others = {n: getattr(self, n) for n in (*_SIZE_FIELDS, *extra) if n != name}
            prod = math.prod(others.values())
            if ws % prod != 0:
                described = " × ".join(f"{k}={v}" for k, v in others.items())
                raise ValueError(
                    f"topology: world_size={ws} is not divisible by {described} = {prod}, so {name} "
                    f"cannot be derived; choose sizes whose product divides {ws} (divisors: {_divisors(ws)})"  # type: ignore[arg-type]
                )
            self._set(name, ws // prod)
            return
        if mp * cp * pp * dp != ws:  # type: ignore[operator]
            cp_term = f"context_parallel_size={cp} × " if cp > 1 else ""
            raise ValueError(
                f"topology: world_size={ws} does not equal model_parallel_size={mp} × {cp_term}"
                f"pipe_parallel_size={pp} × data_parallel_size={dp} = {mp * cp * pp * dp}; "  # type: ignore[operator]
                "change one of them or leave one out to have it derived"
            )

    def _derive_batches(self) -> None:
        dp = self.data_parallel_size
        gbs, mbs, acc = self.global_batch_size, self.micro_batch_size, self.gradient_accumulation_steps
        given = sum(v is not None for v in (gbs, mbs, acc))
        if given == 0:
            return
        if given == 1 and acc is None:
            acc = 1
            self._set("gradient_accumulation_steps", 1)
        if gbs is None and mbs is not None and acc is not None:
            self._set("global_batch_size", mbs * acc * dp)  # type: ignore[operator]
            return
        if gbs is None:
            raise ValueError(
                f"topology: give two of global_batch_size, micro_batch_size, gradient_accumulation_steps "
                f"(got gradient_accumulation_steps={acc} only)"
            )
        if mbs is None or acc is None:
            known, known_name = (mbs, "micro_batch_size") if mbs is not None else (acc, "gradient_accumulation_steps")
            denom = known * dp  # type: ignore[operator]
            if gbs % denom != 0:
                raise ValueError(
                    f"topology: global_batch_size={gbs} is not divisible by {known_name}={known} × "
                    f"data_parallel_size={dp} = {denom}; choose a global_batch_size that is a multiple of {denom}"
                )
            other = "gradient_accumulation_steps" if mbs is not None else "micro_batch_size"
            self._set(other, gbs // denom)
            return
        if mbs * acc * dp != gbs:  # type: ignore[operator]
            raise ValueError(
                f"topology: global_batch_size={gbs} does not equal micro_batch_size={mbs} × "
                f"gradient_accumulation_steps={acc} × data_parallel_size={dp} = {mbs * acc * dp}; "  # type: ignore[operator]
                "change one of them or leave one out to have it derived"
            )
