"""save with one layout, load with another (dp·tp, pp·dp, cp, ZeRO): the state and the next step are unchanged."""

from __future__ import annotations

import contextlib

import pytest
import torch
from auto_models import MODELS, TokenDataset, lr_scheduler_fn, optimizer_fn
from torch.distributed.tensor import DTensor

from scaling.testing import run_distributed
from scaling.trainer.auto import ParallelModel, deferred_init, generate_plan, load, parallelize, save
from scaling.trainer.auto._checkpoint import _tree, _whole_parameters
from scaling.trainer.checkpoint._tree import flatten_state


def _build(name: str, constraints: dict):
    cls, config = MODELS[name]
    model = deferred_init(cls, config())
    plan = generate_plan(model, {**constraints, "seed": 3})
    return (plan, *parallelize(plan, model, optimizer_fn, lr_scheduler_fn, TokenDataset()))


def _step(model, optimizer, scheduler, batch) -> float:
    optimizer.zero_grad()
    loss = model(batch)
    loss.backward()
    optimizer.step()
    scheduler.step()
    return loss.item()


def save_worker(name: str, path: str) -> float:
    plan, model, optimizer, scheduler, _ = _build(
        name, {"data_parallel_size": 2, "tensor_parallel.size": 2, "global_batch_size": 4}
    )
    batch = TokenDataset()[0:4]
    dp = model.topology.axis("dp").rank
    shard = {k: v[2 * dp : 2 * dp + 2] for k, v in batch.items()}
    _step(model, optimizer, scheduler, shard)
    save(path, {"plan": plan, "model": model, "optimizer": optimizer, "lr_scheduler": scheduler}, step=1)
    # the next step's loss over the global batch (mean of the two DP halves)
    loss = torch.tensor(_step(model, optimizer, scheduler, shard))
    torch.distributed.all_reduce(loss, group=model.topology.axis("dp").group)
    return loss.item() / 2


def load_worker(name: str, path: str, constraints: dict) -> tuple[float, dict]:
    plan, model, optimizer, scheduler, _ = _build(name, constraints)
    saved_plan = load(path, {"model": model, "optimizer": optimizer, "lr_scheduler": scheduler})
    batch = TokenDataset()[0:4]
    optimizer.zero_grad()
    loss = model(batch)  # under context parallelism this rank's share: log the mean over the ranks
    loss.backward()
    optimizer.step()
    scheduler.step()
    return model.global_loss(loss), saved_plan.to_dict()


@pytest.mark.slow
def test_save_dp2_tp2_load_tp2_and_one_rank(tmp_path) -> None:
    for name in ("gpt2", "llama"):
        path = str(tmp_path / name)
        expected = run_distributed(save_worker, 4, name, path, timeout_seconds=420)[0]
        for world, constraints in ((2, {"tensor_parallel.size": 2}), (1, {}), (2, {"context_parallel.size": 2})):
            results = run_distributed(load_worker, world, name, path, constraints, timeout_seconds=420)
            for loss, saved_plan in results:
                assert abs(loss - expected) <= 1e-5 * abs(expected)
                assert saved_plan["model_parallel_size"] == 2 and saved_plan["data_parallel_size"] == 2


PP2_DP2 = {"data_parallel_size": 2, "pipeline_parallel.size": 2, "pipeline_parallel.num_micro_batches": 2}
DP2_TP2 = {"data_parallel_size": 2, "tensor_parallel.size": 2}


def _gathered(state: dict) -> dict[str, torch.Tensor]:
    """This rank's checkpoint tensors, each gathered whole (keys of the unmodified model)."""
    with _whole_parameters(state):  # ZeRO-3 gathers them
        tensors, _ = flatten_state(_tree(state))
        return {k: (v.full_tensor() if isinstance(v, DTensor) else v).clone() for k, v in tensors.items()}


def _global_step(objects: tuple, i: int) -> float:
    """One step on global batch ``i`` (this DP rank's half); the loss over the whole batch."""
    _, model, optimizer, scheduler, _ = objects
    batch = TokenDataset()[4 * i : 4 * i + 4]
    dp = model.topology.axis("dp").rank
    loss = torch.tensor(_step(model, optimizer, scheduler, {k: v[2 * dp : 2 * dp + 2] for k, v in batch.items()}))
    torch.distributed.all_reduce(loss, group=model.topology.axis("dp").group)
    return loss.item() / 2


def _state(objects: tuple) -> dict:
    plan, model, optimizer, scheduler, _ = objects
    return {"plan": plan, "model": model, "optimizer": optimizer, "lr_scheduler": scheduler}


