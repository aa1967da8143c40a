"""Verification policies as a registry (dspark.registry.POLICIES, dspark.scheduling.policies.make_policy).

Oracles: each built-in spec against the scheduling function it names, called directly (Algorithm 1,
the asynchronous scheduler, the draft skipper, the static and threshold cuts) over several steps, a
toy factory registered by name, and a user's module on sys.path loaded as ``module:function``.
"""

from __future__ import annotations

import functools
import sys
import textwrap
import warnings

import numpy as np
import pytest

import dspark.scheduling.policies as policies
from dspark.registry import POLICIES, policy_help
from dspark.scheduling.algorithm1 import SPSTable, first_below_lengths, schedule_prefix, threshold_lengths
from dspark.scheduling.async_scheduler import AsyncPrefixScheduler
from dspark.scheduling.policies import POLICY_HELP, Policy, make_policy, policy_name, skip_policy

SPS = SPSTable(list(range(1, 65)), [100.0 / b**0.6 for b in range(1, 65)], 64)
BUILTINS = {"algorithm1": "algorithm1_policy", "algorithm1+skip": "algorithm1_skip_policy", "async": "async_policy",
            "static1": "static1_policy", "static": "static_policy", "threshold": "threshold_policy",
            "first-below": "first_below_policy"}


def steps(seed: int = 0, n: int = 6, rows: int = 3, gamma: int = 4) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.uniform(0.05, 0.99, (rows, gamma)) for _ in range(n)]


def run(policy: Policy, confidences: list[np.ndarray]) -> list[tuple[list[bool], list[int]]]:
    """The plan and the lengths of each step, as the serving loop asks for them (rows that do not
    draft show zeros), with a fixed draft time reported after each step's drafts."""
    ids = list(range(confidences[0].shape[0]))
    if policy.on_start is not None:
        policy.on_start()
    out = []
    for conf in confidences:
        drafting = np.ones(len(ids), bool) if policy.plan is None else np.asarray(policy.plan(ids), bool)
        if policy.on_draft_time is not None and drafting.any():
            policy.on_draft_time(0.004)
        shown = np.where(drafting[:, None], conf, 0.0)
        out.append((drafting.tolist(), np.asarray(policy(ids, shown)).tolist()))
    return out


def by_hand(choose, plan=None, on_draft_time=None) -> Policy:
    return Policy("by-hand", True, choose, plan=plan, on_draft_time=on_draft_time)


def async_by_hand(default):
    scheduler = AsyncPrefixScheduler(SPS, default_capacity=default)
    return by_hand(lambda ids, c: scheduler.step(ids, c),
                   plan=lambda ids: np.full(len(ids), scheduler.plan(ids), dtype=bool))


def skip_by_hand(backoff):
    return skip_policy(SPS, max_backoff=backoff, name="by-hand")


@pytest.mark.parametrize("spec, expected", [
    ("algorithm1", lambda: by_hand(lambda ids, c: schedule_prefix(c, SPS, early_stop=True))),
    (" Algorithm1 ", lambda: by_hand(lambda ids, c: schedule_prefix(c, SPS, early_stop=True))),
    ("algorithm1+skip", lambda: skip_by_hand(16)),
    ("algorithm1+skip:2", lambda: skip_by_hand(2)),
    ("async", lambda: async_by_hand(None)),
    ("async:5", lambda: async_by_hand(5)),
    ("static1", lambda: by_hand(lambda ids, c: np.ones(c.shape[0], np.int64))),
    ("static", lambda: by_hand(lambda ids, c: np.full(c.shape[0], c.shape[1]))),
    ("static:2", lambda: by_hand(lambda ids, c: np.full(c.shape[0], 2))),
    ("threshold:0.4", lambda: by_hand(lambda ids, c: threshold_lengths(c, 0.4))),
    ("first-below:0.4", lambda: by_hand(lambda ids, c: first_below_lengths(c, 0.4))),
])
def test_every_builtin_spec_dispatches_to_the_function_it_names(spec, expected):
    policy = make_policy(spec, SPS)
    assert policy.name == spec.strip()
    assert policy.needs_confidences == (spec.split(":")[0] not in ("static1", "static"))
    for seed in range(3):  # a fresh policy per run: the stateful ones keep per-request history
        confidences = steps(seed)
        assert run(make_policy(spec, SPS), confidences) == run(expected(), confidences)


def test_the_builtins_are_lazy_registry_entries_of_the_factories():
    assert set(BUILTINS) <= set(POLICIES.names())
    for name, factory in BUILTINS.items():
        assert POLICIES.is_builtin(name) and POLICIES.help(name)
        assert POLICIES.get(name) is getattr(policies, factory)
        assert name in POLICY_HELP
    assert POLICY_HELP == policy_help()
    assert "threshold:<a> (" in POLICY_HELP and "async[:K0] (" in POLICY_HELP and "module:function" in POLICY_HELP


def test_builtin_arguments_are_checked_by_their_factories():
    cases = {
        "algorithm1": "needs an SPS table", "async": "needs an SPS table", "algorithm1+skip": "needs an SPS table",
        "algorithm1:3": "takes no argument", "static1:2": "takes no argument",
        "threshold": "needs a threshold", "first-below:2": r"threshold must be in \[0, 1\]",
        "static:-1": "ℓ must be >= 0", "static:two": "cannot read 'two' as int", "async:0": "K0 must be >= 1",
        "algorithm1+skip:0": "back-off M must be >= 1",
    }
    for spec, message in cases.items():
        with pytest.raises(ValueError, match=message):
            make_policy(spec, None if "SPS" in message else SPS)
    with pytest.raises(ValueError, match="asks for ℓ = 5 but the drafter's block size γ is 4"):
        make_policy("static:5")([0], np.full((1, 4), 0.5))


