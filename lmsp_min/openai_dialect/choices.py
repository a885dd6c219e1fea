"""The choices of an OpenAI request (chat and plain completions): `n` generations of each prompt.

Every choice is one LMSP generation (lmsp_min/generation.py), prepared before any of
them generates, so that whatever refuses the request refuses it before a token (D1):
each holds its admission until it ends, or until the request does. They are generated
one after the other, so that each choice after the first finds its prompt in the prefix
cache (a finished sequence's keys and values are kept: engine/prefix_cache.py) and the
prompt is run once. With a seed, choice i of a prompt uses seed + i (mod 2^64): the
choices differ, and each repeats. A completion's several prompts give the choices in
prompt-major order, as OpenAI numbers them: prompt p's choice i has index p × n + i.

A stream gives the choices' events one choice after the other, each tagged with its
index, and stops after a choice that failed.

Next: openai_dialect/chat.py and openai_dialect/completions.py write the choices.
"""

from collections.abc import AsyncIterator
from contextlib import aclosing

from lmsp_min import generation
from lmsp_min.generation import Generation, StreamBody
from lmsp_min.http import Request
from lmsp_min.openai_dialect.requests import Translated
from lmsp_min.problems import Problem
from lmsp_min.validate import EXTENSION

Source = tuple[list[dict], str | list[int] | None]  # an LMSP input, and its raw prompt if any (completions)


async def prepare(call: Translated, sources: list[Source], principal: str, service) -> list[Generation]:
    """`call.n` choices of each source, prepared; a refusal as the client's request names
    things, the choices prepared until then released."""
    prepared: list[Generation] = []
    try:
        for items, prompt in sources:
            for choice in range(call.n):
                body = {**_seeded(call.body, choice), "input": items}
                prepared.append(await generation.prepare(body, principal, service, prompt))
    except Problem as problem:
        release(prepared)
        raise call.rename(problem) from None
    except BaseException:
        release(prepared)
        raise
    return prepared


def _seeded(body: dict, choice: int) -> dict:
    """The LMSP body of a prompt's choice `choice`: its seed, if it has one, moved by `choice`."""
    seed = body.get("extensions", {}).get(EXTENSION, {}).get("seed")
    if seed is None or choice == 0:
        return body
    ours = {**body["extensions"][EXTENSION], "seed": (seed + choice) % 2**64}
    return {**body, "extensions": {**body["extensions"], EXTENSION: ours}}


def release(choices: list[Generation]) -> None:
    for choice in choices:
        choice.release()


async def respond(choices: list[Generation], call: Translated, request: Request, service) -> None:
    """Generate every choice to its end, one after the other; a failed one is its problem,
    named as the client's request names things (the later ones are not generated)."""
    try:
        for choice in choices:
            await generation.respond(choice, request, service)
    except Problem as problem:
        raise call.rename(problem) from None
    finally:
        release(choices)


def stream_body(choices: list[Generation], chunks: AsyncIterator[bytes]) -> StreamBody:
    """`chunks` as a streamed response's body, which releases every choice when it is closed."""
    return StreamBody(choices, chunks)


async def events(choices: list[Generation], call: Translated, request: Request,
                 service) -> AsyncIterator[tuple[int, str, dict]]:
    """(index, name, data) of each LMSP event of the choices, one after the other; an
    error naming the client's params (`call.rename_document`), and the last event."""
    for index, choice in enumerate(choices):
        async with aclosing(generation.response_events(choice, request, service)) as lmsp_events:
            async for event in lmsp_events:
                data = event.data
                if "error" in data:
                    data = {**data, "error": call.rename_document(data["error"])}
                yield index, event.name, data
                if "error" in data or event.name == "response.cancelled":
                    return
