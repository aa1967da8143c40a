"""Drafter checkpoints: our own save/load round trip, and folders written by hand in
DeepSpec's layout (names, shapes and config.json fields spelled out here, not taken from our
modules), plain, sharded and DFlash."""

from __future__ import annotations

import functools
import json
import math

import pytest
import torch
from safetensors.torch import load_file, save_file

import dspark.modeling.checkpoint as checkpoint
from helpers.targets import make_tiny_target, tiny_drafter_config
from dspark.modeling import Drafter, load_drafter, save_drafter
from dspark.modeling.checkpoint import read_weights

GAMMA = 4
RANK = 8

# Real Gemma4 geometry: full-attention layers have a larger head_dim and, with k_eq_v, fewer KV heads.
GEMMA4_FULL = (("global_head_dim", 32), ("attention_k_eq_v", True), ("num_global_key_value_heads", 1))


@functools.lru_cache(maxsize=None)
def _target(family: str, overrides: tuple = ()):
    return make_tiny_target(family, **dict(overrides))


def _drafter(family: str, seed: int = 0, target_overrides: tuple = (), **fields) -> Drafter:
    """A drafter of the tiny target with every parameter and buffer random (none at its init value)."""
    target = _target(family, target_overrides)
    config = tiny_drafter_config(target, **{"block_size": GAMMA, "markov_rank": RANK, **fields})
    drafter = Drafter(config).attach_target(target)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, t in [*drafter.named_parameters(), *drafter.named_buffers()]:
            t.copy_(torch.randn(t.shape, generator=gen) / math.sqrt(t.shape[-1]))
    return drafter


def _features(family: str, batch: int = 2, length: int = 9, seed: int = 0, target_overrides: tuple = ()):
    target = _target(family, target_overrides)
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, target.vocab_size, (batch, length + 1), generator=gen)
    return target(ids[:, :length]).features, ids[:, length]


def _proposal(drafter: Drafter, family: str, target_overrides: tuple = ()):
    features, anchors = _features(family, target_overrides=target_overrides)
    return drafter.propose_from_features(features, anchors, temperature=1.0, generator=torch.Generator().manual_seed(5))


def _assert_same_proposal(a, b) -> None:
    assert torch.equal(a.tokens, b.tokens)
    assert torch.equal(a.probs, b.probs)
    assert torch.equal(a.logits, b.logits)
    assert (a.confidences is None and b.confidences is None) or torch.equal(a.confidences, b.confidences)


# ------------------------------------------------------------------ our own round trip
@pytest.mark.parametrize(
    "family,overrides,head,include_shared",
    [
        ("qwen3", (), "vanilla", False),
        ("gemma4", (), "vanilla", False),
        ("gemma4", GEMMA4_FULL, "vanilla", False),
        ("qwen3", (), "rnn", True),
        ("llama", (), "vanilla", True),
    ],
    ids=["qwen3", "gemma4", "gemma4-full-attention-geometry", "qwen3-rnn-with-shared", "llama-with-shared"],
)
def test_save_then_load_is_bit_identical(tmp_path, family, overrides, head, include_shared):
    drafter = _drafter(family, target_overrides=overrides, markov_head_type=head)
    folder = save_drafter(drafter, tmp_path / "drafter", include_shared=include_shared)
    # Without the shared tensors in the file the target supplies them; with them, the file does.
    loaded = load_drafter(folder, None if include_shared else _target(family, overrides))
    original, restored = drafter.state_dict(), loaded.state_dict()
    assert sorted(original) == sorted(restored)
    for name, tensor in original.items():
        assert torch.equal(restored[name], tensor), name
    for name, tensor in drafter.shared_weights().items():
        assert torch.equal(loaded.shared_weights()[name], tensor), name
    assert loaded.config.to_hf_dict() == json.loads(json.dumps(drafter.config.to_hf_dict()))
    _assert_same_proposal(_proposal(loaded, family, overrides), _proposal(drafter, family, overrides))