def test_an_unknown_name_is_refused_with_the_registered_names():
    with pytest.raises(ValueError, match="unknown policy 'fastest'") as info:
        make_policy("fastest", SPS)
    for name in BUILTINS:
        assert repr(name) in str(info.value)
    with pytest.raises(ValueError, match=r"unknown policy 'no_such_module_xyz:fast'.*'no_such_module_xyz' is not a "
                                         r"registered policy.*cannot import module 'no_such_module_xyz'"):
        make_policy("no_such_module_xyz:fast", SPS)
    with pytest.raises(ValueError, match="non-empty string"):
        make_policy("  ")


@pytest.fixture
def every_third():
    """A toy policy registered by name: the whole block every third step of a request, else ℓ (default 0)."""
    calls = []

    def factory(arg, sps, spec):
        calls.append((arg, sps, spec))
        short = int(arg) if arg else 0
        seen: dict = {}

        def choose(ids, confidences):
            out = []
            for rid in ids:
                seen[rid] = seen.get(rid, -1) + 1
                out.append(confidences.shape[1] if seen[rid] % 3 == 0 else short)
            return np.asarray(out, dtype=np.int64)

        return Policy(spec, False, choose, on_start=seen.clear)

    POLICIES.register("every-third", factory, help="[:ℓ] the whole block every third step, else ℓ")
    yield calls
    POLICIES.unregister("every-third")


def test_a_policy_registered_by_name_runs_through_make_policy(every_third):
    assert "every-third[:ℓ] (the whole block every third step, else ℓ)" in policy_help()
    policy = make_policy("every-third:1", SPS)
    assert every_third == [("1", SPS, "every-third:1")] and policy.name == "every-third:1"
    lengths = [lengths for _, lengths in run(policy, steps(n=4, rows=2))]
    assert lengths == [[4, 4], [1, 1], [1, 1], [4, 4]]
    make_policy("every-third")
    assert every_third[-1] == ("", None, "every-third")
    with pytest.raises(ValueError, match="already registered"):
        POLICIES.register("every-third", lambda arg, sps, spec: None)


def test_a_factory_must_return_a_policy():
    POLICIES.register("broken", lambda arg, sps, spec: (lambda ids, c: np.zeros(len(ids))))
    try:
        with pytest.raises(ValueError, match="factory of policy 'broken' returned function"):
            make_policy("broken")
    finally:
        POLICIES.unregister("broken")


USER_MODULE = textwrap.dedent('''
    import numpy as np

    from dspark.scheduling.policies import Policy


    def verify_two(request_ids, confidences):
        """Two drafts per request (fewer when γ is smaller)."""
        return np.full(len(request_ids), min(2, confidences.shape[1]), dtype=np.int64)


    ready = Policy("ready-made", False, lambda ids, c: np.zeros(len(ids), dtype=np.int64))
    NOT_A_POLICY = 3
''')


@pytest.fixture
def user_policies(tmp_path, monkeypatch):
    """A user's module ``dspark_user_policies`` on sys.path (it is unloaded afterwards)."""
    (tmp_path / "dspark_user_policies.py").write_text(USER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "dspark_user_policies"
    sys.modules.pop("dspark_user_policies", None)


def test_module_function_loads_a_users_function_or_policy(user_policies):
    policy = make_policy(f"{user_policies}:verify_two", SPS)
    assert policy.name == "verify_two" and policy.needs_confidences
    assert policy([0, 1, 2], np.full((3, 4), 0.5)).tolist() == [2, 2, 2]
    ready = make_policy(f"{user_policies}:ready")
    assert ready is sys.modules[user_policies].ready and ready.name == "ready-made"
    with pytest.raises(ValueError, match="names a value of type int; module:function must name a function"):
        make_policy(f"{user_policies}:NOT_A_POLICY")
    with pytest.raises(ValueError, match="has no attribute 'missing'"):
        make_policy(f"{user_policies}:missing")


def test_callables_are_named_by_their_function():
    def my_lengths(ids, confidences):
        return np.zeros(len(ids), dtype=np.int64)

    class Cut:
        def __call__(self, ids, confidences):
            return np.zeros(len(ids), dtype=np.int64)

    assert make_policy(my_lengths).name == "my_lengths"
    assert make_policy(functools.partial(my_lengths)).name == "my_lengths"
    assert make_policy(Cut()).name == "Cut"
    assert policy_name("  static:2 ") == "static:2" and policy_name(make_policy("static")) == "static"
    assert policies.per_request_policy(lambda c, i: 0).name == "<lambda>"


def test_the_cli_help_lists_the_registered_policies(capsys):
    from dspark.cli.flags import POLICY_HELP as FLAG_HELP
    from dspark.cli.main import main

    assert FLAG_HELP == POLICY_HELP
    with pytest.raises(SystemExit) as info, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        main(["simulate", "--help"])
    assert info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for name in BUILTINS:
        assert name in text
    assert "module:function" in text
