"""docs/extending.md, run as written: its code blocks are the user's modules and config, and each
test does what its walk-through says (a toy head trains, decodes, saves, reloads and is refused by
the exporters; a toy policy runs from the CLI; a toy family is one table entry and gets a drafter)."""

from __future__ import annotations

import dataclasses
import logging
import re
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from dspark.registry import FAMILIES, HEADS, POLICIES

DOC = Path(__file__).resolve().parents[1] / "docs" / "extending.md"


def doc_blocks() -> list[str]:
    """The ```python blocks of docs/extending.md, in page order."""
    return [textwrap.dedent(b) for b in re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)]


def block_with(text: str) -> str:
    (block,) = [b for b in doc_blocks() if text in b]
    return block


@pytest.fixture
def mypkg(tmp_path, monkeypatch):
    """A user's package `mypkg` on sys.path holding the page's modules; registrations undone after."""
    pkg = tmp_path / "mypkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "heads.py").write_text(block_with("class ScaledBigramHead"))
    (pkg / "policies.py").write_text(block_with("def every_other"))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield pkg
    for name in [m for m in sys.modules if m == "mypkg" or m.startswith("mypkg.")]:
        del sys.modules[name]
    for registry, name in ((HEADS, "scaled-bigram"), (POLICIES, "every-other"), (FAMILIES, "helium")):
        if name in registry:
            registry.unregister(name)


def test_the_page_has_one_block_per_step():
    blocks = doc_blocks()
    assert len(blocks) == 4
    assert ["HEADS.register" in b for b in blocks].count(True) == 1
    assert ["POLICIES.register" in b for b in blocks].count(True) == 1
    assert ["FAMILIES.add" in b for b in blocks].count(True) == 1


def test_a_new_head_trains_decodes_saves_reloads_and_is_refused_by_the_exporters(mypkg, tiny_qwen3, tmp_path,
                                                                                   caplog):
    from dspark.build import build_drafter
    from dspark.decoding.loop import speculative_generate
    from dspark.interop.export import export_drafter
    from dspark.modeling.checkpoint import load_drafter, save_drafter
    from dspark.modeling.heads import SequentialHead
    from helpers.training import synthetic_samples, tiny_config

    namespace: dict = {}
    exec(block_with("head_options="), namespace)  # the page's config file: imports mypkg.heads
    page = namespace["config"].drafter
    assert HEADS.get("scaled-bigram").__module__ == "mypkg.heads"
    config = tiny_config(tiny_qwen3, str(tmp_path / "run"), max_steps=1)
    config = dataclasses.replace(config, drafter=dataclasses.replace(
        config.drafter, markov_head_type=page.markov_head_type, head_options=page.head_options))
    drafter = build_drafter(config, tiny_qwen3)
    head = drafter.markov_head
    assert type(head).__name__ == "ScaledBigramHead" and isinstance(head, SequentialHead) and head.scale == 0.5
    assert drafter.confidence_head.proj.in_features == tiny_qwen3.hidden_size + head.embedding_dim

    # training: the head has no fused factors, so the fused loss (on by default) says so and falls back
    from dspark.data.dataset import RenderedSource
    from dspark.training.trainer import Trainer

    torch.nn.init.normal_(head.w2.weight, std=0.1)
    trainer = Trainer(config, tiny_qwen3, drafter, RenderedSource(synthetic_samples(tiny_qwen3.vocab_size)),
                      progress=False)
    before = head.w1.weight.detach().clone()
    with caplog.at_level(logging.INFO):
        trainer.train_step()
    assert not torch.equal(before, head.w1.weight.detach())
    assert any("fused_factors" in r.getMessage() for r in caplog.records)

    # decoding: the head's step biases the draft
    drafter.eval()
    result = speculative_generate(tiny_qwen3, drafter, [3, 5, 7, 9], max_new_tokens=6, temperature=0.0)
    assert len(result.tokens) == 6

    # save -> reload rebuilds the head with its hyperparameter
    folder = save_drafter(drafter, tmp_path / "saved")
    import json

    written = json.loads((folder / "config.json").read_text())
    assert written["markov_head_type"] == "scaled-bigram" and written["markov_head_options"] == {"scale": 0.5}
    assert written["markov_head_source"] == "mypkg.heads:ScaledBigramHead"
    again = load_drafter(folder, target=tiny_qwen3)
    assert type(again.markov_head) is type(head) and again.markov_head.scale == 0.5
    torch.testing.assert_close(again.markov_head.w2.weight, head.w2.weight)

    # exporters refuse it by name
    with pytest.raises(ValueError, match="scaled-bigram.*registered in your own code"):
        export_drafter(again, tmp_path / "out", to="vllm")

    # without the module imported, loading names the module to import (dspark imports nothing itself)
    HEADS.unregister("scaled-bigram")
    with pytest.raises(ValueError, match=r"scaled-bigram.*mypkg\.heads:ScaledBigramHead.*import the module"):
        load_drafter(folder, target=tiny_qwen3)


