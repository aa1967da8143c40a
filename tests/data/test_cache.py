"""The offline target cache: codec, format, validation, resume, size, quality."""

from __future__ import annotations

import json
import pickle

import pytest
import torch

from helpers.targets import make_tiny_target
from dspark.data.anchors import anchor_candidates
from dspark.data.cache import (
    PRECISIONS,
    Manifest,
    TargetCache,
    build_cache,
    bytes_per_token,
    decode_rows,
    encode_rows,
    estimate_cache_size,
)
from dspark.data.cache.format import MANIFEST

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

LENGTHS = (6, 9, 5, 12, 7, 4, 10)


def make_samples(vocab_size: int, lengths=LENGTHS, seed: int = 0) -> list[dict]:
    """Random ids; loss masks shaped like chats: a prompt outside the mask, an answer inside."""
    g = torch.Generator().manual_seed(seed)
    samples = []
    for n in lengths:
        prompt = int(torch.randint(1, max(2, n // 2), (1,), generator=g))
        mask = [0] * prompt + [1] * (n - prompt)
        if n > 6:
            mask[prompt + 2] = 0  # a hole inside the answer: two candidates fewer
        samples.append({"input_ids": torch.randint(0, vocab_size, (n,), generator=g).tolist(), "loss_mask": mask})
    return samples


@pytest.fixture(scope="module")
def qwen3():
    return make_tiny_target("qwen3")


@pytest.fixture(scope="module")
def samples(qwen3):
    return make_samples(qwen3.vocab_size)


def build(target, samples, path, **kwargs):
    kwargs = {"precision": "fp32", "shard_tokens": 16, "batch_size": 2, "progress": False, **kwargs}
    return build_cache(target, samples, path, **kwargs)


@pytest.fixture
def built(qwen3, samples, tmp_path) -> Manifest:
    """An fp32 cache of ``samples`` in tmp_path, named "tiny-qwen3", in two shards."""
    return build(qwen3, samples, tmp_path, target_name="tiny-qwen3")


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


# ------------------------------------------------------------------ codec
def test_fp8_scale_is_the_smallest_power_of_two_that_fits_448():
    rows = torch.tensor([[448.0, 1.0], [449.0, 0.0], [224.0, -3.0], [-1.0, 0.5], [0.0, 0.0]])
    _, exps = encode_rows(rows, "fp8")
    # absmax 448 -> 2^0; 449 -> 2^1 (449/1 would overflow); 224 -> 2^-1 (224*2 = 448); 1 -> 2^-8 (256 <= 448 < 512)
    assert (exps.int() - 127).tolist()[:4] == [0, 1, -1, -8]


def test_fp8_never_overflows_and_rounds_within_e4m3_precision():
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(64, 256, generator=g) * torch.logspace(-30, 30, 64)[:, None]
    rows[3, 7] = 1e4 * rows[3].abs().max()  # an outlier dimension
    values, exps = encode_rows(rows, "fp8")
    scaled = values.view(torch.float8_e4m3fn).float()
    assert torch.isfinite(scaled).all() and scaled.abs().amax() <= 448
    assert (scaled.abs().amax(-1) >= 224).all()  # the absmax lands in (224, 448], rounded to e4m3
    back = decode_rows(values, exps, "fp8")
    normal = scaled.abs() > 2.0**-6  # e4m3's normal range: 3 mantissa bits, half-ulp <= 2^-4 relative
    assert ((back - rows).abs() <= 2.0**-4 * rows.abs())[normal].all()


@pytest.mark.parametrize("precision", PRECISIONS)
def test_zero_rows_round_trip_to_zero(precision):
    back = decode_rows(*encode_rows(torch.zeros(2, 8), precision), precision)
    assert torch.equal(back, torch.zeros(2, 8))


def test_fp32_codec_is_exact_and_bf16_is_round_to_nearest():
    rows = torch.randn(4, 32)
    assert torch.equal(decode_rows(*encode_rows(rows, "fp32"), "fp32"), rows)
    assert torch.equal(decode_rows(*encode_rows(rows, "bf16"), "bf16"), rows.bfloat16().float())


def test_non_finite_hidden_states_are_refused():
    with pytest.raises(ValueError, match="non-finite"):
        encode_rows(torch.tensor([[1.0, float("nan")]]), "fp8")


# ----------------------------------------------------------------- sizes
def test_bytes_per_token_at_qwen3_4b_sizes():
    # 4 (id + mask bit) + (m + f) * (d*b + s), d = 2560, m = 5
    assert bytes_per_token(2560, 5, "fp8", 1.0) == 4 + 6 * 2561 == 15370  # 7 bytes over half of 30,726
    assert bytes_per_token(2560, 5, "fp8", 0.0) == 4 + 5 * 2561
    assert bytes_per_token(2560, 5, "bf16", 1.0) == 4 + 6 * 5120
    assert bytes_per_token(2560, 5, "fp32", 0.5) == 4 + 5.5 * 10240


@pytest.mark.parametrize("precision", PRECISIONS)
def test_estimate_equals_the_size_of_the_built_cache(qwen3, samples, tmp_path, precision):
    manifest = build(qwen3, samples, tmp_path, precision=precision)
    on_disk = sum(p.stat().st_size for p in tmp_path.iterdir() if p.name != MANIFEST)
    assert estimate_cache_size(qwen3, samples, precision) == manifest.data_bytes == on_disk
    # from dims only, with plain token counts and their true candidate fraction
    assert estimate_cache_size((qwen3.hidden_size, 3), samples, precision) == on_disk
    assert estimate_cache_size(qwen3, [len(s["input_ids"]) for s in samples], precision) >= on_disk  # worst case


# ------------------------------------------------------------ round trip
def test_fp32_cache_returns_exactly_what_the_target_computed(qwen3, samples, tmp_path):
    build(qwen3, samples, tmp_path, batch_size=1)
    cache = TargetCache(tmp_path, expected_target=qwen3, expected_layer_ids=[0, 2, 3])
    assert len(cache) == len(samples) and cache.lengths.tolist() == list(LENGTHS)
    assert cache.num_tokens == sum(LENGTHS)
    for i, sample in enumerate(samples):
        out = qwen3(torch.tensor([sample["input_ids"]]), return_logits=False)
        item = cache[i]
        assert item["input_ids"].tolist() == sample["input_ids"]
        assert item["loss_mask"].tolist() == sample["loss_mask"]
        assert torch.equal(item["features"], out.features[0])
        has_final = item["has_final"]
        assert torch.equal(has_final, anchor_candidates(torch.tensor([sample["loss_mask"]]))[0])
        assert torch.equal(item["final_hidden"][has_final], out.last_hidden[0][has_final])
        assert (item["final_hidden"][~has_final] == 0).all()


@pytest.mark.parametrize("family", ["qwen3", "gemma4"])
def test_padding_in_a_batch_does_not_change_the_features(family, tmp_path):
    target = make_tiny_target(family)
    samples = make_samples(target.vocab_size, lengths=(5, 13, 9))  # gemma4's window is 8
    build(target, samples, tmp_path / "one", batch_size=1)
    build(target, samples, tmp_path / "three", batch_size=3)
    one, three = TargetCache(tmp_path / "one"), TargetCache(tmp_path / "three")
    for i in range(len(samples)):
        torch.testing.assert_close(three[i]["features"], one[i]["features"], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(three[i]["final_hidden"], one[i]["final_hidden"], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("precision, bound", [("fp8", 0.04), ("bf16", 0.005)])
def test_quantized_caches_stay_within_their_precision(qwen3, samples, tmp_path, precision, bound):
    build(qwen3, samples, tmp_path / "exact")
    build(qwen3, samples, tmp_path / precision, precision=precision)
    exact, quantized = TargetCache(tmp_path / "exact"), TargetCache(tmp_path / precision)
    for i in range(len(samples)):
        a, b = quantized[i], exact[i]
        assert torch.equal(a["has_final"], b["has_final"]) and torch.equal(a["input_ids"], b["input_ids"])
        assert rel_err(a["features"], b["features"]) < bound
        assert rel_err(a["final_hidden"], b["final_hidden"]) < bound


def test_raw_read_decodes_to_the_same_sample(qwen3, samples, tmp_path):
    build(qwen3, samples, tmp_path, precision="fp8")
    cache = TargetCache(tmp_path)
    raw, item = cache.read(3, dequantize=False), cache[3]
    assert raw["feature_values"].dtype == torch.uint8 and raw["feature_scales"].shape == (12 * 3,)
    features = decode_rows(raw["feature_values"], raw["feature_scales"], "fp8").view(12, -1)
    assert torch.equal(features, item["features"])


def test_a_pickled_cache_reopens_its_shards(built, tmp_path):
    cache = TargetCache(tmp_path)
    first = cache[0]["features"]
    clone = pickle.loads(pickle.dumps(cache))  # what a DataLoader worker receives
    assert clone._maps == {} and torch.equal(clone[0]["features"], first)


# ------------------------------------------------------------- validation
def test_mismatched_layer_ids_are_rejected_with_the_fix(built, tmp_path):
    with pytest.raises(ValueError, match=r"layer ids \[0, 2, 3\].*asks for \[0, 1, 3\] \(\[1\] not cached\).*dspark cache"):
        TargetCache(tmp_path, expected_layer_ids=[0, 1, 3])
    with pytest.raises(ValueError, match=r"asks for \[3, 0\] \(not strictly increasing\)"):
        TargetCache(tmp_path, expected_layer_ids=[3, 0])
    with pytest.raises(ValueError, match="target_layer_ids: cache"):
        TargetCache(tmp_path, expected_target=make_tiny_target("qwen3", target_layer_ids=[0, 1, 3]))


@pytest.mark.parametrize("precision", ["fp8", "fp32"])
def test_a_subset_of_the_cached_layers_reads_their_column_blocks(qwen3, samples, tmp_path, precision):
    build(qwen3, samples, tmp_path, precision=precision)  # layers [0, 2, 3], d = hidden size
    full = TargetCache(tmp_path)
    d = full.manifest.hidden_size
    part = TargetCache(tmp_path, expected_layer_ids=[0, 3])
    assert part.target_layer_ids == [0, 3] and full.target_layer_ids == [0, 2, 3]
    for i in (0, 3):
        want = full[i]["features"].view(-1, 3, d)[:, [0, 2]].reshape(-1, 2 * d)
        got = part[i]
        assert torch.equal(got["features"], want)
        assert torch.equal(got["final_hidden"], full[i]["final_hidden"])
        raw = part.read(i, dequantize=False)
        assert torch.equal(decode_rows(raw["feature_values"], raw["feature_scales"], precision).view(-1, 2 * d), want)
    # a target whose layer ids are a subset passes the fingerprint check too
    sub_target = make_tiny_target("qwen3", target_layer_ids=[2, 3])
    assert TargetCache(tmp_path, expected_target=sub_target).target_layer_ids == [2, 3]


def test_a_different_target_is_rejected(built, tmp_path):
    TargetCache(tmp_path, expected_target="tiny-qwen3")
    with pytest.raises(ValueError, match="asks for target 'Qwen/Qwen3-4B'"):
        TargetCache(tmp_path, expected_target="Qwen/Qwen3-4B")
    with pytest.raises(ValueError, match="lm_head_digest"):  # same architecture, other weights
        TargetCache(tmp_path, expected_target=make_tiny_target("qwen3", seed=1))
    with pytest.raises(ValueError, match="model_type: cache 'qwen3', target 'llama'"):
        TargetCache(tmp_path, expected_target=make_tiny_target("llama", target_layer_ids=[0, 2, 3]))


def test_a_truncated_shard_is_rejected(built, tmp_path):
    shard = tmp_path / built.shards[1].file
    shard.write_bytes(shard.read_bytes()[:-8])
    with pytest.raises(ValueError, match=r"shard-00001\.bin has \d+ bytes, the manifest records"):
        TargetCache(tmp_path)


def test_a_missing_shard_is_rejected(built, tmp_path):
    (tmp_path / built.shards[0].index_file).unlink()
    with pytest.raises(ValueError, match=r"index-00000\.bin is missing"):
        TargetCache(tmp_path)


def test_a_corrupted_byte_is_caught_by_the_checksum(built, tmp_path):
    shard = tmp_path / built.shards[0].file
    data = bytearray(shard.read_bytes())
    data[100] ^= 0x01
    shard.write_bytes(bytes(data))
    TargetCache(tmp_path)  # same size: the default check cannot see it
    with pytest.raises(ValueError, match="fails its sha256 check"):
        TargetCache(tmp_path, verify="checksum")


def test_a_newer_format_version_is_rejected(built, tmp_path):
    data = json.loads((tmp_path / MANIFEST).read_text())
    data["version"] = 99
    (tmp_path / MANIFEST).write_text(json.dumps(data))
    with pytest.raises(ValueError, match="format version 99"):
        TargetCache(tmp_path)


def test_a_folder_without_manifest_is_not_a_cache(tmp_path):
    with pytest.raises(ValueError, match="has no manifest.json"):
        TargetCache(tmp_path)


# ------------------------------------------------------------------ resume
class Killed(Exception):
    pass


def killed_after(samples, n):
    yield from samples[:n]
    raise Killed


def build_killed(target, samples, path, **kwargs):
    """A build killed when it draws a sixth sample: the shard closes after batches {0,1},{2,3}
    (32 tokens >= 16), so it holds 4 samples and batch {4,5} is still open."""
    with pytest.raises(Killed):
        build(target, killed_after(samples, 5), path, **kwargs)


def test_resume_after_a_kill_gives_the_same_cache_as_one_build(qwen3, samples, tmp_path):
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    build(qwen3, samples, whole, precision="fp8")
    build_killed(qwen3, samples, resumed, precision="fp8")
    partial = Manifest.read(resumed)
    assert not partial.complete and partial.num_samples == 4 and len(partial.shards) == 1
    with pytest.raises(ValueError, match="incomplete .*rerun `dspark cache` to resume"):
        TargetCache(resumed)
    # what a kill between a shard's os.replace and its manifest could leave behind
    (resumed / "shard-00001.bin").write_bytes(b"torn")
    (resumed / "shard-00002.bin.tmp").write_bytes(b"torn")
    (resumed / ".manifest.json.tmp-4242").write_bytes(b"torn")  # a killed atomic write of the manifest

    build(qwen3, samples, resumed, precision="fp8")
    names = sorted(p.name for p in whole.iterdir())
    assert sorted(p.name for p in resumed.iterdir()) == names
    for name in names:
        if name != MANIFEST:
            assert (whole / name).read_bytes() == (resumed / name).read_bytes(), name
    a, b = Manifest.read(whole), Manifest.read(resumed)
    a.created = b.created = {}
    assert a == b and a.complete


def test_resume_refuses_other_samples(qwen3, samples, tmp_path):
    build_killed(qwen3, samples, tmp_path)
    other = make_samples(qwen3.vocab_size, seed=1)
    with pytest.raises(ValueError, match="differ from the ones it was built from"):
        build(qwen3, other, tmp_path)


def test_resume_refuses_another_precision(qwen3, samples, tmp_path):
    build_killed(qwen3, samples, tmp_path, precision="fp8")
    with pytest.raises(ValueError, match="precision 'fp8' vs 'bf16'.*resume=False"):
        build(qwen3, samples, tmp_path, precision="bf16")
    build(qwen3, samples, tmp_path, precision="bf16", resume=False)
    assert TargetCache(tmp_path).precision == "bf16"


def test_building_a_complete_cache_again_runs_no_forward(qwen3, samples, built, tmp_path, monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("the target ran")

    monkeypatch.setattr(type(qwen3), "forward", fail)
    assert build(qwen3, samples, tmp_path) == built


# --------------------------------------------------------- real features
CHAT = [
    {"role": "user", "content": "Explain why the sky is blue in a short paragraph, then give two everyday examples."},
    {
        "role": "assistant",
        "content": "The sky looks blue because sunlight is scattered by the molecules of the air. Sunlight "
        "contains all colours, but the short blue wavelengths are scattered much more strongly than the long "
        "red ones (Rayleigh scattering goes as one over the fourth power of the wavelength). When you look at "
        "any part of the sky away from the sun, you see this scattered light, and it is dominated by blue. At "
        "sunrise and sunset the light travels through much more air, so most of the blue is scattered away "
        "before it reaches you, and the sun looks orange and red.\n\nTwo everyday examples:\n1. A glass of "
        "water with a few drops of milk looks slightly blue from the side and orange when you look through it "
        "at a lamp.\n2. Car headlights in fog: the beam is visible from the side because the droplets scatter "
        "the light towards you.",
    },
]


def no_scale_fp8(rows):  # broken: casts without a scale, clamped at e4m3's range
    return rows.clamp(-448, 448).to(torch.float8_e4m3fn).float()


def int8_truncating(rows):  # broken: per-row int8 that truncates instead of rounding
    step = rows.abs().amax(-1, keepdim=True) / 127
    return torch.trunc(rows / step) * step


def fp8_round_trip(rows):
    return decode_rows(*encode_rows(rows, "fp8"), "fp8")


def quality(target, features, last_hidden, candidates, quantize):
    """Worst per-layer relative L2 error of the features, and the mean TV of p^t at the candidates."""
    m, d = len(target.target_layer_ids), target.hidden_size
    rows = features.reshape(-1, d)
    layers = (quantize(rows) - rows).view(-1, m, d).norm(dim=(0, 2)) / rows.view(-1, m, d).norm(dim=(0, 2))
    h = last_hidden[candidates]
    p = torch.softmax(target.compute_logits(h).float(), -1)
    q = torch.softmax(target.compute_logits(quantize(h)).float(), -1)
    return float(layers.max()), float(0.5 * (p - q).abs().sum(-1).mean())


@pytest.mark.slow
def test_fp8_keeps_real_smollm2_features_and_target_distributions(smollm2_target):
    from dspark.data.render import render_conversation

    sample = render_conversation(smollm2_target.tokenizer, CHAT, max_length=4096)
    assert len(sample.input_ids) > 200
    out = smollm2_target(torch.tensor([sample.input_ids]), return_logits=False)
    candidates = anchor_candidates(torch.tensor([sample.loss_mask]))[0]
    args = (smollm2_target, out.features[0], out.last_hidden[0], candidates)
    # measured: fp8 worst layer 0.027, mean TV 0.035 (a bf16 target forward alone gives TV 0.015 vs fp32)
    layer_err, tv = quality(*args, fp8_round_trip)
    assert layer_err < 0.04 and tv < 0.045
    # the bounds catch broken quantizers: without scales (0.97 on a layer), truncating int8 (0.084, TV 0.053)
    assert quality(*args, no_scale_fp8)[0] > 0.04
    broken_err, broken_tv = quality(*args, int8_truncating)
    assert broken_err > 0.04 and broken_tv > 0.045