def reshard_worker(layout: dict, load_path: str | None, save_path: str | None, done: int) -> dict:
    """Load ``load_path`` (``done`` steps in); with ``save_path`` one step and save; two steps.

    Returns the gathered state after loading and when saving, and the global loss per batch index.
    """
    objects = _build("gpt2", {**layout, "global_batch_size": 4})
    out: dict = {"losses": {}}
    if load_path is not None:
        load(load_path, _state(objects))
        out["loaded"] = _gathered(_state(objects))
    if save_path is not None:
        out["losses"][done] = _global_step(objects, done)
        done += 1
        save(save_path, _state(objects), step=done)
        out["saved"] = _gathered(_state(objects))
    for i in (done, done + 1):
        out["losses"][i] = _global_step(objects, i)
    return out


def _merged(results: list[dict], which: str) -> dict[str, torch.Tensor]:
    merged: dict[str, torch.Tensor] = {}
    for r in results:  # pipeline stages hold different keys; a tied weight is on both
        for k, v in r[which].items():
            torch.testing.assert_close(merged.setdefault(k, v), v, rtol=0, atol=0)
    return merged


@pytest.mark.slow
@pytest.mark.parametrize("zero_stage", [0, 1, 3])
def test_save_pp2_dp2_load_dp2_tp2_and_back(tmp_path, zero_stage: int) -> None:
    # GPT-2: tied LM head (on both stages under pp2), fused c_attn (viewed by part under tp2)
    pp, tp = {**PP2_DP2, "zero_stage": zero_stage}, {**DP2_TP2, "zero_stage": zero_stage}
    first, second = str(tmp_path / "pp"), str(tmp_path / "tp")
    saved_pp = run_distributed(reshard_worker, 4, pp, None, first, 0, timeout_seconds=420)
    on_tp = run_distributed(reshard_worker, 4, tp, first, second, 1, timeout_seconds=420)
    on_pp = run_distributed(reshard_worker, 4, pp, second, None, 2, timeout_seconds=420)
    form = "scaling_optim." if zero_stage else "optimizer."  # scaling.optim's state (ZeRO) or torch's
    for saved, loaded in ((saved_pp, on_tp), (on_tp, on_pp)):
        expected, got = _merged(saved, "saved"), _merged(loaded, "loaded")
        assert sorted(got) == sorted(expected)
        assert any(k.startswith(form) and k.endswith(".exp_avg_sq") for k in got)
        for key, value in expected.items():
            torch.testing.assert_close(got[key], value, rtol=0, atol=1e-7, msg=key)
        # the steps after the save, uninterrupted and resumed in the other layout (the second
        # one after an update from the loaded optimizer state)
        for a, b in zip(saved, loaded):
            common = sorted(set(a["losses"]) & set(b["losses"]))
            assert len(common) == 2
            for i in common:
                assert abs(b["losses"][i] - a["losses"][i]) <= 1e-5 * abs(a["losses"][i]), (i, a, b)


def other_form_worker(path: str) -> str:
    plain = _build("gpt2", {})
    _step(*plain[1:4], TokenDataset()[0:2])  # the torch optimizer's state exists
    save(path, _state(plain), step=1)
    zero = _build("gpt2", {"zero_stage": 1})
    with pytest.raises(ValueError, match=r"saved by a plan with zero_stage=0 and precision='float32'") as info:
        load(path, _state(zero))
    return str(info.value)


def test_load_other_optimizer_form_names_it(tmp_path) -> None:
    (message,) = run_distributed(other_form_worker, 1, str(tmp_path / "plain"), timeout_seconds=300)
    assert "pass optimizer_state=False to load the model (and scheduler) only" in message


def _weights(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.module.named_parameters()}


def model_only_worker(path: str) -> bool:
    """One trained step saved by a plain plan; its weights load without the optimizer's state: into
    a ZeRO-1 plan (the other form, as the refusal says), as the model alone, and into a ZeRO-3 plan
    (whose optimizer places them in its shards); each then computes the saved model's next loss."""
    plain = _build("gpt2", {})
    _step(*plain[1:4], TokenDataset()[0:2])
    save(path, _state(plain), step=1)
    expected, batch = _weights(plain[1]), TokenDataset()[2:4]
    with torch.no_grad():
        next_loss = plain[1](batch).item()
    zero1, alone, zero3 = _build("gpt2", {"zero_stage": 1}), _build("gpt2", {}), _build("gpt2", {"zero_stage": 3})
    load(path, _state(zero1), optimizer_state=False)
    load(path, {"model": alone[1]})  # raised a bare StopIteration
    load(path, {"model": zero3[1], "optimizer": zero3[2]}, optimizer_state=False)
    for objects in (zero1, alone, zero3):
        with objects[2].engine.full_parameters() if objects[2].engine is not None else contextlib.nullcontext():
            got = _weights(objects[1])
        assert sorted(got) == sorted(expected)
        for name, value in expected.items():
            torch.testing.assert_close(got[name], value, rtol=0, atol=0, msg=name)
        with torch.no_grad():
            assert objects[1](batch).item() == pytest.approx(next_loss, rel=1e-6)
    return True


