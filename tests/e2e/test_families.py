"""Three families' scripted answers through a real `hearth serve`: every API, whole and streamed (fast tier).

The doubles (app/devtools/family_models.py) carry each family's real vocabulary and template; a
grammar makes them emit the script's raw text token for token: through OpenAI chat by the request's
`grammar`, through Ollama, Anthropic and Responses by the runner's default grammar (runner_args:
--grammar-file), rewritten per script. Each answer must land in the API's reasoning, content and call
fields as the script says, and each stream's deltas must concatenate to the whole answer's fields.
`hearth bench families` runs every family and every script the same way; here the APIs without a
grammar of their own take three scripts a family (each costs a runner restart), OpenAI chat all of them.
"""

import pytest

from app.devtools import family_models
from app.devtools.family_models import load_scripts
from app.devtools.serving.families_bench import APIS, FamiliesServe, ask, check_pair

# Reasoning and calls in three markups: <think> + Hermes, harmony channels, [THINK] + [TOOL_CALLS].
FAMILIES = ["qwen3", "gpt_oss", "magistral"]
CASES = [(f, s.name) for f in FAMILIES for s in load_scripts(f)]
# Thinking then content, thinking then a call, a thought cut by max_tokens.
DEFAULT_GRAMMAR_SCRIPTS = ("reasoning_content", "reasoning_call", "cut_thought")
OTHER_API_CASES = [(f, n) for f, n in CASES if n in DEFAULT_GRAMMAR_SCRIPTS]


@pytest.fixture(scope="module")
def serve(tmp_path_factory):
    """One hearth serve whose models folder holds the three doubles."""
    try:
        family_models.vendored_models_dir()
    except RuntimeError as exc:
        pytest.skip(str(exc))
    s = FamiliesServe(FAMILIES, tmp_path_factory.mktemp("families"))
    yield s
    s.stop()


def _script(family: str, name: str):
    return next(s for s in load_scripts(family) if s.name == name)


def _report(outcomes) -> str:
    return "\n".join(f"{o.line()}\n    got {o.got}" for o in outcomes if not o.right)


@pytest.mark.parametrize("family, name", CASES)
def test_openai_chat_splits_the_script_whole_and_streamed(serve, family, name):
    script = _script(family, name)
    grammar = serve.doubles[family].gbnf(script.raw)
    whole = ask(serve.client, "openai", family, script, False, grammar)
    outcomes = check_pair("hearth", script, "openai", whole, ask(serve.client, "openai", family, script, True, grammar))
    assert all(o.right for o in outcomes), _report(outcomes)


@pytest.mark.parametrize("family, name", OTHER_API_CASES)
def test_ollama_anthropic_and_responses_split_the_script_whole_and_streamed(serve, family, name):
    script = _script(family, name)
    serve.use_script(script)
    outcomes = []
    for api in APIS[1:]:
        whole = ask(serve.client, api, family, script, False)
        outcomes += check_pair("hearth", script, api, whole, ask(serve.client, api, family, script, True))
    assert all(o.right for o in outcomes), _report(outcomes)
