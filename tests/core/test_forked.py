"""core/forked: a function in a forked child — its result back, its output kept out of the caller's streams, and
forking refused where another thread could hold a lock the child would wait on."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator

import pytest

from ckptfix.core import forked


@pytest.fixture
def idle_thread(request: pytest.FixtureRequest) -> Iterator[None]:
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait, name=request.param, daemon=True)
    thread.start()
    yield
    stop.set()
    thread.join()


@pytest.mark.parametrize("idle_thread, safe", [("a-server", False), (forked.QUIET_THREADS[0], True)],
                         indirect=["idle_thread"])
def test_forking_is_refused_beside_a_foreign_thread(idle_thread: None, safe: bool) -> None:
    others = [t for t in threading.enumerate() if t is not threading.main_thread() and t.name not in forked.QUIET_THREADS]
    assert forked.can_fork() is (safe and not others)  # (pytest-xdist's worker has threads of its own: never safe)


def test_the_result_comes_back_and_the_childs_output_stays_its_own(capfd: pytest.CaptureFixture[str]) -> None:
    def work() -> dict:
        print("from the child")
        os.write(2, b"raw stderr\n")
        return {"pid": os.getpid(), "values": [1, 2.5, None]}

    child = forked.start(work)
    result, why = child.wait(30)
    assert why is None and result["values"] == [1, 2.5, None] and result["pid"] == child.pid != os.getpid()
    out, err = capfd.readouterr()
    assert "from the child" not in out and "raw stderr" not in err
    assert not os.path.exists(child.tmp)


def test_an_exception_in_the_child_is_its_exit_status_with_its_last_line() -> None:
    def work() -> None:
        raise ValueError("bad\x1b[2Jname")  # a terminal escape from a file: shown escaped

    result, why = forked.start(work).wait(30, "the loader's process")
    assert result is None and why is not None
    assert why.startswith("the loader's process exited with status 1 (ValueError: bad") and "\x1b" not in why


def test_a_child_that_leaves_without_its_answer_is_named() -> None:
    result, why = forked.start(lambda: os._exit(0)).wait(30, "the loader's process")
    assert result is None and why == "the loader's process exited without writing its answer"
