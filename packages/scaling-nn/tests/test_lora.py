"""LoRA vs peft (single device and TP=2 export), merge/unmerge, adapters, BitFit."""

import json
import os
import sys

import pytest
import torch
import torch.nn.functional as F

from scaling.nn import (
    AttentionConfig,
    BottleneckAdapter,
    ColumnParallelLinear,
    LoRAConfig,
    ParallelMLP,
    ParallelSelfAttention,
    RowParallelLinear,
    apply_bottleneck_adapters,
    apply_lora,
    export_peft_adapter,
    get_parameter_meta,
    load_peft_adapter,
    lora_modules,
    lora_state_dict,
    mark_only_bias_trainable,
    mark_only_lora_trainable,
    merge_lora,
    reduce_sequence_parallel_gradients,
    unmerge_lora,
)
from scaling.testing import make_topology, run_distributed

sys.path.insert(0, os.path.dirname(__file__))
from nn_parity import close, full_tensor  # noqa: E402

H = 8
TARGETS = ["qkv", "dense", "fc1", "fc2"]


class OurNet(torch.nn.Module):
    def __init__(self, topology=None):
        super().__init__()
        self.qkv = ColumnParallelLinear(H, 2 * H, topology=topology)
        self.dense = RowParallelLinear(2 * H, H, topology=topology)
        self.mlp = ParallelMLP(H, 4 * H, topology=topology)

    def forward(self, x):
        return self.mlp(self.dense(torch.relu(self.qkv(x))))


class TorchNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv, self.dense = torch.nn.Linear(H, 2 * H), torch.nn.Linear(2 * H, H)
        self.mlp = torch.nn.Module()
        self.mlp.fc1, self.mlp.fc2 = torch.nn.Linear(H, 4 * H), torch.nn.Linear(4 * H, H)

    def forward(self, x):
        return self.mlp.fc2(F.gelu(self.mlp.fc1(self.dense(torch.relu(self.qkv(x))))))


def _randomize_lora(model):
    """Same full random A and B on every layout (B is zero after apply_lora)."""
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for _, module in lora_modules(model):
            for factor in (module.lora_A.weight, module.lora_B.weight):
                meta = get_parameter_meta(factor)
                full = torch.randn(meta.logical_shape, generator=g) * 0.3
                if meta.is_model_parallel:
                    full = full.chunk(meta.model_parallel_size, dim=meta.parallel_dim)[module._tp.rank]
                factor.copy_(full)


def _peft_twin(path):
    import peft

    torch.manual_seed(0)
    return peft.PeftModel.from_pretrained(TorchNet(), path, is_trainable=True)


def test_single_device_matches_peft(tmp_path):
    pytest.importorskip("peft")
    config = LoRAConfig(rank=4, alpha=8.0, target_modules=TARGETS)
    torch.manual_seed(0)
    ours = OurNet()
    assert apply_lora(ours, config) == ["qkv", "dense", "mlp.fc1", "mlp.fc2"]
    _randomize_lora(ours)
    tensors = export_peft_adapter(ours, config, str(tmp_path))
    assert sorted(tensors)[0] == "base_model.model.dense.lora_A.weight"
    twin = _peft_twin(str(tmp_path))
    x = torch.randn(2, 3, H)
    y, y_ref = ours(x), twin(x)
    close(y, y_ref, "output")
    y.pow(2).sum().backward()
    y_ref.pow(2).sum().backward()
    ref_grads = {n.replace(".default", ""): p.grad for n, p in twin.named_parameters() if "lora_" in n}
    for name, p in ours.named_parameters():
        if "lora_" in name:
            close(p.grad, ref_grads[f"base_model.model.{name}"], f"grad {name}")


def test_loads_an_adapter_written_by_peft(tmp_path):
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    twin = peft.get_peft_model(TorchNet(), peft.LoraConfig(r=2, lora_alpha=6, target_modules=["qkv", "fc2"]))
    with torch.no_grad():
        for n, p in twin.named_parameters():
            if "lora_" in n:
                p.normal_()
    twin.save_pretrained(str(tmp_path))
    torch.manual_seed(0)
    ours = OurNet()
    config = load_peft_adapter(ours, str(tmp_path))
    assert (config.rank, config.alpha, sorted(config.target_modules)) == (2, 6.0, ["fc2", "qkv"])
    x = torch.randn(2, 3, H)
    close(ours(x), twin(x), "output")