def test_an_unregistered_head_assigned_after_construction_is_refused_by_save(tiny_qwen3, tmp_path):
    from dspark.modeling.checkpoint import save_drafter
    from dspark.modeling.drafter import Drafter
    from dspark.modeling.heads import MarkovHead
    from helpers.targets import tiny_drafter_config

    class MyMarkov(MarkovHead):
        pass

    drafter = Drafter(tiny_drafter_config(tiny_qwen3))
    drafter.markov_head = MyMarkov(tiny_qwen3.vocab_size, 8, tiny_qwen3.hidden_size)
    with pytest.raises(ValueError, match="MyMarkov.*not registered.*HEADS.register"):
        save_drafter(drafter, tmp_path / "d")
    HEADS.register("my-markov", MyMarkov)
    try:
        folder = save_drafter(drafter, tmp_path / "d")
        assert '"markov_head_type": "my-markov"' in (folder / "config.json").read_text()
    finally:
        HEADS.unregister("my-markov")


def test_a_new_family_is_one_table_entry(mypkg):
    from transformers import AutoModelForCausalLM, HeliumConfig

    from dspark.modeling.drafter import Drafter
    from dspark.target import TargetModel
    from helpers.targets import tiny_drafter_config

    config = HeliumConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32).eval()
    with pytest.raises(ValueError, match="model_type='helium' is not in dspark.registry.FAMILIES"):
        TargetModel(model, [0, 2, 3])

    exec(block_with("FAMILIES.add"), {})  # the page's one entry
    target = TargetModel(model, [0, 2, 3])
    drafter = Drafter(tiny_drafter_config(target))
    drafter.attach_target(target)
    assert target.family == "helium" and drafter.config.to_hf_dict()["architectures"] == ["HeliumDSparkModel"]
    assert drafter.layers[0].self_attn.q_norm is None  # Llama-like: no q/k norms
    ids = torch.randint(0, 96, (1, 12))
    out = target(ids, return_logits=False)
    hidden = drafter(out.features, ids, torch.tensor([[2, 5]]))
    assert hidden.shape == (1, 2, 4, 64) and torch.isfinite(hidden).all()


def test_families_without_draft_layers_decode_as_targets_and_refuse_a_drafter(make_target):
    from dspark.modeling.drafter import Drafter
    from helpers.targets import tiny_drafter_config

    target = make_target("qwen2")
    assert target.family == "qwen2"
    with pytest.raises(ValueError, match="model_type='qwen2'.*no draft layers.*FAMILIES"):
        Drafter(tiny_drafter_config(target))


def test_a_new_policy_registered_from_a_config_file_runs_from_the_cli(mypkg, tmp_path, monkeypatch):
    """The page's policy module, imported by a config file, then `dspark simulate --config ... --policy
    every-other:2`: every request alternates between the whole block and ℓ = 2."""
    import json

    import dspark.build
    from dspark.cli.main import main
    from dspark.scheduling.algorithm1 import SPSTable
    from helpers.benchmarks import CharTokenizer, write_benchmarks
    from helpers.decoding import random_drafter
    from helpers.targets import make_tiny_target

    config_file = tmp_path / "my_config.py"
    config_file.write_text("import mypkg.policies  # registers 'every-other'\n"
                           "from dspark.config import Config\n\nconfig = Config()\n")
    target = make_tiny_target("llama")
    target.tokenizer = CharTokenizer()
    drafter = random_drafter(target, gamma=4)
    monkeypatch.setattr(dspark.build, "load_models", lambda config: (target, drafter, "a random drafter"))
    write_benchmarks(tmp_path / "data", {"gsm8k": ["g0", "g1"]})
    SPSTable(list(range(1, 33)), [100.0 / b**0.6 for b in range(1, 33)], 32).to_json(tmp_path / "sps.json")
    assert main(["simulate", "--config", str(config_file), "--data-dir", str(tmp_path / "data"),
                 "--benchmarks", "gsm8k", "--num-prompts", "2", "--concurrency", "1", "--max-new-tokens", "12",
                 "--engine", "per-request", "--policy", "every-other:2", "--sps", str(tmp_path / "sps.json"),
                 "--threads", "1", "--out", str(tmp_path / "sim")]) == 0
    results = json.loads((tmp_path / "sim" / "results.json").read_text())["results"]
    assert [r["policy"] for r in results] == ["every-other:2"]
    rounds = [json.loads(line) for line in (tmp_path / "sim" / "rounds.jsonl").read_text().splitlines()]
    by_request: dict = {}
    for r in rounds:
        by_request.setdefault(r["request"], []).append(r["proposed"])
    assert len(by_request) == 2
    for proposed in by_request.values():
        assert len(proposed) >= 3 and proposed[:3] == [4, 2, 4]
