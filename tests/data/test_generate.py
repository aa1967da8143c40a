"""Regeneration of training answers (paper Section 4.1): row format, order, resume, both backends.

The transformers backend runs on a tiny random Llama with a small byte-level
BPE tokenizer trained here (ChatML template, no pad token). The OpenAI backend
talks to a fake OpenAI-compatible server started on 127.0.0.1 in the test.
One short real run on SmolLM2 checks that answers are text (`-s` prints them).
"""

from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
from transformers import PreTrainedTokenizerFast

from helpers.targets import build_tiny_model
from helpers.bpe import train_bpe
from dspark.config import GenerationConfig
from dspark.data.generate import (
    OpenAIBackend,
    Result,
    TransformersBackend,
    end_of_turn_token_ids,
    generate_responses,
    load_responses,
    split_completion,
)
from dspark.hub import CHATML_TEMPLATE

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "system\nuser\nassistant\nYou are a helpful AI assistant.",
    "What is two plus two? Two plus two is four. Name a colour. Blue is a colour.",
    "Write a short poem about the sea and the wind and the rain.",
] * 10

PROMPTS = [
    [{"role": "user", "content": "What is two plus two?"}],
    [{"role": "user", "content": "Name a colour."}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Write a poem about the sea."}],
    [{"role": "user", "content": "Wind?"}],
    [{"role": "user", "content": "What is the rain and the wind and the sea?"}],
    [{"role": "user", "content": "Blue?"}],
    [{"role": "user", "content": "Two plus two is four. Is it?"}],
]
IDS = [f"p{i}" for i in range(len(PROMPTS))]


# ------------------------------------------------------------------- fixtures
@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """Generation is many tiny matmuls; on the shared 2-core machine two OpenMP threads
    contending with other processes made it ~20x slower than one."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    bpe = train_bpe(CORPUS, 300, SPECIAL_TOKENS)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>")
    tok.chat_template = CHATML_TEMPLATE
    assert tok.pad_token_id is None  # the backend must pick a pad token itself
    return tok


@pytest.fixture(scope="module")
def tiny_model(tokenizer):
    return build_tiny_model("llama", vocab_size=len(tokenizer))


def sampling(**overrides) -> GenerationConfig:
    return GenerationConfig(**{"max_new_tokens": 6, **overrides})


def read_rows(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


class CountingBackend:
    """Wraps a backend; raises after `crash_after` batches (a killed run) and records each call's start."""

    def __init__(self, inner, crash_after: int | None = None):
        self.inner, self.crash_after, self.starts = inner, crash_after, []

    def generate(self, batch, start):
        if self.crash_after is not None and len(self.starts) == self.crash_after:
            raise KeyboardInterrupt("killed")
        self.starts.append(start)
        return self.inner.generate(batch, start)


class EchoBackend:
    """Deterministic: answers `answer-<row>`; rows in `fail` get an error."""

    def __init__(self, fail=()):
        self.fail = set(fail)

    def generate(self, batch, start):
        return [
            Result(error="boom") if start + j in self.fail else Result(f"answer-{start + j}", "stop", 3)
            for j in range(len(batch))
        ]


# ------------------------------------------------------------ pure functions
def test_split_completion_cuts_at_first_stop_token_and_counts_it():
    assert split_completion([5, 6, 2, 9, 2], {2}) == ([5, 6], "stop", 3)
    assert split_completion([5, 6, 7], {2}) == ([5, 6, 7], "length", 3)
    assert split_completion([3, 5], {2, 3}) == ([], "stop", 1)


def test_end_of_turn_token_of_chatml_is_im_end(tokenizer):
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert end_of_turn_token_ids(tokenizer) == {im_end}


# ------------------------------------------------------- transformers backend
def test_rows_are_in_input_order_with_ids_and_one_assistant_turn(tmp_path, tiny_model, tokenizer):
    out = tmp_path / "gen.jsonl"
    backend = TransformersBackend(tiny_model, tokenizer, sampling(), seed=0)
    stats = generate_responses(PROMPTS, out, backend, batch_size=3, ids=IDS, progress=False)
    rows = read_rows(out)
    assert [r["index"] for r in rows] == list(range(len(PROMPTS)))
    assert [r["id"] for r in rows] == IDS
    for row, prompt in zip(rows, PROMPTS):
        assert row["error"] is None
        assert row["conversations"][:-1] == prompt
        assert row["conversations"][-1]["role"] == "assistant"
        assert isinstance(row["conversations"][-1]["content"], str)
        assert 1 <= row["num_tokens"] <= 6
        assert row["finish_reason"] in ("stop", "length")
        assert (row["num_tokens"] == 6) if row["finish_reason"] == "length" else True
    assert (stats.total, stats.generated, stats.resumed, stats.failed) == (7, 7, 0, 0)
    assert stats.tokens == sum(r["num_tokens"] for r in rows)
    assert load_responses(out) == [r["conversations"] for r in rows]


def test_same_seed_gives_same_answers_and_leaves_caller_rng_alone(tiny_model, tokenizer):
    backend = TransformersBackend(tiny_model, tokenizer, sampling(temperature=1.0, top_k=0, top_p=1.0), seed=3)
    torch.manual_seed(123)
    state = torch.get_rng_state()
    first = backend.generate(PROMPTS[:3], start=0)
    assert torch.equal(torch.get_rng_state(), state)
    assert backend.generate(PROMPTS[:3], start=0) == first
    assert backend.generate(PROMPTS[:3], start=3) != first  # each batch start has its own seed


def test_left_padding_does_not_change_greedy_answers(tiny_model, tokenizer):
    backend = TransformersBackend(tiny_model, tokenizer, sampling(temperature=0.0, max_new_tokens=8))
    batched = backend.generate(PROMPTS[:5], start=0)  # prompt lengths differ, so rows are padded
    alone = [backend.generate([p], start=0)[0] for p in PROMPTS[:5]]
    assert batched == alone


def test_answer_stops_at_end_of_turn_token(tiny_model, tokenizer):
    """Force <|im_end|> as row 0's third token: row 0 stops with 2 answer tokens, row 1 runs to length."""
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    calls = []

    def force_end_of_turn(module, args, logits):  # logits [B, S, V]
        calls.append(1)
        if len(calls) == 3:
            logits = logits.clone()
            logits[0, :, im_end] = 1e4
        return logits

    handle = tiny_model.lm_head.register_forward_hook(force_end_of_turn)
    try:
        backend = TransformersBackend(tiny_model, tokenizer, sampling(temperature=0.0, max_new_tokens=6))
        stopped, running = backend.generate(PROMPTS[:2], start=0)
    finally:
        handle.remove()
    assert (stopped.finish_reason, stopped.num_tokens) == ("stop", 3)
    assert "<|im_end|>" not in stopped.text and "<|endoftext|>" not in stopped.text
    two_tokens = TransformersBackend(tiny_model, tokenizer, sampling(temperature=0.0, max_new_tokens=2))
    assert stopped.text == two_tokens.generate(PROMPTS[:2], start=0)[0].text  # the 2 tokens before the stop
    assert (running.finish_reason, running.num_tokens) == ("length", 6)


# ----------------------------------------------------------------------- resume
def test_resume_after_kill_equals_uninterrupted_run(tmp_path, tiny_model, tokenizer):
    backend = TransformersBackend(tiny_model, tokenizer, sampling(temperature=1.0), seed=7)
    full, resumed = tmp_path / "full.jsonl", tmp_path / "resumed.jsonl"
    generate_responses(PROMPTS, full, backend, batch_size=2, ids=IDS, progress=False)

    killed = CountingBackend(backend, crash_after=2)
    with pytest.raises(KeyboardInterrupt):
        generate_responses(PROMPTS, resumed, killed, batch_size=2, ids=IDS, progress=False)
    assert len(read_rows(resumed)) == 4  # the two finished batches are on disk
    again = CountingBackend(backend)
    stats = generate_responses(PROMPTS, resumed, again, batch_size=2, ids=IDS, progress=False)
    assert again.starts == [4, 6]
    assert (stats.resumed, stats.generated) == (4, 3)
    assert resumed.read_bytes() == full.read_bytes()


def test_resume_drops_partial_line_and_regenerates_partly_written_batch(tmp_path):
    full, cut = tmp_path / "full.jsonl", tmp_path / "cut.jsonl"
    generate_responses(PROMPTS, full, EchoBackend(), batch_size=3, progress=False)
    lines = full.read_bytes().splitlines(keepends=True)
    # Killed while writing the second batch (rows 3-5): row 3 complete, row 4 half written.
    cut.write_bytes(b"".join(lines[:4]) + lines[4][: len(lines[4]) // 2])
    backend = CountingBackend(EchoBackend())
    stats = generate_responses(PROMPTS, cut, backend, batch_size=3, progress=False)
    assert backend.starts == [3, 6]
    assert stats.resumed == 3
    assert cut.read_bytes() == full.read_bytes()


def test_finished_file_is_not_regenerated(tmp_path):
    out = tmp_path / "gen.jsonl"
    generate_responses(PROMPTS, out, EchoBackend(), batch_size=3, progress=False)
    backend = CountingBackend(EchoBackend())
    stats = generate_responses(PROMPTS, out, backend, batch_size=3, progress=False)
    assert backend.starts == []
    assert (stats.resumed, stats.generated) == (7, 0)


def test_resume_refuses_rows_out_of_order(tmp_path):
    out = tmp_path / "gen.jsonl"
    generate_responses(PROMPTS, out, EchoBackend(), batch_size=3, progress=False)
    lines = out.read_bytes().splitlines(keepends=True)
    out.write_bytes(lines[1] + lines[0] + b"".join(lines[2:]))
    with pytest.raises(ValueError, match=r"line 1 has index 1, expected 0.*delete"):
        generate_responses(PROMPTS, out, EchoBackend(), batch_size=3, progress=False)


def test_resume_refuses_a_file_made_from_other_prompts(tmp_path):
    out = tmp_path / "gen.jsonl"
    generate_responses(PROMPTS[:4], out, EchoBackend(), batch_size=2, progress=False)
    with pytest.raises(ValueError, match=r"row 0 answers a different prompt.*delete"):
        generate_responses(PROMPTS[1:], out, EchoBackend(), batch_size=2, progress=False)
    with pytest.raises(ValueError, match=r"more rows than the 3 prompts"):
        generate_responses(PROMPTS[:3], out, EchoBackend(), batch_size=2, progress=False)


def test_failed_row_keeps_its_place_without_answer(tmp_path):
    out = tmp_path / "gen.jsonl"
    stats = generate_responses(PROMPTS, out, EchoBackend(fail={2}), batch_size=3, progress=False)
    rows = read_rows(out)
    assert rows[2] == {
        "index": 2, "id": None, "conversations": PROMPTS[2], "finish_reason": None, "num_tokens": 0, "error": "boom",
    }
    assert rows[3]["conversations"][-1] == {"role": "assistant", "content": "answer-3"}
    assert (stats.failed, stats.tokens) == (1, 6 * 3)
    assert len(load_responses(out)) == 6
    # A resumed run still counts the failed row already in the file.
    assert generate_responses(PROMPTS, out, EchoBackend(), batch_size=3, progress=False).failed == 1


# ------------------------------------------------------------- openai backend
class FakeOpenAIServer(ThreadingHTTPServer):
    """Canned chat completions; behaviour chosen by the user message (see `Handler.do_POST`)."""

    daemon_threads = True

    def __init__(self):
        super().__init__(("127.0.0.1", 0), Handler)
        self.lock = threading.Lock()
        self.attempts: dict[str, int] = {}
        self.bodies: list[dict] = []
        self.in_flight = self.max_in_flight = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def reply(self, code: int, body: dict, headers: dict | None = None):
        data = json.dumps(body).encode()
        try:
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            for key, value in (headers or {}).items():
                self.send_header(key, value)
            self.end_headers()
            self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):  # the client timed out and left
            pass

    def do_GET(self):
        assert self.path == "/v1/models"
        self.reply(200, {"object": "list", "data": [{"id": "served-model", "object": "model"}]})

    def do_POST(self):
        server = self.server
        assert self.path == "/v1/chat/completions"
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        prompt = body["messages"][-1]["content"]
        with server.lock:
            server.bodies.append(body)
            attempt = server.attempts[prompt] = server.attempts.get(prompt, 0) + 1
            server.in_flight += 1
            server.max_in_flight = max(server.max_in_flight, server.in_flight)
        try:
            time.sleep(0.05)  # long enough for concurrent requests to overlap
            if prompt == "transient-503" and attempt == 1:
                return self.reply(503, {"error": {"message": "overloaded"}})
            if prompt == "rate-limited" and attempt == 1:
                return self.reply(429, {"error": {"message": "slow down"}}, {"Retry-After": "0"})
            if prompt == "always-503":
                return self.reply(503, {"error": {"message": "engine dead"}})
            if prompt == "bad-request":
                return self.reply(400, {"error": {"message": "prompt is too long", "code": 400}})
            if prompt == "slow-once" and attempt == 1:
                time.sleep(1.0)  # past the client's timeout
            content = f"answer to {prompt}"
            finish = "length" if prompt.startswith("long") else "stop"
            self.reply(200, {
                "choices": [
                    {"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": finish}
                ],
                "usage": {"prompt_tokens": 10, "completion_tokens": len(content.split())},
            })
        finally:
            with server.lock:
                server.in_flight -= 1


@pytest.fixture
def server():
    srv = FakeOpenAIServer()
    thread = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield srv
    srv.shutdown()
    srv.server_close()


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def openai_config(**overrides) -> GenerationConfig:
    return GenerationConfig(**{"max_new_tokens": 32, "request_timeout_s": 0.5, "max_retries": 2, **overrides})


def test_openai_backend_retries_transient_errors_and_records_permanent_ones(tmp_path, server):
    prompts = [user("hello"), user("transient-503"), user("bad-request"), user("rate-limited"), user("long story")]
    backend = OpenAIBackend(server.url, "m", openai_config(), backoff_s=0.01)
    out = tmp_path / "gen.jsonl"
    stats = generate_responses(prompts, out, backend, batch_size=5, progress=False)
    rows = read_rows(out)
    assert [r["conversations"][-1]["content"] for r in rows if r["error"] is None] == [
        "answer to hello", "answer to transient-503", "answer to rate-limited", "answer to long story",
    ]
    assert [r["finish_reason"] for r in rows] == ["stop", "stop", None, "stop", "length"]
    assert [r["num_tokens"] for r in rows] == [3, 3, 0, 3, 4]
    assert rows[2]["error"] == "HTTP 400: prompt is too long"
    assert rows[2]["conversations"] == prompts[2]
    assert server.attempts == {"hello": 1, "transient-503": 2, "bad-request": 1, "rate-limited": 2, "long story": 1}
    assert (stats.failed, stats.tokens) == (1, 13)
    assert server.max_in_flight > 1  # a batch's requests run concurrently


def test_openai_request_carries_sampling_and_thinking_off(server):
    backend = OpenAIBackend(server.url + "/v1/", None, openai_config(temperature=0.7, top_p=0.8, top_k=20), seed=5)
    assert backend.model == "served-model"  # asked the server
    backend.generate([user("a"), user("b")], start=10)
    body = next(b for b in server.bodies if b["messages"] == user("b"))
    assert body == {
        "model": "served-model", "messages": user("b"), "temperature": 0.7, "top_p": 0.8, "top_k": 20,
        "max_tokens": 32, "chat_template_kwargs": {"enable_thinking": False}, "seed": 16,
    }


def test_openai_gives_up_after_max_retries(server):
    backend = OpenAIBackend(server.url, "m", openai_config(max_retries=2), backoff_s=0.01)
    (result,) = backend.generate([user("always-503")], start=0)
    assert result.error == "HTTP 503: engine dead (gave up after 3 attempts)"
    assert server.attempts["always-503"] == 3


def test_openai_retries_a_timed_out_request(server):
    backend = OpenAIBackend(server.url, "m", openai_config(request_timeout_s=0.3), backoff_s=0.01)
    (result,) = backend.generate([user("slow-once")], start=0)
    assert result == Result("answer to slow-once", "stop", 3)
    assert server.attempts["slow-once"] == 2


def test_openai_unreachable_server_fails_the_row_after_retries():
    with socket.socket() as s:  # a port on 127.0.0.1 that nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    backend = OpenAIBackend(f"http://127.0.0.1:{port}", "m", openai_config(max_retries=1), backoff_s=0.01)
    (result,) = backend.generate([user("hello")], start=0)
    assert "gave up after 2 attempts" in result.error


# -------------------------------------------------------------------- SmolLM2
def test_smollm2_answers_prompts_with_text(tmp_path, smollm2_target):
    prompts = [user("What is the capital of France?"), user("Say hello in one word.")]
    backend = TransformersBackend(smollm2_target.model, smollm2_target.tokenizer, sampling(max_new_tokens=16), seed=0)
    stats = generate_responses(prompts, tmp_path / "gen.jsonl", backend, batch_size=2, progress=False)
    rows = read_rows(tmp_path / "gen.jsonl")
    for row in rows:
        answer = row["conversations"][-1]["content"]
        print(f"\n[{row['finish_reason']}, {row['num_tokens']} tokens] {answer!r}")
        assert row["error"] is None and answer.strip()
        assert "<|im_end|>" not in answer
    print(f"{stats.tokens} tokens in {stats.seconds:.1f} s")
