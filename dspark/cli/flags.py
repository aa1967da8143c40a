"""The command-line flags of `dspark`: each a shorthand for a config field, declared once.

Every command that runs a model reads one `dspark.config.Config`: `--config FILE`
(a Python config file, or the config.json a run wrote) plus `--set key.path=value`.
The flags below only set fields of that config; `COMMANDS` says, per
command, which field each flag sets (`--out` is `eval.out` for `eval` and
`serve.out` for `simulate`). A deprecated flag still works, hidden from the help,
with a FutureWarning naming its replacement. Kept free of torch so that
`dspark --help` is fast.
"""

from __future__ import annotations

import argparse
import warnings
from dataclasses import dataclass
from typing import Any

from dspark.registry import policy_help

POLICY_HELP = policy_help()  # the registered verification policies (dspark.registry.POLICIES), with their arguments


@dataclass(frozen=True)
class Flag:
    help: str
    kind: str = "value"  # "value": one text | "list": items, comma- or space-separated | "true" / "false": a switch
    metavar: str | None = None
    replaced_by: str | None = None  # a deprecated flag: the flag to use instead


FLAGS: dict[str, Flag] = {
    "--target": Flag("the target: hub name, local folder, or smollm2-135m (the embedded default)"),
    "--draft": Flag("a trained drafter folder (ours or DeepSpec's layout); default: a fresh drafter from the config"),
    "--device": Flag("auto (a GPU if there is one, else cpu), cpu, cuda or cuda:N"),
    "--dtype": Flag("auto (bfloat16 on a GPU or on a CPU with native bf16, else float32), float32, bfloat16, float16"),
    "--threads": Flag("torch CPU threads (0: torch's choice)"),
    "--trust-remote-code": Flag("allow the target's own modeling code from the hub", kind="true"),
    "--data-dir": Flag("folder with the benchmark <name>.jsonl files"),
    "--benchmarks": Flag("benchmark names (default: all nine)", kind="list"),
    "--builtin-eval": Flag("use the built-in evaluation prompts instead of benchmark files", kind="true"),
    "--num-samples": Flag("prompts per benchmark (0: the protocol's count of each benchmark)"),
    "--num-prompts": Flag("prompts per benchmark (seeded subset)"),
    "--split": Flag("which prompts of each benchmark: all (the whole file, DeepSpec's subsets), dev (tuning) "
                    "or test (reported results)"),
    "--max-new-tokens": Flag("the most tokens generated per request"),
    "--temperature": Flag("sampling temperature (0 = greedy)"),
    "--block-size": Flag("override the drafter's γ (0: the drafter's own)"),
    "--seed": Flag("seed of the prompt subset and of every random draw"),
    "--engine": Flag("the serving loop: batched (one drafter and one target forward per step for every live "
                     "request, timed on the wall clock too) or per-request (each request verified on its own)"),
    "--batch-size": Flag("requests decoded together (one drafter and one target forward per round for all; "
                         "each request decodes the tokens it would alone); auto: the largest that still pays, "
                         "timed on the device before decoding; 1: one at a time"),
    "--no-baseline": Flag("skip target-only decoding (no speedup figures)", kind="false"),
    "--label": Flag("row label in the report tables"),
    "--policy": Flag("verification-length policy: eval decodes through the serving loop under each one given "
                     "(none: verify all γ drafts; several: the same requests under each, one target-only decode, "
                     "policy P in OUT/P-R<R>), simulate compares the ones given (default: algorithm1, async, "
                     "static1, static, threshold:0.5); " + POLICY_HELP, kind="list", metavar="POLICY"),
    "--scheduler": Flag("deprecated spelling of --policy", metavar="POLICY", replaced_by="--policy"),
    "--sts": Flag("STS JSON (dspark calibrate): calibrated confidences for the policy and the report"),
    "--sps": Flag("SPS table JSON (dspark profile-sps), for algorithm1 / async and the simulated clock"),
    "--concurrency": Flag("requests decoded in lockstep (eval: one R; simulate: R values, e.g. 1,4,16,64)"),
    "--num-requests": Flag("stop after this many finished requests (0: max(prompts, R)); prompts are cycled"),
    "--no-cycle": Flag("serve every prompt once; the slots drain at the end", kind="false"),
    "--draft-overhead": Flag("drafter time on the simulated clock: a fraction of the verification step "
                             "(0: ignored) or 'measured' (every phase measured at each step but the target's verification: draft, accept, cache and context bookkeeping, the policy's decision)"),
    "--batch-tokens": Flag("B values, e.g. 1,2,4,8 (default 1..512, powers of 2)", kind="list"),
    "--context-len": Flag("tokens already in the KV cache"),
    "--tokens-per-request": Flag("time B/q rows of q tokens with their own caches (0: one sequence of B tokens)"),
    "--warmup": Flag("untimed forwards per B"),
    "--repeats": Flag("timed forwards per B (the median is kept)"),
    "--rounds": Flag("rounds.jsonl file(s) from dspark eval / simulate", kind="list"),
    "--fit-fraction": Flag("share of requests to fit on (the rest is the test part)"),
    "--bins": Flag("ECE bins"),
    "--min-events": Flag("STS: accepted and rejected prefixes a position needs before T_k may leave 1 (0: no rule)"),
    "--folds": Flag("STS: request folds of the held-out check that T_k beats T = 1 beyond noise (0: no check)"),
    "--prompt": Flag("the user message"),
    "--num-blocks": Flag("blocks proposed along the continuation"),
    "--resume": Flag("continue from the latest checkpoint in out_dir", kind="true"),
    "--no-cache": Flag("stop after rendering (online feature mode: the target runs in the training step)",
                       kind="const:online"),
    "--out": Flag("where to write the outputs"),
    "--vocab-size": Flag("k, the draft vocabulary's number of ids (0: the full vocabulary)"),
    "--counts": Flag("how tokens are counted: hard (supervised tokens), soft (the target's probabilities), "
                     "hard+soft (hard first, topped up from soft)"),
    "--vocab": Flag("the draft vocabulary file (default <data_dir>/draft_vocab_<k>.safetensors)"),
}

