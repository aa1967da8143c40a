"""The HTTP client of one llama-server: ``/completion`` with token-id prompts, ``/metrics``, ``/health``.

- :func:`request_body`: the ``/completion`` body that samples exactly softmax(logits / T) (argmax
  at T = 0), every truncation and penalty sampler off.
- :class:`LlamaClient`: the requests (urllib; timeouts; bounded retries); ``complete`` reads the
  verification rounds of a request as the difference of ``/metrics``' round counter around it.
- :class:`Completion`, :func:`parse_completion`, :func:`parse_metrics`, :func:`tau_of`: the answers,
  with τ on dspark's scale (1 + accepted / rounds).

docs/interop.md ("Serving it: τ and sampling") derives the mapping of llama.cpp's counts to τ and
what the sampling means.
"""

from __future__ import annotations

import json
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "Completion",
    "LlamaClient",
    "parse_completion",
    "parse_metrics",
    "request_body",
    "tau_of",
]

# Counters of /metrics (prometheus text) the client reads around a request.
METRIC_ROUNDS = "llamacpp:spec_decode_num_drafts_total"
METRIC_ACCEPTED = "llamacpp:spec_decode_num_accepted_tokens_total"
METRIC_DRAFTED = "llamacpp:spec_decode_num_draft_tokens_total"


def request_body(prompt_ids: Sequence[int], *, temperature: float, n_predict: int, seed: int,
                 cache_prompt: bool = False) -> dict[str, Any]:
    """The ``/completion`` body that samples exactly softmax(logits / T) (argmax at T = 0).

    The sampler chain is the temperature sampler alone (llama.cpp appends the final ``dist``
    draw, which has one candidate left at T = 0); every other sampler is also set to its
    neutral value, so a server started with other defaults changes nothing. ``prompt_ids``
    are token ids (the chat template already applied); the generated ids come back in
    ``tokens`` (``return_tokens``). No prompt cache unless ``cache_prompt``: every request is
    prefilled from scratch (with it, only the tokens after the prefix the slot already holds)."""
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if n_predict < 1:
        raise ValueError(f"n_predict must be >= 1, got {n_predict}")
    return {
        "prompt": [int(t) for t in prompt_ids],
        "n_predict": int(n_predict),
        "temperature": float(temperature),
        "seed": int(seed) % (2**32 - 1),  # 0xFFFFFFFF is LLAMA_DEFAULT_SEED (a random seed)
        "samplers": ["temperature"],
        "top_k": 0,
        "top_p": 1.0,
        "min_p": 0.0,
        "typical_p": 1.0,
        "top_n_sigma": -1.0,
        "xtc_probability": 0.0,
        "dynatemp_range": 0.0,
        "repeat_penalty": 1.0,
        "repeat_last_n": 0,
        "frequency_penalty": 0.0,
        "presence_penalty": 0.0,
        "dry_multiplier": 0.0,
        "mirostat": 0,
        "min_keep": 0,
        "n_probs": 0,
        "ignore_eos": False,
        "return_tokens": True,
        "cache_prompt": bool(cache_prompt),
        "stream": False,
    }


@dataclass
class Completion:
    """One ``/completion`` answer.

    tokens: the generated ids; tokens_per_s: the server's ``predicted_per_second`` (generation
    only: the tokens after the first over the time after the prefill); predicted_n / predicted_ms,
    prompt_n / prompt_ms: its timings; draft_n (Σ draft sizes) and draft_accepted (Σ accepted)
    from its timings, 0 without a draft; rounds: verification rounds from /metrics (None when not
    read); stop_type: "eos", "limit", "word" or "none"."""

    tokens: list[int]
    content: str
    tokens_per_s: float | None
    predicted_n: int
    predicted_ms: float
    prompt_n: int
    prompt_ms: float
    draft_n: int = 0
    draft_accepted: int = 0
    rounds: int | None = None
    stop_type: str = ""
    timings: dict[str, Any] = field(default_factory=dict)

    @property
    def tau(self) -> float | None:
        """τ of the request: 1 + accepted / rounds (docs/interop.md, "Serving it"); None without rounds."""
        return tau_of(self.draft_accepted, self.rounds)

    def to_json(self) -> dict[str, Any]:
        return {"tokens": self.tokens, "tokens_per_s": self.tokens_per_s, "predicted_n": self.predicted_n,
                "predicted_ms": self.predicted_ms, "prompt_n": self.prompt_n, "prompt_ms": self.prompt_ms,
                "draft_n": self.draft_n, "draft_accepted": self.draft_accepted, "rounds": self.rounds,
                "tau": self.tau, "stop_type": self.stop_type}


