"""`scaling-transformer` (or `python -m scaling.transformer`): preprocess | train | generate | import-hf | export-hf | presets | memory | plan.

scaling-transformer preprocess                      # build the default corpus and tokenizer
scaling-transformer train                           # train the bundled config (1 CPU process)
scaling-transformer train my.yml topology.model_parallel_size=2 runner.nproc_per_node=2
scaling-transformer train --template                # every setting, commented
scaling-transformer generate --checkpoint runs/transformer/checkpoints --prompt "def "
scaling-transformer import-hf HF_DIR OUT_DIR        # Llama/Qwen/Mixtral safetensors -> our checkpoint + config.yml
scaling-transformer export-hf OUT_DIR HF_DIR        # ours -> the family's config.json + safetensors
scaling-transformer export-hf CKPT HF_DIR --peft-dir ADAPTER_DIR   # + the LoRA adapter in PEFT format
scaling-transformer presets                         # the named architectures (transformer_architecture.preset)
scaling-transformer memory my.yml topology.model_parallel_size=8    # model-state and activation bytes per rank, per stage
scaling-transformer memory my.yml --machine h100-sxm-node          # ... and the predicted step time and tokens/s
scaling-transformer plan my.yml --machine h100-sxm-node --devices 8 --device-memory 80   # layouts ranked by tokens/s
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from scaling.transformer.corpus import DEFAULT_VOCAB_SIZE, default_paths

if TYPE_CHECKING:  # imported when used: torch takes seconds to import, the first line does not wait
    from scaling.trainer.planning import MachineProfile
    from scaling.transformer.config import TransformerConfig

DEFAULT_CONFIG = Path(__file__).with_name("config.yml")


def load_config(path: str | Path, overrides: list[str]) -> TransformerConfig:
    """Validate the config, the process count and the data before anything launches."""
    from scaling.transformer.config import TransformerConfig
    from scaling.transformer.data import open_tokens
    from scaling.transformer.model import check_fp8

    config = TransformerConfig.from_file(path, overrides=overrides)
    check_fp8(config)
    world_size = config.topology.world_size
    assert world_size is not None  # derived by TopologyConfig's validation when not given
    config.runner.check_world_size(world_size)
    if config.data.finetuning_jsonl is not None or config.data.blend:
        from scaling.transformer.datasets import build_datasets

        # Reads, tokenises and checks the examples / token files here, not in N processes after launch.
        build_datasets(config)
        return config
    prefix = config.data.data_prefix
    if prefix is None:
        prefix = default_paths(config.data.default_corpus_dir)["train"]
        if not Path(f"{prefix}.idx").is_file():
            raise FileNotFoundError(
                f"data.data_prefix is null and the default corpus is missing in data.default_corpus_dir="
                f"{str(config.data.default_corpus_dir)!r}; run `scaling-transformer preprocess` first"
            )
    # Checks every token id against the model's vocabulary here, not in N processes after launch.
    open_tokens(prefix, config.transformer_architecture.vocab_size, "data.data_prefix")
    return config


def _train(args: argparse.Namespace) -> int:
    from scaling.runner import runner_main

    if args.template:
        from scaling.transformer.config import TransformerConfig

        print(TransformerConfig.template())
        return 0
    if "=" in args.config and not Path(args.config).exists():  # `scaling-transformer train trainer.x=1`
        args.overrides, args.config = [args.config, *args.overrides], str(DEFAULT_CONFIG)
    print(
        f"scaling-transformer: checking {args.config}" + (f" with {' '.join(args.overrides)}" if args.overrides else "")
    )
    sys.stdout.flush()
    try:
        config = load_config(args.config, args.overrides)
    except (ValueError, FileNotFoundError) as exc:
        print(f"scaling-transformer: invalid config: {exc}", file=sys.stderr)
        return 2
    print(f"scaling-transformer: launching {config.describe_launch()}", flush=True)
    return runner_main(config.runner, payload=config.as_dict(), exit_on_failure=False)


def _preprocess(args: argparse.Namespace) -> int:
    from scaling.transformer.corpus import preprocess

    summary = preprocess(args.output, vocab_size=args.vocab_size)
    for split in ("train", "validation"):
        s = summary[split]
        print(f"{split}: {s['documents']} documents, {s['tokens']} tokens -> {s['prefix']}.bin/.idx")
    print(f"tokenizer: {summary['tokenizer']} (vocab {summary['vocab_size']}, Python {summary['python']} sources)")
    return 0


def _generate(args: argparse.Namespace) -> int:
    from scaling.transformer.generate import generate_text

    texts = generate_text(
        args.checkpoint,
        args.prompt or [""],
        tokenizer_path=args.tokenizer,
        config_path=args.config,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
    )
    for text in texts:
        print(text)
        print("-" * 40)
    return 0


def _import_hf(args: argparse.Namespace) -> int:
    from scaling.transformer.hf import import_hf

    out = import_hf(args.hf_dir, args.output)
    print(f"imported {args.hf_dir} -> {out} (config.yml and checkpoint)")
    return 0


def _export_hf(args: argparse.Namespace) -> int:
    from scaling.transformer.hf import export_hf

    if args.peft_dir is not None:  # refused before the base model is written, not after
        from scaling.transformer.hf import check_peft_exportable

        check_peft_exportable(args.checkpoint, args.config)
    out = export_hf(args.checkpoint, args.output, config_path=args.config, tokenizer=args.tokenizer)
    if (out / "tokenizer.json").is_file():
        print(f"exported {args.checkpoint} -> {out} (config.json, model.safetensors, tokenizer; base weights only)")
    else:
        print(f"exported {args.checkpoint} -> {out} (config.json, model.safetensors; base weights only)")
        print("no tokenizer found (data.tokenizer_path, or the default corpus's); pass --tokenizer to ship one")
    if args.peft_dir is not None:
        from scaling.transformer.hf import export_peft

        adapter = export_peft(args.checkpoint, args.peft_dir, config_path=args.config)
        print(f"exported the LoRA adapter -> {adapter} (adapter_config.json, adapter_model.safetensors)")
    return 0


def _presets(args: argparse.Namespace) -> int:
    from scaling.transformer.config import TransformerArchitectureConfig
    from scaling.transformer.hf import FAMILIES, family_of
    from scaling.transformer.presets import PRESETS

    print(f"{'preset':<16} {'exports as':<20} {'layers':>6} {'hidden':>6} {'parameters':>15} {'active':>15}")
    for name in PRESETS:
        arch = TransformerArchitectureConfig(preset=name)
        family = FAMILIES[family_of(arch)].architecture
        print(
            f"{name:<16} {family:<20} {arch.num_layers:>6} {arch.hidden_size:>6} "
            f"{arch.num_parameters():>15,} {arch.num_parameters(active=True):>15,}"
        )
    return 0


T = TypeVar("T")


def _per_stage(fn: Callable[[int], T], stages: int, notes: list[str]) -> list[T] | None:
    """``fn(stage)`` for each stage, or None with the refusal's message added to ``notes``."""
    try:
        return [fn(stage) for stage in range(stages)]
    except ValueError as err:
        notes.append(str(err))
        return None