def _tp_export(tp, path):
    topo = make_topology(model_parallel_size=tp)
    config = LoRAConfig(rank=4, alpha=8.0, target_modules=TARGETS)
    torch.manual_seed(0)
    ours = OurNet(topo)
    apply_lora(ours, config)
    _randomize_lora(ours)
    x = torch.randn(2, 3, H, generator=torch.Generator().manual_seed(3))
    y = ours(x)
    before = {n: p.detach().clone() for n, p in ours.named_parameters()}
    merge_lora(ours)
    close(ours(x), y, "merged output")
    unmerge_lora(ours)
    for n, p in ours.named_parameters():
        close(p, before[n], f"unmerged {n}")
    export_peft_adapter(ours, config, path)
    torch.distributed.barrier()
    # Round trip: load the exported adapter into a fresh TP model.
    torch.manual_seed(0)
    fresh = OurNet(topo)
    load_peft_adapter(fresh, path)
    for n, p in fresh.named_parameters():
        close(
            full_tensor(p, topo.axis("tp").group),
            full_tensor(dict(ours.named_parameters())[n], topo.axis("tp").group),
            n,
        )
    try:
        apply_lora(OurNet(topo), LoRAConfig(dropout=0.1, target_modules=["dense"]))
        dropout_error = None
    except ValueError as e:
        dropout_error = str(e)
    # Last, after every collective: importing peft is slow, and no peer waits on it here.
    if topo.axis("tp").rank == 0:
        close(y, _peft_twin(path)(x), "peft output")
    return sorted(lora_state_dict(ours)), dropout_error


@pytest.mark.slow
@pytest.mark.distributed
def test_tp2_adapter_loads_with_peft(tmp_path):
    pytest.importorskip("peft")
    out = run_distributed(_tp_export, 2, 2, str(tmp_path), timeout_seconds=120)
    keys = [k for k, _ in out]
    assert keys[0] == keys[1] and len(keys) == 2 and len(keys[0]) == 8
    with pytest.raises(ValueError, match=r"LoRAConfig.dropout=0.1 on row-parallel 'dense' \(TP-sharded input\) needs"):
        raise ValueError(out[0][1])


def test_peft_import_errors(tmp_path):
    pytest.importorskip("safetensors")
    config = LoRAConfig(rank=2, target_modules=["qkv"])
    model = OurNet()
    apply_lora(model, config)
    export_peft_adapter(model, config, str(tmp_path))
    with pytest.raises(
        ValueError, match=r"tensor 'base_model.model.qkv.lora_A.weight' is \(2, 8\); expected shape \(3, 8\)"
    ):
        load_peft_adapter(apply_and_return(OurNet(), LoRAConfig(rank=3, target_modules=["qkv"])), str(tmp_path))
    raw = json.loads((tmp_path / "adapter_config.json").read_text())
    (tmp_path / "adapter_config.json").write_text(json.dumps({**raw, "peft_type": "IA3"}))
    with pytest.raises(ValueError, match=r"peft_type='IA3'.*only plain LoRA adapters"):
        load_peft_adapter(OurNet(), str(tmp_path))
    with pytest.raises(ValueError, match=r"rank"):
        LoRAConfig(rank=0, target_modules=["qkv"])


def apply_and_return(model, config):
    apply_lora(model, config)
    return model


def _models(topology):
    yield OurNet(topology), TARGETS, H
    # Separate QKV with 2 kv heads: at TP=4 the key/value projections are replicated.
    attention = ParallelSelfAttention(AttentionConfig(32, 8, 2, fused_qkv=False), topology=topology)
    yield attention, ["query", "key", "value", "dense"], 32
    yield (
        ParallelSelfAttention(AttentionConfig(32, 8, 4, sequence_parallel=True), topology=topology),
        ["qkv", "dense"],
        32,
    )