@pytest.mark.parametrize("include_shared", [False, True])
def test_shared_tensors_are_in_the_file_only_when_asked(tmp_path, include_shared):
    drafter = _drafter("llama")
    folder = save_drafter(drafter, tmp_path / "d", include_shared=include_shared)
    names = set(load_file(str(folder / "model.safetensors")))
    assert names - {"embed_tokens.weight", "lm_head.weight"} == set(drafter.state_dict())
    assert ("embed_tokens.weight" in names) == include_shared and ("lm_head.weight" in names) == include_shared
    if include_shared:  # llama's tiny target has an untied head: two different tables
        weights = read_weights(folder)
        assert torch.equal(weights["embed_tokens.weight"], _target("llama").embed_tokens.weight)
        assert torch.equal(weights["lm_head.weight"], _target("llama").lm_head_weight())


@pytest.mark.parametrize("variant", ["dspark", "dflash"])
def test_saved_config_json_has_the_spec_fields_on_top_of_the_target_config(tmp_path, variant):
    drafter = _drafter("qwen3", variant=variant)
    folder = save_drafter(drafter, tmp_path / "d")
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "model.safetensors"]
    cfg = json.loads((folder / "config.json").read_text())
    target = _target("qwen3").model.config
    expected = {
        "architectures": ["Qwen3DSparkModel" if variant == "dspark" else "Qwen3DFlashModel"],
        "block_size": GAMMA,
        "mask_token_id": target.vocab_size - 1,
        "target_layer_ids": [0, 2, 3],
        "num_target_layers": 4,
        "num_anchors": 512,
        "markov_rank": RANK if variant == "dspark" else 0,
        "markov_head_type": "vanilla",
        "enable_confidence_head": variant == "dspark",
        "confidence_head_with_markov": variant == "dspark",
        # the target's own fields, with num_hidden_layers = the number of draft layers
        "model_type": "qwen3",
        "num_hidden_layers": 2,
        "hidden_size": target.hidden_size,
        "intermediate_size": target.intermediate_size,
        "vocab_size": target.vocab_size,
        "num_attention_heads": target.num_attention_heads,
        "num_key_value_heads": target.num_key_value_heads,
        "head_dim": target.head_dim,
        "rms_norm_eps": target.rms_norm_eps,
        "rope_parameters": target.rope_parameters,
        "tie_word_embeddings": target.tie_word_embeddings,
    }
    assert {k: cfg.get(k) for k in expected} == expected


def test_saving_over_an_existing_folder_replaces_it_and_leaves_no_temporaries(tmp_path):
    first, second = _drafter("qwen3", seed=1), _drafter("qwen3", seed=2)
    folder = tmp_path / "d"
    save_drafter(first, folder)
    (folder / "stale.txt").write_text("from an older run")
    save_drafter(second, folder)
    assert [p.name for p in tmp_path.iterdir()] == ["d"]
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "model.safetensors"]
    loaded = load_drafter(folder, _target("qwen3"))
    for name, tensor in second.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name


def test_a_failed_save_keeps_the_previous_checkpoint_and_leaves_no_temporaries(tmp_path, monkeypatch):
    first, second = _drafter("qwen3", seed=1), _drafter("qwen3", seed=2)
    folder = save_drafter(first, tmp_path / "d")

    def broken_save_file(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"half a file")
        raise OSError("disk full")

    monkeypatch.setattr(checkpoint, "save_file", broken_save_file)
    with pytest.raises(OSError, match="disk full"):
        save_drafter(second, folder)
    assert [p.name for p in tmp_path.iterdir()] == ["d"]
    loaded = load_drafter(folder, _target("qwen3"))
    for name, tensor in first.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name


