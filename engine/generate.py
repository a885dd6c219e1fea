"""Generation: an async generator of tokens and their text, one forward step at a time.

`model.generate(prompt_ids, max_tokens=..., sampling=..., stop=..., constraint=...)`
returns a `Generation`: `async for token in generation` yields `Token(id, text)`.

- The model's scheduler (engine/scheduler.py) runs the forward steps in its worker
  thread, never on the trio loop, batched with the model's other generations;
  prompt tokens an earlier sequence already ran come from its prefix cache
  (`cached_tokens`).
- Between steps the generator is at an `await`: a consumer that stops iterating
  (`aclose()`, leaving the `async for`) or is cancelled ends it there, and no
  further step runs. A step already running finishes first (numpy cannot be
  interrupted) and its result is dropped.
- `text` holds only complete UTF-8 characters (possibly ""). Text that could be
  the start of a stop sequence is held back until it is known not to be one; a
  stop sequence is never emitted, not even partly, and ends the generation.
- An end-of-generation token (EOS, end of turn) ends it and is not yielded
  (unless text was held back until then: it comes with that last Token).
  So does a constraint that reports `is_done()`, after its last token.
  A grammar constraint gets max_tokens as its budget (GrammarConstraint.limit):
  an output it closed ends "length" however it ended, and is a complete document.
- `finish_reason` is "stop" or "length" once the iteration is over.
- With `sampling.logprobs`, each generated token's `logprob` is what the sampler
  reported when it picked it (engine/sampling.py `Reported`); else None.
- A `Continuation` (a generation another process began) is gone through first, its
  tokens taken as if picked (the constraint advanced by them, the sampler's random
  generator moved past its draws), then prefilled after the prompt, and generation
  goes on: `output_ids` and `draws` say where it stands, for another to go on from.

Reading the request path: engine/chat.py's `generate_chat` reads a Generation;
a Generation reads the steps of its request in engine/scheduler.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from .api import Continuation, SamplingParams
from .constrain import GrammarConstraint
from .errors import ContextLengthExceeded
from .sampling import Constraint, Reported, Sampler
from .tokenizer import IncrementalDecoder


@dataclass(frozen=True)
class Token:
    id: int
    text: str  # complete UTF-8 only; "" while held back (partial character or stop-sequence prefix)
    logprob: Reported | None = None  # when the sampling asked for logprobs (not on held-back text's carrier)


class StopFilter:
    """Passes text through, holding back any tail that could begin a stop sequence."""

    def __init__(self, stop: tuple[str, ...]):
        self.stop = tuple(s for s in stop if s)
        self.held = ""
        self.stopped = False
        self.rest = ""  # text that came after the stop sequence (callers that go on read it)

    def feed(self, text: str) -> str:
        """The text that is now safe to emit; sets `stopped` when a stop sequence appeared."""
        if not self.stop:
            return text
        self.held += text
        hits = [(i, s) for i, s in ((self.held.find(s), s) for s in self.stop) if i >= 0]
        if hits:
            i, s = min(hits)
            self.stopped = True
            out, self.rest, self.held = self.held[:i], self.held[i + len(s):], ""
            return out
        keep = max((k for s in self.stop for k in range(1, len(s)) if self.held.endswith(s[:k])), default=0)
        cut = len(self.held) - keep
        out, self.held = self.held[:cut], self.held[cut:]
        return out

    def flush(self) -> str:
        """At the end, held-back text was not a stop sequence after all."""
        out, self.held = self.held, ""
        return out


class Generation:
    """An async iterator of `Token`s (see the module docstring); `finish_reason` at the end."""

    def __init__(self, model, prompt_ids: list[int], *, max_tokens: int,
                 sampling: SamplingParams | None = None, stop: tuple[str, ...] = (),
                 constraint: Constraint | None = None, continuation: Continuation | None = None):
        prompt_ids = [int(t) for t in prompt_ids]
        if not prompt_ids:
            raise ValueError("the prompt has no token")
        if max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        if len(prompt_ids) >= model.n_ctx:
            raise ContextLengthExceeded(len(prompt_ids), max_tokens, model.n_ctx)
        self.model = model
        self.prompt_ids = prompt_ids
        self.max_tokens = min(max_tokens, model.n_ctx - len(prompt_ids))
        if isinstance(constraint, GrammarConstraint):  # a document the limit cuts ends whole
            constraint.limit(self.max_tokens)
        self.continuation = continuation or Continuation((), 0)
        self.sampler = Sampler(sampling or SamplingParams(), constraint, draws=self.continuation.draws)
        self.stop = tuple(stop)
        self.finish_reason: str | None = None
        self.n_generated = 0
        self.output_ids: list[int] = []  # the output so far (a continuation's first)
        self.draws = 0  # the sampler's random numbers drawn for them
        self._pick_draws: list[int] = []  # the sampler's draws after each pick (appended by the scheduler's thread)
        self.cached_tokens = 0  # prompt tokens reused from the prefix cache, known at the first token
        self._eos_ids = model.tokenizer.eos_ids
        self._decoder = IncrementalDecoder(model.tokenizer)
        self._stops = StopFilter(self.stop)
        self._tokens = self._run()

    def __aiter__(self) -> Generation:
        return self

    async def __anext__(self) -> Token:
        return await self._tokens.__anext__()

    async def aclose(self) -> None:
        await self._tokens.aclose()

    def _squeezed(self) -> bool:
        """The budget closed the constrained output (GrammarConstraint.squeezed_at): however
        it ended, it was cut by max_tokens."""
        constraint = self.sampler.constraint
        return isinstance(constraint, GrammarConstraint) and constraint.squeezed_at is not None

    async def _run(self):
        sampler = self.sampler
        complete = sampler.constraint.is_done if sampler.constraint is not None else None
        forced = list(self.continuation.output_ids)
        for token in forced:  # what another process generated: taken again as if picked here
            if sampler.constraint is not None:
                sampler.constraint.advance(token)
            sampler.output_counts[token] += 1  # (the penalties count it as the first process did)
            out, last = self._take(token, "stop" if complete is not None and complete() else None)
            yield out
            if last:
                return
        self.draws = self.continuation.draws
        # (the prompt and the continuation's output are prefilled together)
        with self.model.scheduler.submit(self.prompt_ids + forced, pick=self._pick,
                                         max_tokens=self.max_tokens - len(forced),
                                         stop_ids=frozenset(self._eos_ids), stop_when=complete,
                                         constraint=sampler.constraint) as steps:
            async for token, ending in steps:
                self.cached_tokens = steps.cached_tokens
                self.draws = self._pick_draws[self.n_generated - len(forced)]
                # (the worker picks ahead of this reader: its reports are in the steps' order)
                logprob = sampler.reported.popleft() if sampler.params.logprobs is not None else None
                out, last = self._take(token, ending, logprob)
                if out is None:
                    break
                yield out
                if last:
                    return
        tail = self._stops.feed(self._decoder.flush())
        tail += "" if self._stops.stopped else self._stops.flush()
        if tail:
            yield Token(token, tail)  # the end-of-generation token carries the held-back text

    def _pick(self, logits) -> int:
        """(In the scheduler's thread) the sampler's pick, noting its draws after it."""
        token = self.sampler.pick(logits)
        self._pick_draws.append(self.sampler.draws)
        return token

    def _take(self, token: int, ending: str | None,
              logprob: Reported | None = None) -> tuple[Token | None, bool]:
        """The Token to yield for one picked token (None: an end of generation, not yielded)
        and whether it is the last. `ending` "stop": the constraint is complete (judged when
        the token was picked)."""
        if token in self._eos_ids:
            self.finish_reason = "length" if self._squeezed() else "stop"
            return None, True
        self.n_generated += 1
        self.output_ids.append(token)
        stops = self._stops
        text = stops.feed(self._decoder.feed(token))
        if stops.stopped:
            self.finish_reason = "stop"
            return Token(token, text, logprob), True
        done = ending == "stop"
        if not done and self.n_generated < self.max_tokens:
            return Token(token, text, logprob), False
        self.finish_reason = "stop" if done and not self._squeezed() else "length"
        if done:  # (at the token limit, a character cut in half is left out, not U+FFFD)
            text += stops.feed(self._decoder.flush())
        if stops.stopped:
            self.finish_reason = "stop"
        else:
            text += stops.flush()
        return Token(token, text, logprob), True


def generate(model, prompt_ids, *, max_tokens: int, sampling: SamplingParams | None = None,
             stop=(), constraint: Constraint | None = None, continuation: Continuation | None = None) -> Generation:
    return Generation(model, prompt_ids, max_tokens=max_tokens, sampling=sampling,
                      stop=tuple(stop), constraint=constraint, continuation=continuation)

