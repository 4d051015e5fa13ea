"""The order the test files start in (tests/schedule.py): longest first, a file's tests in their own order."""

from __future__ import annotations

from schedule import longest_files_first, read_seconds, seconds_by_file


def test_longest_files_go_first_unknown_ones_before_them_and_a_files_tests_keep_their_order():
    nodeids = ["a.py::t1", "a.py::t2", "b.py::t1", "c.py::t1", "c.py::t2", "d.py::t1", "e.py::t1"]
    seconds = {"a.py": 10.0, "b.py": 50.0, "c.py": 30.0, "e.py": 10.0}
    # d.py (not in the table) first; then b 50, c 30; a and e tie at 10 and keep their collected order
    assert longest_files_first(nodeids, seconds) == [5, 2, 3, 4, 0, 1, 6]


def test_a_file_whose_tests_were_collected_apart_still_runs_as_one_block():
    nodeids = ["a.py::t1", "b.py::t1", "a.py::t2[x]"]
    assert longest_files_first(nodeids, {"a.py": 1.0, "b.py": 2.0}) == [1, 0, 2]


def test_seconds_by_file_sums_setup_call_and_teardown_per_file():
    durations = {"a.py::t1": 1.04, "a.py::t2[p::q]": 2.0, "b.py::t1": 7.25}
    assert seconds_by_file(durations) == {"b.py": 7.2, "a.py": 3.0}  # 7.25 rounds half to even
    assert list(seconds_by_file(durations)) == ["b.py", "a.py"]


def test_this_session_runs_its_files_longest_first(request):
    # What conftest's hook did to the items collected here (under xdist: each worker's, which the scheduler hands
    # out in this order with --no-loadscope-reorder).
    seconds = read_seconds()
    files = list(dict.fromkeys(item.nodeid.split("::")[0] for item in request.session.items))
    known = [seconds[f] for f in files if f in seconds]
    assert known == sorted(known, reverse=True), files[:10]
    unknown = [i for i, f in enumerate(files) if f not in seconds]
    assert unknown == list(range(len(unknown))), files[:10]
