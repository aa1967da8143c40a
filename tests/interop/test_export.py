"""`dspark export`: each destination's folder loads back bit-identically, carries the config.json
fields that destination reads (spelled out here, not taken from dspark.interop.export), and
what a destination cannot serve is refused with the reason."""

from __future__ import annotations

import functools
import json
import math

import pytest
import torch
from safetensors.torch import load_file

from dspark.cli.main import main
from dspark.interop.export import ExportRefused, export_drafter
from dspark.modeling import Drafter, load_drafter, save_drafter
from helpers.targets import make_tiny_target, tiny_drafter_config

GAMMA = 4
DSPARK = dict(variant="dspark")
ZLAB_DFLASH = dict(variant="dflash", block_layout="anchor_plus_masks")
DEEPSPEC_DFLASH = dict(variant="dflash")


@functools.lru_cache(maxsize=None)
def _target(family: str = "qwen3"):
    return make_tiny_target(family)


def _drafter(family: str = "qwen3", seed: int = 0, **fields) -> Drafter:
    """Every parameter random (none at its init value), attached to the tiny target."""
    target = _target(family)
    drafter = Drafter(tiny_drafter_config(target, **{"block_size": GAMMA, **fields})).attach_target(target)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in drafter.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1]))
    return drafter


def _outputs(drafter: Drafter, family: str = "qwen3"):
    """propose() at T=1 with a fixed generator, and the teacher-forced training forward."""
    target = _target(family)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, target.vocab_size, (2, 12), generator=gen)
    with torch.no_grad():
        features = target(ids).features
        prop = drafter.propose_from_features(features[:, :9], ids[:, 9], temperature=1.0,
                                             generator=torch.Generator().manual_seed(5))
        anchors = torch.tensor([[2, 5], [1, 6]])
        hidden = drafter(features, ids, anchors)
        prev = ids.gather(1, anchors)[..., None].expand(-1, -1, GAMMA)
        logits = drafter.draft_logits(hidden, prev)
        conf = drafter.confidence_logits(hidden, prev)
    return [prop.tokens, prop.probs, prop.logits, prop.confidences, hidden, logits, conf]


def _assert_identical(a: list, b: list) -> None:
    for x, y in zip(a, b):
        assert (x is None and y is None) or torch.equal(x, y)


# ------------------------------------------------------------------ export -> import
CASES = [
    ("deepspec", dict(DSPARK)),
    ("deepspec", dict(DSPARK, markov_head_type="rnn")),
    ("deepspec", dict(DSPARK, markov_head_type="gated")),
    ("deepspec", dict(DEEPSPEC_DFLASH)),
    ("sglang", dict(DSPARK)),
    ("sglang", dict(DSPARK, markov_head_type="rnn")),
    ("sglang", dict(DSPARK, markov_head_type="gated")),
    ("sglang", dict(ZLAB_DFLASH)),
    ("vllm", dict(DSPARK)),
    ("vllm", dict(DSPARK, enable_confidence_head=False)),
    ("vllm", dict(ZLAB_DFLASH)),
    ("zlab", dict(ZLAB_DFLASH)),
]
IDS = ["deepspec-vanilla", "deepspec-rnn", "deepspec-gated", "deepspec-dflash", "sglang-vanilla", "sglang-rnn",
       "sglang-gated", "sglang-dflash", "vllm-vanilla", "vllm-no-confidence", "vllm-dflash", "zlab"]


@pytest.mark.parametrize("to,fields", CASES, ids=IDS)
def test_export_then_import_gives_bit_identical_outputs(tmp_path, to, fields):
    drafter = _drafter(**fields)
    folder = export_drafter(drafter, tmp_path / "out", to)
    loaded = load_drafter(folder, _target())
    assert (loaded.config.variant, loaded.config.block_layout, loaded.config.block_size) == (
        drafter.config.variant, drafter.config.block_layout, GAMMA)
    _assert_identical(_outputs(loaded), _outputs(drafter))


def test_deepspec_export_loads_without_a_target_from_its_own_tables(tmp_path):
    drafter = _drafter()
    loaded = load_drafter(export_drafter(drafter, tmp_path / "out", "deepspec"))
    _assert_identical(_outputs(loaded), _outputs(drafter))