_MODEL = {"--target": "target.name_or_path", "--device": "target.device", "--dtype": "target.dtype",
          "--threads": "threads", "--trust-remote-code": "target.trust_remote_code"}
_PROMPTS = {"--data-dir": "eval.data_dir", "--benchmarks": "eval.benchmarks", "--builtin-eval": "eval.builtin_prompts",
            "--split": "eval.split", "--temperature": "eval.temperature", "--seed": "eval.seed",
            "--block-size": "eval.block_size", "--draft": "eval.draft", "--sts": "serve.sts", "--sps": "serve.sps"}

# command -> (help, {flag: config key})
COMMANDS: dict[str, tuple[str, dict[str, str]]] = {
    "propose": ("show a drafter's proposals along the target's own continuation of a prompt",
                {**_MODEL, "--draft": "eval.draft", "--prompt": "propose.prompt",
                 "--max-new-tokens": "propose.max_new_tokens", "--num-blocks": "propose.num_blocks",
                 "--temperature": "propose.temperature"}),
    "prepare": ("regenerate answers with the target, render them, build the feature cache",
                {**_MODEL, "--no-cache": "data.feature_mode"}),
    "cache": ("build the target feature cache (or --estimate its size)", dict(_MODEL)),
    "vocab": ("count the training tokens and write the draft vocabulary, with its coverage",
              {**_MODEL, "--vocab-size": "drafter.draft_vocab_size", "--counts": "data.vocab_counts",
               "--vocab": "drafter.draft_vocab"}),
    "train": ("train a drafter (torchrun for several processes)", {**_MODEL, "--resume": "train.resume"}),
    "eval": ("accepted length τ on the nine benchmarks (torchrun shards prompts)",
             {**_MODEL, **_PROMPTS, "--num-samples": "eval.num_samples", "--max-new-tokens": "eval.max_new_tokens",
              "--no-baseline": "eval.baseline", "--batch-size": "eval.batch_size", "--label": "eval.label",
              "--policy": "serve.policy",
              "--scheduler": "serve.policy", "--concurrency": "serve.concurrency", "--engine": "serve.engine",
              "--out": "eval.out"}),
    "profile-sps": ("time the target's verification forward: the SPS(B) table of Algorithm 1",
                    {**_MODEL, "--draft": "eval.draft", "--batch-tokens": "profile.batch_tokens",
                     "--context-len": "profile.context_len", "--tokens-per-request": "profile.tokens_per_request",
                     "--warmup": "profile.warmup", "--repeats": "profile.repeats", "--out": "profile.out"}),
    "simulate": ("serving simulation: throughput and verification budget vs concurrency per policy (paper Fig. 8)",
                 {**_MODEL, **_PROMPTS, "--num-prompts": "serve.num_prompts", "--concurrency": "serve.concurrencies",
                  "--policy": "serve.policy", "--num-requests": "serve.num_requests", "--no-cycle": "serve.cycle",
                  "--max-new-tokens": "serve.max_new_tokens", "--draft-overhead": "serve.draft_overhead",
                  "--engine": "serve.engine", "--out": "serve.out"}),
    "calibrate": ("fit STS on eval round logs (split by request) and report calibration",
                  {"--rounds": "calibrate.rounds", "--fit-fraction": "calibrate.fit_fraction",
                   "--seed": "calibrate.seed", "--bins": "calibrate.bins", "--min-events": "calibrate.min_events",
                   "--folds": "calibrate.folds", "--out": "calibrate.out"}),
}
LIST_KEYS = {"serve.concurrencies"}  # a "value" flag whose field is a list (simulate's --concurrency)


