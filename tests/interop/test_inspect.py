"""`dspark inspect`: the description of a folder, and the target check that names the cause of a
low acceptance.

The oracle for the diagnosis is a drafter that accepts well by construction: a few seconds of
training on the tiny target's own greedy continuations of the very prompts the check decodes
(it memorises them). A copy of its folder is then corrupted in one known way (layer ids + 1, the
mask token, the block layout), and the check must name that corruption.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from dspark.cli.main import main, render_inspection
from dspark.data.anchors import block_labels
from dspark.interop.describe import describe_folder
from dspark.interop.inspect import (
    Finding,
    TargetFacts,
    check_structure,
    default_prompts,
    inspect_drafter,
    problems,
)
from dspark.modeling import Drafter, load_drafter, save_drafter
from dspark.evaluation.proposals import greedy_continuation
from tests.helpers.targets import build_tiny_model, make_tiny_target, tiny_drafter_config
from helpers.paths import GOLDEN

LAYER_IDS = (0, 2)  # shiftable both ways in a 4-layer target: (-1, 1) and (1, 3)
GAMMA = 4
NEW_TOKENS = 32


def _train_memorising_drafter(target, prompts: list[list[int]], steps: int = 60) -> Drafter:
    """A 1-layer DFlash-style drafter fitted to the target's greedy continuations of `prompts`."""
    seqs = torch.tensor([greedy_continuation(target, p, 40) for p in prompts])  # [N, P + 40]
    P = len(prompts[0])
    config = tiny_drafter_config(target, variant="dflash", block_size=GAMMA, num_draft_layers=1, markov_rank=0,
                                 enable_confidence_head=False, confidence_head_with_markov=False)
    torch.manual_seed(0)
    drafter = Drafter(config).attach_target(target)
    features = target(seqs).features
    loss_mask = torch.zeros_like(seqs)
    loss_mask[:, P:] = 1
    anchors = torch.arange(P - 1, seqs.shape[1] - 1).expand(seqs.shape[0], -1)  # every anchor of the answer
    keep = torch.ones_like(anchors, dtype=torch.bool)
    labels, valid, prev = block_labels(seqs, loss_mask, anchors, keep, GAMMA)
    opt = torch.optim.Adam(drafter.trainable_parameters(), lr=3e-3)
    for _ in range(steps):
        logits = drafter.draft_logits(drafter(features, seqs, anchors, keep), prev)
        loss = torch.nn.functional.cross_entropy(logits[valid], labels[valid])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return drafter.eval()


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(target, target folder, drafter folder): a drafter that accepts about 3 of γ = 4 drafts."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the same kernels, hence the same greedy tokens, on every machine
    root = tmp_path_factory.mktemp("inspect")
    target = make_tiny_target("llama", target_layer_ids=LAYER_IDS)
    target.model.save_pretrained(root / "target")
    prompts, _ = default_prompts(None, 6, target.vocab_size)  # the first 3 are what the check decodes
    drafter = _train_memorising_drafter(target, prompts)
    save_drafter(drafter, root / "drafter")
    yield target, root / "target", root / "drafter"
    torch.set_num_threads(threads)


def _corrupt(folder: Path, dest: Path, **fields) -> Path:
    shutil.copytree(folder, dest)
    config = json.loads((dest / "config.json").read_text())
    config.update(fields)
    (dest / "config.json").write_text(json.dumps(config))
    return dest


def _check(folder: Path, target) -> tuple[list[Finding], str]:
    inspection = inspect_drafter(folder, target, num_prompts=3, max_new_tokens=NEW_TOKENS)
    return problems(inspection), render_inspection(inspection)


def test_a_good_drafter_passes_every_check(trained):
    target, _, folder = trained
    inspection = inspect_drafter(folder, target, num_prompts=3, max_new_tokens=NEW_TOKENS)
    assert problems(inspection) == []
    stored = inspection.check.runs[0]
    assert len(inspection.check.runs) == 1  # accepting well: no diagnosis runs
    assert stored.mean_accepted >= 2.0, render_inspection(inspection)


def test_layer_ids_shifted_by_one_are_named(trained, tmp_path):
    target, _, folder = trained
    shifted = _corrupt(folder, tmp_path / "shifted", target_layer_ids=[i + 1 for i in LAYER_IDS])
    found, text = _check(shifted, target)
    assert [f.code for f in found] == ["layer_ids"], text
    assert "layer ids look shifted by one" in found[0].message
    assert "input-of-layer" in found[0].message and "vLLM EAGLE-3" in found[0].message
    assert f"set target_layer_ids to {list(LAYER_IDS)}" in found[0].message


