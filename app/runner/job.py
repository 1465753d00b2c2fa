"""A request body as generation jobs: one frozen value carries everything from the body to the answer writer.

Every generating route runs the same steps (as SGLang's serving handlers): validate the body,
build its job (prompt tokens, constraint, sampling settings, the answer's shape), then stream
the job's answer or give it whole (app.runner.generation).
"""

from __future__ import annotations

import contextlib
import dataclasses
import uuid
from collections.abc import Mapping
from dataclasses import dataclass

from app.engine import formats
from app.engine.formats.grammars import call_grammar
from app.engine.grammar import (
    Grammar,
    GrammarTooLarge,
    InvalidGrammar,
    UnsupportedSchema,
    client_grammar,
    json_object_grammar,
    schema_grammar,
)
from app.engine.reasoning_budget import UNLIMITED, ReasoningBudget
from app.engine.request import SamplingParams
from app.policy import NO_SLO, SLO_HEADER, SloTargets, parse_slo_header
from app.protocols.openai import ApiError, ChatBody, CompletionBody, InfillBody, NativeCompletionBody
from app.runner.prompts import (
    chat_prompt,
    fim_tokens,
    native_media_prompt,
    native_prompts,
    prompt_tokens,
    request_thinking,
)
from app.runner.sampling import request_params
from app.runner.state import RunnerState

# How an answer is shaped.
CHAT = "chat"  # OpenAI chat completion
TEXT = "text"  # OpenAI text completion
NATIVE = "native"  # llama-server's /completion and /infill


@dataclass(frozen=True)
class Job:
    """One generation a request asks for: its prompt and settings, and how its answer is written."""

    kind: str
    tokens: tuple[int, ...]
    params: SamplingParams
    rid: str  # the answer's id (chatcmpl-…, cmpl-…), shared by the choices of n > 1
    stream: bool = False
    n: int = 1  # OpenAI's n: as many sequences of the same prompt, one choice each
    index: int = 0  # its place among several native prompts
    tools: list[dict] | None = None  # offered tools: the answer's text is parsed for calls to them
    # The answer format (C1) and how its text is parsed: parse False keeps the plain fast path (no parser; with
    # reasoning_format "none" a parser is still needed where the prompt opened the thought, to write its marker);
    # split_reasoning False leaves thoughts in content (reasoning_format "none"); drop_reasoning: thinking was
    # turned off, so a thought the model writes anyway is left out of the answer; in_thought: the prompt opened one.
    chat_format: formats.ChatFormat | None = None
    parse: bool = False
    split_reasoning: bool = True
    drop_reasoning: bool = False
    in_thought: bool = False
    # The call grammar constrains the answer: a call's name goes out as soon as it is written (a call can then
    # only end whole or be cut), its arguments when the call is whole.
    early_names: bool = False
    logprobs: bool = False
    include_usage: bool = False  # OpenAI's stream_options.include_usage: a last chunk with the usage
    timings_per_token: bool = False  # llama-server's: every streamed piece carries the timings so far
    return_progress: bool = False  # llama-server's: prompt_progress pieces while the prompt computes
    return_tokens: bool = False  # llama-server's: the native answer lists the generated token ids
    post_sampling: bool = False  # llama-server's post_sampling_probs: probabilities instead of logprobs
    response_fields: tuple[str, ...] = ()  # llama-server's: the native answer cut to these fields
    verbose: bool = False  # llama-server's per-request `verbose`: the answer carries __verbose
    priority: int = 0
    class_name: str = "default"
    owner: str | None = None  # the gateway's member: the cells it leaves are theirs (app.engine.prefix_cache.Tag)
    private: bool = False  # a private class's: never written to the KV disk tier
    cache_prompt: bool = True
    slo: SloTargets = NO_SLO
    prompt_param: str = "prompt"  # the body field a prompt too long for the context is named by
    media: object | None = None  # the prompt's images (app.engine.media.MediaPrompt)


def _job(state: RunnerState, headers: Mapping, body, kind: str, tokens: list[int], grammar: Grammar | None,
         logprobs: int | None, **shape) -> Job:
    """The job of one prompt of a body; `shape` holds the answer's extras."""
    return Job(
        kind=kind, tokens=tuple(tokens), params=request_params(state, body, len(tokens), grammar, logprobs),
        rid=("chatcmpl-" if kind == CHAT else "cmpl-") + uuid.uuid4().hex[:24], stream=body.stream,
        n=getattr(body, "n", 1) if kind != NATIVE else 1, logprobs=logprobs is not None,
        include_usage=body.include_usage, timings_per_token=body.timings_per_token,
        return_progress=body.return_progress and body.stream, priority=body.priority, class_name=body.hearth_class,
        owner=body.hearth_member, private=body.hearth_private,
        cache_prompt=body.cache_prompt, slo=parse_slo_header(headers.get(SLO_HEADER)),
        prompt_param="messages" if kind == CHAT else "prompt", **shape,
    )


