"""Which app a ``scaling-check numerics`` run builds: its config class and its trainer builder."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

#: The reference apps by name: ``(config class, build_trainer(config, topology))``, as ``module:attr``.
APPS = {
    "transformer": ("scaling.transformer.config:TransformerConfig", "scaling.transformer.train:build_trainer"),
    "mlp": ("scaling.mlp.config:MLPConfig", "scaling.mlp.train:build_trainer"),
}
#: Their launch checks, ``load_config(path, overrides)`` (the process count, float8 sizes, the data),
#: run on each side before anything starts.
CHECKS = {
    "transformer": "scaling.transformer.__main__:load_config",
    "mlp": "scaling.mlp.__main__:load_config",
}


# Any: a class or a function, found by the user's path.
def attribute(path: str) -> Any:
    module, _, name = path.partition(":")
    if not name:
        raise ValueError(f"{path!r} is not 'module:attribute'")
    return getattr(importlib.import_module(module), name)


# Any: the app's config class and trainer builder, found by name (typed by the app itself).
def resolve_app(app: str) -> tuple[Any, Callable[..., Any]]:
    """``app``: a name of :data:`APPS`, or ``'pkg.config:ConfigClass,pkg.train:build_trainer'`` for
    another app (a ``TrainingAppConfig`` subclass and a function building its ``BaseTrainer``)."""
    if app in APPS:
        config_path, builder_path = APPS[app]
    else:
        config_path, _, builder_path = app.partition(",")
    if not builder_path:
        raise ValueError(
            f"app {app!r} is unknown; give one of {', '.join(APPS)} or 'pkg.config:ConfigClass,pkg.train:build_trainer'"
        )
    return attribute(config_path), attribute(builder_path)