# ------------------------------------------------------------------ DeepSpec's layout, by hand
def _deepspec_config(*, dflash: bool = False) -> dict:
    """A DeepSpec drafter config.json: the Qwen3 target's config with num_hidden_layers = 2 draft
    layers, plus the DSpark fields."""
    cfg = _target("qwen3").model.config.to_dict()
    cfg.update(
        architectures=["Qwen3DFlashModel" if dflash else "Qwen3DSparkModel"],
        num_hidden_layers=2,
        block_size=GAMMA,
        mask_token_id=7,
        target_layer_ids=[0, 2, 3],
        num_target_layers=4,
        num_anchors=64,
        markov_rank=0 if dflash else RANK,
        markov_head_type="vanilla",
        enable_confidence_head=not dflash,
        confidence_head_with_markov=not dflash,
    )
    return cfg


def _deepspec_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes of a Qwen3 DSpark/DFlash drafter, from the config alone."""
    d, V, inter = cfg["hidden_size"], cfg["vocab_size"], cfg["intermediate_size"]
    heads, kv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    m, r = len(cfg["target_layer_ids"]), cfg["markov_rank"]
    shapes = {
        "embed_tokens.weight": (V, d),
        "lm_head.weight": (V, d),
        "fc.weight": (d, m * d),
        "hidden_norm.weight": (d,),
        "norm.weight": (d,),
    }
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        shapes.update({
            p + "self_attn.q_proj.weight": (heads * hd, d),
            p + "self_attn.k_proj.weight": (kv * hd, d),
            p + "self_attn.v_proj.weight": (kv * hd, d),
            p + "self_attn.o_proj.weight": (d, heads * hd),
            p + "self_attn.q_norm.weight": (hd,),
            p + "self_attn.k_norm.weight": (hd,),
            p + "mlp.gate_proj.weight": (inter, d),
            p + "mlp.up_proj.weight": (inter, d),
            p + "mlp.down_proj.weight": (d, inter),
            p + "input_layernorm.weight": (d,),
            p + "post_attention_layernorm.weight": (d,),
        })
    if r > 0:
        shapes["markov_head.markov_w1.weight"] = (V, r)
        shapes["markov_head.markov_w2.weight"] = (V, r)  # nn.Linear(r, V).weight
    if cfg["enable_confidence_head"]:
        conf_in = d + (r if cfg["confidence_head_with_markov"] else 0)
        shapes["confidence_head.proj.weight"] = (1, conf_in)
        shapes["confidence_head.proj.bias"] = (1,)
    return shapes


def _random_tensors(shapes: dict, dtype=torch.float32, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {name: (0.1 * torch.randn(shape, generator=gen)).to(dtype) for name, shape in shapes.items()}


def _write_deepspec(folder, cfg: dict, tensors: dict, *, shards: int = 1, prefix: str = "") -> None:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    named = {prefix + k: v.contiguous() for k, v in tensors.items()}
    if shards == 1:
        save_file(named, str(folder / "model.safetensors"), metadata={"format": "pt"})
        return
    names = sorted(named)
    weight_map = {}
    for s in range(shards):
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = names[s::shards]
        save_file({k: named[k] for k in part}, str(folder / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in part})
    total = sum(t.numel() * t.element_size() for t in named.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


def _assert_loaded_as_written(drafter: Drafter, written: dict, target=None) -> None:
    own = drafter.state_dict()
    shared = drafter.shared_weights()
    assert set(own) | set(shared) == set(written)
    for name, tensor in written.items():
        if name in shared:
            expected = tensor if target is None else {
                "embed_tokens.weight": target.embed_tokens.weight, "lm_head.weight": target.lm_head_weight()
            }[name]
            assert torch.equal(shared[name], expected.float()), name
        else:
            assert own[name].dtype == torch.float32, name
            assert torch.equal(own[name], tensor.float()), name


@pytest.mark.parametrize("prefix", ["", "model."])
def test_deepspec_checkpoint_loads_by_name(tmp_path, prefix):
    cfg = _deepspec_config()
    written = _random_tensors(_deepspec_shapes(cfg))
    _write_deepspec(tmp_path / "ds", cfg, written, prefix=prefix)
    drafter = load_drafter(tmp_path / "ds")
    c = drafter.config
    assert (c.variant, c.num_draft_layers, c.block_size, c.mask_token_id) == ("dspark", 2, GAMMA, 7)
    assert (c.target_layer_ids, c.num_target_layers, c.markov_rank) == ([0, 2, 3], 4, RANK)
    assert c.enable_confidence_head and c.confidence_head_with_markov and c.markov_head_type == "vanilla"
    _assert_loaded_as_written(drafter, written)
    features, anchors = _features("qwen3")
    prop = drafter.propose_from_features(features, anchors, generator=torch.Generator().manual_seed(0))
    assert torch.isfinite(prop.logits).all() and prop.confidences.shape == (2, GAMMA)


def test_deepspec_checkpoint_with_a_target_shares_the_targets_tables(tmp_path):
    cfg = _deepspec_config()
    written = _random_tensors(_deepspec_shapes(cfg))
    _write_deepspec(tmp_path / "ds", cfg, written)
    target = _target("qwen3")
    drafter = load_drafter(tmp_path / "ds", target)
    _assert_loaded_as_written(drafter, written, target=target)


def test_sharded_bf16_deepspec_checkpoint_loads_by_name(tmp_path):
    cfg = _deepspec_config()
    written = _random_tensors(_deepspec_shapes(cfg), dtype=torch.bfloat16, seed=1)
    _write_deepspec(tmp_path / "ds", cfg, written, shards=2)
    assert len(list((tmp_path / "ds").glob("*.safetensors"))) == 2
    drafter = load_drafter(tmp_path / "ds", dtype=torch.float32)
    _assert_loaded_as_written(drafter, written)


def test_deepspec_dflash_checkpoint_loads_without_heads(tmp_path):
    cfg = _deepspec_config(dflash=True)
    written = _random_tensors(_deepspec_shapes(cfg), seed=2)
    assert not any(name.startswith(("markov_head", "confidence_head")) for name in written)
    _write_deepspec(tmp_path / "ds", cfg, written)
    drafter = load_drafter(tmp_path / "ds")
    assert drafter.config.variant == "dflash"
    assert drafter.markov_head is None and drafter.confidence_head is None
    _assert_loaded_as_written(drafter, written)


@pytest.mark.parametrize("change", ["missing", "extra"])
def test_mismatched_checkpoint_is_rejected_naming_the_tensor(tmp_path, change):
    cfg = _deepspec_config()
    written = _random_tensors(_deepspec_shapes(cfg))
    if change == "missing":
        del written["layers.1.mlp.up_proj.weight"]
        name = "layers.1.mlp.up_proj.weight"
    else:
        name = "layers.1.self_attn.g_proj.weight"
        written[name] = torch.zeros(4, 4)
    _write_deepspec(tmp_path / "ds", cfg, written)
    with pytest.raises(ValueError, match=name.replace(".", r"\.")):
        load_drafter(tmp_path / "ds", _target("qwen3"))


# ------------------------------------------------------------------ every head DeepSpec has
def _head_shapes(cfg: dict, head: str, bias: bool = True) -> dict[str, tuple[int, ...]]:
    """DeepSpec's head tensors besides markov_w1/w2: gated `gate_proj` (d+r -> r, with bias) and the
    RNN's `joint_proj` (2r+d -> 3r, with a bias in DeepSpec)."""
    d, r = cfg["hidden_size"], cfg["markov_rank"]
    if head == "gated":
        return {"markov_head.gate_proj.weight": (r, d + r), "markov_head.gate_proj.bias": (r,)}
    if head == "rnn":
        shapes = {"markov_head.joint_proj.weight": (3 * r, 2 * r + d)}
        if bias:
            shapes["markov_head.joint_proj.bias"] = (3 * r,)
        return shapes
    return {}


