"""The process-wide ``scaling`` logger, configured once per process from a LoggerConfig.

The walkthrough's run script calls ``logger.configure(config=config.logger, name="runner")``;
the name tags every line, so the launcher's lines and each rank's lines tell apart.
"""

from __future__ import annotations

import logging

from scaling.trainer.loggers._config import LoggerConfig

ROOT_LOGGER_NAME = "scaling"


class ScalingLogger:
    """A thin front of ``logging.getLogger("scaling")`` with :meth:`configure`."""

    def __init__(self) -> None:
        self._logger = logging.getLogger(ROOT_LOGGER_NAME)

    def configure(
        self, config: LoggerConfig | None = None, name: str = "scaling", global_rank: int | None = None
    ) -> None:
        """Set the level from ``config.log_level`` and tag lines with ``name`` (and the rank)."""
        level = (config or LoggerConfig()).log_level
        tag = name if global_rank is None else f"{name} rank {global_rank}"
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(f"%(asctime)s [{tag}] %(levelname)s %(message)s", "%H:%M:%S"))
        for old in list(self._logger.handlers):
            self._logger.removeHandler(old)
        self._logger.addHandler(handler)
        self._logger.setLevel(level)
        self._logger.propagate = False

    def debug(self, msg: str, *args: object) -> None:
        self._logger.debug(msg, *args)

    def info(self, msg: str, *args: object) -> None:
        self._logger.info(msg, *args)

    def warning(self, msg: str, *args: object) -> None:
        self._logger.warning(msg, *args)

    def error(self, msg: str, *args: object) -> None:
        self._logger.error(msg, *args)


logger = ScalingLogger()
