"""Real English text the benchmarks cut prompts from (written for Hearth; no external corpus)."""

PASSAGES = [
    "The kitchen timer rang twice before anyone noticed. Outside, the rain had turned the garden path "
    "into a shallow stream, and the cat sat on the windowsill watching drops race each other down the "
    "glass. Grandmother wanted to know whether the bread needed another ten minutes, and the answer, as "
    "always, depended on who you asked. The recipe card, stained with decades of butter, said forty "
    "minutes at a moderate heat; the oven, which had opinions of its own, disagreed.",
    "Summarise the following meeting notes for the household calendar. The school trip moved from "
    "Thursday to Friday because the bus company had a scheduling conflict. Parents must sign the consent "
    "form by Wednesday evening and pack a lunch without nuts. The football match on Saturday starts at "
    "nine instead of ten, and the team needs two more drivers. The library books are due on Monday, and "
    "the fine for late returns doubled this term.",
    "def merge_intervals(intervals):\n    \"\"\"Merge overlapping closed intervals and return them sorted.\"\"\"\n"
    "    result = []\n    for start, end in sorted(intervals):\n        if result and start <= result[-1][1]:\n"
    "            result[-1][1] = max(result[-1][1], end)\n        else:\n            result.append([start, end])\n"
    "    return result\n\n# Explain what this function does, its complexity, and write three unit tests.",
    "A continuous-batching server re-decides at every decode step which sequences run. New requests join "
    "as soon as a slot and enough key-value cache are free, and finished ones leave immediately, so a "
    "short answer never waits for the longest answer in its batch. Streaming only changes when text is "
    "delivered; batching changes how requests share the model's execution. Whether the gain is worth it "
    "depends on how often requests overlap.",
    "Dear neighbours, the residents' association will meet in the community hall next Tuesday at seven. "
    "On the agenda: the new recycling schedule, the broken streetlight at the corner of Elm Road, a "
    "proposal to plant fruit trees along the park fence, and the budget for the winter market. Tea and "
    "biscuits will be served. If you cannot attend, please send your questions in advance so that the "
    "committee can answer them in the minutes.",
    "Turn on the living room lights and set the thermostat to twenty degrees. Then tell me whether I "
    "need an umbrella tomorrow morning, and remind me at six to call the plumber about the dripping tap "
    "in the upstairs bathroom.",
    "The history of the bicycle is a history of small improvements. Early machines had no pedals; riders "
    "pushed along the ground with their feet. Pedals on the front wheel came next, which led to enormous "
    "front wheels for speed and to many painful falls. The chain drive, equal-sized wheels and pneumatic "
    "tyres finally produced the safety bicycle, whose basic shape has barely changed in more than a "
    "century, even as materials went from steel to aluminium and carbon fibre.",
    "Write a short bedtime story about a lighthouse keeper who befriends a seagull that cannot fly, in "
    "which they work together to guide a lost fishing boat home through a storm, and end it with a "
    "gentle lesson about asking for help.",
]


def corpus() -> str:
    """All passages joined, long enough to cut prompts of a few hundred tokens from."""
    return "\n\n".join(PASSAGES * 3)


# Repetitive work, for the speculative-decoding scenarios: a prompt whose answer copies from it. Each is
# a raw completion prompt that ends where the copy starts, so a greedy model continues by repeating
# its context, as an editor plugin, a quoting assistant or a tool call over a long context do.