def test_wrong_mask_token_is_named(trained, tmp_path):
    target, _, folder = trained
    wrong = _corrupt(folder, tmp_path / "mask", mask_token_id=5)
    found, text = _check(wrong, target)
    assert [f.code for f in found] == ["mask_token"], text
    V = target.vocab_size
    assert found[0].message.startswith("wrong mask token: the folder says 5")
    assert f"set mask_token_id to {V - 1}" in found[0].message


def test_wrong_block_layout_is_named(trained, tmp_path):
    target, _, folder = trained
    wrong = _corrupt(folder, tmp_path / "layout", block_layout="anchor_plus_masks")
    found, text = _check(wrong, target)
    assert [f.code for f in found] == ["block_layout"], text
    assert found[0].message.startswith("wrong block layout: the folder says anchor_plus_masks")
    assert "set block_layout to anchor_first" in found[0].message


def test_target_of_another_hidden_size_is_an_error_without_decode(trained):
    _, _, folder = trained
    from dspark.target import TargetModel

    other = TargetModel(build_tiny_model("llama", hidden_size=32), [-1])
    inspection = inspect_drafter(folder, other)
    found = problems(inspection)
    assert [(f.level, f.code) for f in found] == [("error", "hidden_size")]
    assert "hidden size mismatch: the drafter's hidden_size is 64, the target's is 32" in found[0].message
    assert inspection.check.runs == []


def test_an_untrained_drafter_is_reported_trivially_low(trained, tmp_path):
    target, _, _ = trained
    torch.manual_seed(1)
    fresh = Drafter(tiny_drafter_config(target, block_size=GAMMA)).attach_target(target)
    save_drafter(fresh, tmp_path / "fresh")
    found, text = _check(tmp_path / "fresh", target)
    assert [f.code for f in found] == ["acceptance", "acceptance"], text
    assert "trivially low" in found[1].message and "no variant recovers it" in found[1].message


def test_structure_checks_name_each_mismatch(trained):
    _, _, folder = trained
    desc = describe_folder(folder)
    facts = TargetFacts("t", num_layers=2, hidden_size=64, vocab_size=100)
    by_code = {f.code: f for f in check_structure(desc, facts) if f.level == "error"}
    assert set(by_code) == {"layer_ids", "vocab_size", "mask_token"}
    assert "[2] do not exist in a 2-layer target" in by_code["layer_ids"].message
    assert "the target has 100 tokens, the drafter has vocab_size (config.json) = 128" in by_code["vocab_size"].message
    assert "mask token 127 is outside the target's vocabulary [0, 100)" in by_code["mask_token"].message


def test_description_of_our_folder(trained):
    _, _, folder = trained
    desc = describe_folder(folder)
    assert (desc.format, desc.algorithm, desc.block_layout, desc.gamma) == ("dspark", "dflash", "anchor_first", GAMMA)
    assert desc.target_layer_ids == list(LAYER_IDS) and desc.mask_token_id == 127
    assert desc.layer_convention.startswith("output of decoder layer i (HF hidden_states[i+1]")
    assert desc.params.frozen == 0 and desc.params.frozen_tensors == []
    # d = 64, m = 2: fc 64·128, 2 norms of 64, one Llama layer (q 64·64, k/v 32·64 each, o 64·64,
    # MLP 3·64·128, 2 norms of 64) = 8192 + 128 + 12288 + 24576 + 128
    assert desc.params.trainable == 8192 + 128 + 12288 + 24576 + 128
    assert desc.dtypes == {"float32": desc.params.trainable}


def test_description_of_a_deepspec_folder():
    folder = GOLDEN / "deepspec" / "dspark_vanilla" / "checkpoint"
    if not folder.is_dir():
        pytest.skip(f"{folder} is absent (tests/golden, or the folder $DSPARK_GOLDEN names)")
    desc = describe_folder(folder)
    assert (desc.format, desc.algorithm, desc.block_layout, desc.gamma) == ("deepspec", "dspark", "anchor_first", 7)
    assert desc.target_layer_ids == [-1, 1, 4] and desc.mask_token_id == 999
    # golden README: vanilla Markov head r = 32, confidence head with markov features (H + r = 96)
    assert desc.heads == ["sequential head: vanilla, Markov rank 32",
                          "confidence head on [h_k; W1[x_(k-1)]] (H + r = 96)"]
    assert desc.params.frozen_tensors == ["embed_tokens.weight", "lm_head.weight"]
    assert desc.params.frozen == 2 * 1000 * 64


