"""planner.target.confirm: the compiler's verdict on the plans the search finds."""

import dataclasses
import types

import pytest

from planner.cost.memory import MemoryLimitError
from planner.target.confirm import UNSEEN, confirmed


@dataclasses.dataclass
class _Plan:
    """What confirmed() reads of a plan: its predicted peak and its compiled bytes."""

    peak: float
    compiled: float

    @property
    def prediction(self):
        return types.SimpleNamespace(peak_bytes=self.peak)

    def compiled_report(self):
        return types.SimpleNamespace(total_bytes=self.compiled)


def _search(smallest: float, compiled: float):
    """A search whose least memory plan is predicted at ``smallest`` and compiles to
    ``compiled``: under any lower limit it finds nothing."""
    asked = []

    def search_under(limit):
        asked.append(limit)
        if limit < smallest:
            peak = types.SimpleNamespace(bytes=smallest, op="dot", buffers=[])
            raise MemoryLimitError(limit, peak)
        return _Plan(smallest, compiled)

    return search_under, asked


def test_a_plan_predicted_over_the_limit_but_within_the_models_error_is_compiled():
    """MaxText's DeepSeek-V3 recipe compiles to 101.7 GB of a chip's 102.8; the least memory the
    model predicts any plan at is 108.7 GB, over the default limit (92.5): compile that plan."""
    search_under, asked = _search(108.7e9, 101.0e9)
    plan, rounds = confirmed(search_under, lambda p: p, 92.5e9, 2.0, 102.8e9)
    assert plan.compiled == 101.0e9 and asked == [92.5e9, 108.7e9]
    assert rounds[0].compiled_bytes == 101.0e9 and rounds[0].searched_limit == 108.7e9


def test_the_compiler_refuses_it_where_it_compiles_over_the_limit():
    search_under, _ = _search(108.7e9, 104.0e9)
    with pytest.raises(MemoryLimitError, match="compiled 104 GB"):
        confirmed(search_under, lambda p: p, 92.5e9, 2.0, 102.8e9)


def test_nothing_is_compiled_where_the_least_memory_is_beyond_the_models_error():
    search_under, asked = _search(102.8e9 * UNSEEN * 1.01, 90e9)
    with pytest.raises(MemoryLimitError, match="smallest predicted peak"):
        confirmed(search_under, lambda p: p, 92.5e9, 2.0, 102.8e9)
    assert asked == [92.5e9]


def test_the_programs_own_layout_is_the_plan_where_only_it_compiles_within_the_limit():
    """A searched plan predicted at 28 GB that compiles to 35.4 of 33.6 (MaxText's Llama 3.1 405B
    on two v6e-256 slices), and the program's own layout that compiles to 31.1: that layout is
    the plan."""
    search_under, _ = _search(28.0e9, 35.4e9)
    yours = _Plan(30.0e9, 31.1e9)
    with pytest.warns(UserWarning, match="the layout the program asks for does"):
        plan, rounds = confirmed(search_under, lambda p: p, 30.2e9, 2.0, 33.6e9, lambda: yours)
    assert plan is yours and [r.layout for r in rounds][-1] == "yours"
    assert rounds[0].compiled_bytes == 35.4e9 and rounds[-1].compiled_bytes == 31.1e9
    assert "your layout: predicted 30 GB, compiled 31.1 GB (within 33.6 GB)" in rounds[-1].describe(
        30.2e9
    )


def test_the_programs_own_layout_is_refused_where_it_compiles_over_too():
    search_under, _ = _search(28.0e9, 35.4e9)
    with pytest.raises(MemoryLimitError, match="your layout: predicted 30 GB, compiled 34 GB"):
        confirmed(search_under, lambda p: p, 30.2e9, 2.0, 33.6e9, lambda: _Plan(30.0e9, 34.0e9))
    compiled = []  # a layout predicted beyond the model's error is not compiled
    far = _Plan(33.6e9 * UNSEEN * 1.01, 1.0)
    far.compiled_report = lambda: compiled.append(1)
    with pytest.raises(MemoryLimitError, match="compiled 35.4 GB"):
        confirmed(search_under, lambda p: p, 30.2e9, 2.0, 33.6e9, lambda: far)
    assert compiled == []
    with pytest.raises(MemoryLimitError, match="compiled 35.4 GB"):  # the program asks for none
        confirmed(search_under, lambda p: p, 30.2e9, 2.0, 33.6e9, lambda: None)
