"""`dspark export` of an Eagle3 drafter: the standard EAGLE-3 layout vLLM and SGLang load
(LlamaForCausalLMEagle3; facts in docs/interop.md, "What each folder holds"), refusals
of what it cannot express, and the way back through dspark's import.

Oracles: the layout's names, shapes and fields written out by hand; the original drafter's own
proposals (the folder read back must give bit-identical ones).
"""

from __future__ import annotations

import json

import pytest
import torch
from helpers.targets import make_tiny_target
from safetensors.torch import load_file
from helpers.eagle3 import tiny_eagle3

from dspark.cli.main import main
from dspark.interop.export import ExportRefused, export_drafter
from dspark.modeling import Eagle3Drafter, load_drafter, save_drafter
from dspark.modeling.vocab import DraftVocab

pytestmark = pytest.mark.usefixtures("one_thread")
IDS = [1, 3, 4]  # = [1, N/2 − 1, N − 4] for N = 8: the standard choice
LAYER = {"hidden_norm.weight": (64,), "input_layernorm.weight": (64,), "post_attention_layernorm.weight": (64,),
         "self_attn.q_proj.weight": (64, 128), "self_attn.k_proj.weight": (32, 128),
         "self_attn.v_proj.weight": (32, 128), "self_attn.o_proj.weight": (64, 64),
         "mlp.gate_proj.weight": (128, 64), "mlp.up_proj.weight": (128, 64), "mlp.down_proj.weight": (64, 128)}


def _target(family: str = "llama", ids=IDS):
    if family == "gemma4":  # its tiny config fixes the layer count (4)
        return make_tiny_target(family, target_layer_ids=[0, 1, 2])
    return make_tiny_target(family, num_hidden_layers=8, target_layer_ids=ids)


def _drafter(target, k: int = 0, preset: str = "eagle3") -> Eagle3Drafter:
    if not k:
        return tiny_eagle3(target, preset)
    vocab = DraftVocab.from_target_ids(list(range(3, 3 * k + 3, 3)), target.vocab_size)
    return tiny_eagle3(target, preset, draft_vocab_size=k).set_vocab(vocab)


def _proposal(drafter, target):
    ids = torch.randint(2, target.vocab_size, (2, 9), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        feats = target(ids).features
        return drafter.propose_from_features(feats[:, :8], ids[:, 8], input_ids=ids[:, :8], temperature=0.0)


@pytest.mark.parametrize("to", ["vllm", "sglang"])
@pytest.mark.parametrize("k", [0, 40])
def test_the_folder_has_the_standard_eagle3_names_shapes_and_fields(tmp_path, to, k):
    target = _target()
    drafter = _drafter(target, k)
    folder = export_drafter(drafter, tmp_path / "out", to)
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["model_type"] == "llama"
    assert cfg["num_hidden_layers"] == 1 and cfg["tie_word_embeddings"] is False
    assert cfg["draft_vocab_size"] == (k or 128) and cfg["vocab_size"] == 128 and cfg["hidden_size"] == 64
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]  # vLLM: input-of-layer, ours + 1
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == IDS  # SGLang: output-of-layer, ours
    for own in ("target_layer_ids", "ttt_length", "eagle3_preset", "dspark_variant", "block_size"):
        assert own not in cfg, own
    tensors = load_file(str(folder / "model.safetensors"))
    expected = {**{f"midlayer.{n}": s for n, s in LAYER.items()}, "fc.weight": (64, 3 * 64), "norm.weight": (64,),
                "lm_head.weight": (k or 128, 64)}
    if k:
        expected.update({"d2t": (k,), "t2d": (128,)})
        assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
        # draft id i is target id 3(i + 1): offsets d2t[i] = 3(i + 1) − i
        assert tensors["d2t"].tolist() == [3 * (i + 1) - i for i in range(k)]
    assert {n: tuple(t.shape) for n, t in tensors.items()} == expected
    assert torch.equal(tensors["lm_head.weight"], drafter.head_weight())
    serve = (folder / "SERVE.md").read_text()
    if to == "vllm":
        assert '"method":"eagle3"' in serve and '"num_speculative_tokens":4' in serve
    else:
        assert "--speculative-algorithm EAGLE3" in serve and "--speculative-num-steps 4" in serve


