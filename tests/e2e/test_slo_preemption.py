"""Slot preemption by class through `hearth serve` on the real model: voice takes background's only slot."""

import json
import threading

import httpx

from tests.helpers import metric

PROMPT = "Write a long, detailed story about a lighthouse keeper and the storm that changed everything."
BACKGROUND_TOKENS = 120


def _complete(serve, klass: str, max_tokens: int, done: list, first_tokens: threading.Event | None = None):
    """Stream one greedy completion in `klass`; append (class, text, finish_reason, completion tokens) when it ends."""
    body = {"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    headers = {"Authorization": f"Bearer {serve.tokens['app']}", "X-Hearth-Class": klass}
    text, finish, usage, pieces = [], None, {}, 0
    with serve.client.stream("POST", "/v1/completions", json=body, headers=headers) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            usage = event.get("usage") or usage
            for choice in event.get("choices") or []:
                text.append(choice.get("text") or "")
                finish = choice.get("finish_reason") or finish
                pieces += 1
                if first_tokens is not None and pieces >= 8:
                    first_tokens.set()
    done.append((klass, "".join(text), finish, usage.get("completion_tokens")))


def test_a_voice_request_preempts_background_which_still_completes_as_if_alone(start_serve):
    # One slot: without preemption the voice request would wait for the whole background answer.
    serve = start_serve(settings={"runner_ctx": 1024, "runner_parallel": 1, "runner_threads": 2},
                        tokens=[("app", "background", ["voice"])])
    alone: list = []
    _complete(serve, "background", BACKGROUND_TOKENS, alone)
    runner = httpx.Client(base_url=serve.runner_url(), headers=serve.runner_headers(), timeout=30)
    sample = 'hearth:preemptions_by_class_total{class="background",reason="slot"}'
    assert metric(runner, sample) is None  # nothing preempted yet

    done: list = []
    started = threading.Event()
    bg = threading.Thread(target=_complete, args=(serve, "background", BACKGROUND_TOKENS, done, started))
    bg.start()
    assert started.wait(120), "the background answer did not start"
    _complete(serve, "voice", 8, done)
    bg.join(300)

    # Voice finished first although background held the only slot: background was preempted, counted per class.
    assert [d[0] for d in done] == ["voice", "background"]
    assert metric(runner, sample) == 1
    # ... and its answer is complete and the same as when it ran alone.
    _, text, finish, n = done[1]
    assert (finish, n) == ("length", BACKGROUND_TOKENS) and text == alone[0][1]
    runner.close()
