"""Prompts as tokens: the one chat prompt (chat, its input_tokens, Anthropic's count_tokens, Responses' input_tokens),
text and token prompts, llama-server's several native prompts, fill-in-the-middle.
"""

from __future__ import annotations

from typing import NamedTuple

from app.engine import tools as toolfmt
from app.engine.chat import ChatTemplateError, strip_leading_bos
from app.engine.media import MEDIA_MARKER
from app.protocols import audio
from app.protocols.openai import ApiError, ChatBody, content_parts
from app.runner import images
from app.runner.state import RunnerState


class ChatPrompt(NamedTuple):
    """A chat request's prompt tokens, the tools it offers and its rendered text (after the BOS strip).

    With images, media holds them (app.engine.media.MediaPrompt) and their positions in tokens hold
    placeholder ids."""

    tokens: list[int]
    tools: list[dict]
    text: str
    media: object | None = None


def render(state: RunnerState, messages: list[dict], add_generation_prompt: bool, tools: list[dict] | None,
           kwargs: dict | None = None) -> str:
    """Messages through the runner's chat template, with llama.cpp's template variables."""
    return render_template(state.template, messages, add_generation_prompt, tools, kwargs)


def render_template(template, messages: list[dict], add_generation_prompt: bool, tools: list[dict] | None,
                    kwargs: dict | None = None) -> str:
    """Messages through a chat template; a template's refusal is a 400 naming the messages."""
    try:
        return template.render(messages, add_generation_prompt=add_generation_prompt, tools=tools, kwargs=kwargs)
    except ChatTemplateError as exc:
        raise ApiError(400, f"'messages': {exc}", param="messages", code="chat_template")


def request_thinking(state: RunnerState, body: ChatBody) -> bool:
    """Whether a chat request thinks: its chat_template_kwargs.enable_thinking, else reasoning_effort "none" (off),
    else the runner's --reasoning."""
    asked = (body.chat_template_kwargs or {}).get("enable_thinking")
    if isinstance(asked, bool):
        return asked
    if body.reasoning_effort == "none":
        return False
    return state.config.reasoning != "off"


def template_kwargs(body: ChatBody, thinking: bool, template_thinks: bool = True) -> dict:
    """The template variables a chat request adds: its chat_template_kwargs, enable_thinking and reasoning_effort.

    As llama-server: past turns' reasoning is kept (preserve_reasoning, its --reasoning-preserve default), and
    thinking is on by default only in a template where llama.cpp finds reasoning."""
    asked = body.chat_template_kwargs or {}
    on = thinking if isinstance(asked.get("enable_thinking"), bool) else thinking and template_thinks
    kwargs = {"preserve_reasoning": True, **asked, "enable_thinking": on}
    # As llama-server: an effort other than "none" reaches the template (gpt-oss reads it).
    if body.reasoning_effort and body.reasoning_effort != "none":
        kwargs["reasoning_effort"] = body.reasoning_effort
    return kwargs


def chat_prompt(state: RunnerState, body: ChatBody, *, thinking: bool | None = None) -> ChatPrompt:
    """The prompt of a chat request, as generation and every token count build it.

    thinking None: as the request asks (request_thinking); True/False: the caller's choice."""
    if thinking is None:
        thinking = request_thinking(state, body)
    model = state.model
    text, tools = chat_text(state.template, body, thinking=thinking, tool_format=state.tool_format,
                            add_bos=getattr(model, "add_bos", True), add_eos=getattr(model, "add_eos", False))
    dumped = [m.model_dump(exclude_none=True) for m in body.messages]
    if audio.audio_parts(dumped):
        return _media_prompt(state, text, tools, dumped)
    found = images.image_parts(dumped)
    if found:
        return _image_prompt(state, text, tools, found)
    return ChatPrompt(model.tokenize(text, add_special=True, parse_special=True), tools, text)


def _image_prompt(state: RunnerState, text: str, tools: list[dict], found: list[tuple[str, str]],
                  field: str = ".image_url.url") -> ChatPrompt:
    """A prompt with images: each checked, then tokenized by the projector at its marker (llama-server's way).

    found: (image, where) in prompt order; a refusal of one names where + field."""
    from app.engine.media import MediaPrompt, image_key
    from app.engine.mtmd_model import ProjectorError

    where = found[0][1]
    if state.projector is None:
        raise ApiError(400, f"'{where}': this model takes no images (it has no vision projector): put its mmproj "
                            "GGUF beside it in the models folder as mmproj-<model name>.gguf (hearth serve), or start "
                            "its runner with --mmproj PATH; or send text only", param=where, code="images_unsupported")
    if not state.projector.describe().get("vision", True):
        raise ApiError(400, f"'{where}': this model takes no images (its projector has an audio encoder only): send "
                            "text or audio", param=where, code="images_unsupported")
    limits = state.config.images
    if len(found) > limits.max_images:
        raise ApiError(400, f"'messages': {len(found)} images, more than the limit of {limits.max_images} a request",
                       param="messages", code="too_many_images")
    budget = images.PixelBudget(limits.max_request_pixels)
    loaded = [images.load_image(url, at, limits, param=at + field, budget=budget) for url, at in found]
    try:
        # Named by the bytes as sent: the same image in a later turn finds its cells in the prefix cache.
        tokens, spans = state.projector.tokenize(text, [d for _, d in loaded], [image_key(sent) for sent, _ in loaded])
    except ProjectorError as exc:
        raise ApiError(400, f"'{where}': {exc}", param=where, code="invalid_image")
    return ChatPrompt(tokens, tools, text, MediaPrompt(spans))