@pytest.mark.parametrize("head,bias", [("gated", True), ("rnn", True), ("rnn", False)],
                         ids=["gated", "rnn-deepspec-bias", "rnn-paper-no-bias"])
def test_deepspec_checkpoint_of_every_head_loads_by_name(tmp_path, head, bias):
    cfg = {**_deepspec_config(), "markov_head_type": head}
    written = _random_tensors({**_deepspec_shapes(cfg), **_head_shapes(cfg, head, bias)}, seed=3)
    _write_deepspec(tmp_path / "ds", cfg, written)
    drafter = load_drafter(tmp_path / "ds")
    assert drafter.config.markov_head_type == head
    if head == "rnn":  # no rnn_bias field in DeepSpec's config: the file's tensors say it
        assert drafter.config.rnn_bias == bias
    _assert_loaded_as_written(drafter, written)


@pytest.mark.parametrize("rnn_bias", [True, False])
def test_rnn_bias_choice_survives_save_and_load(tmp_path, rnn_bias):
    drafter = _drafter("qwen3", markov_head_type="rnn", rnn_bias=rnn_bias)
    assert (drafter.markov_head.joint_proj.bias is not None) == rnn_bias
    loaded = load_drafter(save_drafter(drafter, tmp_path / "d"), _target("qwen3"))
    assert loaded.config.rnn_bias == rnn_bias
    _assert_same_proposal(_proposal(loaded, "qwen3"), _proposal(drafter, "qwen3"))