def add_config_flags(p: argparse.ArgumentParser, command: str) -> None:
    """`--config`, `--set` and the command's shorthand flags (all default to "not given")."""
    p.add_argument("--config", default=None, metavar="FILE",
                   help="a config file (config/*/*.py) or the config.json a run wrote; default: the defaults "
                        "(the Qwen3-4B DSpark recipe)")
    p.add_argument("--set", dest="overrides", nargs="*", action="extend", default=[], metavar="KEY=VALUE",
                   help="override config fields, e.g. --set train.lr=3e-4 drafter.block_size=8; repeated --set "
                        "flags add up, a later value of the same key wins")
    for name, key in COMMANDS[command][1].items():
        flag = FLAGS[name]
        text = argparse.SUPPRESS if flag.replaced_by else f"{flag.help} [{key}]"
        if flag.kind in ("true", "false") or flag.kind.startswith("const:"):
            p.add_argument(name, dest=_dest(name), action="store_true", default=None, help=text)
        elif flag.kind == "list" or key in LIST_KEYS:
            p.add_argument(name, dest=_dest(name), nargs="+", default=None, metavar=flag.metavar or "V", help=text)
        else:
            p.add_argument(name, dest=_dest(name), default=None, metavar=flag.metavar, help=text)


def flag_values(args: argparse.Namespace, command: str) -> dict[str, Any]:
    """{config key: value} of the shorthand flags given on the command line.

    Values are override texts (see `dspark.config.set_values(parse=True)`); a list
    flag gives a list of texts, "1,4 16" and "1 4,16" alike."""
    values: dict[str, Any] = {}
    for name, key in COMMANDS[command][1].items():
        given = getattr(args, _dest(name))
        if given is None:
            continue
        if FLAGS[name].replaced_by:
            warnings.warn(f"{name} is deprecated; use {FLAGS[name].replaced_by}", FutureWarning, stacklevel=2)
        kind = FLAGS[name].kind
        if kind == "true":
            values[key] = True
        elif kind == "false":
            values[key] = False
        elif kind.startswith("const:"):
            values[key] = kind.split(":", 1)[1]
        elif isinstance(given, list):
            values[key] = [item.strip() for text in given for item in text.split(",") if item.strip()]
        else:
            values[key] = given
    return values


def _dest(flag: str) -> str:
    return "flag_" + flag.lstrip("-").replace("-", "_")