@pytest.mark.parametrize("k", [0, 40])
def test_the_exported_folder_loads_back_with_the_same_proposals(tmp_path, k):
    target = _target()
    drafter = _drafter(target, k)
    folder = export_drafter(drafter, tmp_path / "out", "vllm")
    loaded = load_drafter(folder, target)
    c = loaded.config
    assert isinstance(loaded, Eagle3Drafter) and (c.eagle3_preset, c.target_layer_ids, c.num_target_layers) == ("eagle3", IDS, 8)
    assert loaded.vocab == drafter.vocab and c.draft_vocab_size == k
    a, b = _proposal(drafter, target), _proposal(loaded, target)
    # γ is a launch setting there (num_speculative_tokens), not in the folder: read back as ttt_length
    assert c.block_size == 7 and b.tokens.shape[1] == 7
    assert torch.equal(a.tokens, b.tokens[:, :4]) and torch.equal(a.probs, b.probs[:, :4])


def test_the_top_level_vllm_field_alone_is_read_as_input_of_layer(tmp_path):
    target = _target()
    folder = export_drafter(_drafter(target), tmp_path / "out", "vllm")
    cfg = json.loads((folder / "config.json").read_text())
    del cfg["eagle_config"], cfg["num_target_layers"]
    (folder / "config.json").write_text(json.dumps(cfg))
    c = load_drafter(folder, target).config
    assert c.target_layer_ids == IDS and c.num_target_layers == 8  # N = max id + 4 by the standard rule


@pytest.mark.parametrize("preset,ids,family,reason", [
    ("eagle3_deepspec", [0, 1, 3, 4, 6], "llama", "exactly 3 target layers"),  # DeepSpec's 5 layers
    ("eagle3_deepspec", IDS, "llama", "q/k norms"),
    ("eagle3", IDS, "gemma4", "plain Llama layer"),
])
@pytest.mark.parametrize("to", ["vllm", "sglang"])
def test_what_the_serving_layout_cannot_express_is_refused_with_the_reason(tmp_path, preset, ids, family, reason, to):
    target = _target(family, ids)
    with pytest.raises(ExportRefused, match=reason):
        export_drafter(tiny_eagle3(target, preset), tmp_path / "out", to)
    assert not (tmp_path / "out").exists()


def test_destinations_without_an_eagle3_layout_and_sglang_files_are_refused(tmp_path):
    drafter = _drafter(_target())
    for to in ("deepspec", "zlab"):
        with pytest.raises(ExportRefused, match="no EAGLE-3 serving layout"):
            export_drafter(drafter, tmp_path / to, to)
    (tmp_path / "sts.json").write_text("{}")
    with pytest.raises(ExportRefused, match="no confidence head"):
        export_drafter(drafter, tmp_path / "s", "sglang", sts=tmp_path / "sts.json")


def test_cli_exports_a_training_output_folder_given_its_target(tmp_path, capsys, monkeypatch):
    import dspark.target

    target = _target()
    drafter = _drafter(target, 40)
    src = save_drafter(drafter, tmp_path / "src")  # as training writes it: no embedding / LM head
    assert main(["export", str(src), "--to", "sglang", "--out", str(tmp_path / "out")]) == 2
    assert "pass --target" in capsys.readouterr().err
    monkeypatch.setattr(dspark.target.TargetModel, "from_pretrained", staticmethod(lambda name, ids, **kw: target))
    assert main(["export", str(src), "--to", "sglang", "--out", str(tmp_path / "out"), "--target", "tiny"]) == 0
    assert "--speculative-algorithm EAGLE3" in capsys.readouterr().out
    a, b = _proposal(drafter, target), _proposal(load_drafter(tmp_path / "out", target), target)
    assert torch.equal(a.tokens, b.tokens[:, :4])
