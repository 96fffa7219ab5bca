"""Model-state bytes per rank for fp32 AdamW at DP = 2, ZeRO 0-3, against the ZeRO paper's theory.

Run: python bench/model_state_bytes.py [--hidden 256] [--layers 4]

Two gloo ranks train an MLP for one step per ZeRO stage. After ``backward`` and the DP
gradient reduction (gradients present, before ``step``) each rank sums the storage bytes (not RSS) of

- parameters: each parameter's storage (0 once ZeRO-3 has freed it) plus ZeRO-3's owned shard,
- gradients: ``param.grad`` plus the ZeRO-2/3 reduced gradient shards,
- optimizer state: Adam moments and (bf16/fp16 runs only) fp32 master weights,

and prints them in units of Ψ (the parameter count) next to the theory for fp32 AdamW
at DP = 2: 4+4+8 = 16Ψ replicated, 4+4+4 = 12Ψ ZeRO-1, 4+2+4 = 10Ψ ZeRO-2, 2+2+4 = 8Ψ
ZeRO-3. Transient communication buffers (bounded by the bucket size) are not counted.

A last row runs ZeRO-3 as HSDP on 4 ranks (``data_parallel_shard_size=2``: shard over 2,
replicate twice): every model-state byte is split over the shard group only, 16Ψ / 2 = 8Ψ.

With CUDA, two more rows run ZeRO-1 and ZeRO-3 with ``cpu_offload`` on one GPU per rank (up
to 2): the master copy and the moments move to pinned host memory, so the optimizer state
on the device is 0 and the total grows by the fp32 master copy (4Ψ/DP): ZeRO-1 4 + 4 +
12/DP, ZeRO-3 20/DP.

ZeRO-3 rows also print the *peak* of the same sum during the step: it is sampled after
every hook of the forward and backward (each block's forward pre- and post-hook, each
gradient's accumulation), so it sees the gathered layer and its full gradient. The bound:
the end-of-backward figure plus one whole layer's parameters and one layer's full
gradients (4 + 4 bytes per element of the largest layer, U): with prefetch the next
layer's gather is a communication buffer until that layer starts, when the previous one
is already freed.
"""

from __future__ import annotations

import argparse
import os

import torch

from scaling.nn import ParameterMeta
from scaling.optim import Optimizer, OptimizerConfig, OptimizerParamGroup, OptimizerParamGroupConfig
from scaling.testing import make_topology, run_distributed

THEORY = {0: 16.0, 1: 12.0, 2: 10.0, 3: 8.0}


def _bytes(*tensors: torch.Tensor | None) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views of one buffer count once)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors if t is not None}
    return sum(storages.values())


def _on_device(tensors: list[torch.Tensor | None], device: torch.device) -> list[torch.Tensor | None]:
    return [t for t in tensors if t is not None and t.device == device]


