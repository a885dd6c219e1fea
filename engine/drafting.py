"""The scheduler's drafts: which requests of a step carry one, how long, and how they fared.

Before a forward step, the scheduler (engine/scheduler.py) hands this part the step's
requests (`add`). Each one about to pick a token may feed a draft after its last token:
every decoding request, and each prompt whose last chunk the step computes with room
left in it (its constraint's forced start, `{"name": "` or `<tool_call>`, then rides
the prefill instead of costing a step after it). Its `Drafter` (engine/speculate.py)
proposes the tokens, from its context or its constraint's forced text
(engine/jump_forward.py), within what the request, the context window, the step's chunk
and the KV budget (engine/kv_budget.py) leave room for; `draft_lengths` then sends of
each proposal as much as makes the step's expected tokens per second grow, which may be
nothing. The draft is appended to the request's sequence (and kept in `request.draft`),
so the step computes the logits of every drafted position.

After the step the scheduler's picks take what the model agrees with (`Scheduler._take`),
and `observe` tells the drafter what was taken and its acceptance rate how the draft
fared. The steps' measured costs (`step_cost`), by which the lengths are chosen, and the
counts of draft tokens verified and taken are kept here.

The state of one request's drafts lives on its `Request` (engine/scheduler.py):
`drafter`, made at its first draft, `proposal`, this step's proposed tokens and the
Acceptance that predicts them, and `draft`, the tokens fed. Next: engine/speculate.py,
where drafts come from and what they are expected to gain.
"""

from __future__ import annotations

from . import tuning
from .speculate import Drafter, StepCost, draft_lengths


class Drafting:
    """One scheduler's drafts and their bookkeeping (see the module docstring). Runs in the
    scheduler's worker thread."""

    def __init__(self, model):
        self.model = model
        self.step_cost = StepCost()  # measured seconds of a step by its rows, for draft lengths
        self.drafted = 0             # draft tokens verified so far (benchmarks read both)
        self.accepted = 0            # of those, taken

    def add(self, decoding: list, chunks: list, used: int, chunk: int, kv_budget) -> None:
        """Append to the sequence of each request about to pick a token the draft that pays.

        `decoding`: the step's decoding requests; `chunks`: its prompts, fed `used` tokens
        together, at most `chunk` each (those with fewer pending end this step)."""
        ending = [r for r in chunks if r.seq.n_pending < chunk]
        requests = decoding + ending
        if not requests:
            return
        proposals = [self._propose(request, chunk, kv_budget) for request in requests]
        lengths = draft_lengths([p for p in proposals if p[1] is not None], len(decoding) + used, len(requests),
                                self.step_cost)
        for request in requests:
            if request.proposal[1] is not None:
                request.draft = list(request.proposal[0][: lengths.pop(0)])
                request.seq.tokens.extend(request.draft)

    def _propose(self, request, chunk: int, kv_budget) -> tuple:
        """The request's proposal for this step, kept in `request.proposal`: as many tokens as
        it has room for, and the Acceptance that predicts them (None: no draft)."""
        seq = request.seq
        limit = min(tuning.MAX_DRAFT, chunk - seq.n_pending, request.max_tokens - request.generated - 1,
                    self.model.n_ctx - len(seq.tokens) - 1, kv_budget.draft_room(seq))
        if request.drafter is None:
            request.drafter = Drafter(seq.tokens, request.constraint, self.model.tokenizer)
        try:
            request.proposal = request.drafter.propose(limit) if limit > 0 else ([], None)
        except Exception:  # its constraint failed looking ahead (a schema's bound): no draft; the
            request.proposal = ([], None)  # pick meets the same error, for this request alone
        return request.proposal

    def observe(self, request, draft: list[int], taken: list[int]) -> None:
        """Tell the request's drafter what was taken, and its acceptance rate how its draft
        fared (a proposal not sent is judged by its first token, which costs nothing)."""
        if request.drafter is None:
            return
        request.drafter.extend(taken)
        proposed, acceptance = request.proposal
        request.proposal = ([], None)
        if acceptance is None or not taken:
            return
        if draft:
            agreed = next((i for i, (d, t) in enumerate(zip(draft, taken)) if d != t), min(len(draft), len(taken)))
            acceptance.observe(len(draft), agreed)
            self.drafted += len(draft)
            self.accepted += agreed
        elif proposed:
            acceptance.observe(1, int(taken[0] == proposed[0]))
