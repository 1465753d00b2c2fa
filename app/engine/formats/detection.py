"""Which family's answer format a chat template was written for, from its text, as llama.cpp decides.

llama.cpp first looks for markers only one family's template holds (harmony's `<|channel|>`,
Functionary's `>>>all`, Mistral's `[TOOL_CALLS]`...), then reads what the template writes for a
call. The same markers decide here, most specific first; a template without tool markup gets
Hearth's generic envelope (it is taught in the system turn), with `<think>` reasoning if it has it.
"""

from __future__ import annotations

from app.engine.formats.base import ChatFormat

THINK = ("<think>", "</think>")

HARMONY_TOKENS = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|call|>", "<|return|>", "<|constrain|>")
DEEPSEEK_TOKENS = ("<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>",
                   "<｜tool▁calls▁end｜>")
COMMAND_R_TOKENS = ("<|START_THINKING|>", "<|END_THINKING|>", "<|START_ACTION|>", "<|END_ACTION|>",
                    "<|START_RESPONSE|>", "<|END_RESPONSE|>", "<|START_TEXT|>", "<|END_TEXT|>")

GENERIC = ChatFormat("generic")
CONTENT_ONLY = ChatFormat("content_only")
GENERIC_THINKING = ChatFormat("generic", reasoning=True, think_start=THINK[0], think_end=THINK[1], preserved=THINK)
HERMES = ChatFormat("hermes", tools=True, preserved=("<tool_call>", "</tool_call>"))
QWEN3 = ChatFormat("hermes", tools=True, reasoning=True, think_start=THINK[0], think_end=THINK[1],
                   preserved=("<tool_call>", "</tool_call>", *THINK))
QWEN3_CODER = ChatFormat("qwen3_coder", tools=True, preserved=("<tool_call>", "</tool_call>"))
QWEN3_CODER_THINKING = ChatFormat("qwen3_coder", tools=True, reasoning=True, think_start=THINK[0],
                                  think_end=THINK[1], preserved=("<tool_call>", "</tool_call>", *THINK))
GPT_OSS = ChatFormat("gpt_oss", tools=True, reasoning=True, think_start="<|channel|>analysis<|message|>",
                     think_end="<|end|>", preserved=HARMONY_TOKENS)
LLAMA3 = ChatFormat("llama3", tools=True, preserved=("<|python_tag|>",))
MISTRAL = ChatFormat("mistral", tools=True, preserved=("[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"))
# Mistral Nemo and older: `[TOOL_CALLS][{...}]`, a JSON list (no [ARGS] token).
MISTRAL_LIST = ChatFormat("mistral", tools=True, preserved=("[TOOL_CALLS]",))
MAGISTRAL = ChatFormat("magistral", tools=True, reasoning=True, think_start="[THINK]", think_end="[/THINK]",
                       preserved=("[TOOL_CALLS]", "[ARGS]", "[CALL_ID]", "[THINK]", "[/THINK]"))
DEEPSEEK_R1 = ChatFormat("deepseek_r1", tools=True, reasoning=True, think_start=THINK[0], think_end=THINK[1],
                         preserved=(*DEEPSEEK_TOKENS, *THINK))
DEEPSEEK_V3 = ChatFormat("deepseek_v3", tools=True, reasoning=True, think_start=THINK[0], think_end=THINK[1],
                         preserved=(*DEEPSEEK_TOKENS, *THINK))
GRANITE = ChatFormat("granite", tools=True, reasoning=True, think_start=THINK[0], think_end=THINK[1],
                     preserved=("<|tool_call|>", *THINK))
COMMAND_R = ChatFormat("command_r", tools=True, reasoning=True, think_start="<|START_THINKING|>",
                       think_end="<|END_THINKING|>", preserved=COMMAND_R_TOKENS)
FUNCTIONARY_V3_1 = ChatFormat("functionary_v3_1", tools=True, preserved=("<|python_tag|>",))
FUNCTIONARY_V3_2 = ChatFormat("functionary_v3_2", tools=True, marked_content=True)
GEMMA4 = ChatFormat("gemma4", tools=True, reasoning=True, think_start="<|channel>thought", think_end="<channel|>",
                   preserved=("<|channel>", "<channel|>", "<|tool_call>", "<tool_call|>", '<|"|>'))
KIMI_TOKENS = ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
               "<|tool_call_argument_begin|>", "<|tool_call_end|>")
KIMI_K2 = ChatFormat("kimi_k2", tools=True, preserved=KIMI_TOKENS)
KIMI_K2_THINKING = ChatFormat("kimi_k2", tools=True, reasoning=True, think_start=THINK[0], think_end=THINK[1],
                              preserved=(*KIMI_TOKENS, *THINK))

FORMATS = {f.name: f for f in (GENERIC, CONTENT_ONLY, HERMES, QWEN3_CODER, GPT_OSS, LLAMA3, MISTRAL, MAGISTRAL,
                              DEEPSEEK_R1, DEEPSEEK_V3, GRANITE, COMMAND_R, FUNCTIONARY_V3_1, FUNCTIONARY_V3_2,
                              KIMI_K2, GEMMA4)}


def _thinks(src: str) -> bool:
    return THINK[0] in src and THINK[1] in src


def detect(template_source: str | None) -> ChatFormat:
    """The answer format a chat template was written for; GENERIC for one without tool markup."""
    src = template_source or ""
    if "<|channel|>" in src:
        return GPT_OSS
    if "<|tool_call>call:" in src:
        return GEMMA4
    if "[TOOL_CALLS]" in src:
        if "[THINK]" in src:
            return MAGISTRAL
        return MISTRAL if "[ARGS]" in src else MISTRAL_LIST
    if ">>>all" in src:
        return FUNCTIONARY_V3_2
    if "<|tool_calls_section_begin|>" in src and "<|tool_call_begin|>" in src:
        return KIMI_K2_THINKING if _thinks(src) else KIMI_K2
    if "<｜tool▁sep｜>" in src:
        return DEEPSEEK_R1 if "```json" in src else DEEPSEEK_V3
    if "<|START_ACTION|>" in src:
        return COMMAND_R
    if "<parameter=" in src and "<function=" in src:
        return QWEN3_CODER_THINKING if _thinks(src) else QWEN3_CODER
    if "<function=" in src:
        return FUNCTIONARY_V3_1
    if "<|tool_call|>" in src:
        return GRANITE
    if "<tool_call>" in src:
        return QWEN3 if _thinks(src) else HERMES
    if "tools" in src and ("<|python_tag|>" in src or "<|start_header_id|>" in src):
        return LLAMA3
    return GENERIC_THINKING if _thinks(src) else GENERIC


def starts_in_thought(fmt: ChatFormat, prompt_text: str) -> bool:
    """Whether the rendered prompt ends inside an open thought (a Qwen3 or DeepSeek-R1 prompt ending "<think>\\n")."""
    if not fmt.reasoning or not fmt.think_start:
        return False
    return prompt_text.rstrip().endswith(fmt.think_start)