def measure(
    zero: int, hidden: int, layers: int, shard: int | None = None, offload: bool = False, device_type: str = "cpu"
) -> dict[str, float]:
    device = torch.device(device_type, int(os.environ.get("LOCAL_RANK", "0")) if device_type == "cuda" else None)
    if device.type == "cuda":  # one GPU per rank
        torch.cuda.set_device(device)
    topo = make_topology(data_parallel_shard_size=shard, device=device.type)
    torch.manual_seed(0)
    blocks = [torch.nn.Sequential(torch.nn.Linear(hidden, hidden), torch.nn.GELU()).to(device) for _ in range(layers)]
    model = torch.nn.Sequential(*blocks)
    triples = []
    for index, block in enumerate(blocks):
        for name, p in block.named_parameters():
            meta = ParameterMeta(name, tuple(p.shape), layer_index=index).attach(p).parameter_meta
            triples.append((meta.key, p, meta))
    psi = sum(p.numel() for p in model.parameters())
    opt = Optimizer(
        config=OptimizerConfig(zero_stage=zero, cpu_offload=offload),
        parameter_groups=[OptimizerParamGroup(triples, OptimizerParamGroupConfig(name="all"))],
        topology=topo,
        zero3_modules=blocks if zero == 3 else None,
    )

    def stored() -> int:
        params = sum(_bytes(p) for p in model.parameters()) + _bytes(*(s.param_shard for s in opt.slots))
        grads = _bytes(*(p.grad for p in model.parameters()), *(s.grad_shard for s in opt.slots))
        return params + grads + _bytes(*(t for s in opt.slots for t in [*s.state.values(), s.master]))

    peak = [0]

    def sample(*_: object) -> None:
        peak[0] = max(peak[0], stored())

    for block in blocks:  # registered after the optimizer's hooks, so they run after them
        block.register_forward_pre_hook(sample)
        block.register_forward_hook(sample)
    for param in model.parameters():
        param.register_post_accumulate_grad_hook(sample)
    opt.zero_grad()
    opt.backward(model(torch.randn(8, hidden, device=device)).pow(2).mean())
    # ZeRO 1/2 reduce-scatter buckets overlapped with backward: wait until every owned
    # gradient shard has arrived (in-flight buckets are transient communication buffers).
    opt.finish_gradient_reduction()
    sample()
    params = sum(_bytes(p) for p in model.parameters()) + _bytes(*(s.param_shard for s in opt.slots))
    grads = _bytes(*(p.grad for p in model.parameters()), *(s.grad_shard for s in opt.slots))
    state_tensors = [t for s in opt.slots for t in [*s.state.values(), s.master]]
    state = _bytes(*state_tensors)
    state_on_device = _bytes(*_on_device(state_tensors, device))
    opt.step()
    largest = max(sum(p.numel() for p in block.parameters()) for block in blocks)
    return {
        "psi": psi,
        "params": params / psi,
        "grads": grads / psi,
        "state": state / psi,
        "state_on_device": state_on_device / psi,
        "peak": peak[0] / psi,
        "peak_bound": (params + grads + state + 8 * largest) / psi,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()
    print("fp32 AdamW, DP=2, bytes per rank in units of Ψ (parameter count)")
    print(f"{'ZeRO':>10} {'rank':>4} {'params':>8} {'grads':>8} {'state':>8} {'total':>8} {'theory':>7} {'error':>8}")
    worst = 0.0
    runs = [(zero, 2, None, str(zero), THEORY[zero]) for zero in range(4)] + [(3, 4, 2, "3 HSDP 2×2", 8.0)]
    for zero, world, shard, label, theory in runs:
        results = run_distributed(measure, world, zero, args.hidden, args.layers, shard, timeout_seconds=300)
        for rank, r in enumerate(results):
            total = r["params"] + r["grads"] + r["state"]
            err = total / theory - 1
            worst = max(worst, abs(err))
            peak = f" peak {r['peak']:.3f}Ψ (bound {r['peak_bound']:.3f}Ψ)" if zero == 3 else ""
            print(
                f"{label:>10} {rank:>4} {r['params']:>7.3f}Ψ {r['grads']:>7.3f}Ψ {r['state']:>7.3f}Ψ "
                f"{total:>7.3f}Ψ {theory:>6.0f}Ψ {err:>+8.4%}{peak}"
            )
    print(f"Ψ = {int(r['psi']):,}; worst deviation from theory {worst:.4%} (goal: within 1%)")
    if not torch.cuda.is_available():
        print("CPU offload rows: need CUDA (on a CPU run the host is the device); skipped")
        return
    world = min(2, torch.cuda.device_count())
    print(f"CPU offload, DP={world} on CUDA (NCCL): state = fp32 master + Adam moments, in pinned host memory")
    print(f"{'ZeRO':>10} {'rank':>4} {'params':>8} {'grads':>8} {'state':>8} {'total':>8} {'theory':>7} {'error':>8}")
    worst = 0.0
    for zero, theory in ((1, 8 + 12 / world), (3, 20 / world)):
        results = run_distributed(
            measure, world, zero, args.hidden, args.layers, None, True, "cuda", backend="nccl", timeout_seconds=300
        )
        for rank, r in enumerate(results):
            total = r["params"] + r["grads"] + r["state"]
            err = total / theory - 1
            worst = max(worst, abs(err))
            print(
                f"{f'{zero} offload':>10} {rank:>4} {r['params']:>7.3f}Ψ {r['grads']:>7.3f}Ψ {r['state']:>7.3f}Ψ "
                f"{total:>7.3f}Ψ {theory:>6.1f}Ψ {err:>+8.4%}  state on the device {r['state_on_device']:.3f}Ψ"
            )
    print(f"worst deviation from theory {worst:.4%} (goal: within 1%); state on the device: goal 0")


if __name__ == "__main__":
    main()
