"""Issue 47: an exception raised asynchronously at a random moment of a block of any verb leaves
no hook, no copyreg entry, no grad-mode change and no signal handler, and later plain forwards
are unchanged (``tests/interrupt_attack.py`` runs the attack and says what it checks).

Timing-dependent by nature: the delays are random, so each run lands its interrupts elsewhere;
what is asserted holds wherever they land. The suite runs a few hundred blocks per attacker;
``make fuzz`` (hypothesis profile "fuzz") ten times as many, with a fresh seed."""

from __future__ import annotations

import random
import signal
import threading

import pytest
from hypothesis import settings

from tests.conftest import FUZZ_FACTOR
from tests.interrupt_attack import AT_EXIT_ENTRY, TALLY, VERBS, attack

pytestmark = pytest.mark.skipif(
    not hasattr(signal, "setitimer") or threading.current_thread() is not threading.main_thread(),
    reason="needs signal.setitimer in the main thread")

_LEFT = [key for key in TALLY[4:] if key != AT_EXIT_ENTRY]


def _runs(per_verb: int) -> tuple[int, random.Random]:
    """Blocks per verb and the delays' generator: fixed in the suite, FUZZ_FACTOR times as many
    with a fresh seed under ``make fuzz``."""
    if settings.get_current_profile_name() == "fuzz":
        seed = random.SystemRandom().randrange(2**32)
        print(f"seed {seed}")
        return per_verb * FUZZ_FACTOR, random.Random(seed)
    return per_verb, random.Random(47)


def _report(counts: dict[str, dict[str, int]]) -> dict[str, int]:
    total = dict.fromkeys(TALLY, 0)
    for verb, tally in counts.items():
        print(f"{verb:14} " + " ".join(f"{k}={v}" for k, v in tally.items() if v))
        for key, value in tally.items():
            total[key] += value
    return total


@pytest.mark.hypothesis  # `make fuzz` runs ten times as many blocks
def test_a_signal_handlers_exception_at_random_moments_leaves_nothing_behind() -> None:
    """SIGALRM's handler (the user's) raises KeyboardInterrupt after a random delay: before,
    inside or after the block's entry, body or exit, every verb. hookscope holds the signal
    back during any entry and exit, so nothing is ever left (main: 15 of 1,500 blocks left
    hooks, 1,431 the SIGINT handler)."""
    runs, rng = _runs(125)
    leaks: list[tuple[str, list[str]]] = []
    total = _report(attack(VERBS, runs, attacker="alarm", rng=rng,
                           on_leak=lambda verb, what: leaks.append((verb, what))))
    assert leaks == []
    assert total[AT_EXIT_ENTRY] == 0 and total["other error"] == 0
    assert total["interrupted"] > len(VERBS) * runs // 4  # the delays do reach the blocks
    assert total["completed"] > 0


@pytest.mark.hypothesis
def test_an_async_exception_at_random_moments_leaves_nothing_behind() -> None:
    """``PyThreadState_SetAsyncExc`` sets KeyboardInterrupt in the main thread from a timer
    thread after a random delay (no signal: nothing can hold it back). Whatever it interrupts,
    entry, body or exit, nothing is left, except when it lands on the one instruction where no
    Python code can act: the first of ``__exit__``, before any of its code ran (counted apart,
    as ``AT_EXIT_ENTRY``; ``engine.interrupts``)."""
    runs, rng = _runs(60)
    total = _report(attack(VERBS, runs, attacker="async", rng=rng))
    assert {key: total[key] for key in _LEFT} == dict.fromkeys(_LEFT, 0)
    assert total["other error"] == 0
    assert total["interrupted"] > 0
