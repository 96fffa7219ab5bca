"""A training step of the transformer app (1 process) against plain PyTorch, in one run.

python bench/transformer_step.py                      # CPU default: hidden 256, 4 layers, seq 256, batch 8
python bench/transformer_step.py --hidden 2048 --layers 16 --heads 16 --vocab 32000 --seq 2048 --batch 4 \
    --device cuda --dtype bf16 --iters 10 --trace out/   # ~1B parameters, what scripts/gpu_check runs

Both sides: the same shapes, weight layout and kernels (SDPA causal attention, SwiGLU, RMSNorm,
tied embeddings, AdamW). Ours runs scaling.trainer.train_step + scaling.optim.Optimizer
(no document masking, so the same is_causal SDPA kernel); the reference is a hand-written
nn.Module with torch.optim.AdamW. With --documents N each row packs N documents (the same
seeded lengths on both sides): ours masks them as the app does (on CUDA in bf16, flash
attention's variable-length kernel; elsewhere SDPA with the document mask), the reference
as plain PyTorch would, SDPA with a dense document mask and RoPE positions restarting per
document. The two alternate step by step (and which goes first) in
one process. Prints median wall-clock step times and ours / reference (target <= 1.05),
tokens/s and MFU (bf16 on a known CUDA card, or with --peak-tflops); on CPU also the process CPU time of each side, which
a shared machine's load changes far less than the wall clock. CPU runs use one intra-op
thread by default (--threads 0 keeps torch's default).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from scaling.nn import CompileConfig, Float8Config, compile_layers, compile_loss, enable_float8
from scaling.optim import Optimizer
from scaling.pipeline import ParallelModule
from scaling.topology import Topology
from scaling.trainer import device_peak_flops, train_step
from scaling.transformer.config import TransformerArchitectureConfig, TransformerConfig
from scaling.transformer.data import TransformerBatch
from scaling.transformer.model import TransformerLoss, flops_per_token, layer_specs
from scaling.transformer.train import parameter_groups


class RefBlock(torch.nn.Module):
    def __init__(self, h: int, nq: int, nkv: int, f: int, eps: float) -> None:
        super().__init__()
        self.nq, self.nkv, self.d, self.eps = nq, nkv, h // nq, eps
        self.n1, self.n2 = torch.nn.Parameter(torch.ones(h)), torch.nn.Parameter(torch.ones(h))
        self.qkv = torch.nn.Linear(h, (nq + 2 * nkv) * self.d, bias=False)
        self.o = torch.nn.Linear(nq * self.d, h, bias=False)
        self.gate, self.up = torch.nn.Linear(h, f, bias=False), torch.nn.Linear(h, f, bias=False)
        self.down = torch.nn.Linear(f, h, bias=False)
        r = self.d // 2
        inv = 1.0 / (10000.0 ** (torch.arange(0, self.d, 2, dtype=torch.float64) / self.d))
        self.register_buffer("inv", inv.float(), persistent=False)
        self.r = r

    def rope(self, x: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
        if positions is None:
            positions = torch.arange(x.shape[2], device=x.device)
        ang = positions.float().unsqueeze(-1) * self.inv
        cos, sin = ang.cos(), ang.sin()
        if ang.dim() == 3:  # [b, s, r]: per-row positions, broadcast over the heads
            cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        x1, x2 = x[..., : self.r].float(), x[..., self.r :].float()
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1).to(x.dtype)

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor | None = None, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        b, s, _ = x.shape
        g = self.qkv(F.rms_norm(x, (x.shape[-1],), self.n1, self.eps)).view(
            b, s, self.nkv, self.nq // self.nkv + 2, self.d
        )
        q = g[:, :, :, :-2].reshape(b, s, self.nq, self.d).transpose(1, 2)
        k, v = g[:, :, :, -2].transpose(1, 2), g[:, :, :, -1].transpose(1, 2)
        a = F.scaled_dot_product_attention(
            self.rope(q, positions),
            self.rope(k, positions),
            v,
            attn_mask=mask,
            is_causal=mask is None,
            enable_gqa=self.nq != self.nkv,
        )
        x = x + self.o(a.transpose(1, 2).reshape(b, s, -1))
        h = F.rms_norm(x, (x.shape[-1],), self.n2, self.eps)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


def ref_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


class RefModel(torch.nn.Module):
    def __init__(self, arch: TransformerArchitectureConfig) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(arch.vocab_size, arch.hidden_size)
        self.blocks = torch.nn.ModuleList(
            RefBlock(arch.hidden_size, arch.num_attention_heads, arch.kv_heads, arch.ffn_size, arch.norm_eps)
            for _ in range(arch.num_layers)
        )
        self.norm = torch.nn.Parameter(torch.ones(arch.hidden_size))
        self.eps = arch.norm_eps
        self.loss = ref_loss  # bench/compile_step.py compiles it, as torchtitan compiles its loss

    def forward(self, ids: torch.Tensor, targets: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        x = self.emb(ids)
        mask = None
        if positions is not None:  # packed documents: a token sees the earlier tokens of its own document
            doc = (positions == 0).cumsum(-1)  # [b, s]: the document of each token in its row
            causal = torch.ones(doc.shape[-1], doc.shape[-1], dtype=torch.bool, device=doc.device).tril()
            mask = ((doc.unsqueeze(-1) == doc.unsqueeze(-2)) & causal).unsqueeze(1)
        for blk in self.blocks:
            x = blk(x, positions, mask)
        return self.loss(F.linear(F.rms_norm(x, (x.shape[-1],), self.norm, self.eps), self.emb.weight), targets)


@dataclass
class Bench:
    """Both sides built on the same arguments: ``ours()`` and ``reference()`` each run one step."""

    ours: Callable[[], None]
    reference: Callable[[], None]
    arch: TransformerArchitectureConfig
    topo: Topology
    device: torch.device
    optimizer: Optimizer  # ours, for profiling its share of the step
    ref_optimizer: torch.optim.AdamW | None
    module: ParallelModule
    ref_model: RefModel | None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=None)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--ffn", type=int, default=None, help="MLP inner size (default: 8/3 of hidden, rounded up to 8)")
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--device", default="cpu")
    p.add_argument("--iters", type=int, default=20, help="timed steps per side")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per side")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads on CPU (0: torch's default)")
    p.add_argument(
        "--peak-tflops", type=float, default=None,
        help="device dense peak for MFU; default on CUDA: the card's bf16 dense peak when known (H100/H200: 989)",
    )  # fmt: skip
    p.add_argument(
        "--no-master-weights", action="store_true",
        help="bf16: update the bf16 weights directly, as the reference does (default: fp32 master weights)",
    )  # fmt: skip
    p.add_argument(
        "--reference", choices=["bf16", "fsdp2"], default="bf16",
        help="bf16: the plain model's weights and AdamW state in --dtype, updated directly, no gradient norm; "
        "fsdp2: torchtitan's recipe on one rank (fp32 weights and fused AdamW, fully_shard with bf16 compute "
        "and fp32 gradient reduction, clip_grad_norm_ at 1.0), both sides clipping at 1.0",
    )  # fmt: skip
    p.add_argument("--trace", default=None, help="folder for a torch.profiler trace of 3 of our steps (chrome JSON)")
    p.add_argument("--documents", type=int, default=0, help="packed documents per row (0: one sequence per row)")
    return p.parse_args(argv)


def packed_rows(batch: int, seq: int, documents: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(position_ids [b, s], cumulative_seq_lengths)`` of rows that each pack ``documents``
    documents of seeded lengths (at least one token each)."""
    g = torch.Generator().manual_seed(1)
    positions, cu = [], [0]
    for row in range(batch):
        cuts = sorted(torch.randperm(seq - 1, generator=g)[: documents - 1].add(1).tolist())
        starts, ends = [0, *cuts], [*cuts, seq]
        positions.append(torch.cat([torch.arange(e - b) for b, e in zip(starts, ends)]))
        cu += [row * seq + e for e in ends]
    return torch.stack(positions), torch.tensor(cu, dtype=torch.int32)