def _media_prompt(state: RunnerState, text: str, tools: list[dict], messages: list[dict]) -> ChatPrompt:
    """A prompt with audio (and perhaps images): each part checked, then tokenized by the projector at its marker in
    prompt order, the audio keyed by a hash of its bytes as images are."""
    from app.engine.media import MediaPrompt, image_key
    from app.engine.mtmd_model import ProjectorError

    parts = content_parts(messages, images.MEDIA_PARTS)
    where = next(at for p, at in parts if p["type"] == audio.PART_TYPE)
    projector = state.projector
    if projector is None or not projector.describe().get("audio"):
        raise ApiError(400, f"'{where}': this model takes no audio (it has no audio projector): give it an mmproj "
                            "GGUF with an audio encoder (mmproj-<model name>.gguf beside it, or its runner's --mmproj "
                            "PATH), or send text only", param=where, code="audio_unsupported")
    limits = state.config.audio_limits
    n_audio = sum(p["type"] == audio.PART_TYPE for p, _ in parts)
    if n_audio > limits.max_parts:
        raise ApiError(400, f"'messages': {n_audio} audio parts, more than the limit of {limits.max_parts} a request",
                       param="messages", code="too_many_audio_parts")
    budget = images.PixelBudget(state.config.images.max_request_pixels)
    sent, for_mtmd = [], []
    for part, at in parts:
        if part["type"] == audio.PART_TYPE:
            data, _ = audio.load_audio(part.get("input_audio") or {}, at, limits)
            sent.append(data)
            for_mtmd.append(data)
        else:
            if not projector.describe().get("vision", True):
                raise ApiError(400, f"'{at}': this model takes no images (its projector has audio only)", param=at,
                               code="images_unsupported")
            raw, checked = images.load_image((part.get("image_url") or {}).get("url", ""), at, state.config.images,
                                             budget=budget)
            sent.append(raw)
            for_mtmd.append(checked)
    try:
        tokens, spans = projector.tokenize(text, for_mtmd, [image_key(d) for d in sent])
    except ProjectorError as exc:
        raise ApiError(400, f"'{where}': {exc}", param=where, code="invalid_audio")
    return ChatPrompt(tokens, tools, text, MediaPrompt(spans))


def chat_text(template, body: ChatBody, *, thinking: bool, tool_format: str, add_bos: bool = True,
              add_eos: bool = False) -> tuple[str, list[dict]]:
    """A chat request's prompt text and offered tools, as llama-server renders it (no model needed).

    The template takes the tools itself when it can (as llama-server gives them); one that cannot is taught
    Hearth's generic envelope in the system turn. The BOS (and EOS) text a template writes is stripped where
    the tokenizer adds it, as llama.cpp strips it."""
    kwargs = template_kwargs(body, thinking, getattr(template, "supports_thinking", False))
    messages = images.with_markers([m.model_dump(exclude_none=True) for m in body.messages], MEDIA_MARKER)
    tools = body.tool_list
    native = bool(tools) and (tool_format != toolfmt.GENERIC or takes_tools(template))
    messages = toolfmt.prepare_messages(messages, toolfmt.HERMES if native else toolfmt.GENERIC, tools,
                                        body.choice, body.parallel_tool_calls)
    native_tools = tools if native else None
    if body.prefill and not tools:
        text = _continue_final(template, messages, native_tools, kwargs)
    else:
        text = render_template(template, messages, body.add_generation_prompt, native_tools, kwargs)
    return strip_special(text, template, add_bos, add_eos), tools


def takes_tools(template) -> bool:
    """Whether a chat template describes tools itself (llama.cpp's supports_tools probe)."""
    caps = getattr(template, "caps", None)
    return bool(caps and caps.supports_tools)


def strip_special(text: str, template, add_bos: bool, add_eos: bool) -> str:
    """The template's leading BOS text (and trailing EOS text) removed where the tokenizer adds them itself."""
    if add_bos:
        text, _ = strip_leading_bos(text, template.bos_token)
    if add_eos and template.eos_token and text.endswith(template.eos_token):
        text = text[: -len(template.eos_token)]
    return text


def _continue_final(template, messages: list[dict], tools, kwargs) -> str:
    """The prompt that continues the final assistant message: rendered, then cut after its text."""
    content = messages[-1].get("content")
    if isinstance(content, list):
        # The continued message's text parts are joined by a blank line, as llama-server continues them.
        content = "\n\n".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
        messages = [*messages[:-1], {**messages[-1], "content": content}]
    text = render_template(template, messages, False, tools, kwargs)
    cut = text.rfind(content.rstrip()) if content and content.strip() else -1
    return text[: cut + len(content.rstrip())] if cut >= 0 else text