def _positive_gib(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"--device-memory={text!r}: give the device's memory in GiB, a number > 0")
    return value


def _print_step_time(config: TransformerConfig, profile: MachineProfile) -> None:
    from scaling.transformer.steptime import step_time

    try:
        t = step_time(config, profile)
    except ValueError as err:
        print(f"step time not predicted: {err}")
        return
    c = t.chunk
    print(
        f"step time on {profile.name}: {t.total:.4g} s (pipeline {t.pipeline:.4g}, DP reduction left {t.reduction:.4g}, "
        f"update {t.optimizer:.4g}; a micro-batch through the slowest chunk: forward {c.forward:.4g}, backward "
        f"{c.backward:.4g}, of which communication {c.forward_communication:.4g} and {c.backward_communication:.4g}), "
        f"{t.tokens_per_second_per_device:,.0f} tokens/s per device"
    )


def _memory(args: argparse.Namespace) -> int:
    from scaling.trainer.planning import MachineProfile, rank_memory
    from scaling.transformer.config import TransformerConfig
    from scaling.transformer.memory import activation_memory, memory_inputs, method_of, peak_memory

    if "=" in args.config and not Path(args.config).exists():  # `scaling-transformer memory topology.x=1`
        args.overrides, args.config = [args.config, *args.overrides], str(DEFAULT_CONFIG)
    config = TransformerConfig.from_file(args.config, overrides=args.overrides)
    profile = None
    if args.machine is not None:
        try:
            profile = MachineProfile.load(args.machine)
        except ValueError as err:
            print(f"--machine: {err}", file=sys.stderr)
            return 2
    specs, layout = memory_inputs(config)
    gib = 2**30
    arch, opt = config.transformer_architecture, config.optimizer
    sizes = " ".join(f"{k}{v}" for k, v in (("tp", layout.tp), ("pp", layout.pp), ("dp", layout.dp), ("cp", layout.cp),
                                             ("ep", layout.ep)) if v > 1) or "one process"  # fmt: skip
    print(
        f"model state per rank at {sizes}, ZeRO-{opt.zero_stage}{', offload' if opt.cpu_offload else ''}, "
        f"{arch.precision}, {opt.method}: {arch.num_parameters():,} parameters"
    )
    device = "cpu" if config.topology.device == "cpu" else "cuda"
    notes: list[str] = []
    activations = _per_stage(lambda stage: activation_memory(config, stage, device).peak, layout.pp, notes)
    peaks = _per_stage(lambda stage: peak_memory(config, stage, device), layout.pp, notes) if activations else None
    peak = None if peaks is None else [p.peak for p in peaks]
    print(
        f"{'stage':>5} {'parameters':>11} {'gradients':>11} {'master':>11} {'state':>11} {'device':>11} {'host':>11} "
        f"{'activations':>11} {'peak':>11}  GiB, first rank of the stage"
    )
    for stage in range(layout.pp):
        m = rank_memory(specs, layout, config.optimizer, stage, method_of=method_of(config))
        extra = " ".join(f"{'-':>11}" if got is None else f"{got[stage] / gib:>11.3f}" for got in (activations, peak))
        print(
            f"{stage:>5} {m.parameters / gib:>11.3f} {m.gradients / gib:>11.3f} {m.master / gib:>11.3f} "
            f"{m.state / gib:>11.3f} {m.device / gib:>11.3f} {m.host / gib:>11.3f} {extra}"
        )
    for note in notes:
        print(f"not predicted: {note}")
    if profile is not None:
        _print_step_time(config, profile)
    if args.device_memory is None:
        return 0
    if peaks is None:
        print(f"--device-memory {args.device_memory:g}: cannot tell whether it fits (the peak is not predicted)")
        return 2
    worst = max(peaks, key=lambda p: p.peak)
    budget = args.device_memory * gib
    if worst.peak <= budget:
        print(f"fits: the largest peak, stage {worst.stage}'s, is {worst.peak / gib:.3f} of {args.device_memory:g} GiB")
        return 0
    state = worst.model_state
    if worst.moment == "backward":
        parts = (f"backward: model state without gradients {(state.device - state.gradients) / gib:.3f}, activations "
                 f"and gradients made {worst.activations / gib:.3f}, the loss's gradient {worst.transient / gib:.3f}")  # fmt: skip
    else:
        transient = "the DP reduction's buckets" if worst.moment == "reduction" else "fp32 gradient copies"
        parts = f"{worst.moment}: model state {state.device / gib:.3f}, {transient} {worst.transient / gib:.3f}"
    print(
        f"does not fit: stage {worst.stage} peaks at {worst.peak / gib:.3f} GiB ({parts}), "
        f"{(worst.peak - budget) / gib:.3f} GiB over {args.device_memory:g} GiB; shard more (optimizer.zero_stage, "
        "topology.model_parallel_size or pipe_parallel_size), checkpoint activations "
        "(transformer_architecture.activation_checkpointing) or lower topology.micro_batch_size"
    )
    return 1