def test_a_paper_form_rnn_head_is_written_with_a_zero_bias(tmp_path):
    drafter = _drafter(markov_head_type="rnn", rnn_bias=False)
    folder = export_drafter(drafter, tmp_path / "out", "sglang")
    tensors = load_file(str(folder / "model.safetensors"))
    assert torch.equal(tensors["markov_head.joint_proj.bias"], torch.zeros(3 * 8))
    loaded = load_drafter(folder, _target())
    for got, ref in zip(_outputs(loaded), _outputs(drafter)):
        if ref is not None:
            torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------------ the fields each destination reads
def _config(folder) -> dict:
    return json.loads((folder / "config.json").read_text())


def _names(folder) -> set[str]:
    return set(load_file(str(folder / "model.safetensors")))


@pytest.mark.parametrize("to", ["deepspec", "sglang", "vllm"])
def test_dspark_export_has_deepspecs_flat_fields_and_our_layer_ids(tmp_path, to):
    folder = export_drafter(_drafter(), tmp_path / "out", to)
    cfg = _config(folder)
    expected = {
        "architectures": ["Qwen3DSparkModel"], "num_hidden_layers": 2, "num_target_layers": 4,
        "block_size": GAMMA, "mask_token_id": _target().vocab_size - 1,
        "target_layer_ids": [0, 2, 3],  # ours: SGLang and vLLM add 1 themselves
        "num_anchors": 512, "markov_rank": 8, "markov_head_type": "vanilla",
        "enable_confidence_head": True, "confidence_head_with_markov": True, "tie_word_embeddings": False,
        "model_type": "qwen3", "hidden_size": 64, "vocab_size": _target().vocab_size,
    }
    assert {k: cfg.get(k) for k in expected} == expected
    assert not {"dspark_variant", "block_layout", "rnn_bias"} & set(cfg)
    names = _names(folder)
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "markov_head.markov_w1.weight",
            "markov_head.markov_w2.weight", "confidence_head.proj.weight", "confidence_head.proj.bias",
            "layers.1.self_attn.q_norm.weight"} <= names
    # DeepSpec's evaluator needs its own copies; SGLang ignores them and vLLM shares the target's
    assert ({"embed_tokens.weight", "lm_head.weight"} <= names) == (to == "deepspec")


def test_deepspec_dflash_export_is_written_as_deepspec_writes_it(tmp_path):
    cfg = _config(export_drafter(_drafter(**DEEPSPEC_DFLASH), tmp_path / "out", "deepspec"))
    assert cfg["architectures"] == ["Qwen3DSparkModel"] and cfg["markov_rank"] == 0
    assert cfg["enable_confidence_head"] is False
    assert "markov_head_type" not in cfg and "confidence_head_with_markov" not in cfg


def test_deepspec_gemma4_export_is_a_gemma4_dspark_model(tmp_path):
    drafter = _drafter("gemma4")
    folder = export_drafter(drafter, tmp_path / "out", "deepspec")
    assert _config(folder)["architectures"] == ["Gemma4DSparkModel"]
    _assert_identical(_outputs(load_drafter(folder, _target("gemma4")), "gemma4"), _outputs(drafter, "gemma4"))


@pytest.mark.parametrize("to", ["zlab", "sglang", "vllm"])
def test_zlab_layout_export_has_dflash_config_and_no_tables(tmp_path, to):
    folder = export_drafter(_drafter(**ZLAB_DFLASH), tmp_path / "out", to)
    cfg = _config(folder)
    assert cfg["architectures"] == ["DFlashDraftModel"]
    assert cfg["block_size"] == GAMMA + 1 and cfg["num_target_layers"] == 4
    assert cfg["dflash_config"] == {"mask_token_id": _target().vocab_size - 1, "target_layer_ids": [0, 2, 3]}
    assert cfg["layer_types"] == ["full_attention"] * 2
    assert not {"markov_rank", "target_layer_ids", "mask_token_id", "block_layout"} & set(cfg)
    names = _names(folder)
    assert not {n for n in names if n.startswith(("embed_tokens", "lm_head", "markov_head", "confidence_head"))}
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.0.mlp.up_proj.weight"} <= names


