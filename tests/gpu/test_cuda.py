"""The apps, checkpoints, generation, the fused optimizer, activation checkpointing and LoRA on one GPU.

Each test runs one rank on ``cuda`` with NCCL through ``scaling.testing`` (the ranks are
forked from a process that never touched CUDA). Losses must fall, and where a CPU run
or a plain reference exists the CUDA run matches it within the stated tolerance.
"""

import pytest
import torch
from mlp_testlib import losses as mlp_losses
from mlp_testlib import small_config
from mlp_testlib import train_worker as mlp_train_worker
from transformer_testlib import losses, tiny_config, train_worker

from scaling.testing import assert_parity, run_distributed
from scaling.trainer import device_peak_flops

pytestmark = pytest.mark.gpu
CUDA = {"device": "cuda", "backend": "nccl"}


def _mlp(steps, **topology):
    cfg = small_config(steps=steps)
    cfg["topology"].update(topology)
    cfg["trainer"]["log_interval"] = 1
    return run_distributed(mlp_train_worker, 1, cfg, backend=topology.get("backend", "gloo"), timeout_seconds=300)[0]


def test_mlp_app_trains_20_steps_on_cuda():
    curve = mlp_losses(_mlp(20, **CUDA))
    assert len(curve) == 20 and curve[-1] < 0.5 * curve[0], curve


def test_mlp_app_on_cuda_matches_cpu():
    # fp32 throughout: the same 5 steps on both devices agree to rounding (cuBLAS vs CPU GEMM).
    cuda, cpu = mlp_losses(_mlp(5, **CUDA)), mlp_losses(_mlp(5, device="cpu"))
    torch.testing.assert_close(cuda, cpu, rtol=1e-4, atol=1e-5)


def _transformer(corpus, steps=20, arch=None, **sections):
    cfg = tiny_config(corpus, steps=steps, **sections)
    cfg["topology"].update(CUDA)
    cfg["trainer"]["log_interval"] = 1
    cfg["transformer_architecture"].update(arch or {})
    return cfg


def test_transformer_app_trains_20_steps_on_cuda_in_bf16(gpu_corpus):
    cfg = _transformer(gpu_corpus, arch={"precision": "bf16"}, optimizer={"master_weights": True})
    (history,) = run_distributed(train_worker, 1, cfg, backend="nccl", timeout_seconds=300)
    curve = losses(history)
    assert len(curve) == 20 and curve[-1] < curve[0] - 0.5, curve
    if device_peak_flops(torch.device("cuda")) is not None:  # a known card: MFU with no peak configured
        assert all(0 < m["runtime/mfu"] < 1 for m in history if "training/loss" in m), history[-1]


def test_activation_checkpointing_on_cuda_matches_no_checkpointing(gpu_corpus):
    runs = [
        losses(run_distributed(train_worker, 1, _transformer(gpu_corpus, 4, arch={"activation_checkpointing": ac}),
                               backend="nccl", timeout_seconds=300)[0])
        for ac in ("none", "every_layer")
    ]  # fmt: skip
    # Recomputation runs the same kernels; CUDA's embedding and attention backward sum in
    # a nondeterministic order, hence a tolerance rather than bitwise equality.
    torch.testing.assert_close(runs[1], runs[0], rtol=1e-4, atol=1e-5)


def test_deterministic_runs_on_cuda_repeat_bit_for_bit(gpu_corpus):
    """With `trainer.deterministic` a CUDA run repeats bit for bit, and activation checkpointing
    (the same kernels recomputed) changes no bit: what the test above cannot ask without it."""
    runs = []
    for ac in ("none", "none", "every_layer"):
        cfg = _transformer(gpu_corpus, 6, arch={"activation_checkpointing": ac}, trainer={"deterministic": True})
        (history,) = run_distributed(train_worker, 1, cfg, backend="nccl", timeout_seconds=300)
        runs.append([losses(history), losses(history, "training/global_grad_norm")])
    assert runs[1] == runs[0], "two runs with deterministic kernels differ"
    assert runs[2] == runs[0], "activation checkpointing changed the bits"


