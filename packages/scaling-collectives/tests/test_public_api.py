import inspect

import scaling.collectives


def test_public_api():
    assert sorted(scaling.collectives.__all__) == [
        "AutogradContext",
        "CollectiveDeviceError",
        "CollectiveError",
        "CollectiveMismatchError",
        "CollectiveRecord",
        "CollectiveRecorder",
        "CollectiveTimeoutError",
        "PendingCollective",
        "PipeTransport",
        "PyTree",
        "all_gather",
        "all_gather_async",
        "all_gather_flat",
        "all_reduce",
        "all_reduce_async",
        "all_to_all_tokens",
        "barrier",
        "batch_send_recv",
        "broadcast",
        "broadcast_async",
        "broadcast_object",
        "broadcast_pytree",
        "check_consistency",
        "copy_to_model_parallel_region",
        "gather_from_model_parallel_region",
        "gather_from_sequence_parallel_region",
        "gather_heads_scatter_sequence",
        "get_recorder",
        "group_device",
        "group_rank",
        "group_size",
        "recv",
        "reduce_from_model_parallel_region",
        "reduce_scatter",
        "reduce_scatter_async",
        "reduce_scatter_flat",
        "reduce_scatter_to_sequence_parallel_region",
        "ring_shift_async",
        "scatter_heads_gather_sequence",
        "scatter_to_model_parallel_region",
        "scatter_to_sequence_parallel_region",
        "send",
        "tensors_requiring_grad",
    ]
    for name in scaling.collectives.__all__:
        assert getattr(scaling.collectives, name).__doc__, f"{name} has no docstring"


def test_signatures_in_docs_architecture():
    """The interfaces other packages code against (docs/architecture.md, Collectives)."""

    def params(fn):
        return [(p.name, p.default) for p in inspect.signature(fn).parameters.values() if p.kind != p.KEYWORD_ONLY]

    empty = inspect.Parameter.empty
    for name in ("copy_to_model_parallel_region", "reduce_from_model_parallel_region"):
        assert params(getattr(scaling.collectives, name)) == [("x", empty), ("group", empty)]
    for name in ("scatter_to_model_parallel_region", "gather_from_model_parallel_region"):
        assert params(getattr(scaling.collectives, name)) == [("x", empty), ("group", empty)]
    for name in (
        "reduce_scatter_to_sequence_parallel_region",
        "gather_from_sequence_parallel_region",
        "scatter_to_sequence_parallel_region",
    ):
        assert params(getattr(scaling.collectives, name)) == [("x", empty), ("group", empty), ("dim", 1)]
    assert params(scaling.collectives.broadcast_pytree) == [("obj", empty), ("src", empty), ("group", empty)]
    assert params(scaling.collectives.PipeTransport)[:3] == [
        ("prev_rank", empty),
        ("next_rank", empty),
        ("device", empty),
    ]
    for method in (
        "send_forward",
        "recv_forward",
        "send_backward",
        "recv_backward",
        "send_forward_recv_backward",
        "send_backward_recv_forward",
        "wait_sends",
    ):
        assert callable(getattr(scaling.collectives.PipeTransport, method))

    def keyword_only(fn):
        return [(p.name, p.default) for p in inspect.signature(fn).parameters.values() if p.kind == p.KEYWORD_ONLY]

    for method in ("send_forward", "send_backward"):
        assert keyword_only(getattr(scaling.collectives.PipeTransport, method)) == [("wait", True)]
    assert keyword_only(scaling.collectives.PipeTransport.exchange)[-1] == ("wait_sends", True)


def test_recorder_diagnostics_interface():
    """What the trainer codes against to leave a diagnostics file per rank."""
    recorder = scaling.collectives.CollectiveRecorder
    assert list(inspect.signature(recorder.configure).parameters) == ["self", "diagnostics_dir", "rank"]
    assert list(inspect.signature(recorder.write_diagnostics).parameters) == ["self", "reason"]
    assert scaling.collectives.get_recorder().step is None