# ------------------------------------------------------------------ SERVE.md
def test_vllm_serve_md_has_the_speculative_config(tmp_path):
    folder = export_drafter(_drafter(), tmp_path / "out", "vllm", target="Qwen/Qwen3-4B")
    serve = (folder / "SERVE.md").read_text()
    spec = json.dumps({"method": "dspark", "model": str(folder), "num_speculative_tokens": GAMMA}, separators=(",", ":"))
    assert f"vllm serve Qwen/Qwen3-4B --speculative-config '{spec}'" in serve


def test_vllm_dflash_serve_md_drafts_block_size_minus_one(tmp_path):
    folder = export_drafter(_drafter(**ZLAB_DFLASH), tmp_path / "out", "vllm")
    spec = json.dumps({"method": "dflash", "model": str(folder), "num_speculative_tokens": GAMMA}, separators=(",", ":"))
    assert spec in (folder / "SERVE.md").read_text()


def _sts(tmp_path, n: int = GAMMA):
    path = tmp_path / "my_sts.json"
    path.write_text(json.dumps({"temperatures": [1.5] * n, "dataset": "x", "num_samples": 10,
                                "ece_before": [0.1] * n, "ece_after": [0.05] * n}))
    return path


def _sps(tmp_path):
    path = tmp_path / "my_sps.json"
    path.write_text(json.dumps({"sample_batch_tokens": [1, 8, 64], "sample_steps_per_sec": [50.0, 45.0, 20.0],
                                "max_batch_tokens": 64}))
    return path


def test_sglang_serve_md_names_the_sts_and_sps_copied_next_to_the_weights(tmp_path):
    sts, sps = _sts(tmp_path), _sps(tmp_path)
    folder = export_drafter(_drafter(), tmp_path / "out", "sglang", sts=sts, sps=sps)
    assert (folder / "sts.json").read_bytes() == sts.read_bytes()
    assert (folder / "sps.json").read_bytes() == sps.read_bytes()
    serve = (folder / "SERVE.md").read_text()
    for text in ("--speculative-algorithm DSPARK", f"--speculative-draft-model-path {folder}",
                 f"--speculative-dspark-confidence-sts-path {folder / 'sts.json'}",
                 f"--speculative-dspark-sps-table-path {folder / 'sps.json'}", "SGLANG_RAGGED_VERIFY_MODE="):
        assert text in serve


def test_sglang_dflash_serve_md_verifies_block_size_tokens(tmp_path):
    folder = export_drafter(_drafter(**ZLAB_DFLASH), tmp_path / "out", "sglang")
    serve = (folder / "SERVE.md").read_text()
    assert "--speculative-algorithm DFLASH" in serve and f"--speculative-num-draft-tokens {GAMMA + 1}" in serve


# ------------------------------------------------------------------ refusals
@pytest.mark.parametrize("to,fields,reason", [
    ("sglang", DEEPSPEC_DFLASH, "SGLang DSpark needs markov_rank > 0"),
    ("vllm", dict(DSPARK, markov_head_type="rnn"), "only the vanilla Markov head"),
    ("vllm", dict(DSPARK, markov_head_type="gated"), "only the vanilla Markov head"),
    ("zlab", DEEPSPEC_DFLASH, "an anchor-first DFlash is not a z-lab DFlash"),
    ("zlab", DSPARK, "a z-lab DFlash is a DFlash drafter"),
    ("deepspec", ZLAB_DFLASH, "anchor-first"),
    ("sglang", dict(DSPARK, block_layout="anchor_plus_masks"), "anchor-first"),
], ids=["sglang-rank0", "vllm-rnn", "vllm-gated", "zlab-anchor-first", "zlab-dspark", "deepspec-zlab-layout",
        "sglang-anchor-plus-masks"])
def test_what_a_destination_cannot_serve_is_refused_with_the_reason(tmp_path, to, fields, reason):
    with pytest.raises(ExportRefused, match=reason):
        export_drafter(_drafter(**fields), tmp_path / "out", to)
    assert not (tmp_path / "out").exists()


def test_families_a_destination_lacks_are_refused(tmp_path):
    with pytest.raises(ExportRefused, match="Qwen3 and Gemma4 only"):
        export_drafter(_drafter("llama"), tmp_path / "out", "deepspec")
    with pytest.raises(ExportRefused, match="Qwen3DSparkModel only"):
        export_drafter(_drafter("gemma4"), tmp_path / "out", "sglang")
    with pytest.raises(ExportRefused, match="llama.*no q/k norms"):  # a drafter with the Llama target's own layers
        export_drafter(_drafter("llama"), tmp_path / "out", "vllm")
    with pytest.raises(ExportRefused, match="llama.*no q/k norms"):
        export_drafter(_drafter("llama", **ZLAB_DFLASH), tmp_path / "out", "zlab")