def test_the_weights_load_without_the_optimizer_state_into_any_plan(tmp_path) -> None:
    assert run_distributed(model_only_worker, 1, str(tmp_path / "plain"), timeout_seconds=300) == [True]


def test_save_names_objects_not_from_parallelize(tmp_path) -> None:
    linear = torch.nn.Linear(2, 2)
    with pytest.raises(TypeError, match=r"state\['model'\] must be the model parallelize\(\) returned, got Linear"):
        save(tmp_path, {"model": linear})
    model = ParallelModel(linear, None, None)  # type: ignore[arg-type]
    sgd = torch.optim.SGD(linear.parameters(), lr=0.1)
    with pytest.raises(
        TypeError, match=r"state\['optimizer'\] must be the optimizer parallelize\(\) returned, got SGD"
    ):
        save(tmp_path, {"model": model, "optimizer": sgd})


def step0_worker(path: str) -> tuple[list[float], list[float]]:
    """Save before the first optimizer.step(), load into fresh objects: the same next steps."""
    uninterrupted = _build("gpt2", {})
    save(path, _state(uninterrupted), step=0)
    batches = [TokenDataset()[2 * i : 2 * i + 2] for i in range(2)]
    expected = [_step(*uninterrupted[1:4], b) for b in batches]
    resumed = _build("gpt2", {})
    load(path, _state(resumed))
    assert not resumed[2].optimizer.state  # still fresh: torch builds it at the first step
    return expected, [_step(*resumed[1:4], b) for b in batches]


def test_a_checkpoint_saved_before_the_first_step_loads(tmp_path) -> None:
    ((expected, resumed),) = run_distributed(step0_worker, 1, str(tmp_path / "step0"), timeout_seconds=180)
    assert resumed == expected


def full_state_worker(name: str, constraints: dict, out: str) -> dict[str, torch.Tensor]:
    """``full_state_dict`` of a plan (rank 0's), and rank 0 writes it with ``save_pretrained``."""
    from scaling.trainer.auto import full_state_dict

    plan, model, *_ = _build(name, {**constraints, "global_batch_size": 4})
    state = full_state_dict(model)
    if torch.distributed.get_rank() == 0:
        model.module.save_pretrained(out, state_dict=dict(state))  # it consumes the mapping it is given
    else:
        assert state == {}
    return state


@pytest.mark.parametrize(
    ("name", "layout"),
    [
        ("gpt2", {"data_parallel_size": 2, "tensor_parallel.size": 2}),  # the fused c_attn gathered part by part
        ("gpt2", {"pipeline_parallel.size": 2, "pipeline_parallel.num_micro_batches": 2}),  # tied over the stages
        pytest.param("llama", {"data_parallel_size": 2, "zero_stage": 3}, marks=pytest.mark.slow),
    ],
    ids=["gpt2-dp2-tp2", "gpt2-pp2", "llama-dp2-zero3"],
)
def test_full_state_dict_is_one_process_s_and_saves_with_save_pretrained(tmp_path, name: str, layout: dict) -> None:
    """The whole weights of a TP-, pipeline- or ZeRO-3-sharded model in memory equal the one-process
    model's bit for bit; ``save_pretrained`` of them loads with ``from_pretrained`` to the same logits."""
    import transformers

    from scaling.trainer.auto import materialize

    world = 4 if "tensor_parallel.size" in layout else 2
    state = run_distributed(full_state_worker, world, name, layout, str(tmp_path / "hf"), timeout_seconds=300)[0]
    cls, config = MODELS[name]
    reference = materialize(deferred_init(cls, config()), seed=3).eval()
    expected = {k: v for k, v in reference.state_dict().items() if k in dict(reference.named_parameters())}
    assert sorted(state) == sorted(expected)
    for key, value in expected.items():
        torch.testing.assert_close(state[key], value, rtol=0, atol=0, msg=key)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    ids = TokenDataset()[0:2]["input_ids"]
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, reference(ids).logits, rtol=1e-5, atol=1e-5)
