"""Branch points (app/tui/branches.py): forks keep the turns they replace, flips bring them
back with the branch points inside them, and deletes move the later points up."""

from __future__ import annotations

from panechat.app.store import Message
from panechat.app.tui import branches as br


def _h(*texts):
    return [Message("user" if i % 2 == 0 else "assistant", t) for i, t in enumerate(texts)]


def _texts(history):
    return [m.content for m in history]


def test_a_branch_inside_a_branch_travels_with_it():
    history, points = _h("q1", "a1", "q2", "a2"), {}
    history, points = br.fork(history, points, 3)  # regenerate a2
    history += _h("q", "a2b")[1:]
    history, points = br.fork(history, points, 1)  # regenerate a1: the q2/a2 turns go with the old a1
    history += _h("q", "a1b")[1:]
    assert _texts(history) == ["q1", "a1b"] and set(points) == {1} and br.label(points, 1) == "< 2/2 >"
    history, points = br.flip(history, points, 1, -1)
    assert _texts(history) == ["q1", "a1", "q2", "a2b"] and br.label(points, 3) == "< 2/2 >"
    history, points = br.flip(history, points, 3, -1)
    assert _texts(history) == ["q1", "a1", "q2", "a2"]
    history, points = br.flip(history, points, 1, 1)  # the live tail, with its inner point, is kept
    history, points = br.flip(history, points, 1, 1)
    assert _texts(history) == ["q1", "a1", "q2", "a2"] and br.label(points, 3) == "< 1/2 >"


def test_delete_moves_later_points_up():
    assert br.after_delete({1: {"x": 1}, 3: {"y": 2}}, 2) == {1: {"x": 1}, 2: {"y": 2}}
    assert br.label({}, 0) == ""