def test_new_drafters_default_to_deepspecs_biased_rnn_head():
    assert _drafter("qwen3", markov_head_type="rnn").markov_head.joint_proj.bias is not None


# ------------------------------------------------------------------ training output folders
def _write_steps(root, steps: list[int]) -> dict[int, dict]:
    cfg = _deepspec_config()
    written = {}
    for n in steps:
        written[n] = _random_tensors(_deepspec_shapes(cfg), seed=n)
        _write_deepspec(root / f"step_{n}", cfg, written[n])
    return written


def test_training_folder_without_step_latest_loads_the_highest_step(tmp_path):
    written = _write_steps(tmp_path / "run", [3, 10, 9])  # 10 > 9 numerically, not as text
    _assert_loaded_as_written(load_drafter(tmp_path / "run"), written[10])


def test_training_folder_loads_step_latest(tmp_path):
    written = _write_steps(tmp_path / "run", [3, 10])
    (tmp_path / "run" / "step_latest").symlink_to("step_3")
    _assert_loaded_as_written(load_drafter(tmp_path / "run"), written[3])
    assert checkpoint.read_config(tmp_path / "run").markov_rank == RANK


# ------------------------------------------------------------------ z-lab DFlash
def _zlab_config(rope: str = "rope_parameters") -> dict:
    """z-lab's DFlashDraftModel config.json: block_size = γ + 1, ids and mask under dflash_config.
    transformers 4.57 writes a top-level rope_theta, 5.x writes rope_parameters."""
    cfg = _deepspec_config(dflash=True)
    for key in ("block_size", "mask_token_id", "target_layer_ids", "num_anchors", "markov_rank",
                "markov_head_type", "enable_confidence_head", "confidence_head_with_markov"):
        cfg.pop(key)
    theta = cfg.pop("rope_parameters")["rope_theta"]
    cfg.update(architectures=["DFlashDraftModel"], auto_map={"AutoModel": "dflash.DFlashDraftModel"},
               block_size=GAMMA + 1, num_target_layers=4,
               dflash_config={"mask_token_id": 7, "target_layer_ids": [0, 2, 3]})
    if rope == "rope_theta":
        cfg.update(rope_theta=theta, torch_dtype="float32")
    else:
        cfg.update(rope_parameters={"rope_theta": theta, "rope_type": "default"}, dtype="float32")
    return cfg


def _zlab_tensors(cfg: dict, seed: int = 4) -> dict:
    shapes = _deepspec_shapes({**cfg, "target_layer_ids": [0, 2, 3], "markov_rank": 0, "enable_confidence_head": False})
    del shapes["embed_tokens.weight"], shapes["lm_head.weight"]
    return _random_tensors(shapes, seed=seed)


