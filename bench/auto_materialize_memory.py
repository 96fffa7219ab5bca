"""Per-rank peak memory of materialising a deferred model through ``parallelize``.

Run: python bench/auto_materialize_memory.py --world-size 8 --tp 8 --layers 16 --hidden 2048
(the ~4 GB fp32 Llama of docs/benchmarks.md; ``--layers 4 --hidden 512 --vocab 8000
--world-size 4 --tp 4`` is a ~100 MB smoke run).

Every rank builds the model with ``deferred_init`` (meta device), plans it with
``generate_plan`` and materialises its own shards inside ``parallelize``. Around that call
each rank resets its peak resident set (``/proc/self/clear_refs``) and reads the growth
of ``VmHWM`` over ``VmRSS`` before it: the memory materialisation itself needed at its
peak. Printed per rank next to its shard (local parameter bytes) and the stated overhead
(the largest single module's full parameters, which ``materialize`` allocates before
keeping its shard, plus a fixed 64 MiB for allocator slack and process-group buffers).
The whole model's bytes are printed for comparison; no rank comes near them.
"""

from __future__ import annotations

import argparse
import json

import torch

SLACK_BYTES = 64 << 20


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status (Linux only)")


def measure(config_kwargs: dict, constraints: dict) -> dict:
    """On each rank: deferred_init, generate_plan, parallelize; return the memory figures."""
    import gc

    from transformers import LlamaConfig, LlamaForCausalLM

    from scaling.trainer.auto import deferred_init, generate_plan, parallelize

    torch.set_num_threads(1)
    model = deferred_init(LlamaForCausalLM, LlamaConfig(**config_kwargs))
    whole = sum(p.numel() * p.element_size() for p in model.parameters())
    largest = max(sum(p.numel() * p.element_size() for p in m.parameters(recurse=False)) for m in model.modules())
    plan = generate_plan(model, constraints)
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current VmRSS
    before = _status_kib("VmRSS")
    model, _, _, _ = parallelize(plan, model, lambda m: torch.optim.SGD(m.parameters(), lr=0.1), None, None)
    peak = _status_kib("VmHWM") - before
    shard = sum(p.numel() * p.element_size() for p in model.parameters())
    return {
        "rank": torch.distributed.get_rank(),
        "peak_growth_bytes": peak * 1024,
        "shard_bytes": shard,
        "overhead_bytes": largest + SLACK_BYTES,
        "whole_model_bytes": whole,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world-size", type=int, default=8)
    parser.add_argument("--tp", type=int, default=8)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=32000)
    args = parser.parse_args()
    from scaling.testing import run_distributed

    config = {
        "vocab_size": args.vocab,
        "hidden_size": args.hidden,
        "intermediate_size": args.hidden * 11 // 4,
        "num_hidden_layers": args.layers,
        "num_attention_heads": args.hidden // 128 if args.hidden >= 1024 else 8,
        "max_position_embeddings": 256,
    }
    dp = args.world_size // (args.tp * args.pp)
    constraints = {"tensor_parallel.size": args.tp, "pipeline_parallel.size": args.pp, "data_parallel_size": dp}
    results = run_distributed(measure, args.world_size, config, constraints, timeout_seconds=1500)
    mib = 1 << 20
    print(f"config {json.dumps(config)} constraints {json.dumps(constraints)}")
    print(f"whole model: {results[0]['whole_model_bytes'] / mib:.0f} MiB (fp32)")
    print("rank  peak_growth_MiB  shard_MiB  overhead_MiB  peak/shard  peak/(shard+overhead)  peak/whole")
    for r in results:
        peak, shard, over = r["peak_growth_bytes"], r["shard_bytes"], r["overhead_bytes"]
        print(
            f"{r['rank']:>4}  {peak / mib:>15.0f}  {shard / mib:>9.0f}  {over / mib:>12.0f}  {peak / shard:>10.2f}"
            f"  {peak / (shard + over):>21.2f}  {peak / r['whole_model_bytes']:>10.2f}"
        )
    worst = max(r["peak_growth_bytes"] / (r["shard_bytes"] + r["overhead_bytes"]) for r in results)
    print(f"max over ranks of peak/(shard+overhead): {worst:.2f} ({'within' if worst < 1 else 'OVER'} the bound)")


if __name__ == "__main__":
    main()
