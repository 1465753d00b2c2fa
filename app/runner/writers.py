"""Answer writers, one per shape (chat, text, native): engine events in, llama-server's answer objects out.

A writer reads the engine's immutable events only, never the live request. `delta(event)` takes
a Delta or a Progress and returns the stream's pieces for it (none when the answer is whole: the
writer keeps the text and logprobs); `final(finished)` returns a stream's closing pieces, and
`whole(finished)` the whole answer. The pieces are dicts: the route encodes them as SSE, or feeds
the chat writer's chunks to another API's adapter. A writer made `encoded` (its stream goes out as OpenAI's
SSE as it is) writes a plain token's chunk as the event's bytes instead: a head encoded once per stream, the
text escaped, the running timings' prompt half encoded once, the same bytes json.dumps of the dict gives.
"""

from __future__ import annotations

import json
import math
import time
from json.encoder import encode_basestring

from app.engine.formats import AnswerParser, CallArguments, CallStart, Content, Reasoning
from app.engine.request import Delta, Finished, Progress
from app.runner.job import CHAT, NATIVE, Job
from app.runner.prompts import detokenize
from app.runner.sampling import generation_settings
from app.runner.state import RunnerState

# OpenAI's system_fingerprint; llama-server puts its build ("b<number>-<commit>") there.
SYSTEM_FINGERPRINT = "b0-hearth"


def llama_timings(cache_n: int, prompt_n: int, prompt_ms: float, predicted_n: int, predicted_ms: float) -> dict:
    """llama-server's timings object: counts and times with their per-token times and rates.

    The first token comes with the prompt's last batch, so the generation rate is over the steps after it."""
    return {**_prompt_timings(cache_n, prompt_n, prompt_ms), **_predicted_timings(predicted_n, predicted_ms)}


def _prompt_timings(cache_n: int, prompt_n: int, prompt_ms: float) -> dict:
    return {"cache_n": cache_n, "prompt_n": prompt_n, "prompt_ms": prompt_ms,
            "prompt_per_token_ms": prompt_ms / prompt_n if prompt_n else 0.0,
            "prompt_per_second": 1e3 * prompt_n / prompt_ms if prompt_ms > 0 else 0.0}


def _predicted_timings(predicted_n: int, predicted_ms: float) -> dict:
    steps = max(0, predicted_n - 1)
    return {"predicted_n": predicted_n, "predicted_ms": predicted_ms,
            "predicted_per_token_ms": predicted_ms / steps if steps else 0.0,
            "predicted_per_second": 1e3 * steps / predicted_ms if predicted_ms > 0 else 0.0}


def usage(fin: Finished, thinks: bool = False) -> dict:
    """OpenAI's usage of a finished request; for a model that thinks, the tokens generated inside its thoughts."""
    s = fin.stats
    out = {"prompt_tokens": s.num_prompt_tokens, "completion_tokens": s.num_completion_tokens,
           "total_tokens": s.num_prompt_tokens + s.num_completion_tokens,
           "prompt_tokens_details": {"cached_tokens": s.num_cached_tokens}}
    if thinks:
        out["completion_tokens_details"] = {"reasoning_tokens": fin.num_reasoning_tokens}
    return out


def timings(fin: Finished) -> dict:
    """llama-server's timings of a finished request (prompt tokens reused and computed, times, rates) beside Hearth's own."""
    s = fin.stats
    prompt_n = s.num_prompt_tokens - s.num_cached_tokens
    prompt_ms = max(0.0, (s.ttft_ms or s.total_ms) - s.queue_ms)
    predicted_ms = (s.tpot_ms or 0.0) * max(0, s.num_completion_tokens - 1)
    # Numbers only, none null (llama-server's timings are all finite numbers; clients sum and compare them).
    own = {k: v for k, v in s.as_dict().items() if isinstance(v, int | float) and not isinstance(v, bool)}
    out = {**own, **llama_timings(s.num_cached_tokens, prompt_n, prompt_ms, s.num_completion_tokens, predicted_ms)}
    if s.num_draft_tokens:
        # llama-server's names, present only when the request drafted.
        out["draft_n"] = s.num_draft_tokens
        out["draft_n_accepted"] = s.num_draft_accepted
    return out