def test_zlab_dflash_loads_as_anchor_plus_gamma_masks_with_either_rope_field(tmp_path):
    proposals = []
    for rope in ("rope_parameters", "rope_theta"):
        cfg = _zlab_config(rope)
        written = _zlab_tensors(cfg)
        _write_deepspec(tmp_path / rope, cfg, written)
        drafter = load_drafter(tmp_path / rope, _target("qwen3"))
        c = drafter.config
        assert (c.variant, c.block_layout, c.block_size, c.block_len) == ("dflash", "anchor_plus_masks", GAMMA, GAMMA + 1)
        assert (c.target_layer_ids, c.mask_token_id, c.num_draft_layers) == ([0, 2, 3], 7, 2)
        own = drafter.state_dict()  # the embedding and LM head come from the target
        assert set(own) == set(written) and all(torch.equal(own[k], t) for k, t in written.items())
        proposals.append(_proposal(drafter, "qwen3"))
    _assert_same_proposal(*proposals)


@pytest.mark.parametrize("change,message", [
    (dict(architectures=["Qwen3DFlashForCausalLM"]), "unknown drafter architecture 'Qwen3DFlashForCausalLM'"),
    (dict(architectures=[]), "architectures"),
    (dict(dflash_config={"mask_token_id": 7, "target_layer_ids": [0, 2, 3], "use_sliding": True}), "use_sliding"),
    (dict(dflash_config={"target_layer_ids": [0, 2, 3]}), r"dflash_config\.mask_token_id"),
    (dict(eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 2, 3]}), "eagle_config"),
    (dict(draft_vocab_size=32), "draft_vocab_size"),
    (dict(block_size=1), "block_size"),
])
def test_config_fields_are_mapped_or_rejected_by_name(tmp_path, change, message):
    cfg = {**_zlab_config(), **change}
    _write_deepspec(tmp_path / "z", cfg, _zlab_tensors(_zlab_config()))
    with pytest.raises(ValueError, match=message):
        load_drafter(tmp_path / "z", _target("qwen3"))


# ------------------------------------------------------------------ shapes against the target
def test_a_drafter_of_another_hidden_size_is_rejected_naming_the_field(tmp_path):
    cfg = {**_deepspec_config(), "hidden_size": 32}
    _write_deepspec(tmp_path / "ds", cfg, _random_tensors(_deepspec_shapes(cfg)))
    with pytest.raises(ValueError, match="its hidden_size is 32, the target's is 64"):
        load_drafter(tmp_path / "ds", _target("qwen3"))


def test_a_tensor_of_the_wrong_shape_is_rejected_naming_it(tmp_path):
    cfg = _deepspec_config()
    written = _random_tensors(_deepspec_shapes(cfg))
    written["fc.weight"] = written["fc.weight"][:, :128]  # two captured layers' width, config says three
    _write_deepspec(tmp_path / "ds", cfg, written)
    with pytest.raises(ValueError, match=r"fc\.weight has shape \(64, 128\)"):
        load_drafter(tmp_path / "ds", _target("qwen3"))


# ------------------------------------------------------------------ damaged files
def _layout(tmp_path, layout: str):
    """A folder of one accepted layout and the path of its (first) safetensors file."""
    folder = tmp_path / layout
    if layout == "dspark":
        save_drafter(_drafter("qwen3"), folder)
    elif layout in ("deepspec", "deepspec-sharded"):
        cfg = _deepspec_config()
        _write_deepspec(folder, cfg, _random_tensors(_deepspec_shapes(cfg)), shards=2 if "sharded" in layout else 1)
    else:
        _write_deepspec(folder, _zlab_config(), _zlab_tensors(_zlab_config()))
    return folder, sorted(folder.glob("*.safetensors"))[0]