def _plan(args: argparse.Namespace) -> int:
    from scaling.trainer.planning import MachineProfile
    from scaling.transformer.config import TransformerConfig
    from scaling.transformer.plan import rank_plans

    if "=" in args.config and not Path(args.config).exists():  # `scaling-transformer plan topology.x=1`
        args.overrides, args.config = [args.config, *args.overrides], str(DEFAULT_CONFIG)
    try:
        profile = MachineProfile.load(args.machine)
    except ValueError as err:
        print(f"--machine: {err}", file=sys.stderr)
        return 2
    config = TransformerConfig.from_file(args.config, overrides=args.overrides)
    budget = None if args.device_memory is None else args.device_memory * 2**30
    rows = rank_plans(config, profile, args.devices, budget)
    ranked = [r for r in rows if r.refused is None]
    memory = f", {args.device_memory:g} GiB each" if budget is not None else ""
    print(
        f"{len(ranked)} of {len(rows)} layouts of {args.devices} devices on {profile.name}{memory}, fastest first "
        f"(global batch {config.topology.global_batch_size}, micro-batch {config.topology.micro_batch_size}, "
        f"sequence {config.data.sequence_length}):"
    )
    print(f"{'':>4} {'layout':<36} {'micro-batches':>13} {'peak GiB':>9} {'step s':>9} {'tokens/s/device':>16}")
    for i, row in enumerate(ranked[: args.top], 1):
        assert row.peak is not None and row.step is not None  # ranked rows are predicted
        print(
            f"{i:>4} {row.layout:<36} {row.micro_batches:>13} {row.peak / 2**30:>9.2f} {row.step.total:>9.4g} "
            f"{row.step.tokens_per_second_per_device:>16,.0f}"
        )
    reasons: dict[str, int] = {}
    for row in rows:
        if row.refused is not None:
            key = row.refused if not row.refused.startswith("does not fit") else "does not fit the device's memory"
            reasons[key] = reasons.get(key, 0) + 1
    for reason, count in sorted(reasons.items(), key=lambda kv: -kv[1]):
        print(f"refused ({count}): {reason}")
    return 0 if ranked else 1


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="scaling-transformer", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("preprocess", help="build the default corpus (stdlib sources) and its BPE tokenizer")
    p.add_argument("--output", default="runs/transformer/corpus", help="corpus folder (data.default_corpus_dir)")
    p.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE, help="BPE vocabulary size")
    p.set_defaults(fn=_preprocess)
    p = sub.add_parser("train", help="launch training (runner_main)")
    p.add_argument(
        "config", nargs="?", default=str(DEFAULT_CONFIG), help="YAML or JSON config (default: the bundled one)"
    )
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.train_iterations=50")
    p.add_argument("--template", action="store_true", help="print the commented config template and exit")
    p.set_defaults(fn=_train)
    p = sub.add_parser("generate", help="sample text from a checkpoint of any layout (one process)")
    p.add_argument("--checkpoint", required=True, help="checkpoint root (trainer.save_dir or an import-hf output)")
    p.add_argument("--prompt", action="append", help="a prompt (repeat for a batch)")
    p.add_argument("--config", default=None, help="config YAML (default: the one saved with the checkpoint)")
    p.add_argument("--tokenizer", default=None, help="tokenizer.json (default: from the config's data section)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(fn=_generate)
    p = sub.add_parser(
        "import-hf", help="HF folder (Llama, Qwen2/3, Qwen3-MoE, Mixtral) -> our checkpoint + config.yml"
    )
    p.add_argument("hf_dir")
    p.add_argument("output")
    p.set_defaults(fn=_import_hf)
    p = sub.add_parser("export-hf", help="our checkpoint -> an HF folder of its family")
    p.add_argument("checkpoint")
    p.add_argument("output")
    p.add_argument("--config", default=None, help="config YAML (default: the one saved with the checkpoint)")
    p.add_argument(
        "--tokenizer", default=None, help="tokenizer.json to ship (default: the config's, as generate picks it)"
    )
    p.add_argument(
        "--peft-dir", default=None, help="also write the LoRA adapter (finetuning.method=lora) as a PEFT folder"
    )
    p.set_defaults(fn=_export_hf)
    p = sub.add_parser("presets", help="list the named architectures (transformer_architecture.preset)")
    p.set_defaults(fn=_presets)
    p = sub.add_parser(
        "memory",
        help="model-state and activation bytes per rank of a config's layout, per pipeline stage, without allocating",
    )
    p.add_argument("config", nargs="?", default=str(DEFAULT_CONFIG), help="YAML or JSON config (default: bundled)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. topology.model_parallel_size=8")
    p.add_argument(
        "--device-memory",
        type=_positive_gib,
        default=None,
        metavar="GIB",
        help="the device's memory: exit 1, naming the stage and its parts, when a predicted peak exceeds it",
    )
    p.add_argument(
        "--machine",
        default=None,
        metavar="PROFILE",
        help="also predict the step time on this machine: a shipped profile (h100-sxm-node, h200-sxm-node) or a "
        "profile file from `python -m scaling.trainer.planning profile`",
    )
    p.set_defaults(fn=_memory)
    p = sub.add_parser(
        "plan", help="rank a config's layouts on N devices of a machine by predicted tokens/s, with their peak memory"
    )
    p.add_argument("config", nargs="?", default=str(DEFAULT_CONFIG), help="YAML or JSON config (default: bundled)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. data.sequence_length=8192")
    p.add_argument("--machine", required=True, metavar="PROFILE", help="a shipped profile name or a profile file")
    p.add_argument("--devices", type=int, required=True, help="ranks to lay out (devices in the cluster)")
    p.add_argument("--device-memory", type=_positive_gib, default=None, metavar="GIB", help="refuse what exceeds it")
    p.add_argument("--top", type=int, default=10, help="ranked layouts to print (default 10)")
    p.set_defaults(fn=_plan)
    return parser


def main(argv: list[str] | None = None) -> int:
    from scaling.trainer import CheckpointError

    args = _parser().parse_args(argv)
    try:
        return int(args.fn(args))
    except (ValueError, FileNotFoundError) as exc:
        print(f"scaling-transformer {args.command}: {exc}", file=sys.stderr)
        return 2
    except CheckpointError as exc:  # a corrupt or tampered checkpoint: one line, not a traceback
        print(f"scaling-transformer {args.command}: CheckpointError: {' '.join(str(exc).split())}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
