"""The canonical form of a trial spec and its sha256: what a trial grant binds.

The starter (`switchyard trial start`, the demo) and the trial worker both parse the spec
(workflows/spec/trial_spec.py) and hash the parsed form here, so a key's order, a null left
out or a default written out changes nothing, while any value the worker would act on does.
The parsed form is what the worker runs: the parser refuses every key it does not define, so
nothing outside it reaches the trial. Pure and deterministic: the workflow calls it too.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json

from workflows.spec.trial_spec import TrialSpec


def canonical_json(spec: TrialSpec) -> bytes:
    """Sorted keys, no spaces, ASCII only; tuples as lists."""
    body = dataclasses.asdict(spec)
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def spec_sha256(spec: TrialSpec) -> str:
    return hashlib.sha256(canonical_json(spec)).hexdigest()