def prompt_tokens(model, prompt, param: str) -> list[int]:
    """One prompt as tokens: text (BOS added, special tokens parsed) or ids, which may mix in text."""
    if isinstance(prompt, str):
        return model.tokenize(prompt, add_special=True, parse_special=True)
    tokens: list[int] = []
    for item in prompt:
        if isinstance(item, str):
            tokens += model.tokenize(item, add_special=False, parse_special=True)
        elif isinstance(item, int) and not isinstance(item, bool) and 0 <= item < model.n_vocab:
            tokens.append(item)
        else:
            raise ApiError(400, f"'{param}': token id {item!r} is outside the vocabulary (0..{model.n_vocab - 1})",
                           param=param)
    if not tokens:
        raise ApiError(400, f"'{param}' is empty", param=param)
    return tokens


def native_media_prompt(state: RunnerState, prompt: dict) -> ChatPrompt:
    """llama-server's {"prompt_string", "multimodal_data"}: a text with one <__media__> marker per image (raw
    base64, in marker order), tokenized with its images as a chat prompt is (BOS added, specials parsed)."""
    text, data = prompt.get("prompt_string"), prompt.get("multimodal_data")
    if not isinstance(text, str):
        raise ApiError(400, "'prompt.prompt_string' must be text", param="prompt")
    if not isinstance(data, list) or not all(isinstance(d, str) and d for d in data):
        raise ApiError(400, "'prompt.multimodal_data' must be a list of images as base64 strings, one for each "
                            f"{MEDIA_MARKER} in prompt_string", param="prompt", code="invalid_image")
    for i, d in enumerate(data):
        if d.startswith(("http://", "https://")):
            raise ApiError(400, f"'prompt.multimodal_data.{i}': the image itself as base64, not a URL (as "
                                "llama-server takes it)", param="prompt", code="invalid_image")
    if text.count(MEDIA_MARKER) != len(data):
        raise ApiError(400, f"'prompt.prompt_string' has {text.count(MEDIA_MARKER)} {MEDIA_MARKER} markers for "
                            f"{len(data)} images in multimodal_data: put one marker where each image goes",
                       param="prompt", code="invalid_image")
    return _image_prompt(state, text, [], [(d, f"prompt.multimodal_data.{i}") for i, d in enumerate(data)], field="")


def native_prompts(model, prompt) -> list[list[int]]:
    """llama-server's prompt forms: text, ids (mixed with text), a list of those, or {"prompt_string"}
    (with multimodal_data: native_media_prompt)."""
    if isinstance(prompt, dict):
        text = prompt.get("prompt_string")
        if not isinstance(text, str):
            raise ApiError(400, "'prompt.prompt_string' must be text", param="prompt")
        return [prompt_tokens(model, text, "prompt")]
    if isinstance(prompt, str):
        return [prompt_tokens(model, prompt, "prompt")]
    if not prompt:
        raise ApiError(400, "'prompt' is empty", param="prompt")
    if any(isinstance(p, int) for p in prompt):
        return [prompt_tokens(model, prompt, "prompt")]
    return [prompt_tokens(model, p if isinstance(p, (str, list)) else [p], "prompt") for p in prompt]


def fim_tokens(model, prefix: str | None, suffix: str, extra: list, after: str, param: str) -> list[int]:
    """A fill-in-the-middle prompt in the model's own FIM tokens (prefix, suffix, middle)."""
    fim = model.fim_tokens()
    missing = [k for k in ("pre", "suf", "mid") if k not in fim]
    if missing:
        raise ApiError(400, f"'{param}': this model has no fill-in-the-middle tokens in its vocabulary "
                            f"(missing: {', '.join('FIM ' + k for k in missing)}); use a code model that has them",
                       param=param, code="fim_unsupported")

    def text(t: str) -> list[int]:
        return model.tokenize(t, add_special=False, parse_special=False) if t else []

    tokens = [model.bos_token] if model.add_bos else []
    for chunk in extra:
        # Other files as repository context, the way llama-server lays out input_extra.
        if "sep" in fim:
            tokens += [fim["sep"]] + text(f"{chunk.filename}\n{chunk.text}")
        else:
            tokens += text(f"// {chunk.filename}\n{chunk.text}\n")
    tokens += [fim["pre"]] + text(prefix or "") + [fim["suf"]] + text(suffix) + [fim["mid"]] + text(after)
    return tokens


def detokenize(model, tokens) -> str:
    """Tokens back to text (a broken character as U+FFFD); an image's positions (placeholder ids, below 0) have
    no text and are left out, as llama-server leaves them out of a prompt's text. Never a placeholder to llama.cpp:
    it aborts the process on an id outside the vocabulary."""
    return b"".join(model.token_bytes(t) for t in tokens if t >= 0).decode("utf-8", "replace")