def _one_stream(job: Job) -> Job:
    if job.n > 1 and job.stream:
        raise ApiError(400, "'n': several choices cannot be streamed; send one request per choice", param="n")
    return job


# OpenAI's reasoning_effort as a thinking budget in tokens, for templates that do not read the effort
# themselves (gpt-oss does). llama-server only hands the effort to the template; these are Hearth's choice:
# "minimal" a glance, "low" a short thought, "medium" a considered one, "high" as long as the model likes.
EFFORT_BUDGETS = {"minimal": 128, "low": 512, "medium": 2048, "high": UNLIMITED}


def thinking_budget(state: RunnerState, body: ChatBody) -> int:
    """A chat request's thinking budget: its own, else its effort's (where the template ignores efforts),
    else the runner's --reasoning-budget (-1: unlimited)."""
    if body.reasoning_budget >= 0:
        return body.reasoning_budget
    effort = body.reasoning_effort
    if effort in EFFORT_BUDGETS and "reasoning_effort" not in (state.template.source or ""):
        return EFFORT_BUDGETS[effort]
    return state.config.reasoning_budget


def chat_thinking(state: RunnerState, body: ChatBody) -> bool:
    """Whether a chat request thinks: as it asks (C3's request_thinking), and not under a budget of 0."""
    return request_thinking(state, body) and thinking_budget(state, body) != 0


def job_prompt(state: RunnerState, body: ChatBody):
    """The prompt a chat request's job runs (what token counts must measure)."""
    return chat_prompt(state, body, thinking=chat_thinking(state, body))


def chat_job(state: RunnerState, body: ChatBody, headers: Mapping) -> Job:
    """A chat request's job: its prompt (thinking on or off), its constraint, its answer's parsing and budget.

    Thinking is off when the request says so (enable_thinking false, reasoning_effort "none", budget 0) or
    the runner does (--reasoning off, --reasoning-budget 0): a template with an enable_thinking switch renders
    it off; a model that thinks anyway (DeepSeek-R1 always opens "<think>") gets budget 0, and what it still
    thinks is dropped from the answer."""
    fmt = state.chat_format
    budget = thinking_budget(state, body)
    thinking = chat_thinking(state, body)
    prompt = chat_prompt(state, body, thinking=thinking)
    split = (body.reasoning_format or state.config.reasoning_format) != "none"
    in_thought = fmt.reasoning and formats.starts_in_thought(fmt, prompt.text)
    grammar, constrained_calls = chat_grammar(state, body, prompt.tools, fmt, in_thought)
    top = (body.top_logprobs or 0) if body.logprobs else None
    job = _job(state, headers, body, CHAT, prompt.tokens, grammar, top, tools=prompt.tools or None,
               chat_format=fmt, parse=bool(prompt.tools) or fmt.marked_content or (fmt.reasoning and (split or in_thought)), split_reasoning=split,
               drop_reasoning=split and not thinking, in_thought=in_thought, verbose=body.verbose,
               early_names=constrained_calls)
    params = dataclasses.replace(job.params, special_ids=state.special_ids,
                                 reasoning_budget=reasoning_budget(state, budget if thinking else 0, in_thought))
    if prompt.media is not None:
        # A draft copied from the context could be an image's placeholder id, which is no token.
        params = dataclasses.replace(params, speculative_n_max=0)
    return _one_stream(dataclasses.replace(job, params=params, media=prompt.media))


def reasoning_budget(state: RunnerState, budget: int, in_thought: bool) -> ReasoningBudget | None:
    """The engine's budget for a model that thinks (its thoughts are counted even when unlimited); None otherwise."""
    start, end = state.think_tokens
    if not start or not end:
        return None
    return ReasoningBudget(start=start, end=end, budget=budget, in_thought=in_thought,
                           message=state.budget_message_tokens)


