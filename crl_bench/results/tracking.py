"""Optional experiment trackers fed with the rows of ``metrics.jsonl`` (TensorBoard, Weights & Biases).

``metrics.jsonl`` is always written by :class:`crl_bench.results.run_folder.RunWriter` and stays the source of
truth; the trackers chosen in the ``logging`` config section (:class:`crl_bench.config.LoggingConfig`)
receive a copy of every row: its numeric scalars, at the row's ``step``, with nested mappings
flattened into ``/``-joined names (an eval row ``{"step": 4, "eval": {"success_rate": 0.5}}`` logs
``eval/success_rate = 0.5`` at step 4).  Strings, lists and ``None`` are not sent to trackers.

Each tracker's package is imported only when its backend is chosen; a missing one is a
:class:`~crl_bench.config.ConfigError` that names the extra to install.
"""

from __future__ import annotations

import atexit
import importlib
import numbers
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from crl_bench.config import ConfigError, LoggingConfig


def _require(module: str, extra: str, backend: str) -> Any:
    """Import ``module`` or raise :class:`ConfigError` telling which extra provides it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ConfigError(f"logging.backends: {backend!r} needs the package {module!r}, which is not installed: "
                          f"pip install 'crl-bench[{extra}]'") from e


def flatten_scalars(row: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    """The numeric scalars of ``row`` as ``{name: float}``, nested mappings joined with ``/``.

    Booleans become 0.0/1.0; strings, lists, ``None`` and other objects are left out.  The top-level
    ``step`` key is not a metric and is left out too.

    Example: ``{"step": 3, "loss": 0.5, "eval": {"success_rate": 1.0, "tasks": [1, 2]}}`` ->
    ``{"loss": 0.5, "eval/success_rate": 1.0}``.
    """
    out: dict[str, float] = {}
    for key, value in row.items():
        if not prefix and key == "step":
            continue
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flatten_scalars(value, prefix=f"{name}/"))
        elif isinstance(value, (bool, numbers.Real)):
            out[name] = float(value)
    return out


class _TensorBoard:
    """Scalars into TensorBoard event files (``torch.utils.tensorboard.SummaryWriter``)."""

    def __init__(self, log_dir: Path) -> None:
        _require("tensorboard", "tensorboard", "tensorboard")
        tb = _require("torch.utils.tensorboard", "tensorboard", "tensorboard")
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_dir = log_dir
        self.writer = tb.SummaryWriter(log_dir=str(log_dir))

    def log(self, scalars: dict[str, float], step: int) -> None:
        for name, value in scalars.items():
            self.writer.add_scalar(name, value, global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class _Wandb:
    """A Weights & Biases run (``wandb.init``; offline by default, kept under ``<run folder>/wandb``)."""

    def __init__(self, project: str, mode: str, run_dir: Path, run_id: str, config: dict[str, Any]) -> None:
        wandb = _require("wandb", "wandb", "wandb")
        self.run = wandb.init(project=project, mode=mode, dir=str(run_dir), name=run_id, config=config)

    def log(self, scalars: dict[str, float], step: int) -> None:
        self.run.log(scalars, step=step)

    def close(self) -> None:
        self.run.finish()


class Trackers:
    """The open trackers of one run; :meth:`log` fans a metrics row out to all of them.

    Args:
        backends: tracker objects with ``log(scalars: dict[str, float], step: int)`` and ``close()``.

    Attributes:
        names: the backend names, in config order (``jsonl`` included when it was listed).
    """

    def __init__(self, backends: list[Any], names: list[str]) -> None:
        self._backends = backends
        self.names = names
        self._last_step = 0
        self._closed = False
        atexit.register(self.close)     # a crashed run still flushes its event files / finishes wandb

    def log(self, row: Mapping[str, Any]) -> None:
        """Send the numeric scalars of one metrics row (see :func:`flatten_scalars`) at ``row["step"]``.

        A row without an integer ``step`` is logged at the last step seen (0 before any).

        Raises:
            RuntimeError: the trackers are closed.
        """
        if self._closed:
            raise RuntimeError("Trackers.log after close()")
        step = row.get("step")
        if isinstance(step, numbers.Integral) and not isinstance(step, bool):
            self._last_step = int(step)
        scalars = flatten_scalars(row)
        if not scalars:
            return
        for backend in self._backends:
            backend.log(scalars, self._last_step)

    def close(self) -> None:
        """Flush and close every tracker (idempotent)."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        for backend in self._backends:
            backend.close()


def open_trackers(logging_cfg: LoggingConfig, run_dir: str | Path, run_id: str,
                  config: dict[str, Any] | None = None) -> Trackers:
    """Open the trackers named in ``logging_cfg.backends`` for one run.

    Args:
        logging_cfg: the run's ``logging`` section (validated by :func:`crl_bench.config.validate`).
        run_dir: the run folder; TensorBoard writes into ``<run_dir>/tensorboard`` unless
            ``logging_cfg.tensorboard_dir`` is set (then ``<tensorboard_dir>/<run_id>``), wandb under
            ``<run_dir>/wandb``.
        run_id: the run's name (wandb run name, TensorBoard sub-folder).
        config: the resolved run config as a plain dict (wandb's run config).

    Returns:
        :class:`Trackers` (with no backend when only ``jsonl`` is chosen: ``metrics.jsonl`` is written
        by the :class:`~crl_bench.results.run_folder.RunWriter` itself).

    Raises:
        ConfigError: an unknown backend, or a chosen backend whose package is not installed (the message
            names the extra, e.g. ``pip install 'crl-bench[tensorboard]'``).
    """
    run_dir = Path(run_dir)
    backends: list[Any] = []
    names = list(dict.fromkeys(logging_cfg.backends))
    try:
        for name in names:
            if name == "jsonl":
                continue
            if name == "tensorboard":
                tb_dir = (Path(logging_cfg.tensorboard_dir) / run_id if logging_cfg.tensorboard_dir
                          else run_dir / "tensorboard")
                backends.append(_TensorBoard(tb_dir))
            elif name == "wandb":
                backends.append(_Wandb(logging_cfg.wandb_project, logging_cfg.wandb_mode, run_dir, run_id,
                                       dict(config or {})))
            else:
                raise ConfigError(f"invalid value for logging.backends: unknown backend {name!r}; "
                                  "valid: jsonl, tensorboard, wandb")
    except BaseException:
        for b in backends:
            b.close()
        raise
    return Trackers(backends, names)
