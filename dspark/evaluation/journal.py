"""An evaluation's output folder as a journal: what lets a killed ``evaluate`` resume.

``settings.json`` is written before decoding and each request's rows are appended (fsynced) as it
finishes; a rerun compares its settings with the folder's (refusing other settings, naming the
fields) and decodes only what is not yet committed (``EvalJournal`` says when a request, or a
scheduled benchmark, is). At the end rank 0 rewrites ``requests.jsonl``, ``rounds.jsonl`` and
``serving.jsonl`` in evaluation order with every journal merged (``finish``), so a resumed run leaves
the same files as an uninterrupted one; ``dspark.evaluation.evaluate.report_from_folder`` rebuilds the
report from them.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dspark.io.atomic import atomic_write_text, is_leftover
from dspark.io.jsonl import append_jsonl, read_jsonl, write_jsonl
from dspark.io.jsonsafe import to_jsonable

SETTINGS = "settings.json"
# What an evaluation writes into its folder besides config.json (--overwrite deletes these, and nothing else).
OUTPUTS = ("settings.json", "report.json", "report.md", "acceptance.png", "reliability.png")
JOURNALS = ("requests", "rounds", "serving")
# Settings that do not change a row: where the files go, the number of processes of a plain
# evaluation (every request has its own seed), CPU threads, the row label, the bootstrap.
IGNORED = ("run.eval.out", "run.out_dir", "run.threads", "run.eval.label", "label", "run.eval.bootstrap_resamples")

Key = tuple[str, int]


class SettingsMismatch(ValueError):
    """The folder holds results of other settings."""


@dataclass
class Done:
    """What the folder already holds: committed records and rounds (keyed by (benchmark, request)),
    and the serving summaries of the committed scheduled benchmarks ((benchmark, rank) -> summary)."""

    records: dict[Key, dict[str, Any]] = field(default_factory=dict)
    rounds: dict[Key, list[dict[str, Any]]] = field(default_factory=dict)
    served: dict[Key, dict[str, Any]] = field(default_factory=dict)
    torn: int = 0  # torn last lines dropped


def differences(old: Mapping[str, Any], new: Mapping[str, Any], ignore: Sequence[str] = ()) -> list[str]:
    """``"key: old -> new"`` for every dotted key whose value differs (keys under ``ignore`` left out)."""
    a, b = _flat(to_jsonable(old)), _flat(to_jsonable(new))
    out = []
    for key in sorted(set(a) | set(b)):
        if any(key == i or key.startswith(i + ".") for i in ignore):
            continue
        if a.get(key, "<absent>") != b.get(key, "<absent>"):
            out.append(f"{key}: {a.get(key, '<absent>')!r} -> {b.get(key, '<absent>')!r}")
    return out


def _flat(d: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(d, Mapping) or not d:
        return {prefix: d} if prefix else {}
    out: dict[str, Any] = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def check_settings(folder: str | os.PathLike, settings: Mapping[str, Any], file: str = SETTINGS,
                   ignore: Sequence[str] = IGNORED) -> bool:
    """True when ``folder/file`` holds ``settings`` (up to ``ignore``), False when there is no such file;
    SettingsMismatch naming the differing fields otherwise."""
    path = Path(folder) / file
    if not path.is_file():
        return False
    try:
        old = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise SettingsMismatch(f"{path} is not JSON ({e}); rerun with --overwrite to start over") from None
    diff = differences(old, settings, ignore)
    if diff:
        shown = "; ".join(diff[:12]) + (f"; and {len(diff) - 12} more" if len(diff) > 12 else "")
        raise SettingsMismatch(f"{path.parent} holds results of other settings ({file} differs in {shown}); "
                               "rerun with --overwrite to start over, or write to another --out folder")
    return True


def clear_outputs(folder: Path, extra: Sequence[str] = ()) -> None:
    """Delete what an evaluation (or ``extra`` names) wrote into ``folder``; other files stay."""
    for name in os.listdir(folder):
        journal = name.endswith(".jsonl") and name.split(".")[0] in JOURNALS
        if name in OUTPUTS or name in extra or journal or is_leftover(name):
            path = folder / name
            shutil.rmtree(path) if path.is_dir() else path.unlink()


class EvalJournal:
    """The journal of one process: appends its rows; reads back every journal of the folder.

    - ``settings.json`` is written before decoding: the resolved settings the report states
      (``report["config"]``, the label, γ, the benchmarks skipped, the STS temperatures). A rerun
      compares its own with it and refuses a folder written by other settings, naming the fields.
    - As each request finishes its round lines go to ``rounds.jsonl`` and then its line to
      ``requests.jsonl`` (``dspark.io.jsonl.append_jsonl``: flushed and fsynced). The request
      line commits the request: rounds without one are dropped on reading, and so is a torn
      last line; the request is then decoded again, with its own seed, to the same rows.
    - Scheduled evaluation (a policy; ``dspark.scheduling.simulator.run_requests``) decodes a
      benchmark's requests in lockstep and the policy sets every request's ℓ from the
      confidences of all of them, so a request's rounds depend on its neighbours: the
      benchmark's serving summary, appended to ``serving.jsonl`` after its last request, commits
      the benchmark, and a benchmark without it is decoded again from its first request.
    - Under ``torchrun`` rank r appends to ``requests.rank<r>.jsonl`` (and rounds, serving);
      each such triple is a journal of its own, read back and committed on its own."""

    def __init__(self, folder: Path, rank: int, world: int, scheduled: bool):
        self.folder, self.rank, self.scheduled = folder, rank, scheduled
        self.suffix = f".rank{rank}" if world > 1 else ""

    def path(self, kind: str, suffix: str | None = None) -> Path:
        return self.folder / f"{kind}{self.suffix if suffix is None else suffix}.jsonl"

    @classmethod
    def open(cls, folder: str | os.PathLike, settings: Mapping[str, Any], *, resume: bool | None, rank: int,
             world: int, barrier: Any = None) -> tuple["EvalJournal", Done]:
        """Open ``folder`` for an evaluation of ``settings``: check or write settings.json, read back
        what is done, and rewrite this process's journal without its uncommitted rows.

        ``resume``: None resumes a folder of the same settings (and starts an empty one); True
        requires something to resume; False starts over, deleting the folder's evaluation files."""
        folder = Path(folder)
        scheduled = settings.get("config", {}).get("scheduler") is not None
        ignore = IGNORED if scheduled else (*IGNORED, "config.world_size")
        if rank == 0:
            folder.mkdir(parents=True, exist_ok=True)
            if resume is False:
                clear_outputs(folder)
            if not check_settings(folder, settings, ignore=ignore):
                if resume is True:
                    raise FileNotFoundError(f"--resume: {folder / SETTINGS} not found, so {folder} holds no "
                                            "evaluation to resume; drop --resume to start one")
                clear_outputs(folder)
                atomic_write_text(folder / SETTINGS, json.dumps(to_jsonable(settings), indent=2) + "\n")
        if barrier is not None:
            barrier()
        folder.mkdir(parents=True, exist_ok=True)
        journal = cls(folder, rank, world, scheduled)
        done = journal.read()
        journal._compact(done, world)
        if barrier is not None:
            barrier()
        return journal, done

    def read(self) -> Done:
        """Every journal of the folder, each committed on its own; the first holding a request wins."""
        done = Done()
        suffixes = sorted({p.name[len("requests"):-len(".jsonl")] for p in self.folder.glob("requests*.jsonl")})
        for suffix in suffixes:
            rows = {}
            for kind in JOURNALS:
                rows[kind], torn = read_jsonl(self.path(kind, suffix))
                done.torn += torn
            served = {(s["benchmark"], int(s["rank"])): s["summary"] for s in rows["serving"]}
            records = {(r["benchmark"], int(r["request"])): r for r in rows["requests"]
                       if not self.scheduled or (r["benchmark"], int(r.get("rank", 0))) in served}
            for key, record in records.items():
                done.records.setdefault(key, record)
            for key in served:
                done.served.setdefault(key, served[key])
            mine: dict[Key, list[dict[str, Any]]] = {}
            for r in rows["rounds"]:
                key = (r["benchmark"], int(r["request"]))
                if key in records:
                    mine.setdefault(key, []).append(r)
            for key, rounds in mine.items():
                done.rounds.setdefault(key, rounds)
        return done

    def _compact(self, done: Done, world: int) -> None:
        """Rewrite this process's journal with the committed rows only (a torn or uncommitted tail
        would otherwise sit under the next append). A single process also folds the other
        journals into its own."""
        def ours(key: Key) -> bool:
            return world == 1 or int(done.records[key].get("rank", 0)) == self.rank

        keys = [k for k in done.records if ours(k)]
        write_jsonl(self.path("rounds"), [r for k in keys for r in done.rounds.get(k, [])])
        write_jsonl(self.path("requests"), [done.records[k] for k in keys])
        write_jsonl(self.path("serving"), [{"benchmark": b, "rank": r, "summary": s}
                                           for (b, r), s in done.served.items() if world == 1 or r == self.rank])
        if world == 1:
            for kind in JOURNALS:
                for p in self.folder.glob(f"{kind}.rank*.jsonl"):
                    p.unlink()

    def append_request(self, record: Mapping[str, Any], rounds: Sequence[Mapping[str, Any]]) -> None:
        """One finished request: its rounds, then its record (which commits it)."""
        append_jsonl(self.path("rounds"), rounds)
        append_jsonl(self.path("requests"), [record])

    def append_served(self, benchmark: str, summary: Mapping[str, Any]) -> None:
        """A scheduled benchmark's serving summary on this rank (commits its requests)."""
        append_jsonl(self.path("serving"), [{"benchmark": benchmark, "rank": self.rank, "summary": summary}])

    def finish(self, records: Sequence[Mapping[str, Any]], rounds: Sequence[Mapping[str, Any]],
               served: Mapping[Key, Any]) -> None:
        """Rank 0, once every rank is done: the merged rows, in evaluation order, replace the journals."""
        write_jsonl(self.folder / "serving.jsonl",
                    [{"benchmark": b, "rank": r, "summary": s} for (b, r), s in sorted(served.items())])
        for p in [*self.folder.glob("*.rank*.jsonl")]:
            if p.name.split(".")[0] in JOURNALS:
                p.unlink()
