"""Subjects are built in one place and ids never break a subject or collide."""

from __future__ import annotations

import re

import pytest

from rankscope.shared.subjects import MAX_TOKEN, IdTooLongError, Subjects, token, untoken

S = Subjects()


def test_design_subject_names() -> None:
    assert S.runner("node-a", "inst-1", 0, "phase") == "rankscope.runner.node-a.inst-1.0.phase"
    assert S.placement("inst-1") == "rankscope.placement.inst-1"
    assert S.tasks("inst-1") == "rankscope.tasks.inst-1"
    assert S.task_status("inst-1", "node-a") == "rankscope.tasks.inst-1.status.node-a"
    assert S.task_statuses("inst-1") == "rankscope.tasks.inst-1.status.*"
    assert S.ranktable("job") == "rankscope.ranktable.job"
    assert S.node_diagnostics("node-a") == "rankscope.node.node-a.diagnostics"
    assert S.query("timeline") == "rankscope.query.timeline"
    assert S.output("cmpl-1", "node-a") == "rankscope.output.cmpl-1.node-a"
    assert S.runner_all() == "rankscope.runner.>"


@pytest.mark.parametrize(
    "raw", ["a.b", "a*b", "a>b", "a b", "a\tb", "host:8000", "ü", "a=2Eb", "a%b"]
)
def test_reserved_characters_are_escaped_reversibly(raw: str) -> None:
    escaped = token(raw)
    assert not set(escaped) & {".", "*", ">", " ", "\t"}
    assert untoken(escaped) == raw


def test_distinct_ids_never_share_a_token() -> None:
    assert len({token(raw) for raw in ["a.b", "a_b", "a=2Eb", "a-b", "a b"]}) == 5


def test_tokens_are_valid_kv_keys() -> None:
    assert re.match(r"^[-/_=.a-zA-Z0-9]+$", token("node a.b*c>d%ü"))


def test_empty_id_is_refused() -> None:
    with pytest.raises(ValueError, match="empty id"):
        S.placement("")


def test_prefix_is_validated() -> None:
    with pytest.raises(ValueError, match="prefix"):
        Subjects("bad prefix")
    assert Subjects("acme.prod").tasks("x") == "acme.prod.tasks.x"


def test_an_id_is_refused_when_it_or_its_escaped_form_is_over_the_limit() -> None:
    assert len(token("a" * MAX_TOKEN)) == MAX_TOKEN
    assert untoken(token("é" * (MAX_TOKEN // 6))) == "é" * (MAX_TOKEN // 6)
    with pytest.raises(IdTooLongError, match="4,100 characters"):
        token("a" * 4100)
    with pytest.raises(IdTooLongError, match="escapes to 1,200"):
        token("*" * 400)
