"""Which candidates are measured with the reference in alternating blocks: those on its host
that can be loaded beside it (an executor holds one load per model version)."""

from __future__ import annotations

from workflows.pipeline.interleave import plan
from workflows.pipeline.types import PathInfo, Target


def _path(
    name: str, address: str, host: str, mode: str = "eager", version: str = ""
) -> tuple[Target, PathInfo]:
    target = Target(
        trial_id="t", path=name, executor=address, model="tiny-lm", version=version,
        checkpoint_sha256="", mode=mode, precision="fp32", batch_buckets=[1, 8],
    )  # fmt: skip
    info = PathInfo(name, address, host, "cpu", "cpu", 1, 0, "c", "cpu/c", "", {}, f"{name}@{host}")
    return target, info


def test_the_same_load_and_another_executor_join_the_reference() -> None:
    reference = _path("ref", "a:1", "h")
    found = plan(reference, [_path("same", "a:1", "h"), _path("xla", "x:2", "h", mode="lazy")])
    assert found.members == ["ref", "same", "xla"]
    assert found.shared == {"same"}  # it uses the reference's loaded instance
    assert found.apart == {}


def test_another_load_of_one_version_on_one_executor_is_measured_apart_and_says_why() -> None:
    reference = _path("ref", "a:1", "h")
    found = plan(reference, [_path("compile", "a:1", "h", mode="compile")])
    assert found.members == ["ref"]
    assert found.apart == {
        "compile": "ref and compile need different loads of tiny-lm:default on one executor (a:1), "
        "which holds one load per model version"
    }


def test_named_versions_are_two_loads_and_other_hosts_are_not_grouped() -> None:
    reference = _path("ref", "a:1", "h", version="1")
    found = plan(
        reference,
        [_path("perturbed", "a:1", "h", version="perturbed"), _path("far", "b:1", "elsewhere")],
    )
    assert found.members == ["ref", "perturbed"] and found.apart == {}


def test_a_candidate_joins_only_if_it_can_load_beside_every_member() -> None:
    reference = _path("ref", "a:1", "h")
    xla, xla_other = _path("xla", "x:2", "h", mode="lazy"), _path("xla-strict", "x:2", "h", mode="strict")
    found = plan(reference, [xla, xla_other])
    assert found.members == ["ref", "xla"]
    assert "xla and xla-strict need different loads" in found.apart["xla-strict"]
