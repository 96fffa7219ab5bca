"""The transformer app's step eager and compiled, against a compiled plain-PyTorch model, in one run.

python bench/compile_step.py                       # CPU default: hidden 256, 4 layers, seq 256, batch 8, inductor
python bench/compile_step.py --hidden 2048 --layers 16 --heads 16 --vocab 32000 --seq 2048 --batch 4 \
    --device cuda --dtype bf16 --iters 10           # ~1B parameters on a GPU; add --fp8 for float8 linears

Three sides on the same shapes and batch (see bench/transformer_step.py for the model and its
plain-PyTorch twin): ours eager, ours with ``compile=CompileConfig(enabled=True)`` (every layer
compiled, identical blocks sharing one graph), and the reference with each block compiled by
``torch.compile`` (torchtitan's regional compilation); both compiled sides compile their loss too
(``CompileConfig.loss``, torchtitan's ``compile.components = ["model", "loss"]``; ``--eager-loss``: neither
does). ``--fp8`` puts our compiled side's
column- and row-parallel linears in float8 (tensorwise; the reference stays in --dtype).
The first step of each compiled side is timed apart (the compile), after a small layer's
compilation has paid what any first compilation in a process costs; then the sides alternate
step by step. Prints median step times, tokens/s, MFU (with a known card or --peak-tflops),
peak memory on CUDA, and the ratios compiled/eager and ours/reference (target <= 1.03).
``--profile DIR`` then profiles 3 steps of each compiled side (``compiled_ours_top_ops.txt``,
``compiled_reference_top_ops.txt``: where the compiled step's time goes, phase by phase).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from transformer_step import _timed, build, card_peak_tflops, ref_loss, trace  # noqa: E402
from transformer_step import parse_args as step_args  # noqa: E402

from scaling.nn import CompileConfig, Float8Config, compile_layer  # noqa: E402
from scaling.transformer.model import flops_per_token  # noqa: E402


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0], add_help=False)
    p.add_argument("--backend", default="inductor", help="torch.compile backend of both compiled sides")
    p.add_argument("--fp8", action="store_true", help="our compiled side's linears in float8 (tensorwise)")
    p.add_argument("--eager-loss", action="store_true", help="keep both compiled sides' loss functions eager")

    p.add_argument("--profile", default=None, help="folder for the top operators of 3 steps of both compiled sides")
    if {"-h", "--help"} & set(sys.argv[1:] if argv is None else argv):
        p.print_help()  # then bench/transformer_step.py's options, which it takes too
        print()
    return p.parse_known_args(argv)


def main(argv: list[str] | None = None) -> None:
    own, rest = parse_args(argv)
    a = step_args(rest)
    config = CompileConfig(enabled=True, backend=own.backend, loss=not own.eager_loss)
    eager = build(a)  # ours eager and the reference
    compiled = build(
        a, topo=eager.topo, compile=config, fp8=Float8Config(enabled=True) if own.fp8 else None, reference=False
    )
    assert eager.ref_model is not None
    for block in eager.ref_model.blocks:  # torchtitan's regional compilation of the reference, and its loss
        compile_layer(block, config)
    if config.loss:
        eager.ref_model.loss = torch.compile(ref_loss, backend=config.backend)
    sides = {"eager": eager.ours, "compiled": compiled.ours, "reference": eager.reference}
    # What a process pays once for its first compilation, whatever it compiles (inductor's and
    # AOTAutograd's imports, the C++ toolchain's checks, the caches' set-up: ~3.5 s on the CPU
    # box), paid here on a small linear layer, so that neither side's first step carries it
    # (it went to whichever side ran first: ours 5.3 s and the reference 1.7 s, or, swapped,
    # ours 2.1 s and the reference 4.7 s, on 2026-11-28).
    warm = torch.nn.Linear(8, 8, device=eager.device)
    torch.compile(warm, backend=config.backend)(torch.randn(2, 8, device=eager.device)).sum().backward()
    compile_seconds = {}
    for name in ("compiled", "reference"):
        t0 = time.perf_counter()
        sides[name]()
        compile_seconds[name] = time.perf_counter() - t0
    wall: dict[str, list[float]] = {k: [] for k in sides}
    order = list(sides)
    for i in range(a.warmup + a.iters):
        for name in order if i % 2 == 0 else order[::-1]:
            w, _ = _timed(sides[name], eager.device)
            if i >= a.warmup:
                wall[name].append(w)
    med = {k: statistics.median(v) for k, v in wall.items()}
    tokens, fpt = a.batch * a.seq, flops_per_token(eager.arch, a.seq)
    threads = torch.get_num_threads() if eager.device.type == "cpu" else "-"
    fp8 = " + fp8 linears (ours compiled)" if own.fp8 else ""
    loss = "eager" if own.eager_loss else "compiled"
    print(
        f"model: hidden {a.hidden}, layers {a.layers}, heads {a.heads}, vocab {a.vocab}, seq {a.seq}, batch "
        f"{a.batch}, {a.dtype}{fp8} on {eager.device} ({threads} threads); backend {own.backend}, loss {loss}, "
        f"reference recipe {a.reference}; "
        f"{a.iters} steps per side after {a.warmup} warm-up; torch {torch.__version__}"
    )
    print(
        f"first step (compile): ours {compile_seconds['compiled']:.1f} s, reference {compile_seconds['reference']:.1f} s; "
        f"ratio {compile_seconds['compiled'] / compile_seconds['reference']:.2f} (target <= 1.5 with a warm cache)"
    )
    peak = a.peak_tflops or (card_peak_tflops(eager.device) if a.dtype == "bf16" else None)
    for name, label in (("eager", "ours eager"), ("compiled", "ours compiled"), ("reference", "reference compiled")):
        t = med[name]
        mfu = f"  MFU {tokens * fpt / t / 1e12 / peak:.1%}" if peak else ""
        print(
            f"{label:20s} {t * 1e3:9.2f} ms/step {tokens / t:10.0f} tokens/s {tokens * fpt / t / 1e12:.3f} TFLOP/s{mfu}"
        )
    print(f"compiled/eager (ours) = {med['compiled'] / med['eager']:.3f}")
    print(f"ours compiled / reference compiled = {med['compiled'] / med['reference']:.3f} (target <= 1.03)")
    if eager.device.type == "cuda":
        print(f"device: {torch.cuda.get_device_name(eager.device)}; peak memory "
              f"{torch.cuda.max_memory_allocated(eager.device) / 2**30:.1f} GiB (all sides)")  # fmt: skip
    if own.profile:
        trace({"compiled_ours": sides["compiled"], "compiled_reference": sides["reference"]}, eager.device, own.profile)
    eager.topo.destroy()


if __name__ == "__main__":
    main()