def card_peak_tflops(device: torch.device) -> float | None:
    """The dense bf16 peak TFLOP/s of this CUDA card where the trainer knows it (its MFU's denominator), else None."""
    peak = device_peak_flops(device)
    return None if peak is None else peak / 1e12


def build(
    a: argparse.Namespace,
    topo: Topology | None = None,
    compile: CompileConfig | None = None,
    fp8: Float8Config | None = None,
    reference: bool = True,
) -> Bench:
    """Our model, optimizer and loss and the reference, with one shared batch.

    ``topo``: reuse an initialised topology (a second copy of ours in the same process);
    ``compile`` / ``fp8``: our layers compiled / with float8 linears; ``reference=False``:
    no reference model (its ``reference()`` then raises).
    """
    if a.threads > 0 and a.device == "cpu":
        torch.set_num_threads(a.threads)
    device = torch.device(a.device)
    arch = TransformerArchitectureConfig(
        vocab_size=a.vocab, hidden_size=a.hidden, num_layers=a.layers, num_attention_heads=a.heads,
        num_kv_heads=a.kv_heads, max_sequence_length=a.seq, precision=a.dtype, document_masking=a.documents > 0,
        intermediate_size=a.ffn,
    )  # fmt: skip
    cfg = TransformerConfig.from_dict(
        {
            "runner": {"runner_type": "local", "nproc_per_node": 1},
            "topology": {"world_size": 1, "global_batch_size": a.batch, "micro_batch_size": a.batch,
                         "device": a.device},
            "optimizer": {"zero_stage": 0, "master_weights": a.dtype != "fp32" and not a.no_master_weights,
                          "gradient_clipping": 1.0 if a.reference == "fsdp2" else 0.0},
            "learning_rate_scheduler": {"learning_rate": 1e-4},
            "transformer_architecture": arch.as_dict(),
            "data": {"sequence_length": a.seq},
        }
    )  # fmt: skip
    if topo is None:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        topo = Topology(cfg.topology, 0).initialize_distributed(f"file://{tempfile.mkdtemp()}/rdzv")
    module = ParallelModule(layer_specs(arch, topo), topo, seed=1)
    if fp8 is not None:
        enable_float8(module, fp8)
    if compile is not None:
        compile_layers(module.layers.values(), compile)
    optimizer = Optimizer(config=cfg.optimizer, parameter_groups=parameter_groups(module, cfg), topology=topo)
    loss_fn = compile_loss(TransformerLoss(arch.vocab_size, topo), compile)  # as BaseTrainer does
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, a.vocab, (a.batch, a.seq + 1), generator=g)
    positions, cu = packed_rows(a.batch, a.seq, a.documents) if a.documents > 0 else (None, None)
    batch = TransformerBatch(ids[:, :-1].contiguous(), ids[:, 1:].contiguous(), positions, cu).to(device)

    ref, ref_opt = _reference(arch, device, a.reference) if reference else (None, None)

    def ours() -> None:
        train_step(module, [batch], optimizer, loss_fn)

    def run_reference() -> None:
        assert ref is not None and ref_opt is not None, "built with reference=False"
        ref_opt.zero_grad(set_to_none=True)
        ref(batch.input_token_ids, batch.target_token_ids, batch.position_ids).backward()
        if a.reference == "fsdp2":
            torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm=1.0, foreach=True)
        ref_opt.step()

    return Bench(ours, run_reference, arch, topo, device, optimizer, ref_opt, module, ref)