def test_sts_of_another_length_and_sts_for_other_destinations_are_refused(tmp_path):
    with pytest.raises(ValueError, match="temperatures"):
        export_drafter(_drafter(), tmp_path / "out", "sglang", sts=_sts(tmp_path, GAMMA + 1))
    with pytest.raises(ExportRefused, match="--sts is the STS file"):
        export_drafter(_drafter(), tmp_path / "out", "vllm", sts=_sts(tmp_path))
    with pytest.raises(ExportRefused, match="--sps is the SPS table"):
        export_drafter(_drafter(), tmp_path / "out", "llamacpp", sps=_sts(tmp_path))


# ------------------------------------------------------------------ the command
def test_cli_export_writes_the_folder_and_prints_serve_md(tmp_path, capsys):
    drafter = _drafter()
    src = save_drafter(drafter, tmp_path / "src", include_shared=True)
    assert main(["export", str(src), "--to", "deepspec", "--out", str(tmp_path / "out")]) == 0
    assert "# Serving this drafter (deepspec)" in capsys.readouterr().out
    _assert_identical(_outputs(load_drafter(tmp_path / "out")), _outputs(drafter))


def test_cli_export_refusal_is_an_error_message(tmp_path, capsys):
    src = save_drafter(_drafter(**DEEPSPEC_DFLASH), tmp_path / "src")
    assert main(["export", str(src), "--to", "sglang", "--out", str(tmp_path / "out")]) == 2
    assert "markov_rank > 0" in capsys.readouterr().err


def test_cli_deepspec_export_without_tables_or_target_says_what_to_pass(tmp_path, capsys):
    src = save_drafter(_drafter(), tmp_path / "src")
    assert main(["export", str(src), "--to", "deepspec", "--out", str(tmp_path / "out")]) == 2
    assert "--target" in capsys.readouterr().err


def test_cli_on_a_corrupted_safetensors_names_the_file_instead_of_a_traceback(tmp_path, capsys):
    src = save_drafter(_drafter(), tmp_path / "src", include_shared=True)
    weights = src / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[:8] + b"{not json" + data[17:])
    assert main(["export", str(src), "--to", "vllm", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert f"{weights} is not a readable safetensors file" in err and "Traceback" not in err


# ------------------------------------------------------------------ a Llama target with Qwen3 draft layers
@pytest.mark.parametrize("to", ["deepspec", "sglang", "vllm"])
def test_a_llama_target_drafter_with_qwen3_layers_exports_and_loads_back(tmp_path, to):
    """SmolLM2 is a Llama: its drafter is servable once its layers are Qwen3 layers."""
    drafter = _drafter("llama", **DSPARK, layer_family="qwen3")
    assert drafter.config.family == "qwen3" and drafter.layers[0].self_attn.q_norm is not None
    folder = export_drafter(drafter, tmp_path / "out", to)
    assert json.loads((folder / "config.json").read_text())["architectures"] == ["Qwen3DSparkModel"]
    loaded = load_drafter(folder, _target("llama"))
    _assert_identical(_outputs(loaded, "llama"), _outputs(drafter, "llama"))


def test_qwen3_layers_keep_the_llama_rope_and_sizes():
    llama = _drafter("llama", **DSPARK)
    qwen = _drafter("llama", **DSPARK, layer_family="qwen3")
    positions = torch.arange(7)[None]
    like = torch.zeros(1, 7, 16)
    for a, b in zip(llama.rotary(like, positions), qwen.rotary(like, positions)):
        assert torch.equal(a, b)
    assert llama.config.hidden_size == qwen.config.hidden_size


def test_layer_family_is_refused_where_it_would_not_be_exact():
    with pytest.raises(ValueError, match="layer_family='qwen3' for a gemma4 target"):
        _drafter("gemma4", **DSPARK, layer_family="qwen3")
    target = make_tiny_target("llama", attention_bias=True)
    with pytest.raises(ValueError, match="attention_bias=True"):
        tiny_drafter_config(target, layer_family="qwen3")