def progress_fields(p: Progress) -> dict:
    """llama-server's prompt_progress and the timings beside it: the prompt so far, nothing generated yet."""
    return {"prompt_progress": {"total": p.total, "cache": p.cache, "processed": p.processed, "time_ms": p.time_ms},
            "timings": llama_timings(p.cache, p.processed - p.cache, p.time_ms, 0, 0.0)}


class Writer:
    """What the three shapes share: the text and logprobs so far, the slot, the running timings."""

    def __init__(self, job: Job, state: RunnerState, encoded: bool = False):
        self.job = job
        self.state = state
        self.encoded = encoded  # a plain token's chunk may be the SSE event's bytes (see the module's docstring)
        self.model_name = state.config.model_name
        self.created = int(time.time())
        self.parts: list[str] = []
        self.logprobs: list[dict] = []  # a whole answer's, or a stream's not yet sent
        self.slot = -1  # the slot it runs in, from the events
        self.num_tokens = 0  # generated so far
        self._last: Delta | None = None  # the last token's event, for the running timings
        self._prompt_key: tuple | None = None  # what the running timings' encoded prompt half was made from
        self._prompt_json = b""

    def start(self) -> list[dict]:
        """The stream's opening pieces."""
        return []

    def delta(self, ev: Delta | Progress) -> list[dict]:
        """The stream's pieces for one event (none for a whole answer, which keeps the text)."""
        if ev.slot >= 0:
            self.slot = ev.slot
        if isinstance(ev, Progress):
            return self.progress(ev) if self.job.stream else []
        if ev.token_ids:
            self._last = ev
            self.num_tokens += ev.num_tokens
        if ev.logprob is not None:
            self.logprobs.append(ev.logprob)
        if not self.job.stream:
            self.parts.append(ev.text)
            return []
        return self.piece(ev)

    def progress(self, p: Progress) -> list[dict]:
        """The stream's pieces for the prompt's progress."""
        raise NotImplementedError

    def piece(self, ev: Delta) -> list[dict]:
        """The stream's pieces for a text delta."""
        raise NotImplementedError

    def final(self, fin: Finished) -> list[dict]:
        """The stream's closing pieces."""
        raise NotImplementedError

    def whole(self, fin: Finished) -> dict:
        """The whole answer."""
        raise NotImplementedError

    def take_logprobs(self) -> list[dict]:
        """The logprobs not sent yet, handed over once."""
        out, self.logprobs = self.logprobs, []
        return out

    def running_timings(self) -> dict:
        """llama-server's timings of a request still generating (timings_per_token): the prompt, the tokens so far."""
        last = self._last or Delta("", 0)
        return llama_timings(last.num_cached, len(self.job.tokens) - last.num_cached, last.prompt_ms,
                             self.num_tokens, last.predicted_ms)

    def running_timings_json(self) -> bytes:
        """running_timings() as json.dumps writes it; the prompt's half is encoded once (it is fixed once the first
        token is out), the tokens' half written by hand (ints and finite floats: repr is JSON's own)."""
        last = self._last or Delta("", 0)
        key = (last.num_cached, last.prompt_ms)
        if self._prompt_key != key:
            prompt = _prompt_timings(last.num_cached, len(self.job.tokens) - last.num_cached, last.prompt_ms)
            self._prompt_key, self._prompt_json = key, json.dumps(prompt)[:-1].encode()
        n, ms = self.num_tokens, last.predicted_ms
        steps = max(0, n - 1)
        per_token = ms / steps if steps else 0.0
        per_second = 1e3 * steps / ms if ms > 0 else 0.0
        return (b"%s, \"predicted_n\": %d, \"predicted_ms\": %s, \"predicted_per_token_ms\": %s, "
                b"\"predicted_per_second\": %s}" % (self._prompt_json, n, repr(ms).encode(), repr(per_token).encode(),
                                                   repr(per_second).encode()))

    def prompt_text(self) -> str:
        """The prompt as text (llama-server's `prompt`, `__verbose`)."""
        return detokenize(self.state.model, self.job.tokens)