def _snapshot_worker(cfg, exhaust_at):
    """The transformer app on CUDA with memory snapshots; at step ``exhaust_at`` (if any) the
    loss first asks for 1 PiB of device memory."""
    from scaling.topology import Topology
    from scaling.transformer import train
    from scaling.transformer.config import TransformerConfig

    config = TransformerConfig.from_dict(cfg)
    topology = Topology.from_env(config.topology)
    trainer = train.build_trainer(config, topology)
    real = trainer.loss_function

    def exhausting(out, batch):
        if trainer.context.iterations + 1 == exhaust_at:
            torch.empty(1 << 50, dtype=torch.uint8, device=topology.device)
        return real(out, batch)

    trainer.loss_function = exhausting
    try:
        trainer.run_training()
        return "trained"
    except torch.OutOfMemoryError as err:
        return type(err).__name__
    finally:
        topology.destroy()


def test_memory_snapshots_on_cuda_at_the_window_and_on_out_of_memory(gpu_corpus, tmp_path):
    import pickle

    runs = {}
    # (window's first step, step that runs out of memory); 3 steps each. "short": the run ends
    # before the window does, so the snapshot is of the steps there were.
    for name, start, exhaust_at in (("window", 2, None), ("oom", 2, 2), ("short", 5, None)):
        trace_dir = tmp_path / name
        profiler = {
            "memory_snapshot": True,
            "trace_dir": str(trace_dir),
            "profile_start_step": start,
            "profile_steps": 1,
        }
        cfg = _transformer(gpu_corpus, 3, profiler=profiler)
        (outcome,) = run_distributed(_snapshot_worker, 1, cfg, exhaust_at, backend="nccl", timeout_seconds=300)
        runs[name] = (outcome, sorted(p.name for p in trace_dir.glob("*.pickle")))
    files = {
        "window": "memory_snapshot_rank0_step2.pickle",
        "oom": "memory_snapshot_rank0_oom.pickle",
        "short": "memory_snapshot_rank0_step3.pickle",
    }
    assert runs == {
        "window": ("trained", [files["window"]]),
        "oom": ("OutOfMemoryError", [files["oom"]]),
        "short": ("trained", [files["short"]]),
    }
    for name, file in files.items():
        with (tmp_path / name / file).open("rb") as f:
            snapshot = pickle.load(f)  # torch's own file, written by this test's run
        assert snapshot["segments"] and any(snapshot["device_traces"]), name


def test_async_checkpoint_stages_cuda_tensors_into_kept_pinned_buffers(tmp_path):
    """The trainer's asynchronous save of CUDA state: pinned host buffers filled by non-blocking
    copies, waited for before the save returns, so a step right after it cannot reach the files;
    the buffers are reused by the next save."""
    from scaling.trainer.checkpoint import StagingBuffers, load_checkpoint, save_checkpoint

    state = {"model": {"w": torch.randn(1024, 1024, device="cuda"), "b": torch.arange(7.0, device="cuda")}}
    staging = StagingBuffers()
    expected, pointers = {}, []
    for step in (1, 2):
        expected[step] = {k: v.cpu() for k, v in state["model"].items()}
        pending = save_checkpoint(tmp_path, step, state, None, async_save=True, staging=staging)
        for value in state["model"].values():  # training goes on at once
            value.mul_(3.0).add_(1.0)
        pending.wait()
        assert all(buffer.is_pinned() for buffer in staging._buffers.values())
        pointers.append(sorted(b.data_ptr() for b in staging._buffers.values()))
    assert pointers[0] == pointers[1]
    for step, values in expected.items():
        template = {"model": {k: torch.zeros_like(v) for k, v in values.items()}}
        loaded = load_checkpoint(tmp_path, template, None, step=step)
        for key, value in values.items():
            assert torch.equal(loaded.state["model"][key], value), (step, key)


def _logits_after_training(cfg, ids):
    from scaling.topology import Topology
    from scaling.transformer import train
    from scaling.transformer.config import TransformerConfig
    from scaling.transformer.data import TransformerBatch

    config = TransformerConfig.from_dict(cfg)
    topology = Topology.from_env(config.topology)
    trainer = train.build_trainer(config, topology)
    trainer.run_training()
    module = trainer.parallel_module.eval()
    batch = TransformerBatch(ids, ids, None, None).to(topology.device)
    with torch.no_grad():
        logits = module(batch).logits[..., : config.transformer_architecture.vocab_size]
    device = str(next(module.parameters()).device)
    topology.destroy()
    return logits.cpu(), device