def tau_of(accepted: int, rounds: int | None) -> float | None:
    """τ = (accepted + rounds) / rounds: tokens per verification round, the target's own token
    included; None when there was no round (or the rounds are unknown)."""
    if not rounds:
        return None
    return (int(accepted) + int(rounds)) / int(rounds)


def parse_completion(response: Mapping[str, Any], rounds: int | None = None) -> Completion:
    """A :class:`Completion` from a non-streamed ``/completion`` response (``rounds`` from /metrics)."""
    timings = dict(response.get("timings") or {})
    rate = timings.get("predicted_per_second")
    return Completion(
        tokens=[int(t) for t in response.get("tokens") or []],
        content=str(response.get("content", "")),
        tokens_per_s=float(rate) if rate is not None and float(rate) > 0 else None,
        predicted_n=int(timings.get("predicted_n", response.get("tokens_predicted", 0))),
        predicted_ms=float(timings.get("predicted_ms", 0.0)),
        prompt_n=int(timings.get("prompt_n", 0)),
        prompt_ms=float(timings.get("prompt_ms", 0.0)),
        draft_n=int(timings.get("draft_n", 0)),
        draft_accepted=int(timings.get("draft_n_accepted", 0)),
        rounds=rounds,
        stop_type=str(response.get("stop_type", "")),
        timings=timings,
    )


def parse_metrics(text: str) -> dict[str, float]:
    """The samples of a prometheus text page: {name (with labels, if any): value}."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, _, value = line.rpartition(" ")
        try:
            out[name.strip()] = float(value)
        except ValueError:
            continue
    return out


class LlamaClient:
    """A small HTTP client of one llama-server (urllib; timeouts; bounded retries of connection
    errors and 503 "loading")."""

    def __init__(self, url: str, *, timeout_s: float = 600.0, retries: int = 2) -> None:
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self.retries = retries

    def _request(self, path: str, body: Mapping[str, Any] | None = None, *, timeout_s: float | None = None,
                 retries: int | None = None) -> tuple[int, bytes]:
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"} if data is not None else {}
        retries = self.retries if retries is None else retries
        last: Exception | None = None
        for attempt in range(retries + 1):
            request = urllib.request.Request(self.url + path, data=data, headers=headers)
            try:
                with urllib.request.urlopen(request, timeout=timeout_s or self.timeout_s) as response:
                    return response.status, response.read()
            except urllib.error.HTTPError as error:
                if error.code != 503:
                    detail = error.read().decode(errors="replace")[:500]
                    raise RuntimeError(f"{path}: HTTP {error.code}: {detail}") from error
                last = error
            except (urllib.error.URLError, ConnectionError, socket.timeout) as error:
                last = error
            if attempt < retries:
                time.sleep(0.5 * (attempt + 1))
        raise RuntimeError(f"{self.url}{path} failed after {retries + 1} attempts: {last}") from last

    def healthy(self) -> bool:
        """True when ``/health`` answers 200 (the model is loaded)."""
        try:
            status, _ = self._request("/health", timeout_s=5.0, retries=0)
        except RuntimeError:
            return False
        return status == 200

    def props(self) -> dict[str, Any]:
        """``/props``: the server's settings (default generation settings, model path, ...)."""
        return json.loads(self._request("/props")[1])

    def metrics(self) -> dict[str, float] | None:
        """``/metrics`` parsed (:func:`parse_metrics`); None when the server has no metrics endpoint."""
        try:
            return parse_metrics(self._request("/metrics", timeout_s=30.0)[1].decode())
        except RuntimeError:
            return None

    def complete(self, prompt_ids: Sequence[int], *, temperature: float, n_predict: int, seed: int,
                 cache_prompt: bool = False) -> Completion:
        """Generate up to ``n_predict`` tokens after ``prompt_ids`` (:func:`request_body`); the
        rounds are the difference of the server's round counter around the request."""
        before = self.metrics()
        status, payload = self._request("/completion", request_body(
            prompt_ids, temperature=temperature, n_predict=n_predict, seed=seed, cache_prompt=cache_prompt))
        response = json.loads(payload)
        after = self.metrics()
        rounds = None
        if before is not None and after is not None and METRIC_ROUNDS in after:
            rounds = int(round(after[METRIC_ROUNDS] - before.get(METRIC_ROUNDS, 0.0)))
        return parse_completion(response, rounds)
