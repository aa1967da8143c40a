"""The rounds of speculative decoding as the inputs of Sequential Temperature Scaling
(paper Section 3.2.1): :func:`sts_inputs` turns ``DecodeResult.rounds`` into the
arguments of ``dspark.fit_sts``.

A round is a ``dspark.decoding.loop.RoundRecord``: the confidences c_1..c_γ of its drafted
positions, the ℓ drafts verified (``proposed``) and the m accepted; the labels STS fits
against, 1[first k accepted] where k ≤ ℓ, come from those two counts
(``dspark.scheduling.calibration_metrics.prefix_labels``). Torch-free (numpy only).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

__all__ = ["sts_inputs"]


def sts_inputs(results: Any) -> dict[str, np.ndarray]:
    """The keyword arguments of ``dspark.fit_sts`` from decoded requests:
    ``temperatures = dspark.fit_sts(**dspark.sts_inputs(results))``.

    Args:
        results: one ``DecodeResult`` (``dspark.speculative_generate``'s) or an iterable of them,
            one per request. Rounds without confidences (a drafter without a confidence head) are
            left out; all others must come from one drafter (one γ).

    Returns:
        {"conf": float64 [N, γ] the per-position confidences c_k (not cumulative),
        "accepted": int64 [N] accepted drafts m, "proposed": int64 [N] verified drafts ℓ,
        "groups": int64 [N] the request of each round (0, 1, ... in the order given), so that
        ``fit_sts``'s held-out check deals whole requests to its folds}.
    """
    from dspark.scheduling.calibration import round_arrays, rounds_with_confidences

    requests = [results] if hasattr(results, "rounds") else list(results)
    rows: list[dict[str, Any]] = []
    for index, result in enumerate(requests):
        rounds: Iterable[Any] = getattr(result, "rounds", None)
        if rounds is None:
            raise TypeError(f"results[{index}] is a {type(result).__name__}, not a DecodeResult (with .rounds)")
        rows += [{"confidences": r.confidences, "accepted": r.accepted, "proposed": r.proposed, "group": index}
                 for r in rounds]
    with_conf = rounds_with_confidences(rows)  # one drafter's rounds that carry confidences
    conf, accepted, proposed = round_arrays(with_conf)
    return {"conf": conf, "accepted": accepted, "proposed": proposed,
            "groups": np.asarray([r["group"] for r in with_conf], dtype=np.int64)}