LAYOUTS = ["dspark", "deepspec", "deepspec-sharded", "zlab"]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("damage", ["truncated", "header", "empty"])
def test_a_damaged_safetensors_file_is_a_value_error_naming_it(tmp_path, layout, damage):
    folder, weights = _layout(tmp_path, layout)
    data = weights.read_bytes()
    if damage == "truncated":
        weights.write_bytes(data[: len(data) // 2])
    elif damage == "header":  # the JSON header right after the 8-byte length
        weights.write_bytes(data[:8] + b"#garbage#" + data[17:])
    else:
        weights.write_bytes(b"")
    with pytest.raises(ValueError, match=rf"{weights.name} is not a readable safetensors file"):
        load_drafter(folder, _target("qwen3"))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("damage,message", [
    ("truncated", "is not valid JSON"), ("empty", "is empty"), ("binary", "is not"), ("list", "JSON list"),
])
def test_a_damaged_config_json_is_a_value_error_naming_it(tmp_path, layout, damage, message):
    folder, _ = _layout(tmp_path, layout)
    path = folder / "config.json"
    text = path.read_text()
    path.write_bytes({"truncated": text[: len(text) // 2].encode(), "empty": b"", "binary": b"\xff\xfe\x00garbage",
                      "list": b"[1, 2]"}[damage])
    with pytest.raises(ValueError, match=rf"config\.json.*{message}"):
        load_drafter(folder, _target("qwen3"))
    with pytest.raises(ValueError, match=r"config\.json"):
        checkpoint.read_config(folder)


def test_a_shard_named_by_the_index_but_missing_is_named(tmp_path):
    folder, first = _layout(tmp_path, "deepspec-sharded")
    first.unlink()
    with pytest.raises(FileNotFoundError, match=first.name):
        load_drafter(folder, _target("qwen3"))


def test_deepspec_gemma4_folder_with_its_target_type_fields_loads(tmp_path):
    """DeepSpec's Gemma4 build_draft_config writes the target's text config (model_type gemma4_text)
    plus `target_model_type` / `target_text_model_type` and architectures Gemma4DSparkModel."""
    drafter = _drafter("gemma4")
    folder = save_drafter(drafter, tmp_path / "g", include_shared=True)
    cfg = json.loads((folder / "config.json").read_text())
    for key in ("dspark_variant", "block_layout", "target_num_hidden_layers", "rnn_bias"):
        cfg.pop(key)
    assert cfg["model_type"] == "gemma4_text"
    cfg.update(architectures=["Gemma4DSparkModel"], target_model_type="gemma4", target_text_model_type="gemma4_text",
               tie_word_embeddings=False)
    (folder / "config.json").write_text(json.dumps(cfg))
    loaded = load_drafter(folder)
    assert loaded.config.family == "gemma4" and loaded.config.variant == "dspark"
    _assert_same_proposal(_proposal(loaded, "gemma4"), _proposal(drafter, "gemma4"))


def test_a_dspark_run_folder_loads_its_final_drafter(tmp_path):
    drafter = _drafter("qwen3")
    save_drafter(drafter, tmp_path / "run" / "drafter")
    loaded = load_drafter(tmp_path / "run", _target("qwen3"))
    _assert_same_proposal(_proposal(loaded, "qwen3"), _proposal(drafter, "qwen3"))


def test_a_dspark_run_folder_loads_its_latest_checkpoint_until_training_finished(tiny_qwen3, tmp_path):
    from helpers.training import fit_killed_after, tiny_trainer

    run = tmp_path / "run"
    fit_killed_after(tiny_trainer(tiny_qwen3, str(run)), 3)  # the latest checkpoint is step 2
    latest = run / "checkpoints" / "step-0000002" / "drafter"
    assert not (run / "drafter").exists()
    assert checkpoint.resolve_folder(run) == latest
    loaded, written = load_drafter(run, tiny_qwen3).state_dict(), read_weights(latest)
    assert set(loaded) == set(written) and all(torch.equal(loaded[n], t) for n, t in written.items())
    save_drafter(load_drafter(latest, tiny_qwen3), run / "drafter")  # what the trainer writes when a run ends
    assert checkpoint.resolve_folder(run) == run / "drafter"
