"""Checks at the decoding API's boundary: the prompt, the settings, the drafter against the target.

Every check runs before the first forward, so that a wrong argument fails with an error that
names it, says what was given and how to fix it, rather than with a shape or index error from
inside a model. ``dspark.decoding.loop`` (one request) and ``dspark.decoding.batched`` (many) run
the same checks.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

from dspark.scheduling.calibration import as_temperatures

_TOKENIZE = "tokenize it first, e.g. tokenizer(text).input_ids"


def check_prompt_ids(prompt_ids: Any, vocab_size: int | None, *, name: str = "prompt_ids",
                     many: str = "use speculative_batch_generate for many prompts") -> list[int]:
    """``prompt_ids`` as a list of ints, checked to be one prompt: a non-empty 1-D sequence (list,
    tuple, 1-D integer tensor or array) of token ids in [0, V), V = ``vocab_size`` (the target's
    vocabulary; None skips the range check).

    Raises TypeError or ValueError naming ``name``, what was given and the fix; ``many`` says how
    to decode many prompts at once (the fix for a 2-D input)."""
    one_of_many = f"pass {name}[0] for one prompt, or {many}"
    if isinstance(prompt_ids, (str, bytes)):
        raise TypeError(f"{name} must be a 1-D sequence of token ids; got a {type(prompt_ids).__name__}: {_TOKENIZE}")
    if isinstance(prompt_ids, Mapping):  # a tokenizer's BatchEncoding
        hint = f"pass {name}['input_ids']" if "input_ids" in prompt_ids else _TOKENIZE
        raise TypeError(f"{name} must be a 1-D sequence of token ids; got a {type(prompt_ids).__name__} "
                        f"with keys {sorted(map(str, prompt_ids))[:4]}: {hint}")
    if isinstance(prompt_ids, (Tensor, np.ndarray)):
        ids = _ids_of_array(prompt_ids, name, one_of_many)
    elif isinstance(prompt_ids, Sequence):
        ids = list(prompt_ids)
        if not all(type(t) is int for t in ids):
            ids = [_one_id(t, f"{name}[{i}]", name, one_of_many) for i, t in enumerate(ids)]
    else:
        hint = (f"pass list({name})" if isinstance(prompt_ids, Iterable) else
                f"wrap a single id in a list, [{prompt_ids}]" if isinstance(prompt_ids, int) else _TOKENIZE)
        raise TypeError(f"{name} must be a 1-D sequence of token ids (a list of ints); got "
                        f"{prompt_ids!r:.60} ({type(prompt_ids).__name__}): {hint}")
    if not ids:
        raise ValueError(f"{name} is empty; the target needs at least one prompt token (e.g. a BOS id)")
    low, high = min(ids), max(ids)
    if low < 0:
        raise ValueError(f"{name}[{ids.index(low)}] = {low}: token ids must lie in [0, vocabulary size); "
                         "drop padding or label ids (-100, -1) from the prompt")
    if vocab_size is not None and high >= vocab_size:
        raise ValueError(f"{name}[{ids.index(high)}]: token id {high} >= the target's vocabulary size {vocab_size}; "
                         "tokenize with the target's own tokenizer (target.tokenizer)")
    return ids


def _ids_of_array(ids: Tensor | np.ndarray, name: str, one_of_many: str) -> list[int]:
    kind = "tensor" if isinstance(ids, Tensor) else "array"
    shape = list(ids.shape)
    if len(shape) == 0:
        raise ValueError(f"{name} must be a 1-D sequence of token ids; got a 0-D {kind} (one id): "
                         f"pass [{name}] or {name}.reshape(1)")
    if len(shape) != 1:
        raise ValueError(f"{name} must be a 1-D sequence of token ids; got a {len(shape)}-D {kind} of shape "
                         f"{shape}: {one_of_many}")
    integer = (not ids.is_floating_point() and not ids.is_complex() and ids.dtype != torch.bool
               if isinstance(ids, Tensor) else np.issubdtype(ids.dtype, np.integer))
    if not integer:
        raise TypeError(f"{name} must hold integer token ids; got a {kind} of dtype {ids.dtype}: "
                        f"{_TOKENIZE}, or cast the ids to an integer dtype")
    return ids.tolist()


def _one_id(token: Any, where: str, name: str, one_of_many: str) -> int:
    """One element of a prompt list as an int (an integer numpy scalar or 0-D tensor counts)."""
    if isinstance(token, np.integer) or (isinstance(token, Tensor) and token.dim() == 0
                                             and not token.is_floating_point() and token.dtype != torch.bool):
        return int(token)
    if isinstance(token, int) and not isinstance(token, bool):
        return int(token)  # an int subclass (IntEnum, ...)
    if isinstance(token, (Tensor, np.ndarray)) or (isinstance(token, Sequence) and not isinstance(token, str)):
        raise ValueError(f"{name} must be a 1-D sequence of token ids; got a sequence of sequences "
                         f"({where} is a {type(token).__name__}): {one_of_many}")
    if isinstance(token, str):
        raise TypeError(f"{name} must hold token ids; {where} is the str {token!r}: {_TOKENIZE}")
    raise TypeError(f"{name} must hold integer token ids; {where} is {token!r} (a {type(token).__name__}): "
                    f"cast the ids to int, or {_TOKENIZE}")


def check_generate_args(max_new_tokens: int, temperature: float) -> None:
    """ValueError unless max_new_tokens is an int >= 0 and temperature a finite number >= 0."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
    if not isinstance(temperature, (int, float)) or not math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {temperature!r}")