def test_description_of_a_zlab_folder():
    folder = GOLDEN / "zlab_dflash" / "checkpoint"
    if not folder.is_dir():
        pytest.skip(f"{folder} is absent (tests/golden, or the folder $DSPARK_GOLDEN names)")
    desc = describe_folder(folder)
    # golden README: block_size 8 = anchor + 7 masks, dflash_config {mask 999, ids [1, 3]}, no embedding/LM head
    assert (desc.format, desc.algorithm, desc.block_layout, desc.gamma) == ("zlab", "dflash", "anchor_plus_masks", 7)
    assert desc.target_layer_ids == [1, 3] and desc.mask_token_id == 999
    assert desc.params.frozen == 0


def test_description_of_our_eagle3_folder_states_its_gamma(tmp_path):
    from helpers.eagle3 import tiny_eagle3

    target = make_tiny_target("llama", target_layer_ids=LAYER_IDS)
    folder = save_drafter(tiny_eagle3(target, preset="eagle3"), tmp_path / "eagle3")  # γ = 4
    desc = describe_folder(folder)
    assert (desc.format, desc.algorithm, desc.block_layout, desc.gamma) == ("dspark-eagle3", "eagle3", None, GAMMA)
    assert desc.target_layer_ids == list(LAYER_IDS)


def test_a_corrupted_safetensors_header_names_the_file(trained, tmp_path):
    _, _, folder = trained
    broken = shutil.copytree(folder, tmp_path / "broken")
    (broken / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(ValueError, match=r"model\.safetensors is not a readable safetensors file"):
        describe_folder(broken)


def test_a_corrupted_config_json_names_the_file(trained, tmp_path):
    _, _, folder = trained
    broken = shutil.copytree(folder, tmp_path / "broken")
    (broken / "config.json").write_text('{"architectures": ["LlamaDSparkModel"], "block_size": ')
    with pytest.raises(ValueError, match=r"config\.json is not valid JSON"):
        describe_folder(broken)


def test_a_deepspec_run_folder_reads_its_last_step(trained, tmp_path):
    _, _, folder = trained
    for step in (20, 100, 3):
        shutil.copytree(folder, tmp_path / "run" / f"step_{step}")
    desc = describe_folder(tmp_path / "run")
    assert desc.path == tmp_path / "run" / "step_100"
    assert desc.notes == [f"read the last checkpoint step_100 of 3 inside {tmp_path / 'run'}"]


def test_inspect_and_load_drafter_read_the_same_checkpoint_of_a_run_folder(trained, tmp_path):
    _, _, folder = trained
    run = tmp_path / "run"
    shutil.copytree(folder, run / "drafter")  # the final drafter, γ = 4
    _corrupt(folder, run / "step_3", block_size=GAMMA - 1)  # a checkpoint told apart by its γ
    (run / "step_latest").symlink_to("step_3")
    desc = describe_folder(run)
    assert desc.path == run / "drafter" and desc.notes == [f"read the final drafter of the training run {run}"]
    assert load_drafter(run).config.block_size == desc.gamma == GAMMA


def test_cli_inspect_prints_the_cause(trained, tmp_path, capsys):
    _, target_dir, folder = trained
    shifted = _corrupt(folder, tmp_path / "shifted", target_layer_ids=[i + 1 for i in LAYER_IDS])
    code = main(["inspect", str(shifted), "--target", str(target_dir), "--dtype", "float32",
                 "--num-prompts", "3", "--max-new-tokens", str(NEW_TOKENS)])
    out = capsys.readouterr().out
    assert code == 1, out
    assert "format: dspark" in out and "WARNING layer ids look shifted by one" in out


def test_cli_inspect_without_target_describes(trained, capsys):
    _, _, folder = trained
    assert main(["inspect", str(folder)]) == 0
    out = capsys.readouterr().out
    assert "algorithm: dflash" in out and "γ (drafts per block): 4" in out


def test_a_deepspec_folder_is_checked_against_its_target():
    folder, target_dir = GOLDEN / "deepspec" / "dspark_vanilla" / "checkpoint", GOLDEN / "deepspec" / "target"
    if not folder.is_dir() or not target_dir.is_dir():
        pytest.skip(f"{folder} or {target_dir} is absent (tests/golden, or the folder $DSPARK_GOLDEN names)")
    inspection = inspect_drafter(folder, str(target_dir), dtype="float32", num_prompts=1, max_new_tokens=8,
                                 diagnose="never")
    structure = [f for f in inspection.check.findings if f.code != "acceptance"]
    assert [(f.level, f.code) for f in structure] == [
        ("ok", "layer_ids"), ("ok", "hidden_size"), ("ok", "vocab_size"), ("ok", "mask_token")]
    assert inspection.check.facts.num_layers == 6 and inspection.check.runs[0].rounds > 0