CODE_FUNCTIONS = '''\
def merge_intervals(intervals):
    """Merge overlapping closed intervals and return them sorted."""
    result = []
    for start, end in sorted(intervals):
        if result and start <= result[-1][1]:
            result[-1][1] = max(result[-1][1], end)
        else:
            result.append([start, end])
    return result


def chunk_list(items, size):
    """Split a list into consecutive chunks of at most `size` items."""
    if size < 1:
        raise ValueError("size must be at least 1")
    return [items[i:i + size] for i in range(0, len(items), size)]


def word_counts(text):
    """Count how often each lower-cased word occurs in the text."""
    counts = {}
    for word in text.lower().split():
        word = word.strip(".,;:!?\\"'()")
        if word:
            counts[word] = counts.get(word, 0) + 1
    return counts


def moving_average(values, window):
    """The mean of each run of `window` consecutive values."""
    if window < 1 or window > len(values):
        return []
    total = sum(values[:window])
    out = [total / window]
    for i in range(window, len(values)):
        total += values[i] - values[i - window]
        out.append(total / window)
    return out


def parse_duration(text):
    """Seconds in a duration such as '1h30m' or '45s'."""
    units = {"h": 3600, "m": 60, "s": 1}
    seconds, number = 0, ""
    for ch in text.strip():
        if ch.isdigit():
            number += ch
        elif ch in units and number:
            seconds += int(number) * units[ch]
            number = ""
        else:
            raise ValueError(f"not a duration: {text!r}")
    if number:
        raise ValueError(f"a number without a unit in {text!r}")
    return seconds


def shopping_total(basket, prices):
    """The price of a basket of {item: quantity} at the given prices."""
    missing = [item for item in basket if item not in prices]
    if missing:
        raise KeyError(f"no price for {', '.join(sorted(missing))}")
    return round(sum(prices[item] * quantity for item, quantity in basket.items()), 2)
'''
# The copy starts with the first function's signature, annotated.
CODE_EDIT_INSTRUCTION = "\n\n# The same functions, with type hints:\n\n"
CODE_EDIT_START = "def merge_intervals(intervals: list[list[int]]) -> list[list[int]]:\n"

DOCUMENT_QUOTE_INSTRUCTION = ("\n\nQuote the residents' association letter and the school notice above word for "
                              "word, as the family newsletter will print them:\n\n")
# The first words of the letter (PASSAGES[4]) begin the quote.
DOCUMENT_QUOTE_START = "Dear neighbours, the residents' association"

# A Home Assistant-style context: the exposed entities, then the request and the start of the tool call.
HA_AREAS = ("living_room", "kitchen", "hallway", "bedroom", "kids_room", "bathroom", "office", "garden")
HA_DEVICES = (
    ("light", "ceiling_light", "Ceiling light"), ("light", "floor_lamp", "Floor lamp"),
    ("switch", "radiator_valve", "Radiator valve"), ("sensor", "temperature", "Temperature"),
    ("cover", "blinds", "Blinds"), ("media_player", "speaker", "Speaker"),
)
TOOL_ARGUMENTS_INSTRUCTION = ("\n\nUser: Turn off every light in the house and close every blind.\n"
                              "Assistant: calling HassTurnOff with all matching entities.\n"
                              '{"name": "HassTurnOff", "arguments": {"entity_id": [')
TOOL_ARGUMENTS_START = '"light.living_room_ceiling_light", "light.living_room_floor_lamp",'


def ha_context() -> str:
    """The entity list a Home Assistant voice pipeline sends as context: id, name, area and state per line."""
    lines = ["You are a voice assistant for Home Assistant. Static context: the devices in this home.",
             "entity_id,name,area,state"]
    for area in HA_AREAS:
        room = area.replace("_", " ").capitalize()
        for domain, device, name in HA_DEVICES:
            state = {"light": "on", "switch": "off", "sensor": "20.5", "cover": "open", "media_player": "idle"}[domain]
            lines.append(f"{domain}.{area}_{device},{room} {name.lower()},{room},{state}")
    return "\n".join(lines)


def repeat_prompt(kind: str) -> str:
    """The whole raw completion prompt of a repetitive-work text kind (code-edit, document-quote, tool-arguments)."""
    if kind == "code-edit":
        return CODE_FUNCTIONS + CODE_EDIT_INSTRUCTION + CODE_EDIT_START
    if kind == "document-quote":
        return "\n\n".join((PASSAGES[1], PASSAGES[4], PASSAGES[3])) + DOCUMENT_QUOTE_INSTRUCTION + DOCUMENT_QUOTE_START
    if kind == "tool-arguments":
        return ha_context() + TOOL_ARGUMENTS_INSTRUCTION + TOOL_ARGUMENTS_START
    raise KeyError(f"no repetitive-work prompt {kind!r}")


REPEAT_KINDS = ("code-edit", "document-quote", "tool-arguments")