class OpenAIWriter(Writer):
    """OpenAI's chat and text completions: chunks, then a last one with the usage; n > 1 merges whole ones."""

    def __init__(self, job: Job, state: RunnerState, encoded: bool = False):
        super().__init__(job, state, encoded)
        self.chat = job.kind == CHAT
        self.object = "chat.completion.chunk" if self.chat else "text_completion"
        # The answer's parser (C1) splits thoughts, content and calls; a plain answer of a plain template has none.
        self.parser = (AnswerParser(job.chat_format, job.tools, split_reasoning=job.split_reasoning,
                                    in_thought=job.in_thought, early_names=job.early_names)
                       if self.chat and job.parse else None)
        self.thinks = self.chat and job.params.reasoning_budget is not None
        self._event_head = self._event_tail = b""  # a plain token chunk's event around its text, made at the first

    def _head(self, obj: str) -> dict:
        return {"id": self.job.rid, "object": obj, "created": self.created, "model": self.model_name,
                "system_fingerprint": SYSTEM_FINGERPRINT}

    def chunk(self, text: str | None, finish: str | None, logprobs: list[dict] | None = None, delta: dict | None = None,
              **extra) -> dict:
        """One streamed chunk: text (or a chat delta), its logprobs, a finish reason, and extra fields after."""
        if self.chat:
            delta = dict(delta or {})
            if text is not None:
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "logprobs": {"content": logprobs} if logprobs else None,
                      "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text or "",
                      "logprobs": completion_logprobs(logprobs) if logprobs else None, "finish_reason": finish}
        return {**self._head(self.object), "choices": [choice], **extra}

    def start(self) -> list[dict]:
        """llama-server's first chat chunk: the role, content null."""
        return [self.chunk(None, None, delta={"role": "assistant", "content": None})] if self.chat else []

    def progress(self, p: Progress) -> list[dict]:
        """A chunk of no text with the prompt's progress."""
        return [self.chunk(None, None, **progress_fields(p))]

    def piece(self, ev: Delta) -> list[dict] | list[bytes]:
        """The chunks of a text delta: as it is, or its parsed pieces (text that may be a marker held back)."""
        if self.encoded and ev.text and self.parser is None and not self.logprobs:
            return [self.plain_event(ev.text)]
        timed = {"timings": self.running_timings()} if self.job.timings_per_token else {}
        if not self.chat:
            return [self.chunk(ev.text, None, logprobs=self.take_logprobs(), **timed)] if ev.text else []
        if self.parser is None:
            deltas = [{"content": ev.text}] if ev.text else []
        else:
            deltas = self._deltas(self.parser.push(ev.text)) if ev.text else []
        if not deltas:
            return []
        out = [self.chunk(None, None, logprobs=self.take_logprobs(), delta=deltas[0], **timed)]
        return out + [self.chunk(None, None, delta=d) for d in deltas[1:]]

    def plain_event(self, text: str) -> bytes:
        """sse.encode(self.chunk(...)) of a plain token's text, with the running timings when asked, built as bytes:
        the head and the choice's fixed fields are encoded once per stream, only the text and the counts per token."""
        if not self._event_head:
            marker = "\x00"  # a text no token writes unescaped: where the head ends and the tail begins
            if self.chat:
                whole = self.chunk(None, None, delta={"content": marker})
            else:
                whole = self.chunk(marker, None)
            head, _, tail = json.dumps(whole, ensure_ascii=False).encode().rpartition(encode_basestring(marker).encode())
            self._event_head, self._event_tail = b"data: " + head, tail[:-1]  # the closing brace comes last
        timed = b', "timings": ' + self.running_timings_json() if self.job.timings_per_token else b""
        return b"".join((self._event_head, encode_basestring(text).encode(), self._event_tail, timed, b"}\n\n"))

    def _deltas(self, pieces: list) -> list[dict]:
        """Parsed pieces as chat deltas, C2's shape: reasoning_content, content, a call's name then its arguments."""
        out: list[dict] = []
        for p in pieces:
            if isinstance(p, Content):
                out.append({"content": p.text})
            elif isinstance(p, Reasoning):
                if not self.job.drop_reasoning:
                    out.append({"reasoning_content": p.text})
            elif isinstance(p, CallStart):
                out.append({"tool_calls": [{"index": p.index, "id": p.id, "type": "function",
                                            "function": {"name": p.name, "arguments": ""}}]})
            elif isinstance(p, CallArguments):
                out.append({"tool_calls": [{"index": p.index, "function": {"arguments": p.text}}]})
        return out

    def final(self, fin: Finished) -> list[dict]:
        """What the parser still held, the finishing chunk with usage and timings, and include_usage's chunk."""
        finish, out = fin.finish_reason, []
        if self.parser is not None:
            out = [self.chunk(None, None, delta=d) for d in self._deltas(self.parser.finish(finish == "length"))]
            finish = calls_finish(finish, bool(self.parser.answer.calls))
        used, timed = usage(fin, self.thinks), timings(fin)
        out.append(self.chunk(None if self.chat else "", finish, logprobs=self.take_logprobs() or None,
                              usage=used, timings=timed, hearth_class=fin.stats.class_name))
        if self.job.include_usage:
            out.append({**self._head(self.object), "choices": [], "usage": used, "timings": timed})
        return out

    def whole(self, fin: Finished) -> dict:
        """chat.completion or text_completion."""
        text = "".join(self.parts)
        out = {**self._head("chat.completion" if self.chat else "text_completion"),
               "choices": [self._choice(text, fin.finish_reason)], "usage": usage(fin, self.thinks),
               "timings": timings(fin),
               "hearth_class": fin.stats.class_name}  # the class the runner applied (timings hold numbers only)
        if self.state.config.verbose or self.job.verbose:
            out["__verbose"] = {"prompt": self.prompt_text(), "content": text}
        return out

    def _choice(self, text: str, finish: str) -> dict:
        if not self.chat:
            return {"index": 0, "text": text,
                    "logprobs": completion_logprobs(self.logprobs) if self.job.logprobs else None,
                    "finish_reason": finish}
        message: dict = {"role": "assistant", "content": text}
        if self.parser is not None:
            self.parser.push(text)
            self.parser.finish(finish == "length")
            answer = self.parser.answer
            # The same fields a stream's deltas add up to; content null beside calls, as OpenAI's.
            message["content"] = answer.content if answer.content or not answer.calls else None
            if answer.reasoning and not self.job.drop_reasoning:
                message["reasoning_content"] = answer.reasoning
            if answer.calls:
                message["tool_calls"] = [c.as_openai() for c in answer.calls]
            finish = calls_finish(finish, bool(answer.calls))
        return {"index": 0, "message": message, "logprobs": {"content": self.logprobs} if self.job.logprobs else None,
                "finish_reason": finish}