def _reference(
    arch: TransformerArchitectureConfig, device: torch.device, recipe: str
) -> tuple[RefModel, torch.optim.AdamW]:
    """The plain-PyTorch model and its optimizer: ``bf16`` updates the weights in ``arch.dtype``
    directly (foreach AdamW); ``fsdp2`` is torchtitan's single-rank recipe: fp32 weights and
    fused AdamW, each block and the root ``fully_shard``-ed computing in ``arch.dtype`` with
    gradients reduced in fp32 (the caller clips the norm at 1.0)."""
    if recipe == "bf16":
        ref = RefModel(arch).to(device, arch.dtype)
        return ref, torch.optim.AdamW(ref.parameters(), lr=1e-4, weight_decay=0.01, foreach=True)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    ref = RefModel(arch).to(device)
    policy = MixedPrecisionPolicy(param_dtype=arch.dtype, reduce_dtype=torch.float32)
    mesh = init_device_mesh(device.type, (1,))
    for block in ref.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(ref, mesh=mesh, mp_policy=policy)
    return ref, torch.optim.AdamW(ref.parameters(), lr=1e-4, weight_decay=0.01, fused=True)


def _timed(step: Callable[[], None], device: torch.device) -> tuple[float, float]:
    """Wall-clock and process CPU seconds of one step."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    wall, cpu = time.perf_counter(), time.process_time()
    step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - wall, time.process_time() - cpu


def _spread(xs: list[float]) -> str:
    q = statistics.quantiles(xs, n=4) if len(xs) > 1 else [xs[0]] * 3
    return f"median {statistics.median(xs):.3f} (IQR {q[0]:.3f}-{q[2]:.3f}, min {min(xs):.3f}, max {max(xs):.3f})"


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    b = build(a)
    # Alternate the sides every step (and which goes first) so drift in machine load hits both alike.
    wall: dict[str, list[float]] = {"ours": [], "ref": []}
    cpu: dict[str, list[float]] = {"ours": [], "ref": []}
    sides = [("ours", b.ours), ("ref", b.reference)]
    for i in range(a.warmup + a.iters):
        for name, step in sides if i % 2 == 0 else sides[::-1]:
            w, c = _timed(step, b.device)
            if i >= a.warmup:
                wall[name].append(w)
                cpu[name].append(c)
    mo, mr = statistics.median(wall["ours"]), statistics.median(wall["ref"])
    tokens = a.batch * a.seq
    fpt = flops_per_token(b.arch, a.seq)
    threads = torch.get_num_threads() if b.device.type == "cpu" else "-"
    print(f"model: hidden {a.hidden}, layers {a.layers}, heads {a.heads}/{b.arch.kv_heads}, vocab {a.vocab}, "
          f"seq {a.seq}, batch {a.batch}, {a.dtype} on {b.device} ({threads} threads); "
          f"FLOPs/token = 6*N + 12*L*H*S = {fpt:.3e}; {a.iters} steps per side after {a.warmup} warm-up")  # fmt: skip
    if a.reference == "fsdp2":
        print(f"ours: {'bf16 weights updated directly' if a.no_master_weights else 'fp32 master weights'}, "
              "clipping at 1.0; reference: torchtitan's recipe (fully_shard with bf16 compute and fp32 reduction, "
              "fp32 weights, fused AdamW, clip_grad_norm_ at 1.0)")  # fmt: skip
    elif a.dtype != "fp32":
        print(f"ours: {'bf16 weights updated directly' if a.no_master_weights else 'fp32 master weights'}; "
              "reference: bf16 weights updated directly (torch.optim.AdamW, foreach)")  # fmt: skip
    print(f"ours      {mo * 1e3:9.2f} ms/step  {tokens / mo:10.0f} tokens/s  {tokens * fpt / mo / 1e12:.3f} TFLOP/s")
    print(f"reference {mr * 1e3:9.2f} ms/step  {tokens / mr:10.0f} tokens/s  {tokens * fpt / mr / 1e12:.3f} TFLOP/s")
    paired = [o / r for o, r in zip(wall["ours"], wall["ref"])]
    print(f"wall ratio ours/reference = {mo / mr:.3f} (target <= 1.05); per-step pairs {_spread(paired)}")
    if b.device.type == "cpu":
        # CPU time is what each side computed; wall time adds waiting for the cores on a shared machine.
        co, cr = statistics.median(cpu["ours"]), statistics.median(cpu["ref"])
        paired = [o / r for o, r in zip(cpu["ours"], cpu["ref"])]
        print(
            f"cpu-time  ours {co * 1e3:.2f} ms, reference {cr * 1e3:.2f} ms, ratio = {co / cr:.3f}; "
            f"per-step pairs {_spread(paired)}"
        )
    peak = a.peak_tflops or (card_peak_tflops(b.device) if a.dtype == "bf16" else None)
    if peak:
        print(
            f"MFU ours = {tokens * fpt / mo / 1e12 / peak:.1%}, reference = {tokens * fpt / mr / 1e12 / peak:.1%} "
            f"of {peak} TFLOP/s"
        )
    if b.device.type == "cuda":
        print(f"device: {torch.cuda.get_device_name(b.device)}; torch {torch.__version__}; peak memory "
              f"{torch.cuda.max_memory_allocated(b.device) / 2**30:.1f} GiB (both sides)")  # fmt: skip
    if a.trace:
        trace({"transformer_step": b.ours, "reference_step": b.reference}, b.device, a.trace, "transformer_step")
    b.topo.destroy()


def trace(sides: dict[str, Callable[[], None]], device: torch.device, folder: str, chrome: str | None = None) -> None:
    """Profile 3 steps of each side (CPU and CUDA activity): the top 60 operators of each in
    ``folder/<side>_top_ops.txt`` (our step's phases are the rows ``train_step: schedule`` and
    ``train_step: optimizer``; torch.optim's is ``Optimizer.step#...``), and side ``chrome``'s
    trace in ``folder/<chrome>_trace.json.gz`` (chrome://tracing or Perfetto). On a GPU each
    file begins with, and the output gets a line of, where the device sat idle
    (:func:`device_idle`)."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    os.makedirs(folder, exist_ok=True)
    sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    for name, step in sides.items():
        with torch.profiler.profile(activities=activities) as prof:
            for _ in range(3):
                step()
            if device.type == "cuda":
                torch.cuda.synchronize()
        path = os.path.join(folder, f"{name}_trace.json.gz" if name == chrome else f".{name}_trace.json")
        prof.export_chrome_trace(path)
        idle = device_idle(_trace_events(path))
        if name != chrome:
            os.remove(path)
        with open(os.path.join(folder, f"{name}_top_ops.txt"), "w") as f:
            if idle:
                f.write("\n".join(idle) + "\n\n")
            f.write(prof.key_averages().table(sort_by=sort, row_limit=60, max_name_column_width=60))
        if idle:
            print(f"{name}: {idle[0]}; {idle[1]}")
    print(f"profiles of 3 steps: {', '.join(f'{folder}/{n}_top_ops.txt' for n in sides)}")


_DEVICE_WORK = ("kernel", "gpu_memcpy", "gpu_memset")


def _trace_events(path: str) -> list[tuple[str, str, float, float]]:
    """``(category, name, start, end)`` in microseconds of a chrome trace's complete events."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        events = json.load(f)["traceEvents"]
    return [(e["cat"], e["name"], e["ts"], e["ts"] + e["dur"]) for e in events if e.get("ph") == "X" and "cat" in e]


def device_idle(events: list[tuple[str, str, float, float]], top: int = 8) -> list[str] | None:
    """Where the device waited in a profiler trace (:func:`_trace_events`); None without device work.

    The device is busy while any kernel, copy or memset runs; each hole between the first and
    the last is idle time (the host was not feeding it: Python, a host-side operator, a wait
    for the host). A hole is charged to the innermost ``record_function`` range around its
    middle on the host (``train_step: schedule`` / ``train_step: optimizer``, torch.optim's
    ``Optimizer.step#...``) and described by the host operators that started during it.
    Lines: the busy share, idle time by range, the ``top`` largest holes.
    """
    spans = sorted((start, end) for cat, _, start, end in events if cat in _DEVICE_WORK)
    if not spans:
        return None
    holes, busy, reached = [], 0.0, spans[0][0]
    for start, end in spans:
        if start > reached:
            holes.append((reached, start))
        busy += max(0.0, end - max(start, reached))
        reached = max(reached, end)
    wall = reached - spans[0][0]
    ranges = [(start, end, name) for cat, name, start, end in events if cat == "user_annotation"]

    def range_at(t: float) -> str:
        inside = [(start, name) for start, end, name in ranges if start <= t <= end]
        return max(inside)[1] if inside else "(outside any range)"

    by_range: dict[str, float] = {}
    for a, b in holes:
        name = range_at((a + b) / 2)
        by_range[name] = by_range.get(name, 0.0) + b - a
    lines = [
        f"device busy {busy / 1e3:.2f} ms of {wall / 1e3:.2f} ms ({busy / wall:.1%}); "
        f"idle {(wall - busy) / 1e3:.2f} ms in {len(holes)} holes",
        "idle by range: "
        + ", ".join(f"{n} {t / 1e3:.2f} ms" for n, t in sorted(by_range.items(), key=lambda x: -x[1])),
    ]
    for a, b in sorted(holes, key=lambda h: h[0] - h[1])[:top]:
        started = dict.fromkeys(name for cat, name, start, _ in events if cat == "cpu_op" and a <= start < b)
        names = ", ".join(list(started)[:12]) or "none"
        lines.append(f"  hole {(b - a) / 1e3:.3f} ms in {range_at((a + b) / 2)}; host operators started: {names}")
    return lines


if __name__ == "__main__":
    main()