def _lora_tp_parity(tp):
    topo = make_topology(model_parallel_size=tp)
    torch.manual_seed(0)
    models = list(_models(topo))
    torch.manual_seed(0)
    refs = list(_models(None))
    for (ours, targets, width), (ref, _, _) in zip(models, refs):
        config = LoRAConfig(rank=4, alpha=8.0, target_modules=targets)
        apply_lora(ours, config)
        apply_lora(ref, config)
        # float64: the loss squares outputs in the hundreds, so float32 sums reordered across
        # ranks differ by ~2e-5 relative on some CPUs (AMD EPYC); in float64 the 1e-6 bound
        # catches a wrong layout and nothing else.
        ours.double(), ref.double()
        _randomize_lora(ours)
        _randomize_lora(ref)
        x = torch.randn(2, 4, width, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
        sp = getattr(ours, "sequence_parallel", False)
        y, y_ref = ours(x.chunk(tp, dim=1)[topo.axis("tp").rank] if sp else x), ref(x)
        close(y, y_ref.chunk(tp, dim=1)[topo.axis("tp").rank] if sp else y_ref, "output")
        y.pow(2).sum().backward()
        y_ref.pow(2).sum().backward()
        reduce_sequence_parallel_gradients(ours, topo.axis("tp").group)
        ref_params = dict(ref.named_parameters())
        for n, p in ours.named_parameters():
            close(full_tensor(p, topo.axis("tp").group, p.grad), ref_params[n].grad, f"grad {n}")
    return True


@pytest.mark.distributed
@pytest.mark.parametrize("tp", [2, 4])
def test_lora_grads_match_one_process(tp):
    assert run_distributed(_lora_tp_parity, tp, tp, timeout_seconds=90) == [True] * tp


def test_lora_errors_and_state():
    with pytest.raises(
        ValueError, match=r"'q_proj' matches no module; linear modules are \['dense', 'fc1', 'fc2', 'qkv'\]"
    ):
        apply_lora(OurNet(), LoRAConfig(target_modules=["q_proj"]))
    with pytest.raises(ValueError, match=r"'mlp' is a ParallelMLP, not a linear layer"):
        apply_lora(OurNet(), LoRAConfig(target_modules=["mlp"]))
    model = OurNet()
    apply_lora(model, LoRAConfig(rank=2, target_modules=["qkv"]))
    assert sorted(lora_state_dict(model)) == ["qkv.lora_A.weight", "qkv.lora_B.weight"]
    assert mark_only_lora_trainable(model) == 2 * H + 2 * H * 2
    assert get_parameter_meta(model.qkv.lora_B.weight).local_name == "qkv.lora_B.weight"


def test_bitfit_and_bottleneck_adapters():
    model = OurNet()
    assert mark_only_bias_trainable(model) == 2 * H + H + 4 * H + H
    with pytest.raises(ValueError, match=r"has no bias parameters"):
        mark_only_bias_trainable(torch.nn.Linear(2, 2, bias=False))
    x = torch.randn(2, 3, H)
    torch.manual_seed(0)
    model = OurNet()
    y = model(x)
    assert apply_bottleneck_adapters(model, ["dense", "mlp"], bottleneck_size=4) == ["dense", "mlp"]
    close(model(x), y, "identity at init")
    assert "mlp.adapter.down.weight" in dict(model.named_parameters())
    with pytest.raises(ValueError, match=r"a column-parallel layer with parallel_output=True returns a TP shard"):
        apply_bottleneck_adapters(OurNet(), ["qkv"], bottleneck_size=2)
    with pytest.raises(ValueError, match=r"cannot tell the output width of ReLU"):
        apply_bottleneck_adapters(torch.nn.Sequential(torch.nn.ReLU()), ["0"], bottleneck_size=2)
    with pytest.raises(ValueError, match=r"target 'attn' matches no module"):
        apply_bottleneck_adapters(model, ["attn"], bottleneck_size=4)
    assert BottleneckAdapter(H, 4)(x).shape == x.shape


def test_peft_files_without_the_extra_say_which_extra(tmp_path, monkeypatch):
    from scaling.nn import write_peft_adapter

    monkeypatch.setitem(sys.modules, "safetensors.torch", None)  # as if the [peft] extra were not installed
    with pytest.raises(ModuleNotFoundError, match=r"scaling-nn's \[peft\] extra: pip install './packages/scaling-nn"):
        write_peft_adapter(str(tmp_path), {}, rank=2, alpha=4.0, dropout=0.0, target_modules=["linear"])