def test_checkpoint_saved_on_cuda_loads_on_cpu_with_equal_logits(gpu_corpus, tmp_path):
    from scaling.transformer.inference import load_model

    cfg = _transformer(gpu_corpus, 6)
    cfg["trainer"].update(save_dir=str(tmp_path / "ckpt"), save_interval=6)
    ids = torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(0))
    ((cuda_logits, device),) = run_distributed(_logits_after_training, 1, cfg, ids, backend="nccl", timeout_seconds=300)
    model, _ = load_model(tmp_path / "ckpt")
    with torch.no_grad():
        cpu_logits = model(ids)
    assert device == "cuda:0"
    assert_parity(cuda_logits, cpu_logits, rtol=1e-4, atol=1e-4, name="logits: trained on cuda vs loaded on cpu")


def test_kv_cache_generation_on_cuda_equals_recomputation():
    from scaling.transformer.config import TransformerArchitectureConfig
    from scaling.transformer.generate import generate
    from scaling.transformer.inference import TransformerLM

    arch = dict(vocab_size=97, hidden_size=32, num_layers=2, num_attention_heads=4, num_kv_heads=2,
                max_sequence_length=40)  # fmt: skip
    model = TransformerLM(TransformerArchitectureConfig(**arch), seed=3).eval().to("cuda")
    prompt = [5, 17, 3, 88, 41]
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(12):
            ids.append(int(model(torch.tensor([ids], device="cuda"))[0, -1].argmax()))
    assert generate(model, [prompt], 12) == [ids[len(prompt) :]]


def test_fused_adamw_on_cuda_matches_the_single_tensor_rule():
    from scaling.optim import OptimizerConfig
    from scaling.optim._update import UpdateItem, apply_update, apply_updates, state_names

    config = OptimizerConfig(method="adamw", beta1=0.8, beta2=0.95, eps=1e-6)

    def run(batched):
        g = torch.Generator().manual_seed(0)
        params = [torch.randn(n, generator=g).cuda() for n in (7, 4096, 1)]
        states = [{k: torch.zeros_like(p) for k in state_names(config)} for p in params]
        for step in range(1, 4):
            grads = [torch.randn(p.shape, generator=g).cuda() for p in params]
            items = [UpdateItem(p, gr, s, 1e-2, 0.1, False) for p, gr, s in zip(params, grads, states)]
            if batched:
                apply_updates(config, items, step)
            else:
                for item in items:
                    apply_update(config, *item[:3], step, *item[3:])
        return params

    for fused, single in zip(run(True), run(False)):
        assert fused.device.type == "cuda"
        torch.testing.assert_close(fused, single, rtol=1e-5, atol=1e-6)


def _lora_worker(cfg):
    from scaling.topology import Topology
    from scaling.transformer import train
    from scaling.transformer.config import TransformerConfig

    config = TransformerConfig.from_dict(cfg)
    topology = Topology.from_env(config.topology)
    trainer = train.build_trainer(config, topology)
    before = {n: p.detach().clone() for n, p in trainer.parallel_module.named_parameters()}
    history = trainer.run_training(return_metrics=True)
    changed = sorted(n for n, p in trainer.parallel_module.named_parameters() if not torch.equal(before[n], p))
    devices = {str(p.device) for p in trainer.parallel_module.parameters()}
    topology.destroy()
    return changed, devices, losses(history)


def test_lora_on_cuda_trains_only_the_adapters_as_on_cpu(gpu_corpus):
    lora = {"method": "lora", "rank": 4, "target_modules": r"attention\..*"}
    cfg = _transformer(gpu_corpus, 6, finetuning=lora)
    ((changed, devices, curve),) = run_distributed(_lora_worker, 1, cfg, backend="nccl", timeout_seconds=300)
    cfg["topology"].update(device="cpu", backend="gloo")
    ((cpu_changed, _, cpu_curve),) = run_distributed(_lora_worker, 1, cfg, timeout_seconds=300)
    assert devices == {"cuda:0"} and changed and all(".lora_" in n for n in changed), changed
    assert changed == cpu_changed
    torch.testing.assert_close(curve, cpu_curve, rtol=1e-4, atol=1e-5)


