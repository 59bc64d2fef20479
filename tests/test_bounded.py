"""The host caches' one table kind (bnbf._bounded.Bounded): bounded, dropping the entry put or used longest ago."""

from __future__ import annotations

import copy
import pickle
import threading

from bnbf._bounded import Bounded


def test_a_full_table_drops_its_oldest_entry_only():
    dropped = []
    t = Bounded(3, dropped.append)
    for k in "abc":
        t.put(k, k.upper())
    t.put("d", "D")
    assert list(t.items()) == [("b", "B"), ("c", "C"), ("d", "D")] and dropped == ["A"]


def test_touch_and_put_make_an_entry_the_newest():
    t = Bounded(3)
    for k in "abc":
        t.put(k, k)
    assert t.touch("a") == "a" and t.touch("zz", 5) == 5 and "zz" not in t
    t.put("b", "b2")  # replaced: the newest now
    t.put("d", "d")
    assert list(t) == ["a", "b", "d"] and t["b"] == "b2"


def test_a_replaced_value_is_passed_on_and_the_same_value_is_not():
    dropped = []
    t = Bounded(2, dropped.append)
    v = object()
    t.put("k", v)
    t.put("k", v)
    assert dropped == []
    t.put("k", "other")
    assert dropped == [v]


def test_kept_makes_a_value_once():
    made = []
    t = Bounded(2)
    make = lambda: made.append(1) or len(made)  # noqa: E731
    assert t.kept("k", make) == 1 and t.kept("k", make) == 1 and made == [1]


def test_a_copy_is_an_empty_table_of_the_same_bounds():
    t = Bounded(5)
    t.put("k", 1)
    for other in (copy.deepcopy(t), pickle.loads(pickle.dumps(t))):
        assert type(other) is Bounded and other.size == 5 and not other


def test_threads_putting_at_once_keep_the_bound():
    t = Bounded(8)
    errors = []

    def work(base):
        try:
            for i in range(2000):
                t.put((base, i), i)
                t.touch((base, i - 1))
        except Exception as e:  # noqa: BLE001 - any error fails the test below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(b,)) for b in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors and len(t) == 8