class NativeWriter(Writer):
    """llama-server's /completion and /infill: content pieces, then the last object with its settings and timings."""

    def __init__(self, job: Job, state: RunnerState, encoded: bool = False):
        super().__init__(job, state, encoded)
        self.unsent: list[int] = []  # ids of tokens whose text has not gone out yet

    def delta(self, ev: Delta | Progress) -> list[dict]:
        """As every writer, keeping the ids of tokens whose text is held back (return_tokens)."""
        if isinstance(ev, Delta):
            self.unsent.extend(ev.token_ids)
        return super().delta(ev)

    def progress(self, p: Progress) -> list[dict]:
        """A piece of no content with the prompt's progress."""
        return [{"index": 0, "content": "", "tokens": [], "stop": False, "id_slot": self.slot,
                 "tokens_predicted": 0, "tokens_evaluated": p.total, **progress_fields(p)}]

    def piece(self, ev: Delta) -> list[dict]:
        """A piece of content with the ids it covers."""
        if not ev.text:
            return []
        out = {"index": 0, "content": ev.text, "tokens": self.unsent if self.job.return_tokens else [],
               "stop": False, "id_slot": self.slot, "tokens_predicted": self.num_tokens,
               "tokens_evaluated": len(self.job.tokens)}
        if self.job.timings_per_token:
            out["timings"] = self.running_timings()
        self.unsent = []
        if self.logprobs:
            out["completion_probabilities"] = [native_prob(e, self.job.post_sampling) for e in self.take_logprobs()]
        return [out]

    def final(self, fin: Finished) -> list[dict]:
        """The last object, no content (it went out in pieces)."""
        return [self._last_object(fin, "", stream=True)]

    def whole(self, fin: Finished) -> dict:
        """The one object, with all the content."""
        return self._last_object(fin, "".join(self.parts), stream=False)

    def _last_object(self, fin: Finished, text: str, stream: bool) -> dict:
        job, s = self.job, fin.stats
        stop_type = "limit" if fin.finish_reason == "length" else ("word" if fin.stop_word else "eos")
        slot = fin.slot if fin.slot >= 0 else self.slot
        out = {
            "index": job.index, "content": text,
            "tokens": list(fin.output_tokens) if job.return_tokens and not stream else [],
            "id_slot": slot, "stop": True, "model": self.model_name,
            "tokens_predicted": s.num_completion_tokens, "tokens_evaluated": s.num_prompt_tokens,
            "generation_settings": generation_settings(self.state, job.params, n_probs=job.params.logprobs or 0,
                                                       stream=stream),
            "prompt": self.prompt_text(), "has_new_line": "\n" in text, "truncated": False, "stop_type": stop_type,
            "stopping_word": fin.stop_word, "tokens_cached": s.num_prompt_tokens + s.num_completion_tokens,
            "timings": timings(fin),
        }
        probs = self.take_logprobs()
        if probs:
            out["completion_probabilities"] = [native_prob(e, job.post_sampling) for e in probs]
        if job.response_fields:
            out = {f: _nested(out, f) for f in job.response_fields}
        return out


