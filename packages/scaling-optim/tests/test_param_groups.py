import pytest
import torch
import torch.distributed as dist

from scaling.nn import ParameterMeta
from scaling.optim import OptimizerParamGroup, OptimizerParamGroupConfig, build_parameter_groups
from scaling.testing import make_topology, run_distributed


def named(*names, shape=(2, 3)):
    out = []
    for n in names:
        p = torch.nn.Parameter(torch.zeros(shape))
        m = ParameterMeta(n, shape).attach(p).parameter_meta
        out.append((n, p, m))
    return out


def cfg(name, include=(".*",), exclude=(), wd=0.0):
    return OptimizerParamGroupConfig(name=name, weight_decay=wd, parameters_include=include, parameters_exclude=exclude)


def test_groups_by_include_exclude_and_frozen():
    params = named("layers.0.linear.weight", "layers.0.linear.bias", "layers.1.norm.weight", "layers.2.emb.weight")
    groups = build_parameter_groups(
        params,
        [cfg("decay", (r"\.weight$",), (r"norm", r"emb")), cfg("no_decay", (r"\.bias$", r"norm"))],
        frozen=[r"emb"],
    )
    assert [[n for n, _, _ in g.named_parameters_with_meta] for g in groups] == [
        ["layers.0.linear.weight"],
        ["layers.0.linear.bias", "layers.1.norm.weight"],
    ]
    assert not params[3][1].requires_grad and params[0][1].requires_grad


@pytest.mark.parametrize(
    "groups,frozen,match",
    [
        (
            [cfg("a", (r"weight",)), cfg("b", (r"linear",))],
            (),
            r"'layers.0.linear.weight' matches groups \['a', 'b'\] \(overlapping patterns\)",
        ),
        ([cfg("a", (r"weight",))], (), r"'layers.0.linear.bias' is in no group and not frozen"),
        ([cfg("a")], (r"bias",), r"'layers.0.linear.bias' is frozen and also in group\(s\) \['a'\]"),
        ([cfg("a", (r"weight", r"lm_head"))], (r"bias",), r"patterns match no parameter: \[\"a: 'lm_head'\"\]"),
        ([cfg("a"), cfg("a")], (), r"group names must be unique; \['a'\]"),
        ([cfg("a", (r"(",))], (), r"a: invalid parameter pattern '\('"),
    ],
)
def test_group_errors(groups, frozen, match):
    with pytest.raises(ValueError, match=match):
        build_parameter_groups(named("layers.0.linear.weight", "layers.0.linear.bias"), groups, frozen)


def test_param_group_checks():
    ((name, p, _),) = named("w", shape=(4, 3))
    bad = ParameterMeta("w", (8, 3), parallel_dim=0, model_parallel_size=4)
    with pytest.raises(ValueError, match=r"local shape \[4, 3\] does not match its meta .*expected \[2, 3\]"):
        OptimizerParamGroup([(name, p, bad)], OptimizerParamGroupConfig())
    with pytest.raises(TypeError, match=r"expected \(name, parameter, meta\) triples"):
        OptimizerParamGroup([p], OptimizerParamGroupConfig())
    m = ParameterMeta("w", (4, 3))
    with pytest.raises(ValueError, match=r"meta key 'w' is used by both 'a' and 'b'"):
        OptimizerParamGroup([("a", p, m), ("b", torch.nn.Parameter(torch.zeros(4, 3)), m)], OptimizerParamGroupConfig())


def _per_stage_pattern():
    topo = make_topology(pipe_parallel_size=2)
    names = ["layers.0.w"] if topo.axis("pp").rank == 0 else ["layers.1.head"]
    groups = [cfg("body", (r"layers\.0",)), cfg("head", (r"head",))]
    ok = build_parameter_groups(named(*names), groups, process_group=topo.axis("replica").group)
    try:
        build_parameter_groups(named(*names), groups)
    except ValueError as err:
        local_error = str(err)
    dist.barrier()
    return [len(g.named_parameters_with_meta) for g in ok], local_error


@pytest.mark.distributed
def test_pattern_may_match_on_another_pipe_stage():
    (counts0, err0), (counts1, err1) = run_distributed(_per_stage_pattern, 2, timeout_seconds=60)
    assert counts0 == [1, 0] and counts1 == [0, 1]
    assert "head: 'head'" in err0 and "body: " in err1 and "head" not in err1