def test_loader_pins_batches_and_the_trainer_moves_them_to_cuda():
    from scaling.data import BaseDataset, DataLoader
    from scaling.trainer._placement import to_device
    from scaling.transformer.data import TransformerBatch

    class Tokens(BaseDataset):
        def ident(self):
            return "tokens"

        def __len__(self):
            return 8

        def __getitem__(self, i):
            return torch.arange(5) + i

        def collate(self, items):
            ids = torch.stack(items)
            return TransformerBatch(ids, ids, None, None)

    loader = DataLoader(Tokens(), seed=0, global_batch_size=4, micro_batch_size=4, data_parallel_rank=0,
                        data_parallel_size=1, pin_memory=True)  # fmt: skip
    (batch,) = loader.next_step()
    assert batch.input_token_ids.is_pinned()
    moved = to_device(batch, torch.device("cuda", 0))
    assert moved.input_token_ids.device.type == "cuda" and torch.equal(
        moved.target_token_ids.cpu(), batch.target_token_ids
    )


def _offload_worker(cfg):
    from scaling.topology import Topology
    from scaling.transformer import train
    from scaling.transformer.config import TransformerConfig

    config = TransformerConfig.from_dict(cfg)
    topology = Topology.from_env(config.topology)
    trainer = train.build_trainer(config, topology)
    history = trainer.run_training(return_metrics=True)
    held = {
        (t.device.type, t.is_pinned())
        for s in trainer.optimizer.slots
        for t in [*s.state.values(), *([s.master] if s.master is not None else [])]
    }
    with trainer.optimizer.full_parameters():  # waits for the host update in flight
        # Each device shard is its host master in the shard's dtype (bf16: through a pinned buffer).
        landed = all(
            torch.equal(s.param_shard.cpu(), s.master.cpu().to(s.param_shard.dtype))
            for s in trainer.optimizer.slots
            if s.param_shard is not None and s.master is not None
        )
    topology.destroy()
    return held, losses(history), landed


def _offload_config(corpus, zero, offload, precision):
    return _transformer(
        corpus, 4, arch={"precision": precision}, optimizer={"zero_stage": zero, "cpu_offload": offload}
    )


def test_zero3_with_cpu_offload_keeps_no_optimizer_state_on_the_device(gpu_corpus):
    # (ZeRO stage, cpu_offload, precision) -> where the masters and moments live. ZeRO-3 offloaded:
    # the layered host update in its thread; ZeRO-1: the synchronous path (both copy the gradients
    # to pinned host memory without blocking per parameter); bf16 with fp32 masters: the updated
    # masters return to the bf16 shards through pinned buffers of their dtype.
    held = {(3, False, "fp32"): {("cuda", False)}, (3, True, "fp32"): {("cpu", True)}}
    held |= {(1, True, "fp32"): {("cpu", True)}, (3, True, "bf16"): {("cpu", True)}}
    runs = {
        key: run_distributed(
            _offload_worker, 1, _offload_config(gpu_corpus, *key), backend="nccl", timeout_seconds=300
        )[0]
        for key in held
    }
    assert {key: run[0] for key, run in runs.items()} == held
    assert runs[3, True, "bf16"][2], "a bf16 shard differs from its master after the host update"
    # The same fp32 update, run by the CPU's fused AdamW instead of the GPU's: equal to rounding.
    for key in ((3, True, "fp32"), (1, True, "fp32")):
        torch.testing.assert_close(runs[key][1], runs[3, False, "fp32"][1], rtol=1e-5, atol=0)
    bf16 = runs[3, True, "bf16"][1]
    assert bf16[-1] < bf16[0], bf16


def test_moe_transformer_trains_on_cuda_and_matches_cpu(gpu_corpus):
    """Mixture-of-experts blocks (routing, sort, expert loop, balancing loss) on CUDA: fp32 losses track CPU's."""
    moe = {"moe": {"every": 1, "num_experts": 4, "top_k": 2, "num_shared_experts": 1}}
    cuda = losses(run_distributed(train_worker, 1, _transformer(gpu_corpus, 10, arch=moe), backend="nccl",
                                  timeout_seconds=300)[0])  # fmt: skip
    cpu_cfg = tiny_config(gpu_corpus, steps=10)
    cpu_cfg["transformer_architecture"].update(moe)
    cpu = losses(run_distributed(train_worker, 1, cpu_cfg, timeout_seconds=300)[0])
    assert cuda[-1] < cuda[0], cuda
    # A routing choice may flip on a near tie between devices: a tolerance, not parity.
    torch.testing.assert_close(torch.tensor(cuda), torch.tensor(cpu), rtol=1e-2, atol=1e-3)