def text_job(state: RunnerState, body: CompletionBody, headers: Mapping) -> Job:
    """A text completion's job (a fill-in-the-middle one when it has a suffix)."""
    model = state.model
    if body.fim:
        if not isinstance(body.prompt, str):
            raise ApiError(400, "'prompt': with 'suffix', the prompt must be text", param="prompt")
        tokens = fim_tokens(model, body.prompt, body.suffix, [], "", "suffix")
    else:
        tokens = prompt_tokens(model, body.prompt, "prompt")
    return _one_stream(_job(state, headers, body, TEXT, tokens, state.default_grammar, body.logprobs,
                            verbose=body.verbose))


def native_jobs(state: RunnerState, body: NativeCompletionBody, headers: Mapping) -> list[Job]:
    """llama-server's /completion: a job per prompt (several are generated together, answered in order); a
    prompt with multimodal_data is one job with its images."""
    media = None
    if isinstance(body.prompt, dict) and body.prompt.get("multimodal_data"):
        prompt = native_media_prompt(state, body.prompt)
        prompts, media = [prompt.tokens], prompt.media
    else:
        prompts = native_prompts(state.model, body.prompt)
    grammar = raw_grammar(body) or state.default_grammar
    job = _job(state, headers, body, NATIVE, prompts[0], grammar, body.n_probs or None,
               return_tokens=body.return_tokens, post_sampling=body.post_sampling_probs,
               response_fields=tuple(body.response_fields or ()))
    if media is not None:
        # As a chat job with images: no drafts (one copied from the context could be a placeholder id).
        return [dataclasses.replace(job, media=media, params=dataclasses.replace(job.params, speculative_n_max=0))]
    if len(prompts) > 1 and body.stream:
        raise ApiError(400, "'prompt': several prompts cannot be streamed; send one per request", param="prompt")
    return [job] + [dataclasses.replace(job, index=i, tokens=tuple(tokens),
                                        params=request_params(state, body, len(tokens), grammar, body.n_probs or None))
                    for i, tokens in enumerate(prompts[1:], start=1)]


def infill_job(state: RunnerState, body: InfillBody, headers: Mapping) -> Job:
    """llama-server's /infill: a fill-in-the-middle prompt, answered in the native shape."""
    tokens = fim_tokens(state.model, body.input_prefix, body.input_suffix, body.input_extra, body.prompt,
                        "input_suffix")
    return _job(state, headers, body, NATIVE, tokens, state.default_grammar, body.n_probs or None)


@contextlib.contextmanager
def _constraint(param: str):
    """A constraint refused while it is built (past a bound or the converter's budget, not parseable): a 400 naming param."""
    try:
        yield
    except (UnsupportedSchema, GrammarTooLarge, InvalidGrammar) as exc:
        raise ApiError(400, f"'{param}': {exc}", param=param, code=exc.code)


def chat_grammar(state: RunnerState, body: ChatBody, tools: list[dict], fmt: formats.ChatFormat,
                 in_thought: bool = False) -> tuple[Grammar | None, bool]:
    """The constraint of a chat request: a forced call, else the response format, else llama-server's grammar or
    json_schema, else the runner's --grammar, else a lazy call grammar; and whether it is the call grammar.

    The runner's --grammar outranks the lazy grammar of tool_choice auto: an admin's constraint for every answer is
    explicit, while auto only says a call may come (the grammar can still spell the family's calls)."""
    forced = tools and (body.choice == "required" or isinstance(body.choice, dict))
    calls = None
    if tools:
        with _constraint("tools"):
            calls = call_grammar(fmt, tools, body.choice, body.parallel_tool_calls, in_thought=in_thought,
                                 trigger_tokens=state.trigger_tokens)
    if forced:
        return calls, calls is not None
    grammar = _answer_grammar(state, body)
    return (grammar, False) if grammar is not None else (calls, calls is not None)


def _answer_grammar(state: RunnerState, body: ChatBody) -> Grammar | None:
    """The response format's constraint, else llama-server's grammar or json_schema, else the runner's --grammar."""
    rf = body.response_format
    with _constraint("response_format"):
        if rf is not None and rf.type == "json_object" and rf.schema_ is not None:
            return schema_grammar(rf.schema_)
        if rf is not None and rf.type == "json_object":
            return json_object_grammar()
        if rf is not None and rf.type == "json_schema":
            return schema_grammar(rf.json_schema.schema_)
    return raw_grammar(body) or state.default_grammar


def raw_grammar(body: ChatBody | NativeCompletionBody) -> Grammar | None:
    """llama-server's own constraint fields of a body: GBNF text, else a JSON Schema (None: neither)."""
    if body.grammar:
        with _constraint("grammar"):
            return client_grammar(body.grammar)
    if body.json_schema is not None:
        with _constraint("json_schema"):
            return schema_grammar(body.json_schema)
    return None