def check_drafter(drafter: Any, target: Any) -> None:
    """The drafter was built for this target (``dspark.modeling.checkpoint.check_against_target``:
    hidden size, vocabulary, layer count, the feature layers the target captures). Applies to every
    drafter with a ``DrafterConfig`` (DSpark and Eagle3); a test double without one is not checked."""
    from dspark.modeling import DrafterConfig
    from dspark.modeling.checkpoint import check_against_target

    config = getattr(drafter, "config", None)
    if isinstance(config, DrafterConfig):
        check_against_target(config, target, "the drafter")


def checked_sts_temperatures(value: Any, drafter: Any) -> np.ndarray | None:
    """STS temperatures T_1..T_γ (values, or the path of an STS JSON) as a float64 vector, checked
    against the drafter's block size γ when its config says it; None stays None."""
    if value is None:
        return None
    temps = as_temperatures(value, None, "sts_temperatures")
    config = getattr(drafter, "config", None)
    gamma = getattr(config, "block_size", None)
    if isinstance(gamma, int) and temps.size != gamma:
        raise ValueError(f"sts_temperatures has {temps.size} values but the drafter's block size γ is {gamma}: "
                         "give one temperature per draft position (the STS JSON fitted for this drafter)")
    return temps


def checked_length(ell: Any, gamma: int) -> int:
    """What a choose_length hook returned, as an int in 0..γ."""
    if isinstance(ell, bool) or not isinstance(ell, (int, Tensor)) or (isinstance(ell, Tensor) and ell.numel() != 1):
        raise ValueError(f"choose_length must return an int in 0..γ = 0..{gamma}, got {ell!r}")
    value = int(ell)
    if not 0 <= value <= gamma:
        raise ValueError(
            f"choose_length returned {value}; the verification length must be in 0..γ = 0..{gamma} "
            "(γ is the drafter's block size)"
        )
    return value


def checked_verify_length(ell: Any, gamma: int) -> int:
    """The ``ell`` handed to ``SpeculativeRequest.verify``, as an int in 0..γ."""
    if isinstance(ell, bool) or not isinstance(ell, (int, np.integer)) or not 0 <= int(ell) <= gamma:
        raise ValueError(
            f"verification length ell={ell!r} must be an int in 0..γ = 0..{gamma} (γ is the drafter's block size)"
        )
    return int(ell)