def calls_finish(finish: str, calls: bool) -> str:
    """OpenAI's finish_reason of an answer with calls: "tool_calls" when it ended by itself; a cut stays "length"
    (its whole calls are still returned: a cut loses only the call it was inside)."""
    return "tool_calls" if calls and finish == "stop" else finish


def writer_for(job: Job, state: RunnerState, encoded: bool = False) -> Writer:
    """The writer of a job's shape; `encoded` when its stream goes out as the shape's own SSE (bytes pieces allowed)."""
    return NativeWriter(job, state, encoded) if job.kind == NATIVE else OpenAIWriter(job, state, encoded)


def merge_choices(answers: list[dict]) -> dict:
    """OpenAI's n > 1: the whole answers of one prompt's sequences as one answer, a choice each, usage summed."""
    out = dict(answers[0])
    out["choices"] = [{**a["choices"][0], "index": i} for i, a in enumerate(answers)]
    completion = sum(a["usage"]["completion_tokens"] for a in answers)
    out["usage"] = {**out["usage"], "completion_tokens": completion,
                    "total_tokens": out["usage"]["prompt_tokens"] + completion}
    if "completion_tokens_details" in out["usage"]:
        out["usage"]["completion_tokens_details"] = {"reasoning_tokens": sum(
            a["usage"]["completion_tokens_details"]["reasoning_tokens"] for a in answers)}
    return out


def native_prob(entry: dict, post_sampling: bool) -> dict:
    """A logprob entry in llama-server's completion_probabilities shape (probabilities when post_sampling)."""
    def one(e: dict) -> dict:
        base = {"id": e.get("id", -1), "token": e["token"], "bytes": e["bytes"]}
        if post_sampling:
            return {**base, "prob": math.exp(e["logprob"])}
        return {**base, "logprob": e["logprob"]}

    out = one(entry)
    top = [one(t) for t in entry.get("top_logprobs", [])]
    if post_sampling:
        top = [t for t in top if t["prob"] > 0.0]
    out["top_probs" if post_sampling else "top_logprobs"] = top
    return out


def _nested(obj: dict, path: str):
    """A field of llama-server's response_fields: "a/b" reads obj["a"]["b"]."""
    value = obj
    for part in path.split("/"):
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return value


def completion_logprobs(entries: list[dict]) -> dict:
    """The legacy completions logprobs object from per-token entries."""
    offsets, pos = [], 0
    for e in entries:
        offsets.append(pos)
        pos += len(e["token"])
    return {
        "tokens": [e["token"] for e in entries],
        "token_logprobs": [e["logprob"] for e in entries],
        "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in entries],
        "text_offset": offsets,
    }
