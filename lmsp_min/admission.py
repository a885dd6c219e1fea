"""Admission to a model: a bounded queue, shared and served fairly between principals (D9).

A model admits at most `depth` requests at once, generating or waiting (past it:
429 `rate_limited`, before any work is done for the request). Of those, at most
`slots` generate at once (the engine's batch); the others wait here, one FIFO
queue per principal, rather than in the engine's single FIFO queue. When a slot
is free, the next one to generate is the first waiting request of the principal
with the fewest requests generating, and among equals the one served longest
ago: round-robin between principals, so that one principal's burst of thirty
requests does not make another's single request wait behind all of them.

The places of the queue are shared too (`has_room`), or taking turns would order
only what was admitted: a busy principal's clients, retrying at once, would take
every place that frees and a quiet principal would get 429. So `reserve(depth)`
places (an eighth, at least one) are kept for principals with nothing admitted,
and the rest is split evenly between the principals with something admitted, the
asker counted. One principal alone may hold `depth - reserve` (28 of the default
32); two busy ones, half of that each; a principal past its share gets 429 while
the queue still has room for the others.

Every `Admission` has an owner, who releases it explicitly (`release`, or
`with admission:`) once its request is over or will never generate, whether it
was waiting or generating; releasing again does nothing. Everything here runs
on the trio loop. Next: lmsp_min/registry.py's `ModelEntry.admit`, which refuses.
"""

import itertools
from collections import deque
from collections.abc import Callable

import trio


def reserve(depth: int) -> int:
    """The places of a `depth` queue kept for principals with nothing admitted."""
    # an eighth (4 of the default 32): room for a few quiet principals' requests at once, while
    # one principal alone loses little of the queue; at least one, or a quiet principal could
    # still be shut out of a short queue
    return max(1, depth // 8)


class Admissions:
    """The requests admitted to one model, and whose turn it is to generate.

    `slots` is asked each time a turn may be given (the engine's batch size,
    which its scheduler holds)."""

    def __init__(self, slots: Callable[[], int]):
        self._slots = slots
        self.admitted = 0  # admitted and not yet released: waiting, generating, or not yet asking
        self.generating = 0
        self._admitted_by: dict[str, int] = {}  # principal -> its requests admitted, not yet released
        self._waiting: dict[str, deque["Admission"]] = {}  # principal -> its requests waiting, in order
        self._generating_by: dict[str, int] = {}  # principal -> its requests generating
        self._served: dict[str, int] = {}  # principal -> when it last got a turn (a counter)
        self._clock = itertools.count(1)

    def admit(self, principal: str) -> "Admission":
        """Count in one more request (the caller has checked `has_room`)."""
        self.admitted += 1
        self._admitted_by[principal] = self._admitted_by.get(principal, 0) + 1
        return Admission(self, principal)

    def has_room(self, principal: str, depth: int) -> bool:
        """Whether a queue of `depth` admits one more request of `principal`: there is a
        place, and the principal holds less than its share (the module docstring)."""
        held = self._admitted_by.get(principal, 0)
        sharing = len(self._admitted_by) + (held == 0)  # the principals with something admitted, and the asker
        share = max(1, (depth - reserve(depth)) // sharing)
        return self.admitted < depth and held < share

    @property
    def waiting(self) -> int:
        return sum(len(queue) for queue in self._waiting.values())

    def _wait(self, admission: "Admission") -> None:
        self._waiting.setdefault(admission.principal, deque()).append(admission)
        self._give_turns()

    def _give_turns(self) -> None:
        while self._waiting and self.generating < self._slots():
            principal = min(self._waiting, key=lambda name: (self._generating_by.get(name, 0),
                                                             self._served.get(name, 0)))
            queue = self._waiting[principal]
            admission = queue.popleft()
            if not queue:
                del self._waiting[principal]
            self._served[principal] = next(self._clock)
            self.generating += 1
            self._generating_by[principal] = self._generating_by.get(principal, 0) + 1
            admission._turn_given()

    def _release(self, admission: "Admission", generating: bool) -> None:
        self.admitted -= 1
        principal = admission.principal
        self._admitted_by[principal] -= 1
        if not self._admitted_by[principal]:
            del self._admitted_by[principal]
        if generating:
            self.generating -= 1
            self._generating_by[principal] -= 1
            if not self._generating_by[principal]:
                del self._generating_by[principal]
                if principal not in self._waiting:
                    self._served.pop(principal, None)  # (a principal gone is not remembered)
            self._give_turns()
        elif admission in self._waiting.get(principal, ()):  # (else it never asked for a turn)
            self._waiting[principal].remove(admission)
            if not self._waiting[principal]:
                del self._waiting[principal]


class Admission:
    """One admitted request of a model (`Admissions.admit`): `await turn()` before it
    generates; its owner releases it explicitly once it is over or will never generate."""

    def __init__(self, admissions: Admissions, principal: str):
        self._admissions: Admissions | None = admissions
        self.principal = principal
        self._asked = False
        self._generating = False
        self._turn = trio.Event()

    async def turn(self) -> None:
        """Wait until this request may generate (at once when a slot is free and no one
        waits); ask once. Cancelled while waiting, it keeps its place until released."""
        if self._admissions is None or self._asked:
            raise RuntimeError("an admission asks for its turn once, before it is released")
        self._asked = True
        self._admissions._wait(self)
        await self._turn.wait()

    def _turn_given(self) -> None:
        self._generating = True
        self._turn.set()

    def release(self) -> None:
        if self._admissions is not None:
            admissions, self._admissions = self._admissions, None
            admissions._release(self, self._generating)

    def __enter__(self) -> "Admission":
        return self

    def __exit__(self, *exc_info) -> None:
        self.release()
